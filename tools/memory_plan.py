"""What every rank of one_mesh.py (step 11) holds and sends, computed from the GPT's shapes and the layout alone.

    python tools/memory_plan.py --size cpu --pp 2 --dp 2 --tp 2 --batch_size 4 --microbatches 2
    python tools/memory_plan.py --size gpu --pp 2 --tp 4 --checkpoint_activations --precision bf16 --text FILE
    python tools/memory_plan.py --fit --gpus 8 --gpu_gib 80 --size 1b|8b [--precision fp32] [--batch_size 8 ...]
    python tools/memory_plan.py --fit --gpus 8 --gpu_gib 80 --size 8b --reshard_after_forward   # ZeRO-3: what if

A row per rank (pipeline rank r holds stages r and r + pp of the 2 pp stages one_mesh.py cuts), in MiB. Each column is
the most the rank holds of it at once in a step, walking torch's order of forwards and backwards (schedule); the
columns' peaks fall at different moments, and `total` is the most they come to together.
params, grads, optim: its local shards, as the step measures them (each tensor split over tp by one_mesh.py's plan,
then its dim 0 over dp in torch.chunk's ceil-sized pieces; AdamW: two fp32 moments and a 4-byte step per parameter).
gathered: FSDP's unsharded copies. Each weight of its layers in the compute dtype, padded to dp equal shards, from the
first forward (reshard_after_forward=False) to its stage's reduction after the last micro-batch's backward; and the
fp32 gradients the micro-batches add up in them, from the stage's first backward to that reduction: of each tp slice's
shape, but for the embeddings', whole under tp (DTensor's embedding backward hands every tp rank a gradient of the
whole table).
act_mb, act_step: what autograd keeps for backward (as utils/memory.saved_for_backward counts it, which one_mesh.py
reports per step) for a micro-batch through both stages, and for the step's M. peak_act: what it keeps of the
micro-batches in flight, at most; a stage's input is not in it: it lies in a pipeline buffer.
logits: the last stage's output, which torch's schedule keeps for every micro-batch until the next step begins (to
return them merged, one more copy at the step's end, counted in the total). pipeline: each stage's receive buffers,
one per micro-batch for the activations in and one for the gradients back, kept from step to step; with pp > 1 what it
sent, which the schedule waits for only at the step's end. loss: loss_parallel's temporaries in a micro-batch's
backward, beyond the log-softmax that autograd keeps: three fp32 tensors of the logits' slice and a few numbers a
position (LOSS_COPIES, LOSS_PER_POSITION). total: the most all of it comes to at once, with the loss's temporaries in
the forward and the backward of the last stage and, with checkpointing, one block's activations while recomputed.
pp, dp, tp_bytes: what it sends a step: activations and their gradients between stages; FSDP's ring all-gather of the
weights and reduce-scatter of the gradients; sequence parallelism's all-gathers and reduce-scatters (4 a block
forward, 4 backward, 3 more to recompute: the recomputation stops at the last tensor the backward needs, before the
block's last reduce-scatter), the embeddings' and the head's, loss_parallel's three all-reduces of a number a position,
the LayerNorms' gradients all-reduced once a step; the clipping's norms, a number per gradient tensor. Checked against
8-rank CPU jobs column by column, rank by rank (tests/test_memory_plan.py, on benchmarks/one_mesh.py --parts plan).

--fit adds it up for each pp x dp x tp of --gpus, and keeps MARGIN of each GPU for what the plan leaves out: the CUDA
context, NCCL's buffers, fragmentation, and the temporaries inside a pass (activation gradients, attention's
workspace, a layer's bf16 gradient before FSDP adds it to the fp32 one, the all-gather and reduce-scatter buffers, the
optimizer's): at most a block's activations and a layer's gathered weights (pass_temporaries, not in the table; the
CPU jobs measured 0.10 to 0.57 of it beyond the plan's total). --reshard_after_forward: FSDP alone (pp 1)
as ZeRO-3 runs without a pipeline schedule (torchtitan without pp): each micro-batch's forward and backward in turn,
each layer's weights gathered for its forward and again for its backward, its gradients reduce-scattered after each
backward; two layers gathered at once (the one computing and the next); arithmetic, not a layout one_mesh.py runs.
Sizes: "cpu", "gpu" (utils/gpt.SIZES, the vocabulary of --text or of the help pages); "1b", "8b", "70b", "405b"
(utils/gpt.SHAPES): THIS GPT (LayerNorm, biases, a 4x GELU MLP, learned positions, an untied head) at the shapes of
Llama 3.2 1B, Llama 3 8B and 70B and Llama 3.1 405B, not Llama (RMSNorm, SwiGLU, rotary positions). On CUDA, LayerNorm's statistics are fp32.
"""
import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils.estimates import GPUS, device_flops, mfu, recomputed_flops, step_time  # noqa: E402
from utils.gpt import SHAPES, SIZES, load_text  # noqa: E402

MiB, GiB = 2**20, 2**30
MARGIN = 0.15  # of each GPU's memory, for what the plan leaves out
# What check() allows between the plan and a job's measurement: the weights and their state to the byte; activations
# within 1% of the measured (measured here: 0 bytes off in every layout run; 1% is room for a kernel that keeps a few
# small tensors more, while one block's activations left out or counted twice is 10% or more).
ACTIVATION_TOLERANCE = 0.01
# loss_parallel's cross-entropy on logits split over the vocabulary (torch.distributed.tensor.parallel.loss): its
# backward makes the gradient of the log-softmax as (zeros with -1 at the targets + exp(log-softmax)) x the output's
# gradient, three fp32 tensors of the logits' slice at once beside the log-softmax autograd keeps; its forward, the
# shifted logits and their exp (fp32 logits), and in bf16 the fp32 copy before them. Measured on every rank of four CPU
# layouts (vocabulary slices of 12 to 57): the backward's rise exactly 3 slices and 33 bytes a position (the targets
# as int64, their masks and indices), the forward's 2 or 3 slices and 12 bytes a position.
LOSS_COPIES, LOSS_PER_POSITION = 3, 40
BIG = SHAPES  # the large models' shapes (utils/gpt.py)


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
    reshard_after_forward: bool = False  # ZeRO-3 without a pipeline schedule (pp 1): what if, not one_mesh.py


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
    pp, dp, tp, M, B = layout.pp, layout.dp, layout.tp, layout.microbatches, layout.batch_size
    pp_rank, dp_rank, tp_rank = rank // (dp * tp), rank // tp % dp, rank % tp
    names = ["embed", *(f"block{i}" for i in range(config.n_layer)), "head"]
    count, stages = len(names), 2 * pp
    local_stages = [(index, names[index * count // stages:(index + 1) * count // stages])
                    for index in (pp_rank, pp_rank + pp)]
    mine = [name for _, layers in local_stages for name in layers]
    d, T, C = 2 if layout.precision == "bf16" else 4, config.context, config.n_embd
    row = dict(rank=rank, coordinates=(pp_rank, dp_rank, tp_rank), layers=mine, params=0, optim=0,
               stages=",".join("-".join(dict.fromkeys([layers[0], layers[-1]])) for _, layers in local_stages))
    # Per layer of the rank: its shards (fp32); its weights gathered in the compute dtype, padded (FSDP gathers every
    # dp rank's shard padded to the largest: ceil(rows / dp) x dp rows); their fp32 gradients, unpadded.
    layers = {name: dict(shard=0, weights=0, gradients=0) for name in mine}
    for name in mine:
        for shape, tp_dim in layer_params(config, name):
            tp_local = [split(size, tp, tp_rank) if dim == tp_dim else size for dim, size in enumerate(shape)]
            rows, per_row = tp_local[0], math.prod(tp_local[1:])
            layers[name]["shard"] += 4 * split(rows, dp, dp_rank) * per_row
            row["optim"] += 2 * 4 * split(rows, dp, dp_rank) * per_row + 4
            layers[name]["weights"] += d * math.ceil(rows / dp) * dp * per_row
            layers[name]["gradients"] += 4 * (math.prod(shape) if name == "embed" else rows * per_row)
    row["params"] = row["grads"] = sum(layer["shard"] for layer in layers.values())
    full = [sum(activations(config, layout, name, tp_rank, device) for name in names) for _, names in local_stages]
    once = 8 * B * T * (("embed" in mine) + ("head" in mine))  # the step's token ids and targets (int64) it saves
    row["act_mb"], row["act_step"] = sum(full), M * sum(full) + once
    # Between the stages each micro-batch's (b, T / tp, C) in the compute dtype (sequence parallelism: 1/tp of it).
    between = B // M * T // (tp if layout.sequence_parallel else 1) * C * d
    row.update(walk(config, layout, rank, local_stages, layers, full, between, row["params"] + row["optim"], device))
    # What a pass may hold beyond the plan, left to MARGIN: a block's activation gradients, each the size of the
    # activation it belongs to and freed as the backward moves on, and one layer's gathered weights' worth of FSDP's
    # buffers (its all-gather before the copy into the weights; in bf16 its gradient before FSDP adds it to the fp32
    # one). On the CPU jobs the temporaries measured beyond the plan stay under it (benchmarks/one_mesh.py).
    row["pass_temporaries"] = (activations(config, layout, "block", tp_rank, device, False)
                               + max(layer["weights"] for layer in layers.values()))
    # The clipping's gradient norm: each of the rank's gradient tensors' norm all-reduced over dp and over tp (a fp32
    # number a tensor, 2 (n - 1)/n of them sent), then the squares' sum over pp (one number).
    norms = 4 * sum(len(layer_params(config, name)) for name in mine)
    row["pp_bytes"] = (0 if pp == 1 else M * between * sum((i < stages - 1) + (i > 0) for i, _ in local_stages)
                       + round(2 * (pp - 1) / pp * 4))
    # dp: a ring sends (dp - 1)/dp of each buffer: the weights all-gathered once a step in the compute dtype, the
    # gradients reduce-scattered once in fp32 (ZeRO-3: the weights gathered for each forward and each backward, the
    # gradients reduce-scattered after each backward).
    padded = sum(layer["weights"] for layer in layers.values()) // d
    gathers, reductions = (2 * M, M) if layout.reshard_after_forward else (1, 1)
    row["dp_bytes"] = round((dp - 1) / dp * (padded * (gathers * d + reductions * 4) + 2 * norms))
    # tp, per micro-batch: sequence parallelism's all-gathers and reduce-scatters of (micro-batch, context, width)
    # tensors, each sending (tp - 1)/tp of it; the position embedding's reduce-scatter and its gradient's all-gather,
    # (context, width); loss_parallel's all-reduces (2 (tp - 1)/tp of each) of a number a position (the largest logit,
    # the sum of exponentials, the target's log-probability). Once a step, each LayerNorm's weight and bias gradients
    # (fp32) all-reduced: each tp rank computes them from its own positions.
    blocks = sum(name.startswith("block") for name in mine)
    collectives = blocks * (11 if layout.checkpoint_activations else 8) + 2 * ("embed" in mine) + 2 * ("head" in mine)
    gathers_and_scatters = M * (collectives * B // M * T * C * d + 2 * T * C * d * ("embed" in mine))
    all_reduced = 3 * B * T * 4 * ("head" in mine) + (4 * blocks + 2 * ("head" in mine)) * C * 4 + norms
    row["tp_bytes"] = round((tp - 1) / tp * (gathers_and_scatters + 2 * all_reduced))
    return row


def walk(config, layout, rank, local_stages, layers, full, between, state, device):
    """{gathered, peak_act, logits, pipeline, loss, held, total}: the most of each that one rank holds at once (held:
    all of them between two passes; total: with the temporaries of a pass that the plan counts), walking torch's order
    of its forwards and backwards (see the module's docstring). `layers`: plan_rank's sizes per layer; `full`: each
    local stage's activations per micro-batch; `state`: its params and AdamW's state."""
    pp, M, d = layout.pp, layout.microbatches, 2 if layout.precision == "bf16" else 4
    tp_rank, stages = rank % layout.tp, 2 * pp
    first, last = [index == 0 for index, _ in local_stages], [index == stages - 1 for index, _ in local_stages]
    names = [stage_layers for _, stage_layers in local_stages]
    # A micro-batch's positions, and the bytes of its logits on this rank (its slice of the vocabulary).
    n = layout.batch_size // M * config.context
    logits = n * split(config.vocab_size, layout.tp, tp_rank) * d
    # The loss's rise over what autograd keeps: in its backward LOSS_COPIES fp32 slices of the logits; in its forward
    # (after which autograd keeps its log-softmax) one more in fp32, two in bf16 (the fp32 copy of the logits too).
    loss_backward = (LOSS_COPIES * logits // d * 4 + LOSS_PER_POSITION * n) * any(last)
    loss_forward = ((2 if d == 2 else 1) * logits // d * 4 + LOSS_PER_POSITION * n) * any(last)
    # With checkpointing, the block being recomputed in backward holds all its activations again.
    blocks = [any(name.startswith("block") for name in stage_layers) for stage_layers in names]
    recompute = activations(config, layout, "block", tp_rank, device, False) * layout.checkpoint_activations
    # Every rank moves the step's ids and targets (int64) to its device.
    batch = 2 * 8 * layout.batch_size * config.context
    if layout.reshard_after_forward:
        return zero3(layers, sum(full), logits, state + batch, max(loss_backward, loss_forward, recompute),
                     loss_backward)
    # Receive buffers, kept from step to step: one per micro-batch for the activations into a stage that is not the
    # first, and one for the gradients back into one that is not the last. On one rank (pp 1) a stage's output becomes
    # the next one's buffer, and the buffer it replaces is freed only after: one more at that moment.
    received = M * between * ((not first[0]) + (not first[1]) + (not last[0]) + (not last[1]))
    # What autograd keeps of a micro-batch on each stage, less the stage's input: the buffer (or the tensor the stage
    # before on this rank handed over), which its first layer keeps.
    kept = [activation - between * (index > 0) for activation, (index, _) in zip(full, local_stages)]
    forwards, backwards, reduced = [0, 0], [0, 0], [False, False]
    peaks = dict(gathered=0, peak_act=0, logits=0, pipeline=0, held=0, total=0)

    def moment(transient=0, handing_over=False):
        gathered = sum(sum(layers[name]["weights"] for name in names[local]) * (not reduced[local])
                       + sum(layers[name]["gradients"] for name in names[local]) * (0 < backwards[local])
                       * (not reduced[local]) for local in (0, 1))
        grads = sum(sum(layers[name]["shard"] for name in names[local]) * reduced[local] for local in (0, 1))
        held_activations = sum((forwards[local] - backwards[local]) * kept[local] for local in (0, 1))
        held_logits = sum(forwards[local] * logits * last[local] for local in (0, 1))
        # With pp > 1 the outputs and input gradients sent, which the schedule waits for at the step's end.
        sent = (pp > 1) * between * sum(forwards[local] * (not last[local]) + backwards[local] * (not first[local])
                                        for local in (0, 1))
        pipeline = received + sent + between * (pp == 1 and handing_over)
        held = state + batch + gathered + grads + held_activations + held_logits + pipeline
        for key, value in (("gathered", gathered), ("peak_act", held_activations), ("logits", held_logits),
                           ("pipeline", pipeline), ("held", held), ("total", held + transient)):
            peaks[key] = max(peaks[key], value)

    for local, step in schedule(pp, M, rank // (layout.dp * layout.tp)):
        if step > 0:
            forwards[local] += 1
            moment(loss_forward * last[local], handing_over=not last[local])
        else:
            # Before a backward its micro-batch is all there: the loss's temporaries come first, the recomputed block
            # later, once the head's backward has freed them.
            moment(max(loss_backward * last[local], recompute * blocks[local]))
            backwards[local] += 1
            moment(handing_over=not first[local])
            # After the stage's last backward its gradients are reduce-scattered and its gathered weights freed.
            reduced[local] = backwards[local] == M
    # The step's end: the schedule merges the logits it kept into one more tensor.
    moment(M * logits * any(last))
    return dict(peaks, loss=loss_backward)


def zero3(layers, activations_per_microbatch, logits, state, transient, loss):
    """walk()'s figures for FSDP alone as ZeRO-3 runs without a pipeline schedule (--reshard_after_forward): the
    micro-batches' forwards and backwards one after another, at most two consecutive layers' weights gathered and two
    layers' unsharded gradients at once (the layer computing and the next, prefetched; the one reduce-scattered and
    the next), one micro-batch's activations and logits, no pipeline buffers; the gradients' shards from the first
    backward on."""
    order = list(layers.values())
    gathered = (max(a["weights"] + b["weights"] for a, b in zip(order, order[1:] or order))
                + max(a["gradients"] + b["gradients"] for a, b in zip(order, order[1:] or order)))
    held = state + sum(layer["shard"] for layer in order) + gathered + activations_per_microbatch + logits
    return dict(gathered=gathered, peak_act=activations_per_microbatch, logits=logits, pipeline=0, held=held,
                total=held + transient, loss=loss)


def plan(config, layout, device="cuda"):
    """plan_rank for every rank of the mesh, in rank order."""
    return [plan_rank(config, layout, rank, device) for rank in range(layout.pp * layout.dp * layout.tp)]


def compare(records_by_rank, config, layout):
    """[(rank, field, planned, measured)] for params, grads, optim and activation_bytes of every rank of a CPU job of
    one_mesh.py: `records_by_rank` {rank: its runs/rank<R>.jsonl record} of one epoch, of a job run without the
    recorder (harness/jobs' record=True counts each stage's forward itself, which hides them from the step's count)."""
    fields = {"params": "params", "grads": "grads", "optim": "optim", "activation_bytes": "act_step"}
    return [(row["rank"], field, row[key], records_by_rank[row["rank"]][field])
            for row in plan(config, layout, device="cpu") for field, key in fields.items()]


def check(records_by_rank, config, layout):
    """compare()'s rows that disagree: the state by a byte, activations by more than ACTIVATION_TOLERANCE. []: none."""
    return [(rank, field, planned, measured)
            for rank, field, planned, measured in compare(records_by_rank, config, layout)
            if abs(planned - measured) > (ACTIVATION_TOLERANCE * measured if field == "activation_bytes" else 0)]


def ranked(config, gpus, gpu, batch_size=8, microbatches=8, precision="bf16"):
    """fit()'s layouts of `gpus` that fit a `gpu` (utils.estimates.GPUS: its memory, peak and links) with tp inside a
    node, fastest first: [{layout, total, links, compute, bubble, tp, dp, pp, exposed, step, mfu}], the time of a step
    and its MFU on paper (utils.estimates.step_time), each mesh dimension on its link (NVLink when its ranks are one
    node's GPUs, else the network; tp innermost, then dp, then pp, as one_mesh.py orders them)."""
    found = []
    for layout, total, fits in fit(config, gpus, gpu.memory / GiB, batch_size, microbatches, precision,
                                   max_tp=gpu.per_node):
        if not fits:
            continue
        links = dict(tp="nvlink", dp="network" if layout.tp * layout.dp > gpu.per_node else "nvlink",
                     pp="network" if layout.tp * layout.dp * layout.pp > gpu.per_node else "nvlink")
        flops = device_flops(config, layout.batch_size, layout.tp, layout.pp)
        recomputed = recomputed_flops(config, layout.batch_size, layout.tp, layout.pp) if (
            layout.checkpoint_activations) else 0.0
        # The slower of a pipeline's first rank and its last (the head's): every rank waits for it.
        seconds = max((step_time(flops, gpu, row["tp_bytes"], row["dp_bytes"], row["pp_bytes"], links["tp"],
                                 links["dp"], links["pp"], layout.pp, layout.microbatches, recomputed=recomputed)
                       for row in (plan_rank(config, layout, rank) for rank in
                                   {0, (layout.pp - 1) * layout.dp * layout.tp})), key=lambda time: time["step"])
        found.append(dict(layout=dataclasses.asdict(layout), total=total, links=links, **seconds,
                          mfu=mfu(flops, seconds["step"], gpu.flops)))
    return sorted(found, key=lambda candidate: -candidate["mfu"])


COLUMNS = "params grads optim gathered act_mb peak_act logits pipeline loss total pp_bytes dp_bytes tp_bytes".split()


def table(rows):
    lines = [f"{'rank':>4} {'pp,dp,tp':>8}  {'its two stages':<18}" + "".join(f"{key:>10}" for key in COLUMNS)]
    for row in rows:
        lines.append(f"{row['rank']:>4} {','.join(map(str, row['coordinates'])):>8}  "
                     f"{row['stages'].replace('block', 'b'):<18}"
                     + "".join(f"{row[key] / MiB:>10.2f}" for key in COLUMNS))
    return "\n".join(lines)


def fullest_ranks(layout):
    """The ranks whose totals are the most any rank of the layout holds: dp rank 0 of every pipeline and tensor-parallel
    coordinate. The dp ranks of one coordinate differ only in their shards of the weights, of the gradients and of
    AdamW's state, and torch.chunk cuts the largest pieces first: dp rank 0's total is the largest of them. So fit()
    plans pp x tp ranks of a layout, not all of them (a 512-GPU layout of dp 64: 64 times fewer)."""
    return [pp_rank * layout.dp * layout.tp + tp_rank for pp_rank in range(layout.pp) for tp_rank in range(layout.tp)]


def fit(config, gpus, gpu_gib, batch_size=8, microbatches=8, precision="bf16", reshard_after_forward=False,
        max_tp=None):
    """[(layout, the largest rank's total bytes, fits)] for every pp x dp x tp = gpus that one_mesh.py accepts (a
    layer per stage, whole heads and positions per tp rank, micro-batches in rounds of pp), with and without
    activation checkpointing; with reshard_after_forward, pp 1's alone, as ZeRO-3 would run them. A layout fits when
    its total leaves MARGIN of the GPU's memory free. max_tp: leave out the layouts of a larger tp (a node's GPUs)."""
    results = []
    for pp, tp in ((pp, tp) for pp in range(1, gpus + 1) for tp in range(1, gpus + 1) if gpus % (pp * tp) == 0):
        if 2 * pp > config.n_layer + 2 or config.n_head % tp or config.context % tp or microbatches % pp:
            continue
        if reshard_after_forward and pp > 1 or max_tp and tp > max_tp:
            continue
        for checkpointed in (False, True):
            layout = Layout(pp, gpus // (pp * tp), tp, batch_size, microbatches, precision, checkpointed,
                            reshard_after_forward=reshard_after_forward)
            total = max(plan_rank(config, layout, rank)["total"] for rank in fullest_ranks(layout))
            results.append((layout, total, total <= (1 - MARGIN) * gpu_gib * GiB))
    return results


def largest(gpus, gpu, batch_size=8, microbatches=8, precision="bf16"):
    """(size, ranked()'s layouts) of the largest of utils/gpt.SHAPES that some layout of `gpus` fits on `gpu`, and the
    sizes tried before it that none fits: the worked example of docs/reference/plan-at-scale.md."""
    too_big = []
    for size in sorted(BIG, key=lambda name: -sum(weights_of(BIG[name]).values())):
        layouts = ranked(BIG[size], gpus, gpu, batch_size, microbatches, precision)
        if layouts:
            return size, layouts, too_big
        too_big.append(size)
    return None, [], too_big


def weights_of(config):
    """{layer name: its weights' count} of the GPT (one_mesh.py's layers: the embedding, the blocks, the head)."""
    names = ["embed", *(f"block{i}" for i in range(config.n_layer)), "head"]
    return {name: sum(math.prod(shape) for shape, _ in layer_params(config, name)) for name in names}


def largest_lines(gpus, gpu, batch_size=8, microbatches=8, precision="bf16", runners_up=2):
    """What --largest prints for `gpus` GPUs: the largest GPT that fits and the fastest layouts on paper."""
    size, layouts, too_big = largest(gpus, gpu, batch_size, microbatches, precision)
    head = f"{gpus} x {gpu.name} ({gpu.memory / GiB:.1f} GiB, {gpu.per_node} a node): " + "".join(
        f"{name}: no layout fits; " for name in too_big)
    if size is None:
        return [head + "no GPT of utils/gpt.SHAPES fits"]

    def described(row):
        layout = row["layout"]
        return (f"pp {layout['pp']} x dp {layout['dp']} x tp {layout['tp']}"
                + (", recomputation" if layout["checkpoint_activations"] else "")
                + f": planned peak {row['total'] / GiB:.1f} GiB; a step {row['step']:.2f} s at best (compute "
                  f"{row['compute']:.2f} + bubble {row['bubble']:.2f} + communication not hidden {row['exposed']:.2f};"
                  f" tp {row['tp']:.2f}, dp {row['dp']:.2f}, pp {row['pp']:.2f} s on their links), MFU "
                  f"{row['mfu']:.1%}")

    count = len(layouts)
    lines = [head + f"{size} ({sum(weights_of(BIG[size]).values()) / 1e9:.1f} billion weights): {count} layout"
             + ("s fit" if count > 1 else " fits"),
             "  the best on paper (the highest MFU): " + described(layouts[0])]
    lines += [f"  then: {described(row)}" for row in layouts[1:1 + runners_up]]
    return lines


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
    parser.add_argument("--reshard_after_forward", action="store_true",
                        help="FSDP alone (pp 1) as ZeRO-3 without a pipeline schedule: what if")
    parser.add_argument("--fit", action="store_true", help="which layouts of --gpus fit in --gpu_gib each")
    parser.add_argument("--largest", type=int, nargs="+", metavar="GPUS",
                        help="for each number of GPUs, the largest of the big sizes that fits and its fastest layouts")
    parser.add_argument("--gpu", default="h100", choices=GPUS, help="--largest: the GPU (utils/estimates.GPUS)")
    args = parser.parse_args(argv)
    if args.largest:
        batch, M = args.batch_size or 8, args.microbatches or 8
        precision = args.precision or "bf16"
        print(f"the largest GPT of utils/gpt.SHAPES ({', '.join(BIG)}) that a layout of one_mesh.py fits (its "
              f"largest rank's total <= {1 - MARGIN:.0%} of the GPU), tp inside a node; {batch} sequences of "
              f"{BIG['8b'].context:,} tokens a dp rank in {M} micro-batches, {precision}; its layouts by their MFU "
              "on paper, best first")
        for gpus in args.largest:
            print("\n".join(largest_lines(gpus, GPUS[args.gpu], batch, M, precision)), flush=True)
        return
    config = config_of(args.size, args.text)
    batch, M = args.batch_size or (8 if args.fit else 4), args.microbatches or (8 if args.fit else 2)
    precision = args.precision or ("bf16" if args.fit else "fp32")
    weights = sum(math.prod(shape) for name in ["embed", *["block"] * config.n_layer, "head"]
                  for shape, _ in layer_params(config, name))
    print(f"GPT {args.size}: {config.n_layer} blocks, {config.n_head} heads, {config.n_embd} wide, context "
          f"{config.context}, vocabulary {config.vocab_size}: {weights:,} weights; {precision}, {batch} sequences "
          f"per dp rank in {M} micro-batches" + (", ZeRO-3 (reshard after forward)" if args.reshard_after_forward
                                                  else ""))
    if args.reshard_after_forward and not args.fit and args.pp != 1:
        parser.error("--reshard_after_forward is FSDP alone: --pp 1")
    if not args.fit:
        layout = Layout(args.pp, args.dp, args.tp, batch, M, precision, args.checkpoint_activations,
                        not args.no_sequence_parallel, args.reshard_after_forward)
        print("MiB per rank, each column at its most in a step (total: all at once; pp_bytes, dp_bytes, tp_bytes: "
              "sent a step)\n" + table(plan(config, layout)))
        return
    print(f"per-GPU total, the largest rank's: the most its shards (params, grads, AdamW), gathered weights and fp32 "
          f"gradients, activations, kept logits, pipeline buffers and the loss's temporaries come to at once; fits: "
          f"<= {1 - MARGIN:.0%} of {args.gpu_gib} GiB, the rest for the CUDA context, NCCL, fragmentation and the "
          "temporaries inside a pass")
    for layout, total, fits in fit(config, args.gpus, args.gpu_gib, batch, M, precision, args.reshard_after_forward):
        print(f"  pp {layout.pp} dp {layout.dp} tp {layout.tp} {'AC' if layout.checkpoint_activations else '  '}"
              f"  {total / GiB:7.1f} GiB  {'fits' if fits else '-'}")


if __name__ == "__main__":
    main()
