"""What every rank of one_mesh.py (step 11) holds and sends, computed from the GPT's shapes and the layout alone.

    python tools/memory_plan.py --size cpu --pp 2 --dp 2 --tp 2 --batch_size 4 --microbatches 2
    python tools/memory_plan.py --size gpu --pp 2 --tp 4 --checkpoint_activations --precision bf16 --text FILE
    python tools/memory_plan.py --fit --gpus 8 --gpu_gib 80 --size 1b|8b [--precision fp32] [--batch_size 8 ...]

A row per rank (pipeline rank r holds stages r and r + pp of the 2 pp stages one_mesh.py cuts), in MiB.
params, grads, optim: its local shards, as the step measures them (each tensor split over tp by one_mesh.py's plan,
then its dim 0 over dp in torch.chunk's ceil-sized pieces; AdamW: two fp32 moments and a 4-byte step per parameter).
gathered: its layers' tp slices whole, the weights in the compute dtype (reshard_after_forward=False keeps them from
the first forward to the last backward) and the fp32 gradients FSDP accumulates over the micro-batches.
act_mb, act_step: what autograd keeps for backward (as utils/memory.saved_for_backward counts it) for a micro-batch
through both stages, and for the step's M. peak_act: the most the interleaved 1F1B schedule holds at once (see
plan_rank). pp, dp, tp_bytes: what it sends a step: activations and their gradients between stages; FSDP's ring
all-gather of the weights and reduce-scatter of the gradients; sequence parallelism's all-gathers and reduce-scatters
(4 a block forward, 4 backward, 4 more to recompute: as many bytes as plain tp's all-reduces; loss_parallel's few
numbers a position left out). --fit adds up shards, gathered and peak_act for each pp x dp x tp of --gpus, and keeps
MARGIN of each GPU for what the plan leaves out: the CUDA context, NCCL's buffers, fragmentation, temporaries (fp32
logits, attention's workspace, all-gather buffers, activation gradients). Sizes: "cpu", "gpu" (utils/gpt.SIZES, the
vocabulary of --text or of the help pages); "1b", "8b": THIS GPT (LayerNorm, biases, a 4x GELU MLP, learned positions,
an untied head) at the widths of Llama 3.2 1B and Llama 3 8B, not Llama (RMSNorm, SwiGLU, rotary positions): 1.35e9
and 7.53e9 weights. Calibrated against CPU jobs (tests/test_memory_plan.py); on CUDA, LayerNorm's statistics are fp32.
"""
import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils.gpt import SIZES, GPTConfig, load_text  # noqa: E402

MiB, GiB = 2**20, 2**30
MARGIN = 0.15  # of each GPU's memory, for what the plan leaves out
# What check() allows between the plan and a job's measurement: the weights and their state to the byte; activations
# within 1% of the measured (measured here: 0 bytes off in every layout run; 1% is room for a kernel that keeps a few
# small tensors more, while one block's activations left out or counted twice is 10% or more).
ACTIVATION_TOLERANCE = 0.01
BIG = {name: GPTConfig(n_layer=layers, n_head=32, n_embd=width, context=8192, dropout=0.0, lr=3e-4, betas=(0.9, 0.95),
                       weight_decay=0.1, vocab_size=128256)
       for name, layers, width in (("1b", 16, 2048), ("8b", 32, 4096))}


@dataclasses.dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    batch_size: int = 4  # sequences per dp rank per step
    microbatches: int = 2
    precision: str = "fp32"  # or "bf16": the compute dtype; weights, gradients and AdamW's state stay fp32
    checkpoint_activations: bool = False
    sequence_parallel: bool = True  # one_mesh.py always splits the positions over tp between the matrices


def config_of(size, text=None):
    """The GPTConfig of a size: a big one as it is, "cpu" or "gpu" with the vocabulary of `text` (a file)."""
    return BIG.get(size) or dataclasses.replace(SIZES[size], vocab_size=len(set(load_text(text, 0)[1])))


def split(n, parts, index):
    """What part `index` of `parts` gets of n rows, as torch.chunk and DTensor's Shard cut: ceil-sized pieces."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def layer_params(config, name):
    """(shape, the dim tp splits or None) of each weight of a layer, per one_mesh.py's plan: column-wise q, k, v, fc
    (weight rows and bias), row-wise proj (weight columns, bias replicated), the embeddings by rows, the norms
    replicated (sequence parallelism runs them on each rank's positions), the head's linear column-wise (no bias)."""
    C, V, T = config.n_embd, config.vocab_size, config.context
    if name == "embed":
        return [((V, C), 0), ((T, C), 0)]
    norm = [((C,), None)] * 2
    if name == "head":
        return norm + [((V, C), 0)]
    column, row = [((C, C), 0), ((C,), 0)], [((C, C), 1), ((C,), None)]
    return norm + column * 3 + row + norm + [((4 * C, C), 0), ((4 * C,), 0), ((C, 4 * C), 1), ((C,), None)]


def activations(config, layout, name, tp_rank, device, checkpointed=None):
    """Bytes autograd keeps for one micro-batch through a layer on a tp rank (the batch's ids and targets: a step)."""
    b, T, C, H = layout.batch_size // layout.microbatches, config.context, config.n_embd, config.n_head
    n, t, d = b * T, layout.tp, 2 if layout.precision == "bf16" else 4
    s = t if layout.sequence_parallel else 1  # between the matrices each tp rank holds n / s positions
    stats = d if device == "cpu" else 4  # LayerNorm's mean and 1/std: in the input's dtype on CPU, fp32 on CUDA
    mask = 1 if config.dropout else 0  # each dropout's mask, a byte an element (CUDA's kernel)
    if name == "embed":  # the position embedding's arange
        return 8 * T + mask * n * C // s
    if name == "head":  # the norm's input, mean, 1/std; the linear's gathered input; the fp32 log-softmax; a scalar
        return n * C // s * d + 2 * n // s * stats + n * C * d + n * split(config.vocab_size, t, tp_rank) * 4 + 4
    if layout.checkpoint_activations if checkpointed is None else checkpointed:
        return n * C // s * d  # the block's input alone: backward recomputes the rest
    # The norms' inputs (n / s positions) and the matrices' gathered inputs (all n); 1/t of the heads and columns: q, k,
    # v, attention's output (the proj's input is a view of it), the 4C-wide MLP before and after GELU; the norms' mean
    # and 1/std, attention's fp32 log-sum-exp per head and position; the dropouts' masks.
    return (2 * n * C // s * d + 2 * n * C * d + 12 * n * C // t * d + 4 * n // s * stats + b * H // t * T * 4
            + 2 * mask * n * C // s)


def schedule(pp, M, rank):
    """torch's ScheduleInterleaved1F1B on pipeline rank `rank` of pp, two stages each: (local stage 0 or 1, +1 for a
    forward, -1 for a backward). Warm-up forwards (more on the first ranks), then a forward and a backward each, then
    the backwards left; forwards and backwards take the micro-batches in rounds of pp, stage by stage."""
    per_round = M // max(1, M // pp)
    warmup = min(per_round + 2 * (pp - 1 - rank), 2 * M)
    for op in range(2 * M + warmup):
        if op < 2 * M:
            yield (op // per_round) % 2, +1
        if op >= warmup:
            yield 1 - ((op - warmup) // per_round) % 2, -1


def plan_rank(config, layout, rank, device="cuda"):
    """Everything the module's docstring lists, for one rank (rank = pp x dp x tp's coordinates, tp innermost)."""
    pp_rank, dp_rank, tp_rank = rank // (layout.dp * layout.tp), rank // layout.tp % layout.dp, rank % layout.tp
    names = ["embed", *(f"block{i}" for i in range(config.n_layer)), "head"]
    count, stages = len(names), 2 * layout.pp
    local_stages = [(index, names[index * count // stages:(index + 1) * count // stages])
                    for index in (pp_rank, pp_rank + layout.pp)]
    mine = [name for _, layers in local_stages for name in layers]
    d, M, B = 2 if layout.precision == "bf16" else 4, layout.microbatches, layout.batch_size
    T, C = config.context, config.n_embd
    row = dict(rank=rank, coordinates=(pp_rank, dp_rank, tp_rank), layers=mine, params=0, optim=0, gathered=0,
               stages=",".join("-".join(dict.fromkeys([layers[0], layers[-1]])) for _, layers in local_stages))
    for shape, tp_dim in (param for name in mine for param in layer_params(config, name)):
        tp_local = [split(size, layout.tp, tp_rank) if dim == tp_dim else size for dim, size in enumerate(shape)]
        rows, per_row = tp_local[0], math.prod(tp_local[1:])
        row["params"] += 4 * split(rows, layout.dp, dp_rank) * per_row
        row["optim"] += 2 * 4 * split(rows, layout.dp, dp_rank) * per_row + 4
        # FSDP gathers every dp rank's shard padded to the largest: ceil(rows / dp) x dp rows in all.
        row["gathered"] += (d + 4) * math.ceil(rows / layout.dp) * layout.dp * per_row
    row["grads"] = row["params"]
    per_stage = [sum(activations(config, layout, name, tp_rank, device) for name in layers)
                 for _, layers in local_stages]
    once = 8 * B * T * (("embed" in mine) + ("head" in mine))  # the step's token ids and targets (int64)
    row["act_mb"], row["act_step"] = sum(per_stage), M * sum(per_stage) + once
    # The peak: torch's order of forwards and backwards walked (schedule), each micro-batch in flight on a stage holding
    # its activations and the stage's output; with checkpointing, one block's activations more while recomputed.
    between = (B // M) * T // (layout.tp if layout.sequence_parallel else 1) * C * d
    kept = [a + between * (index < stages - 1) for a, (index, _) in zip(per_stage, local_stages)]
    held, peak = [0, 0], 0
    for local, step in schedule(layout.pp, M, pp_rank):
        held[local] += step
        peak = max(peak, held[0] * kept[0] + held[1] * kept[1])
    blocks = sum(name.startswith("block") for name in mine)
    recomputed = activations(config, layout, "block", tp_rank, device, False) if blocks else 0
    row["peak_act"] = peak + once + recomputed * layout.checkpoint_activations
    # pp: a stage sends its output forward and its input's gradient back, a micro-batch each, unless on this rank.
    row["pp_bytes"] = 0 if layout.pp == 1 else M * between * sum((i < stages - 1) + (i > 0) for i, _ in local_stages)
    row["dp_bytes"] = round((layout.dp - 1) / layout.dp * row["gathered"])  # a ring sends (dp - 1)/dp of the whole
    # tp: each collective of a (micro-batch, context, width) tensor sends (tp - 1)/tp of it; the position embedding's
    # reduce-scatter and its backward, (context, width).
    collectives = blocks * (12 if layout.checkpoint_activations else 8) + 2 * ("embed" in mine) + 2 * ("head" in mine)
    sent = collectives * (B // M) * T * C * d + 2 * T * C * d * ("embed" in mine)
    row["tp_bytes"] = round((layout.tp - 1) / layout.tp * M * sent)
    row["total"] = row["params"] + row["grads"] + row["optim"] + row["gathered"] + row["peak_act"]
    return row


def plan(config, layout, device="cuda"):
    """plan_rank for every rank of the mesh, in rank order."""
    return [plan_rank(config, layout, rank, device) for rank in range(layout.pp * layout.dp * layout.tp)]


def compare(records_by_rank, config, layout):
    """[(rank, field, planned, measured)] for params, grads, optim and activation_bytes of every rank of a CPU job of
    one_mesh.py: `records_by_rank` {rank: its runs/rank<R>.jsonl record} of one epoch, of a job run without the
    recorder (tools/jobs' record=True counts each stage's forward itself, which hides them from the step's count)."""
    fields = {"params": "params", "grads": "grads", "optim": "optim", "activation_bytes": "act_step"}
    return [(row["rank"], field, row[key], records_by_rank[row["rank"]][field])
            for row in plan(config, layout, device="cpu") for field, key in fields.items()]


def check(records_by_rank, config, layout):
    """compare()'s rows that disagree: the state by a byte, activations by more than ACTIVATION_TOLERANCE. []: none."""
    return [(rank, field, planned, measured)
            for rank, field, planned, measured in compare(records_by_rank, config, layout)
            if abs(planned - measured) > (ACTIVATION_TOLERANCE * measured if field == "activation_bytes" else 0)]


def table(rows):
    keys = "params grads optim gathered act_mb act_step peak_act pp_bytes dp_bytes tp_bytes".split()
    lines = [f"{'rank':>4} {'pp,dp,tp':>8}  {'its two stages':<18}" + "".join(f"{key:>10}" for key in keys)]
    for row in rows:
        lines.append(f"{row['rank']:>4} {','.join(map(str, row['coordinates'])):>8}  "
                     f"{row['stages'].replace('block', 'b'):<18}" + "".join(f"{row[key] / MiB:>10.2f}" for key in keys))
    return "\n".join(lines)


def fit(config, gpus, gpu_gib, batch_size=8, microbatches=8, precision="bf16"):
    """[(layout, the largest rank's total bytes, fits)] for every pp x dp x tp = gpus that one_mesh.py accepts (a
    layer per stage, whole heads and positions per tp rank, micro-batches in rounds of pp), with and without
    activation checkpointing. A layout fits when its total leaves MARGIN of the GPU's memory free."""
    results = []
    for pp, tp in ((pp, tp) for pp in range(1, gpus + 1) for tp in range(1, gpus + 1) if gpus % (pp * tp) == 0):
        if 2 * pp > config.n_layer + 2 or config.n_head % tp or config.context % tp or microbatches % pp:
            continue
        for checkpointed in (False, True):
            layout = Layout(pp, gpus // (pp * tp), tp, batch_size, microbatches, precision, checkpointed)
            total = max(row["total"] for row in plan(config, layout))
            results.append((layout, total, total <= (1 - MARGIN) * gpu_gib * GiB))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="cpu", choices=[*SIZES, *BIG])
    parser.add_argument("--text", help="the text whose characters are the vocabulary of cpu and gpu (the help pages)")
    for name, default in (("pp", 2), ("dp", 1), ("tp", 2), ("gpus", 8), ("gpu_gib", 80)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--batch_size", type=int, help="sequences per dp rank (4; with --fit 8)")
    parser.add_argument("--microbatches", type=int, help="micro-batches a step (2; with --fit 8)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="compute dtype (fp32; with --fit bf16)")
    parser.add_argument("--checkpoint_activations", action="store_true")
    parser.add_argument("--no_sequence_parallel", action="store_true", help="plain tensor parallelism: what if")
    parser.add_argument("--fit", action="store_true", help="which layouts of --gpus fit in --gpu_gib each")
    args = parser.parse_args(argv)
    config = config_of(args.size, args.text)
    batch, M = args.batch_size or (8 if args.fit else 4), args.microbatches or (8 if args.fit else 2)
    precision = args.precision or ("bf16" if args.fit else "fp32")
    weights = sum(math.prod(shape) for name in ["embed", *["block"] * config.n_layer, "head"]
                  for shape, _ in layer_params(config, name))
    print(f"GPT {args.size}: {config.n_layer} blocks, {config.n_head} heads, {config.n_embd} wide, context "
          f"{config.context}, vocabulary {config.vocab_size}: {weights:,} weights; {precision}, {batch} sequences "
          f"per dp rank in {M} micro-batches")
    if not args.fit:
        layout = Layout(args.pp, args.dp, args.tp, batch, M, precision, args.checkpoint_activations,
                        not args.no_sequence_parallel)
        print("MiB per rank (pp_bytes, dp_bytes, tp_bytes: sent a step)\n" + table(plan(config, layout)))
        return
    print(f"per-GPU total: shards (params, grads, AdamW) + gathered weights and fp32 gradients + peak activations, of "
          f"the largest rank; fits: <= {1 - MARGIN:.0%} of {args.gpu_gib} GiB, the rest for the CUDA context, NCCL, "
          "fragmentation and temporaries")
    for layout, total, fits in fit(config, args.gpus, args.gpu_gib, batch, M, precision):
        print(f"  pp {layout.pp} dp {layout.dp} tp {layout.tp} {'AC' if layout.checkpoint_activations else '  '}"
              f"  {total / GiB:7.1f} GiB  {'fits' if fits else '-'}")


if __name__ == "__main__":
    main()
