"""What every step shares and none of them teaches: the workload, evaluation and a few small helpers.

The step scripts keep the distributed concepts (process group, sampler, DDP wrap, snapshots, ranks)
in plain sight; only the parts that are the same in every step live here.
"""
from utils.helpers import configure_cpu_threads, free_port, positive_int, require_torchrun
from utils.workload import WORKLOADS, Workload, evaluate, make_workload

__all__ = ["WORKLOADS", "Workload", "configure_cpu_threads", "evaluate", "free_port", "make_workload",
           "positive_int", "require_torchrun"]

# What fsdp.py adds: the memory table, swapping a finished snapshot directory in, and the "wide" workload.
from utils.helpers import replace_directory  # noqa: E402
from utils.memory import log_memory  # noqa: E402
import utils.wide_mlp  # noqa: E402,F401  (registers "wide" in WORKLOADS)

__all__ += ["log_memory", "replace_directory"]
