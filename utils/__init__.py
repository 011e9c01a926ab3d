"""What every step shares and none of them teaches: the workload, evaluation and a few small helpers.

The step scripts keep the distributed concepts (process group, sampler, DDP wrap, snapshots, ranks)
in plain sight; only the parts that are the same in every step live here.
"""
from utils.helpers import (configure_cpu_threads, exit_without_teardown, free_port, fsdp_options, positive_int,
                           replace_directory, require_a_gpu_each, require_torchrun)
from utils.memory import log_memory
from utils.metrics import log_rank_metrics
from utils.workload import WORKLOADS, Workload, evaluate, make_workload
import utils.wide_mlp  # noqa: E402,F401  (adds the "wide" workload to WORKLOADS)

__all__ = ["WORKLOADS", "Workload", "configure_cpu_threads", "evaluate", "exit_without_teardown", "free_port",
           "fsdp_options", "log_memory", "log_rank_metrics", "make_workload", "positive_int", "replace_directory",
           "require_a_gpu_each", "require_torchrun"]
