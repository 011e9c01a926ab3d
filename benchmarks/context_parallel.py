"""Context parallelism's attention alone: one causal attention layer's forward and backward with its sequence split
over cp = 1, 2 and 4 processes, how its work and memory fall on the ranks, for both splits and both exchanges.

    python benchmarks/context_parallel.py                      # context 1024, batch 1, 4 heads of 64, best of 10
    python benchmarks/context_parallel.py --context 4096 --rounds 3

Four processes (gloo, one CPU thread each) start once; at each cp the first cp of them take random q, k and v of shape
(--batch, --heads, --context / cp, --head_size), float32, through utils/context.py's attention and its backward (the
others wait at a barrier, blocked): the ring with the balanced split (rank r holds chunks r and 2cp-1-r of 2cp, as
context_parallel.py does) and with the contiguous one (rank r holds chunk r of cp), and the all-gather, balanced. At cp
1 one process computes the whole sequence with the same code (the all-gather is then torch's fused kernel, masked).
  scores     the query-key scores a rank computes, in % of one head's T x T: for the ring, counted (the chunk pairs
             Ring.pairs yields, each a whole block: the diagonal ones masked, not skipped); for the all-gather, its
             (T/cp) x T rectangle, which the masked kernel computes whole
  CPU ms     each rank's thread's CPU time for forward + backward (time.thread_time: its compute, not its waits for
             the others' blocks, nor gloo's threads), the best of --rounds after a warm-up round; max/min over ranks
  step ms    the slowest rank's wall time, the best round (with more processes than cores, it holds their sharing)
  saved MiB  the storages autograd keeps from the forward for the backward, each once (saved_tensors_hooks): the
             ring's q, k, v, output and log-sum-exp; the all-gather's q, whole K and V, output and mask (made float)
  K/V MiB    the most bytes of stacked keys and values (5-dimensional tensors: a block, one in flight, the gathered
             whole) alive at once in the forward, a dispatch mode following each storage from the op that made it
  peak MiB   the same for every tensor the forward and backward make, not what a kernel allocates inside itself
The last three are the most of any rank. Rounds take the configurations in turn, in reverse order every other round:
load drifting on the machine slows none of them more than another.

Then, untimed, the ring (balanced split) at cp 2 and 4 once more, for two more tables:
  traffic    its sends in one forward and its backward, q, k and v in float32 and in bfloat16: how many and their
             bytes, the most of any rank, counted as torch.distributed.batch_isend_irecv takes them (the ring sends
             by nothing else); a block is a rank's keys and values stacked, 2 x batch x heads x context/cp x head_size
  precision  the gradients of q, k and v with all four inputs in bfloat16 (the output's gradient too), against whole
             causal attention's in float64 on the same bfloat16 numbers: the root mean square of the error over every
             position, relative to the gradient's, with the gradients of keys and values sent in float32 (as
             utils/context.py's GRADIENTS_IN_TRANSIT does) and in bfloat16; cp 1 is the ring's code on one process,
             which sends nothing; under it, the same of the exact gradients rounded to bfloat16 once
"""
import argparse
import json
import os
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/context_parallel.py` from anywhere

from harness.jobs import free_port, machine_summary, spawned_result  # noqa: E402
from utils import exit_without_teardown, positive_int  # noqa: E402

CPS = [1, 2, 4]
EXCHANGES = [("ring", "balanced"), ("ring", "contiguous"), ("all-gather", "balanced")]
# The ring's traffic, counted with q, k and v in either dtype.
SENT = [(cp, dtype) for cp in CPS if cp > 1 for dtype in ("float32", "bfloat16")]
# The ring's gradients with bfloat16 inputs, the gradients of keys and values sent in either dtype (none at cp 1).
TRANSITS = [(1, "float32")] + [(cp, transit) for cp in CPS if cp > 1 for transit in ("float32", "bfloat16")]


def tracker(inputs):
    """A dispatch mode that follows each storage its ops make until it is freed (not views, nor `inputs`' storages):
    `peak`, the most bytes alive at once, of all of them and of the 5-dimensional ones (keys and values stacked)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Tracker(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak = [0, 0], [0, 0]  # of every tensor, of the 5-dimensional ones
            self.seen = {tensor.untyped_storage().data_ptr() for tensor in inputs}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in (leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)):
                storage, stacked = tensor.untyped_storage(), tensor.dim() >= 5
                if storage.data_ptr() not in self.seen:
                    self.seen.add(storage.data_ptr())
                    weakref.finalize(storage, self.count, storage.data_ptr(), -storage.nbytes(), stacked)
                    self.count(None, storage.nbytes(), stacked)
            return out

        def count(self, freed, size, stacked):
            self.seen.discard(freed)  # its address may hold a new storage next
            for i in (0, 1) if stacked else (0,):
                self.live[i] += size
                self.peak[i] = max(self.peak[i], self.live[i])

    return Tracker()


def worker(rank, args, result_path):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from utils import context
    from utils.context import Ring, gathered_attention, positions_of, ring_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=max(CPS), timeout=timedelta(seconds=args.timeout))
    groups = {cp: dist.new_group(list(range(cp))) for cp in CPS}  # every rank takes part in making each group
    torch.manual_seed(rank)
    inputs = {cp: [torch.randn(args.batch, args.heads, args.context // cp, args.head_size, requires_grad=i < 3)
                   for i in range(4)] for cp in CPS}  # q, k, v and the output's gradient

    def attention(cp, exchange, split):
        chunks_by_rank = [[r, 2 * cp - 1 - r] if split == "balanced" else [r] for r in range(cp)]
        q, k, v, _ = inputs[cp]
        q.grad = k.grad = v.grad = None
        attend = ring_attention if exchange == "ring" else gathered_attention
        return attend(q, k, v, groups[cp], chunks_by_rank, sum(map(len, chunks_by_rank)))

    def memory(cp, exchange, split):
        """The scores, saved, K/V and peak figures of one more forward and backward (untimed: the hooks cost time)."""
        # The ring's scores are counted pair by pair below; the all-gather's kernel computes its whole rectangle.
        saved, scores, pairs = {}, [(args.context // cp) * args.context * (exchange == "all-gather")], Ring.pairs

        def counted_pairs(ring, held):
            for pair in pairs(ring, held):
                scores[0] += ring.n ** 2  # one head's chunk x chunk block of scores
                yield pair

        def pack(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        Ring.pairs = counted_pairs  # the forward's pairs; the backward computes the same ones again
        with tracker(inputs[cp]) as mode:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = attention(cp, exchange, split)
            Ring.pairs, kv = pairs, mode.peak[1]
            out.backward(inputs[cp][3])
            del out
        return dict(scores=scores[0] / args.context ** 2, saved=sum(saved.values()), kv=kv, peak=mode.peak[0])

    def traffic(cp, dtype):
        """The ring's sends (balanced split) of one forward and one backward with q, k and v in `dtype`: the bytes of
        each block this rank posts, counted as dist.batch_isend_irecv takes them (the ring sends by nothing else)."""
        posted, post = [], dist.batch_isend_irecv

        def counted(ops):
            posted.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return post(ops)

        q, k, v, grad = (tensor.detach().to(getattr(torch, dtype)).requires_grad_(i < 3)
                         for i, tensor in enumerate(inputs[cp]))
        chunks_by_rank = [[r, 2 * cp - 1 - r] for r in range(cp)]
        dist.batch_isend_irecv = counted
        try:
            out = ring_attention(q, k, v, groups[cp], chunks_by_rank, 2 * cp)
            forward = list(posted)
            out.backward(grad)
        finally:
            dist.batch_isend_irecv = post
        return dict(block=2 * k.numel() * k.element_size(), forward=forward, backward=posted[len(forward):])

    def precision(cp, transit):
        """The ring's gradients (balanced split) with q, k, v and the output's gradient in bfloat16, the gradients of
        keys and values sent in `transit`, against whole attention's in float64 on the same bfloat16 numbers: per
        gradient (dQ, dK, dV) the error's root mean square over the group's positions, relative to the gradient's; and
        the same of the exact gradients rounded to bfloat16 once, the least any bfloat16 gradient can be off."""
        # The same sequence on every rank: each takes its chunks of it.
        torch.manual_seed(1234)
        q, k, v, grad = (torch.randn(args.batch, args.heads, args.context, args.head_size, dtype=torch.float64)
                         .bfloat16() for _ in range(4))
        whole = [tensor.double().requires_grad_() for tensor in (q, k, v)]
        F.scaled_dot_product_attention(*whole, is_causal=True).backward(grad.double())
        chunks_by_rank = [[r, 2 * cp - 1 - r] for r in range(cp)]
        mine = positions_of(chunks_by_rank[rank], 2 * cp, args.context)
        parts = [tensor[:, :, mine].clone().requires_grad_() for tensor in (q, k, v)]
        context.GRADIENTS_IN_TRANSIT = getattr(torch, transit)
        try:
            ring_attention(*parts, groups[cp], chunks_by_rank, 2 * cp).backward(grad[:, :, mine])
        finally:
            context.GRADIENTS_IN_TRANSIT = torch.float32
        squares = torch.tensor([[((part.grad.double() - exact) ** 2).sum(), ((exact.bfloat16() - exact) ** 2).sum(),
                                 (exact ** 2).sum()] for part, exact in
                                ((part, tensor.grad[:, :, mine]) for part, tensor in zip(parts, whole))])
        # The sums over every rank's positions.
        dist.all_reduce(squares, group=groups[cp])
        return dict(ring=(squares[:, 0] / squares[:, 2]).sqrt().tolist(),
                    rounded=(squares[:, 1] / squares[:, 2]).sqrt().tolist())

    configurations = [(cp, exchange, split) for cp in CPS for exchange, split in EXCHANGES]
    figures = {key: dict(cpu=[], wall=[]) for key in configurations}
    for round_ in range(args.rounds + 1):  # round 0 warms up (its times are left out) and measures the memory
        for key in configurations if round_ % 2 else configurations[::-1]:
            dist.barrier()
            wall = torch.zeros(1)
            if rank < key[0]:
                began, began_cpu = time.perf_counter(), time.thread_time()
                attention(*key).backward(inputs[key[0]][3])
                figures[key]["cpu"].append(time.thread_time() - began_cpu)
                wall[0] = time.perf_counter() - began
                figures[key].update(memory(*key) if not round_ else {})
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank's
            figures[key]["wall"].append(wall.item())
    sends, errors = {}, {}
    for cp, dtype in SENT:
        dist.barrier()
        sends[cp, dtype] = traffic(cp, dtype) if rank < cp else None
    for cp, transit in TRANSITS:
        dist.barrier()
        errors[cp, transit] = precision(cp, transit) if rank < cp else None
    everyone = [None] * max(CPS)  # each rank's figures of each configuration, None where it had no part
    dist.all_gather_object(everyone, ([dict(figures[key], cpu=min(figures[key]["cpu"][1:])) if rank < key[0] else None
                                       for key in configurations], [sends[key] for key in SENT]))
    if rank == 0:
        Path(result_path).write_text(json.dumps(dict(attention=[
            dict(cp=cp, exchange=exchange, split=split, ranks=[theirs[0][i] for theirs in everyone[:cp]],
                 step=min(figures[cp, exchange, split]["wall"][1:])) for i, (cp, exchange, split) in
            enumerate(configurations)], traffic=[
            dict(cp=cp, dtype=dtype, ranks=[theirs[1][i] for theirs in everyone[:cp]])
            for i, (cp, dtype) in enumerate(SENT)], precision=[
            dict(errors[cp, transit], cp=cp, transit=transit) for cp, transit in TRANSITS])))
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


def table(rows):
    lines = ["| exchange | split | cp | scores per rank (% of T x T) | CPU ms per rank | max/min | step ms | "
             "saved MiB | K/V MiB | peak MiB |", "|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        cpu = [rank["cpu"] * 1e3 for rank in row["ranks"]]
        scores = " / ".join(f"{rank['scores']:.1%}" for rank in row["ranks"])
        most = " | ".join(f"{max(rank[name] for rank in row['ranks']) / 2**20:.2f}" for name in ("saved", "kv", "peak"))
        lines.append(f"| {row['exchange']} | {row['split']} | {row['cp']} | {scores} | "
                     f"{' / '.join(f'{ms:.1f}' for ms in cpu)} | {max(cpu) / min(cpu):.2f} | {row['step'] * 1e3:.1f} | "
                     f"{most} |")
    return "\n".join(lines)


def traffic_table(rows):
    """Per cp and dtype of q, k and v: the ring's sends of one forward and one backward, the most of any rank."""
    lines = ["| cp | q, k, v | block MiB | forward sends | forward MiB | backward sends | backward MiB | "
             "backward / forward |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        forward, backward = (max(sum(rank[name]) for rank in row["ranks"]) for name in ("forward", "backward"))
        count = {name: max(len(rank[name]) for rank in row["ranks"]) for name in ("forward", "backward")}
        lines.append(f"| {row['cp']} | {row['dtype']} | {row['ranks'][0]['block'] / 2**20:.3f} | {count['forward']} | "
                     f"{forward / 2**20:.3f} | {count['backward']} | {backward / 2**20:.3f} | "
                     f"{backward / forward:.2f} |")
    return "\n".join(lines)


def precision_table(rows):
    """Per cp and dtype the gradients of keys and values travel in: the ring's error of each gradient, in % of it;
    under the table, the error of the exact gradients rounded to bfloat16 once."""
    lines = ["| cp | dK, dV sent in | dQ error | dK error | dV error |", "|---:|---|---:|---:|---:|"]
    for row in rows:
        errors = " | ".join(f"{error:.3%}" for error in row["ring"])
        lines.append(f"| {row['cp']} | {row['transit'] if row['cp'] > 1 else 'not sent'} | {errors} |")
    rounded = ", ".join(f"{name} {error:.3%}" for name, error in zip(("dQ", "dK", "dV"), rows[0]["rounded"]))
    return "\n".join(lines + [f"the exact gradients rounded to bfloat16 once: {rounded}"])


def imbalance(rows):
    """At the largest cp, for each split of the ring: its last rank's scores and CPU time against its first rank's."""
    cp = max(row["cp"] for row in rows)
    return "; ".join(f"{row['split']} split at cp {cp}: the last rank computes "
                     f"{row['ranks'][-1]['scores'] / row['ranks'][0]['scores']:.2f}x the first's scores in "
                     f"{row['ranks'][-1]['cpu'] / row['ranks'][0]['cpu']:.2f}x its CPU time"
                     for row in rows if row["cp"] == cp and row["exchange"] == "ring")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", default=1024, type=positive_int, help="Tokens per sequence (default 1024)")
    parser.add_argument("--batch", default=1, type=positive_int, help="Sequences (default 1)")
    parser.add_argument("--heads", default=4, type=positive_int, help="Attention heads (default 4)")
    parser.add_argument("--head_size", default=64, type=positive_int, help="Dimensions per head (default 64)")
    parser.add_argument("--rounds", default=10, type=positive_int, help="Timed rounds (the best one counts)")
    parser.add_argument("--timeout", default=600, type=positive_int, help="Seconds before the run is stopped")
    args = parser.parse_args()
    if args.context % (2 * max(CPS)):
        sys.exit(f"error: --context must cut into 2 x cp = {2 * max(CPS)} chunks of equal length")

    print(f"one attention layer: batch {args.batch}, {args.heads} heads of {args.head_size}, context {args.context}, "
          f"forward and backward, best of {args.rounds} rounds; on {machine_summary()}", flush=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                      CUDA_VISIBLE_DEVICES="")
    began = time.perf_counter()
    result = spawned_result(worker, (args,), max(CPS), args.timeout, "the context-parallel benchmark")
    rows = result["attention"]
    print(f"{table(rows)}\n{imbalance(rows)}")
    print(f"the ring's sends, balanced split, one forward and its backward:\n{traffic_table(result['traffic'])}")
    print("the ring's gradients with q, k, v in bfloat16, against float64 on the same numbers (root mean square error, "
          f"relative):\n{precision_table(result['precision'])}")
    print(f"{time.perf_counter() - began:.0f} s; at the end: {machine_summary()}")


if __name__ == "__main__":
    main()
