"""What pipeline_parallel.py (step 8) and one_mesh.py (step 11) need around their pipelines and do not teach: the
checks of their options, the shapes a stage sends and receives, and the whole GPT put back together at the end (the
cut into stages, the stage, the schedule and the micro-batches stay in the steps).

    require_pipeline_fits(args, world_size)     one line and exit when step 8's pipelines cannot be built
    require_mesh_fits(args, world_size)         the same for step 11's mesh of pp x dp x tp
    require_a_batch(train_data)                 one line and exit when a pipeline gets no whole batch in an epoch
    stage_io(model, micro_batch, stage, stages) what a stage receives and sends per micro-batch (their shapes)
    reassembled(stage)                          the whole GPT again, from every rank's stages
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.torch_version import TorchVersion

from utils.gpt import GPT, size_of, unwrap
from utils.helpers import require_dense_gpt


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
    if args.batch_size % M or M % pp:
        raise SystemExit(f"error: --microbatches {M} must divide --batch_size {args.batch_size} and be a multiple of "
                         f"--pp {pp}: the micro-batches have one size, and go through the pipeline in rounds of pp")
    if gloo and version < (2, 10):
        raise SystemExit(f"error: torch {torch.__version__} cannot train this on CPU processes (its FSDP sums the "
                         "gradients instead of averaging them before 2.9, and 2.9's pipelining fails on gloo): use "
                         "torch 2.10 or newer there (on GPUs, 2.6 or newer)")


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


def reassembled(stage):
    """The whole GPT, put back together from every rank's pipeline stages (a DDP wrapper of one, or a GPT holding the
    rank's layers, sharded by FSDP and split by tensor parallelism), on the stage's device: each rank's weights
    gathered whole, then to every rank. A collective: call it on every rank."""
    state = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))  # DTensors gathered whole
    stage = unwrap(stage)
    state["_extra_state"] = stage.get_extra_state()  # the text's identity too
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, {name: value.cpu() if isinstance(value, torch.Tensor) else value
                                    for name, value in state.items()})
    model = GPT(stage.config, stage.vocab, stage.text)
    missing = set(model.state_dict()) - {name for piece in pieces for name in piece}
    assert not missing, f"no stage holds {sorted(missing)}"
    for piece in pieces:
        model.load_state_dict(piece, strict=False)
    return model.to(next(stage.parameters()).device)
