"""What each way of training the same GPT communicates per optimizer step: DDP, FSDP, TP, 2D (FSDP x TP), CP and EP
(on the GPT's mixture-of-experts version), on the same ranks and the same global batch; and the tokens/s each reaches
here, in the same run.

    python benchmarks/communication.py                    # 4 CPU processes (gloo), the CPU-size GPT
    python benchmarks/communication.py --size gpu --steps 2   # the GPU size: nanoGPT's 10.8M weights (slow)

The N processes (one CPU thread each) train the GPT the way the steps wrap it: DDP(model) (steps 2-4, 6); fully_shard
on each block and the root (step 5, fsdp.py); tensor_parallel.py's PLAN on each block over a tp group of all N ranks,
then fully_shard over the remaining dp dimension of one rank (--tp N); the 2D layout dp 2 x tp N/2; and CP as
context_parallel.py (step 9) trains it: DDP over all ranks, each sequence split over a cp group of all N ranks (rank r
holds chunks r and 2N-1-r of 2N, utils.context.split_sequence), keys and values passed around the ring. EP trains
the mixture-of-experts GPT of the same size (gpt-moe-cpu: every block's MLP as 4 experts, 8 at the GPU size, each
token sent to its top 2) as expert_parallel.py (step 10) wraps it, on a (dp, ep) mesh: each rank keeps 1/ep of every
layer's experts (utils.moe.split_experts); per layer the counts, the tokens and, back, the experts' outputs travel by
all-to-all, and backward sends the tokens' gradients both ways; each layer's experts are a DDP over dp, the rest a
DDP over all ranks. Each layer's forward also all-reduces its tokens per expert over all ranks (E numbers: the
batch's load, for the load-balancing loss, which is itself left out here: it adds no communication). EP is ep N,
"EP 2D" dp 2 x ep N/2, and "MoE DDP" is DDP(model) of the same mixture of experts, every rank holding all of it: the
all-reduce that EP shrinks. Every layout takes the same global batch (--batch_size sequences per optimizer step: N/1,
N/2 or 1 share of it per rank; a CP rank reads all of them and keeps its chunks' positions of each; an EP rank reads
its own, as a DDP rank does).

Counts come from torch's own instrument, CommDebugMode (torch.distributed.tensor.debug; utils/traffic.py weighs each
collective): a dispatch mode that sees
every collective a rank calls, c10d's (DDP's all-reduces, FSDP's all-gathers and reduce-scatters) and DTensor's
functional ones (TP's all-reduces). It does not count point-to-point ops, which the ring's exchange is made of
(batch_isend_irecv's isend and irecv): the same dispatch mode sees them as c10d's send and recv_ ops, and each send is
noted here as one "send/recv" (a rank sends a block to the next rank as it receives one from the previous; the
receive is its peer's send, counted there). Each collective's buffer is weighed (the whole tensor: an all-gather's
output, a reduce-scatter's input, a send's block) and named by its process group (dp, tp, cp, ep or all ranks). "Sent
per rank" is what a ring algorithm sends for that buffer: 2(n-1)/n of it for an all-reduce, (n-1)/n for an all-gather
or a reduce-scatter over n ranks, all of it for a send; a group of one rank sends nothing. An all-to-all's is what
rank 0 sends to the other ranks (its input less its own split): the tokens' splits follow the routers' choices, so
EP's figure depends on the data and the weights, and differs from rank to rank. One step after two warm-up
steps is counted; the forward and backward of the counted step are told apart. Timed steps: the best of --rounds
rounds of --steps steps, the layouts taking turns round after round (other work only ever slows a turn down).
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/communication.py` from anywhere; tensor_parallel.py imports

from harness.jobs import free_port, machine_summary, spawned_result  # noqa: E402
from utils import exit_without_teardown, positive_int  # noqa: E402
from utils.traffic import counting_collectives, sent_per_rank  # noqa: E402

MOE_LAYOUTS = ["MoE DDP", "EP", "EP 2D"]  # the mixture-of-experts GPT: DDP of it whole, then its experts split
LAYOUTS = ["DDP", "FSDP", "TP", "2D", "CP", *MOE_LAYOUTS]
def labelled(group, label):
    """{the group's name: (label, its ranks)}: how counting_collectives names the collectives over it."""
    import torch.distributed as dist

    return {group.group_name: (label, dist.get_process_group_ranks(group))}


def wrapped(layout, world_size, size, text_path):
    """The GPT of `size` ("cpu" or "gpu"; dropout 0; its mixture-of-experts version for EP) wrapped as `layout`: (its
    workload, the wrapped model, its optimizer, {group name: (label, its ranks)}, the mesh's number of dp ranks, the number
    of ranks that read different sequences, and a context manager inside which the model trains: CP's split of each
    sequence, which yields the positions this rank takes; else one that yields None)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tensor_parallel import PLAN
    from utils import make_workload
    from utils.context import split_sequence
    from utils.moe import moe_layers, split_experts

    workload = make_workload(f"gpt-moe-{size}" if layout in MOE_LAYOUTS else f"gpt-{size}", text=text_path,
                             dropout=0)
    model, groups = workload.model, labelled(dist.group.WORLD, "all")
    if layout in ("DDP", "MoE DDP"):
        return workload, DDP(model), workload.optimizer, groups, world_size, world_size, contextlib.nullcontext()
    if layout in MOE_LAYOUTS:  # as expert_parallel.py: a (dp, ep) mesh, each rank 1/ep of every layer's experts
        ep = world_size if layout == "EP" else world_size // 2
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("dp", "ep"))
        # An ep dimension of all ranks is the default group itself, as with CP: a group of its own over the same
        # ranks gives the all-to-alls a name apart from DDP's all-reduce.
        ep_group = dist.new_group(list(range(world_size))) if ep == world_size else mesh["ep"].get_group()
        groups.update(labelled(ep_group, "ep") | labelled(mesh["dp"].get_group(), "dp"))
        split_experts(model, ep_group)
        # Each layer's experts: a DDP over their dp copies, the gradient / ep (the mean over all ranks, as the rest's).
        for layer in moe_layers(model):
            layer.experts = DDP(layer.experts, process_group=mesh["dp"].get_group())
            for weight in layer.experts.parameters():
                weight.register_hook(lambda grad: grad / ep)
        experts = [name for name, _ in model.named_parameters() if "expert" in name]
        DDP._set_params_and_buffers_to_ignore_for_model(model, experts)  # the rest: DDP over all ranks
        return (workload, DDP(model), workload.make_optimizer(model), groups, world_size // ep, world_size,
                contextlib.nullcontext())
    if layout == "CP":  # as context_parallel.py with dp 1: DDP over all ranks, the balanced split, the ring
        # A group of its own over all ranks, where context_parallel.py's mesh would hand out the default group itself:
        # the same ranks, but a name of its own, so that the table tells the ring's sends from DDP's all-reduce.
        cp = dist.new_group(list(range(world_size)))
        groups.update(labelled(cp, "cp"))
        chunks_by_rank = [[r, 2 * world_size - 1 - r] for r in range(world_size)]
        model = DDP(model)
        return workload, model, workload.optimizer, groups, 1, 1, split_sequence(model, cp, chunks_by_rank, "ring")
    tp = {"FSDP": 1, "TP": world_size, "2D": world_size // 2}[layout]
    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    groups.update(labelled(mesh["tp"].get_group(), "tp") | labelled(mesh["dp"].get_group(), "dp"))
    for block in list(model.children())[1:-1] if tp > 1 else []:
        parallelize_module(block, mesh["tp"], PLAN)
    for module in [*model.children(), model]:
        fully_shard(module, mesh=mesh["dp"])
    return (workload, model, workload.make_optimizer(model), groups, world_size // tp, world_size // tp,
            contextlib.nullcontext())


def worker(rank, world_size, args, text_path, result_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Under CommDebugMode's module tracker FSDP warns that a block returns a view (a linear layer's 3-D output is
    # one): no in-place operation follows, so nothing is lost.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout))
    runs, splits = {}, contextlib.ExitStack()  # CP's model stays split until the timed rounds are over
    for layout in LAYOUTS:
        workload, model, optimizer, groups, dp, readers, split = wrapped(layout, world_size, args.size, text_path)
        positions = splits.enter_context(split)
        share = args.batch_size // readers  # sequences per rank; the ranks of a tp or cp group take the same ones
        start = (rank // (world_size // readers)) * share
        source, targets = (t[start:start + share] for t in workload.train_set[:args.batch_size])
        if positions is not None:  # a cp rank keeps its chunks of each sequence
            source, targets = source[:, positions], targets[:, positions]

        def step():
            workload.loss_fn(model(source), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(2):  # warm-up: DDP rebuilds its buckets after the first step, Adam creates its moments
            step()
        with counting_collectives(groups) as mode:
            step()
        runs[layout] = dict(collectives=mode.collectives, dp=dp, step=step, seconds=[])
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            dist.barrier()
            began = time.perf_counter()
            for _ in range(args.steps):
                runs[layout]["step"]()
            slowest = torch.tensor([time.perf_counter() - began])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            runs[layout]["seconds"].append(slowest.item())
    splits.close()
    context = workload.train_set.tensors[0].shape[1]
    if rank == 0:
        Path(result_path).write_text(json.dumps({layout: dict(
            collectives=run["collectives"], dp=run["dp"],
            tokens_per_s=args.batch_size * context * args.steps / min(run["seconds"]))
            for layout, run in runs.items()}))
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


def summary(results, world_size):
    """One row per layout: its collectives per optimizer step by kind and group, and what each rank sends."""
    rows = []
    for layout, result in results.items():
        counts, sent = defaultdict(int), defaultdict(float)
        for collective in result["collectives"]:
            where = collective["group"] if collective["ranks"] > 1 else "alone"
            counts[(collective["kind"], where, collective["backward"])] += 1
            sent[where] += sent_per_rank(collective)
        # The mesh's other dimension: what shares a sequence, a matrix or a layer's experts.
        inner = "cp" if layout == "CP" else "ep" if layout in MOE_LAYOUTS else "tp"
        rows.append(dict(layout=layout, mesh=f"dp {result['dp']} x {inner} {world_size // result['dp']}",
                         counts=dict(counts), sent={where: value / 2**20 for where, value in sent.items()},
                         tokens_per_s=result["tokens_per_s"]))
    return rows


def describe(counts):
    """`2 all-gather (fwd) + ...` from {(kind, group, backward): n}, groups of one rank left out."""
    parts = [f"{n} {kind} over {group} ({'bwd' if backward else 'fwd'})"
             for (kind, group, backward), n in sorted(counts.items(), key=lambda item: (item[0][2], item[0][:2]))
             if group != "alone"]
    return ", ".join(parts) or "none"


def table(rows):
    lines = ["| layout | mesh | collectives per optimizer step (each rank) | MiB sent per rank per step | tokens/s |",
             "|---|---|---|---:|---:|"]
    for row in rows:
        sent = " + ".join(f"{mib:.2f} ({where})" for where, mib in sorted(row["sent"].items()) if where != "alone")
        lines.append(f"| {row['layout']} | {row['mesh']} | {describe(row['counts'])} | {sent or '0'} | "
                     f"{row['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", default=4, type=positive_int, help="Processes (an even number: 2D is dp 2)")
    parser.add_argument("--size", default="cpu", choices=["cpu", "gpu"], help="The GPT's size (utils/gpt.py)")
    parser.add_argument("--batch_size", default=16, type=positive_int, help="Sequences per optimizer step, all ranks")
    parser.add_argument("--steps", default=10, type=positive_int, help="Timed optimizer steps per round")
    parser.add_argument("--rounds", default=3, type=positive_int, help="Timed rounds (the best one counts)")
    parser.add_argument("--chars", default=60_000, type=positive_int, help="Characters of Python's help pages")
    parser.add_argument("--timeout", default=600, type=positive_int, help="Seconds before the run is stopped")
    args = parser.parse_args()
    from utils.gpt import SIZES, help_pages, size_of

    heads, context = SIZES[args.size].n_head, SIZES[args.size].context
    moe = size_of(f"gpt-moe-{args.size}")
    if (args.nproc % 2 or args.batch_size % args.nproc or heads % args.nproc or context % (2 * args.nproc)
            or moe.experts % args.nproc):
        sys.exit(f"error: --nproc must be even (2D is dp 2 x tp nproc/2) and divide --batch_size, the "
                 f"{args.size}-size GPT's {heads} heads (TP alone splits them over all the processes) and its "
                 f"{moe.experts} experts per layer (EP alone splits them over all the processes), and 2 x --nproc "
                 f"its context of {context} (CP cuts each sequence into 2 x nproc chunks)")

    print(f"{machine_summary()}; {args.nproc} processes, one thread each; the {args.size}-size GPT, "
          f"{args.batch_size} sequences per optimizer step")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                      CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryDirectory() as scratch:
        text_path = Path(scratch) / "text.txt"
        text_path.write_text(help_pages()[:args.chars])
        results = spawned_result(worker, (args.nproc, args, str(text_path)), args.nproc, args.timeout,
                                 f"{args.nproc} processes")
    print(table(summary(results, args.nproc)))
    print(f"EP: the mixture-of-experts GPT of the same size, {moe.experts} experts per layer, each token to its top "
          f"{moe.top_k}; its all-to-alls' count is fixed, their bytes are rank 0's and depend on the routing (data-"
          f"dependent): the tokens this batch's routers sent to experts on other ranks, and took in for its own")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
