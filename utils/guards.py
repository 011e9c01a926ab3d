"""The guards a step calls by name before or right after its process group forms: started by torchrun with a GPU
each, a layout the job can split, a torch that trains it right, every rank starting alike. Each stops every rank
with one line that says what to do."""
import os
import sys

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from utils.collectives import gathered_json
from utils.gpt import size_of
from utils.launch import stop_once_per_node


def require_torchrun(example="torchrun --standalone --nproc_per_node=2"):
    """Stop with one clear line when a torchrun script is started wrongly.

    Started with plain `python`, the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE...) are missing;
    started with more processes per machine than it has GPUs, two processes would share one GPU: said once on each
    node, by local rank 0 (every rank of a machine counts the same GPUs), and once for the job across torchrun's
    restarts.
    """
    script = " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] or ["50", "10"]))
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"error: start this script with torchrun, which starts and numbers the processes: "
                         f"{example} {script}")
    try:
        require_a_gpu_each(int(os.environ["LOCAL_WORLD_SIZE"]), "--nproc_per_node=gpu")
    except SystemExit as stop:
        # Every rank of this machine counts the same GPUs: one line, by local rank 0.
        stop_once_per_node(stop.code)


def require_a_gpu_each(processes, hint):
    """`processes`, after checking this machine has a GPU for each (DDP and FSDP run one process per GPU; two on one
    GPU would fight over it): else one clear line and exit 1, where the official tutorial silently exits 0.
    Without CUDA, any number of CPU processes."""
    gpus = torch.cuda.device_count()
    if torch.cuda.is_available() and processes > gpus:
        raise SystemExit(f"error: {processes} processes on this machine but {gpus} GPU(s): one process per GPU "
                         f"({hint}), so start {gpus} or fewer; or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run "
                         f"{processes} on the CPU")
    return processes


def exists_on_any_rank(path, device):
    """True on every rank when any rank finds `path`. A collective: call it on every rank. For a snapshot whose
    loading is itself a collective (DCP's), so that either all ranks load it or none does: a rank that saw no
    snapshot on its disk then fails to load instead of waiting for the others in a different collective."""
    found = torch.tensor(os.path.exists(path), device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found)


def require_same_start(epochs_run, device, unit="epochs"):
    """Stop every rank with one line unless all of them resume from the same epoch (or step: unit="steps"). Each node
    reads the snapshot from its own disk: if the nodes do not share that storage, one resumes while another starts
    over, and their collectives stop matching. A collective: call it on every rank once the snapshot is loaded (or not)."""
    seen = torch.tensor([epochs_run, -epochs_run], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if seen[0] != -seen[1]:
        raise SystemExit(f"error: ranks resume from different {unit} ({-int(seen[1])} to {int(seen[0])}): put "
                         "--snapshot_path on storage that every node shares")


def require_dense_gpt(args):
    """Stop with one line, before any process group forms, when a GPT step that does not add the load-balancing loss
    (all but expert_parallel.py, which has --aux_weight) is given the mixture-of-experts GPT."""
    if "moe" in args.workload and not hasattr(args, "aux_weight"):
        raise SystemExit(f"error: --workload {args.workload} is the mixture-of-experts GPT: expert_parallel.py (step "
                         "10) trains it, with the load-balancing loss its routers need")


def require_tp_fits(args, world_size):
    """Stop with one line, before any process group forms, when tensor_parallel.py's `--tp` cannot split the job: the
    processes must form whole tp groups, and each block's attention heads must split evenly over a group (a rank
    computes heads/tp of them). The heads are those of the GPT size that `--workload` trains here."""
    require_dense_gpt(args)  # its plan splits one MLP per block, not experts
    tp, heads = args.tp, size_of(args.workload).n_head
    if world_size % tp or heads % tp:
        raise SystemExit(f"error: --tp {tp} must divide the number of processes ({world_size}) and of attention heads "
                         f"({heads}): the processes form groups of {tp}, and each group splits every block's heads "
                         "evenly")


def require_torch_for_fsdp(sharded=True):
    """Stop with one line, before any process group forms, where this torch's FSDP (fully_shard) does not train CPU
    processes right: 2.6's runs on CUDA streams only (its first forward fails), and 2.7's and 2.8's reduce-scatter
    the gradients with ReduceOp.AVG, which their gloo takes for a sum: the gradients come out N times the mean over N
    ranks, silently (measured with 2.7.1 and 2.8.0, against one process; right from 2.9.1 on). On GPUs (NCCL) they
    are right. `sharded`: whether the job shards at all (fsdp.py's --strategy ddp does not)."""
    if sharded and not torch.cuda.is_available() and TorchVersion(torch.__version__) < (2, 9):
        wrong = ("runs on CUDA streams only" if TorchVersion(torch.__version__) < (2, 7) else
                 "sums the gradients over the ranks instead of averaging them (gloo has no average)")
        raise SystemExit(f"error: FSDP of torch {torch.__version__} {wrong} on CPU processes: use torch 2.9 or newer "
                         "there (on GPUs it is right from 2.6)")


def require_same_arguments(args, ignore=("snapshot_path",)):
    """Stop every rank with one line, before any training, when the nodes were started with different arguments
    (TOTAL_EPOCHS, SAVE_EVERY, the batch size, the workload...): their collectives would not match, and the job would
    crash with a gloo abort or wait out --timeout. A collective: call it on every rank, right after the process group
    forms. The snapshot path may differ (nodes can mount shared storage at different places)."""
    # As JSON in tensors, not pickled objects: a process that joined the group could make a pickle run its code.
    everyone = gathered_json({name: value for name, value in vars(args).items() if name not in ignore})
    for rank, theirs in enumerate(everyone[1:], start=1):  # every rank compares the same pairs: all say the same
        different = [name for name in everyone[0] if theirs.get(name) != everyone[0][name]]
        if different:
            name = different[0]
            raise SystemExit(f"error: the nodes were started with different arguments: {name} is {everyone[0][name]} "
                             f"on rank 0 but {theirs[name]} on rank {rank}; start every node with the same command")
