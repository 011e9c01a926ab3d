"""What pipeline_parallel.py (step 8) and one_mesh.py (step 11) need around their pipelines and do not teach: the
checks of their options, the shapes a stage sends and receives, and the whole GPT put back together at the end (the
cut into stages, the stage, the schedule and the micro-batches stay in the steps).

    require_pipeline_fits(args, world_size)     one line and exit when step 8's pipelines cannot be built
    require_mesh_fits(args, world_size)         the same for step 11's mesh of pp x dp x tp
    require_a_batch(train_data)                 one line and exit when a pipeline gets no whole batch in an epoch
    stage_io(model, micro_batch, stage, stages) what a stage receives and sends per micro-batch (their shapes)
    whole_weights(stage, to)                    the whole GPT's weights one at a time, from every rank's stages
    reassembled(stage)                          the whole GPT again on every rank (step 8)
    exported(stage, path)                       the whole GPT written to one file from rank 0, weight by weight
    held_out_loss(schedule, stages, mesh, batches)  the mean held-out loss through the pipeline on every rank (step 12)
"""
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.torch_version import TorchVersion

from utils.context import ALL_GATHER
from utils.gpt import GPT, size_of, unwrap
from utils.guards import require_dense_gpt

# A schedule that meets an error in a step (a peer gone, a collective that gave up) logs its whole plan, 49 lines on
# every rank of step 11, before it raises the error again; the error says what happened, and the step's worker turns
# it into one line (utils.launch.known_cause). The plan is what a learner reads in the page, not in a fault.
logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.CRITICAL)
# DTensor warns, once a rank, when a tensor sharded or summed over two mesh dimensions (dp and tp) is made whole in two
# collectives, one a dimension, rather than in one over a flattened mesh (a private API): the gradient norm of step
# 11's clipping (a number) and the weights gathered at the end. Both happen once a step or once a run; every rank
# gets the same result either way.
logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
    lambda record: not str(record.msg).startswith("While redistributing from"))


def require_pipeline_fits(args, world_size):
    """Stop with one line, before any process group forms, when pipeline_parallel.py's pipelines cannot be built:
    the processes must form whole pipelines of --pp stages, each stage needs a block of the GPT at least (of the size
    --workload trains here), the micro-batches one size, and 1F1B a micro-batch per stage to fill its pipeline."""
    stages, blocks, M = args.pp, size_of(args.workload).n_layer, args.microbatches
    if world_size % stages:
        raise SystemExit(f"error: --pp {stages} does not divide the {world_size} processes: they form pipelines of "
                         f"{stages} stages, a process each")
    if stages > blocks:
        raise SystemExit(f"error: --pp {stages} stages but the GPT has {blocks} blocks: each stage needs one at least; "
                         "lower --pp")
    if args.batch_size % M:
        raise SystemExit(f"error: --microbatches {M} does not divide --batch_size {args.batch_size}: the "
                         "micro-batches must all have one size")
    if args.schedule == "1f1b" and M < stages:
        raise SystemExit(f"error: --schedule 1f1b needs a micro-batch per stage at least ({stages}), got "
                         f"--microbatches {M}: raise it, or use --schedule gpipe")
    version, gloo = TorchVersion(torch.__version__), not torch.cuda.is_available()
    nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # Before 2.8 the schedules wait for one of the works that gloo's batch_isend_irecv returns and drop the others
    # (pytorch#132644): 1F1B's fused sends and receives then hang on CPU processes, with no timeout.
    if args.schedule == "1f1b" and stages > 1 and gloo and version < (2, 8):
        raise SystemExit(f"error: --schedule 1f1b hangs on CPU processes (gloo) with torch {torch.__version__}, whose "
                         "pipelining waits for one of a step's sends and receives and drops the others (fixed in "
                         "torch 2.8): use --schedule gpipe, or torch 2.8 or newer")
    # 2.9 opens each pipeline with a send of an int64 to a neighbour that receives a float32 (pytorch#165143, fixed
    # in 2.10): gloo stops on it ("Received data size doesn't match"), NCCL across nodes does what it happens to do.
    if stages > 1 and (gloo or nodes > 1) and (2, 9) <= version < (2, 10):
        raise SystemExit(f"error: torch {torch.__version__}'s pipelining opens each pipeline with a send of another "
                         f"size than its neighbour receives (fixed in torch 2.10), which fails on CPU processes and "
                         "across nodes: use torch 2.8, or 2.10 or newer")


def require_mesh_fits(args, world_size):
    """Stop with one line, before any process group forms, when one_mesh.py's mesh cannot be built: the processes
    must form whole pp x tp grids, each rank's two stages need a layer of the GPT at least (the embedding, a block or
    the head), each tp group must split the heads and the sequence evenly, and the interleaved schedule wants the
    micro-batches to fill the pipeline in rounds of pp; the torch at hand must train FSDP and pipelines on CPU."""
    require_dense_gpt(args)
    config, pp, tp, M = size_of(args.workload), args.pp, args.tp, args.microbatches
    version, gloo = TorchVersion(torch.__version__), not torch.cuda.is_available()
    if world_size % (pp * tp):
        raise SystemExit(f"error: --pp {pp} x --tp {tp} = {pp * tp} does not divide the {world_size} processes: they "
                         "form grids of pp x tp, dp of them")
    if 2 * pp > config.n_layer + 2:
        raise SystemExit(f"error: --pp {pp} makes {2 * pp} stages, two per rank, but the GPT has {config.n_layer + 2} "
                         "layers (its blocks, the embedding and the head): each stage needs one at least; lower --pp")
    if config.n_head % tp or config.context % tp:
        raise SystemExit(f"error: --tp {tp} must divide the attention heads ({config.n_head}) and the context "
                         f"({config.context}): each tp rank computes heads/tp heads, and holds context/tp positions "
                         "between the blocks")
    if hasattr(args, "global_batch") and args.global_batch % (world_size // (pp * tp) * M):
        dp = world_size // (pp * tp)
        raise SystemExit(f"error: --global_batch {args.global_batch} must split into the {dp} dp ranks' shares of "
                         f"--microbatches {M} micro-batches of one size: a multiple of {dp} x {M} = {dp * M}")
    batch_size = getattr(args, "batch_size", None) or args.global_batch // (world_size // (pp * tp))
    if batch_size % M or M % pp:
        raise SystemExit(f"error: --microbatches {M} must divide --batch_size {batch_size} and be a multiple of "
                         f"--pp {pp}: the micro-batches have one size, and go through the pipeline in rounds of pp")
    if gloo and version < (2, 10):
        raise SystemExit(f"error: torch {torch.__version__} cannot train this on CPU processes (its FSDP sums the "
                         "gradients instead of averaging them before 2.9, and 2.9's pipelining fails on gloo): use "
                         "torch 2.10 or newer there (on GPUs, 2.6 or newer)")
    # With pp 1 a rank holds two neighbouring stages. torch 2.14 hands a micro-batch from one to the other in memory;
    # 2.11 sends it over the pp group of one rank, which gloo cannot ("Pair is not connected"; seen with 2.11 on every
    # number of processes, 2.12 and 2.13 not tried). NCCL sends to itself: on GPUs it runs.
    if gloo and pp == 1 and version < (2, 14):
        raise SystemExit(f"error: --pp 1 puts both of a rank's stages on that rank, and the pipelining of torch "
                         f"{torch.__version__} sends between them over gloo, which cannot send to itself: use --pp 2 "
                         "or more on CPU processes, or torch 2.14 or newer")


def require_a_batch(train_data):
    """Stop with one line, before any training, when a pipeline's share of the data holds no whole batch: the stages'
    buffers have one shape, so an incomplete last batch is dropped, and an epoch without batches would train nothing.
    Every rank computes the same: all of them stop."""
    sequences, pipelines = len(train_data.sampler), train_data.sampler.num_replicas
    if len(train_data) == 0:
        raise SystemExit(f"error: each of the {pipelines} pipelines gets {sequences} sequences an epoch, fewer than "
                         f"--batch_size {train_data.batch_size}: no whole batch to train on; lower --batch_size, or "
                         "start fewer pipelines (fewer processes, or a larger --pp)")


def stage_io(model, micro_batch, stage, stages, dtype=None, tp=None):
    """(inputs, outputs) of a pipeline stage for one micro-batch of `micro_batch` sequences, as tensors on the meta
    device (shapes, no memory), for PipelineStage's input_args and output_args: token ids (micro_batch, context) into
    the first stage, activations (micro_batch, context, width) between stages, logits (micro_batch, context, vocab)
    out of the last, in the autocast `dtype` (torch 2.6 checks each output's dtype). The activations require grad:
    their gradients travel back. `tp`: the ranks that split each stage's sequences between the blocks (one_mesh.py's
    sequence parallelism): each holds context/tp positions, and the activations travel in `dtype` too (the last
    stage's logits are a DTensor split over the vocabulary, of the whole shape)."""
    config = unwrap(model).config
    between = dtype if tp else None  # one_mesh.py's FSDP computes in bf16 throughout: its activations are bf16
    activations = torch.empty(micro_batch, config.context // (tp or 1), config.n_embd, dtype=between, device="meta",
                              requires_grad=True)
    tokens = torch.empty(micro_batch, config.context, dtype=torch.long, device="meta")
    logits = torch.empty(micro_batch, config.context, config.vocab_size, dtype=dtype, device="meta")
    return tokens if stage == 0 else activations, logits if stage == stages - 1 else activations


def whole_weights(stage, to=None):
    """(name, the whole tensor) for every entry of the whole GPT's state_dict, in order, from every rank's pipeline
    stages (a DDP wrapper of one, or a GPT holding the rank's layers, sharded by FSDP and split by tensor parallelism):
    each weight made whole on the ranks that hold it (DTensor.full_tensor(), over their mesh), then sent from the first
    of them, a tensor, to rank `to` (None: to every rank, a broadcast). One weight at a time: no rank holds more than
    one whole weight beyond its shards, but the receiver of what it keeps. On the ranks that receive nothing, the value
    is None. A collective: call it on every rank, and take every item."""
    with torch.device("meta"):
        template = GPT(unwrap(stage).config, unwrap(stage).vocab, unwrap(stage).text)
    whole = template.state_dict()  # names and shapes; the text's identity (_extra_state), which every rank knows
    mine = get_model_state_dict(stage)  # this rank's weights under the whole model's names: tensors or DTensors
    device = next(stage.parameters()).device
    names = [name for name, value in whole.items() if isinstance(value, torch.Tensor)]
    # Who holds what: a flag per weight from every rank, gathered (numbers, not pickles).
    flags = torch.tensor([name in mine for name in names], dtype=torch.int32, device=device)
    holders = torch.empty(dist.get_world_size() * len(names), dtype=torch.int32, device=device)
    ALL_GATHER(holders, flags)
    holders = holders.view(dist.get_world_size(), len(names)).argmax(0).tolist()  # the first rank holding each
    me = dist.get_rank()
    for name, value in whole.items():
        if not isinstance(value, torch.Tensor):
            yield name, value
            continue
        first = holders[names.index(name)]
        held = mine.get(name)
        held = held.full_tensor() if hasattr(held, "full_tensor") else held  # its holders gather it, one collective
        if to is None:
            buffer = held.contiguous() if me == first else torch.empty_like(value, device=device)
            dist.broadcast(buffer, src=first)
            yield name, buffer
        elif me == to:
            if first != me:
                held = torch.empty_like(value, device=device)
                dist.recv(held, src=first)
            yield name, held
        else:
            if me == first:
                dist.send(held.contiguous(), dst=to)
            yield name, None
        del held


def reassembled(stage):
    """The whole GPT on every rank, put back together from every rank's pipeline stages (whole_weights), on the
    stage's device: each weight travels once, from one of the ranks that hold it. A collective: call it on every
    rank."""
    gpt = unwrap(stage)
    model = GPT(gpt.config, gpt.vocab, gpt.text).to(next(stage.parameters()).device)
    model.load_state_dict(dict(whole_weights(stage)))
    return model


def exported(stage, path):
    """Write the whole GPT's state_dict (whole_weights) from rank 0 to one plain file at `path`, weight by weight: each
    weight goes to a file of its own in a folder beside it (`PATH.<pid>.parts.tmp`) as it arrives, and is let go; the
    file is then written from those, read memory-mapped. So no rank holds the whole model, rank 0 included. The file
    loads with torch.load into a GPT without torch.distributed. What an export cut short left is removed by the next
    one (and the folder by a Ctrl-C). Returns, on rank 0, the GPT read back from the file, on the stage's device (for
    the held-out loss and a sample: what a user of the file does); None elsewhere. A collective: call it on every
    rank."""
    from utils.files import UNFINISHED, being_written, remove, remove_cut_short, replacing

    weights = whole_weights(stage, to=0)
    if dist.get_rank() != 0:
        for _ in weights:
            pass
        return None
    remove_cut_short(path)
    parts = being_written(f"{path}.{os.getpid()}.parts.tmp")
    os.makedirs(parts)
    try:
        state = {}
        for name, value in weights:
            if isinstance(value, torch.Tensor):
                part = os.path.join(parts, f"{len(state)}.pt")
                torch.save(value.cpu(), part)
                value = torch.load(part, mmap=True, weights_only=True)
            state[name] = value
        with replacing(path) as tmp:
            torch.save(state, tmp)
    finally:
        remove(parts)
        UNFINISHED.discard(parts)
    gpt = unwrap(stage)
    model = GPT(gpt.config, gpt.vocab, gpt.text)
    model.load_state_dict(torch.load(path, mmap=True, weights_only=True))
    return model.to(next(stage.parameters()).device)


def held_out_loss(schedule, stages, mesh, batches):
    """The mean loss over every token that counts in the held-out `batches` (this dp rank's (inputs, targets) share
    of each), run through the pipeline `schedule` in eval mode by every rank of the mesh (pp, dp, tp) in step; the
    schedule's loss must be each micro-batch's summed (utils.data.token_loss). The last stages' sums and counts are
    added over the ranks (a tp group's once): the mean over every token, the same number on any layout. The schedule
    runs its backwards too, whose gradients are set to None after: torch 2.14's forward-only eval() fails where a rank
    holds two neighbouring stages (--pp 1: "can't steal_bwd_input if this stage doesn't have backward"), and older
    versions have none."""
    from torch.distributed.tensor.parallel import loss_parallel

    from utils.data import IGNORE

    models = [stage.submod for stage in stages]
    device, last = stages[0].device, stages[-1].is_last
    totals = torch.zeros(2, device=device)  # [summed loss, tokens that count], of this rank's last-stage shares
    for model in models:
        model.eval()
    for source, targets in batches:
        inputs, losses = [source.to(device)] if stages[0].is_first else [], []
        with loss_parallel():
            schedule.step(*inputs, target=targets.to(device) if last else None, losses=losses)
        if losses and mesh["tp"].get_local_rank() == 0:  # the tp ranks of a stage hold the same loss
            totals += torch.stack([sum(loss.full_tensor() for loss in losses).detach(),
                                   (targets != IGNORE).sum().to(totals)])
    for model in models:
        model.train()
        model.zero_grad(set_to_none=True)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()
