"""What the steps share and none of them teaches: the workloads, evaluation, and the guards a step calls by name.

The step scripts keep the distributed concepts (process group, sampler, DDP wrap, snapshots, ranks, sharding,
accumulation, precision) in plain sight. What lives here is of two kinds: what several steps share (the workloads,
evaluate(), per-rank metrics, argument types, the store of a torchrun attempt), and the guards against a mistake or a
fault that a step needs but does not teach, each one call whose name says what it guards (require_torchrun,
stop_if_unloadable, require_same_start...; for mp.spawn in step 2, a checked MASTER_PORT and Ctrl-C that stops the
workers). Written out in the steps they would be a fifth of each script, and the lesson would drown in them.
"""
from utils import gpt, synthetic, vision
from utils.arguments import non_negative_int, non_negative_number, positive_int, positive_number, probability
from utils.collectives import weights_digest
from utils.files import being_written, dcp_folder, remove, replacing, writable_path
from utils.errors import reason
from utils.guards import (exists_on_any_rank, require_a_gpu_each, require_same_arguments, require_same_start,
                          require_torch_for_fsdp, require_torchrun, require_tp_fits)
from utils.process import configure_cpu_threads, exit_without_teardown, quiet_torchft
from utils.snapshots import (latest_snapshot, require_epochs_left, require_written_by, snapshot_folder, step_snapshot,
                             stop_if_unloadable, whole_snapshots)
from utils.launch import (attempt_store, collectives_timeout, errors_said_once, mesh_with_timeout, rendezvous_port,
                          said_once_per_node, stop_on_signals, watch_this_worker)
from utils.gpt import size_of
from utils.memory import log_memory, log_slices
from utils.snapshot_reader import snapshot_to_resume
from utils.metrics import log_rank_metrics
from utils.workload import SEED, evaluate

# What `--workload NAME` trains in every step: NAME -> builder(seed) -> Workload (utils/workload.py). A new workload
# is a builder added here; no step script changes.
WORKLOADS = {
    "synthetic": synthetic.synthetic,  # a small MLP learns a random teacher network: the default
    "wide": synthetic.wide,  # the same data on a ~1M-parameter residual MLP: large enough for FSDP to show
    "mnist": vision.mnist,  # small CNN; data in $TUTORIAL_DATA_DIR (default ./data), downloaded when online
    "cifar10": vision.cifar10,  # resnet18 from scratch
    "fakedata": vision.fakedata,  # random images, no files: offline benchmarks
    "gpt": gpt.gpt,  # a small character-level GPT on Python's help pages (step 6): the GPU size on CUDA, else the CPU's
    "gpt-cpu": gpt.gpt_cpu,  # either size anywhere, by name
    "gpt-gpu": gpt.gpt_gpu,
    # The mixture-of-experts GPT (step 10): every block's MLP as 4 experts (8 on the GPU size) and a router.
    "gpt-moe": gpt.gpt_moe,
    "gpt-moe-cpu": gpt.gpt_moe_cpu,
    "gpt-moe-gpu": gpt.gpt_moe_gpu,
}


def make_workload(name="synthetic", seed=SEED, **options):
    """Build the named workload. Same name, seed and options: the same data and initial weights, in any process.
    Options are the builder's own (the GPT's: text, dropout)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed, **options)


__all__ = ["attempt_store", "being_written", "configure_cpu_threads", "dcp_folder", "errors_said_once", "evaluate",
           "exists_on_any_rank", "exit_without_teardown", "latest_snapshot", "log_memory", "log_rank_metrics",
           "log_slices", "make_workload", "mesh_with_timeout", "non_negative_int", "non_negative_number",
           "positive_int", "positive_number", "probability", "quiet_torchft", "reason", "remove", "rendezvous_port",
           "replacing", "require_a_gpu_each", "require_epochs_left", "require_same_arguments", "require_same_start",
           "require_torch_for_fsdp", "require_torchrun", "require_tp_fits", "require_written_by", "said_once_per_node",
           "SEED", "size_of", "snapshot_folder", "snapshot_to_resume", "step_snapshot", "stop_if_unloadable", "stop_on_signals", "watch_this_worker",
           "weights_digest", "whole_snapshots", "WORKLOADS", "writable_path"]
