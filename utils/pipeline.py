"""What pipeline_parallel.py (step 8) needs to cut the GPT into stages and put it back together, and its checks:
the mechanics around the lesson, not the lesson (the stage, the schedule, the micro-batches stay in the step).

    require_pipeline_fits(args, world_size)     the pipeline's stages, or one line and exit when it cannot be built
    pipeline_stage(model, stage, stages)        a stage's layers: the GPT less the other stages'
    stage_io(model, micro_batch, stage, stages) what a stage receives and sends per micro-batch (their shapes)
    reassembled(stage)                          the whole GPT again, from every rank's stage
"""
import torch
import torch.distributed as dist

from utils.gpt import GPT, SIZES, unwrap


def pipeline_stage(model, stage, stages):
    """Stage `stage` (0 to stages - 1) of a pipeline over the GPT `model`: the model itself, with the layers of the
    other stages taken out. The blocks are dealt out in consecutive runs (sizes differing by one at most); the
    embedding goes with the first stage, the final norm and the head with the last. It stays a GPT whose config
    describes the whole model (the FLOPs of a token), and its layers keep their names (block3 stays block3), so a
    stage's state_dict holds the whole model's keys for its layers."""
    blocks = [name for name, _ in model.named_children() if name.startswith("block")]
    mine = blocks[stage * len(blocks) // stages:(stage + 1) * len(blocks) // stages]
    mine += ["embed"] * (stage == 0) + ["head"] * (stage == stages - 1)
    for name in [name for name, _ in model.named_children() if name not in mine]:
        delattr(model, name)
    return model


def require_pipeline_fits(args, world_size):
    """The number of stages of pipeline_parallel.py's pipelines (world_size / --dp), after checking that they can be
    built: else one line and exit 1, before any process group forms. Each stage needs a block of the GPT at least,
    the micro-batches one size, and 1F1B a micro-batch per stage to fill its pipeline."""
    size = args.workload.partition("-")[2] or ("gpu" if torch.cuda.is_available() else "cpu")  # as gpt() picks it
    stages, blocks, M = world_size // args.dp, SIZES[size].n_layer, args.microbatches
    if world_size % args.dp:
        raise SystemExit(f"error: --dp {args.dp} does not divide the {world_size} processes: each of the --dp "
                         "pipelines needs as many processes as it has stages")
    if stages > blocks:
        raise SystemExit(f"error: {stages} pipeline stages ({world_size} processes / --dp {args.dp}) but the GPT has "
                         f"{blocks} blocks: each stage needs one at least; start fewer processes or raise --dp")
    if args.batch_size % M:
        raise SystemExit(f"error: --microbatches {M} does not divide --batch_size {args.batch_size}: the "
                         "micro-batches must all have one size")
    if args.schedule == "1f1b" and M < stages:
        raise SystemExit(f"error: --schedule 1f1b needs a micro-batch per stage at least ({stages}), got "
                         f"--microbatches {M}: raise it, or use --schedule gpipe")
    return stages


def stage_io(model, micro_batch, stage, stages, dtype=None):
    """(inputs, outputs) of a pipeline stage for one micro-batch of `micro_batch` sequences, as tensors on the meta
    device (shapes, no memory), for PipelineStage's input_args and output_args: token ids (micro_batch, context) into
    the first stage, activations (micro_batch, context, width) between stages, logits (micro_batch, context, vocab)
    out of the last, in the autocast `dtype` (torch 2.6 checks each output's dtype). The activations require grad:
    their gradients travel back."""
    config = unwrap(model).config
    activations = torch.empty(micro_batch, config.context, config.n_embd, device="meta", requires_grad=True)
    tokens = torch.empty(micro_batch, config.context, dtype=torch.long, device="meta")
    logits = torch.empty(micro_batch, config.context, config.vocab_size, dtype=dtype, device="meta")
    return tokens if stage == 0 else activations, logits if stage == stages - 1 else activations


def reassembled(stage):
    """The whole GPT, put back together from every rank's pipeline stage (a DDP wrapper of one too), on the stage's
    device: each rank's weights gathered to every rank. A collective: call it on every rank."""
    stage = unwrap(stage)
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, {name: value.cpu() if isinstance(value, torch.Tensor) else value
                                    for name, value in stage.state_dict().items()})  # the text's identity too
    model = GPT(stage.config, stage.vocab, stage.text)
    missing = set(model.state_dict()) - {name for piece in pieces for name in piece}
    assert not missing, f"no stage holds {sorted(missing)}"
    for piece in pieces:
        model.load_state_dict(piece, strict=False)
    return model.to(next(stage.parameters()).device)
