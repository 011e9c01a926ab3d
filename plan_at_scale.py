"""Step 14 - plan a thousand-GPU job on a laptop: the steps' own code lays out one rank of a job of any size, in one
process, on torch's fake process group (the other ranks are only numbers) with fake tensors (shapes, no memory); one
training step runs, and what the rank holds, keeps for backward, peaks at and sends is counted.

    python plan_at_scale.py --world 1024 --pp 8 --tp 8 --size 8b --checkpoint_activations   # step 11's mesh
    python plan_at_scale.py --step fsdp --world 64 --size 1b --microbatches 1                # step 5's FSDP
"""
import argparse
import contextlib
import dataclasses
import json
import os
import time
import warnings
from argparse import Namespace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import expert_parallel
import fsdp
import gpt
import one_mesh
import tensor_parallel
from utils import positive_int
from utils.estimates import GPUS, device_flops, mfu, recomputed_flops, step_time
from utils.fake_job import (EvenRouter, NewJobNumbers, already_in_place, each_bucket_all_reduced, even_routing,
                            forget_the_meshes)
from utils.gpt import GPT, MOE_EXPERTS, SHAPES, SIZES, load_text, make_optimizer, next_token_loss
from utils.memory import saved_for_backward, state_bytes
from utils.moe import split_experts
from utils.traffic import counting_collectives, named_groups, sent_per_rank

# Whose code lays the job out: the step scripts, imported as modules; their Trainers wrap the model and run the step.
STEPS = {"one_mesh": "step 11: pp x dp x tp on one mesh", "fsdp": "step 5: FSDP", "gpt": "step 6: DDP",
         "tensor_parallel": "step 7: FSDP over dp x tensor parallelism over tp",
         "expert_parallel": "step 10: experts split over ep, DDP over the rest"}
NO_SNAPSHOT = "/dev/null/no-snapshot"  # a path that cannot exist: a Trainer finds no snapshot and starts a new job
GiB, MiB = 2**30, 2**20


@contextlib.contextmanager
def fake_job(rank, world_size):
    """Be `rank` of a job of `world_size` ranks, inside: torch's fake process group accepts every collective and moves
    nothing, so the other ranks need not exist. The steps' Trainers read who they are from torchrun's variables."""
    variables = dict(RANK=str(rank), LOCAL_RANK=str(rank % 8), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE="8",
                     TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_RUN_ID="plan")
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_the_meshes()  # the next rank's meshes are new
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class PeakMemory(MemTracker):
    """torch's MemTracker: every tensor made while it is on, by its storage, and the most they come to at once (the
    peak), the rank's weights and optimizer given to it. Its per-module snapshots expect each module to run once a
    step, and a pipeline runs a stage once a micro-batch: they are left out. The rank's peak is what a plan needs."""

    def _pre_fw_hook(self, module, inputs):
        pass

    def _post_fw_hook(self, module, inputs, outputs):
        pass

    def _pre_bw_hook(self, module, args):
        pass

    def _post_bw_hook(self, module, args):
        pass


def mesh_of(args):
    """The step's device mesh, as its main() makes it (steps 5 and 6 have none: all ranks are one group). Made before
    the fake tensors: a mesh holds the real numbers of its ranks."""
    if args.step == "one_mesh":
        dp = args.world // (args.pp * args.tp)
        return init_device_mesh("cpu", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    if args.step == "tensor_parallel":
        return init_device_mesh("cpu", (args.world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    if args.step == "expert_parallel":
        return init_device_mesh("cpu", (args.world // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
    return None


def one_mesh_rank(config, args, mesh, fake):
    """Step 11's job on this rank, as one_mesh.py's main() builds it: the GPT on the meta device, one_mesh.parallelize,
    memory for this rank's shards (fake), its Trainer; a step is Trainer._run_batch."""
    with torch.device("meta"):
        model = GPT(config, vocab=None)
    model, stages = one_mesh.parallelize(model, mesh, step_arguments(args))
    with fake, NewJobNumbers(), already_in_place():
        model.to_empty(device="cpu")
        batch = tokens(args.batch_size, config.context)
        trainer = one_mesh.Trainer(model, stages, [batch], make_optimizer(model, config), next_token_loss,
                                   torch.device("cpu"), 1, NO_SNAPSHOT, step_arguments(args), mesh)
    # Each of the rank's stages, with the layers it holds.
    described = []
    for stage in trainer.stages:
        names = [name for name, _ in stage.submod.named_children()]
        described.append(f"stage {stage.stage_index}: {', '.join(names)}")
    layers = "; ".join(described)
    groups = {dim: mesh[dim].get_group() for dim in ("tp", "dp", "pp")}
    return trainer, lambda saved: trainer._run_batch(*batch, saved), groups, layers


def fsdp_rank(config, args, mesh, fake):
    """Step 5's job on this rank: fsdp.py's Trainer shards each block and the root over all ranks, as its main() sets
    FSDP up (a model on the meta device for it to shard, its shards given fake memory after)."""
    bf16 = torch.bfloat16 if args.precision == "bf16" else None
    options = dict(mp_policy=MixedPrecisionPolicy(bf16, reduce_dtype=torch.float32, output_dtype=torch.float32),
                   offload_policy=OffloadPolicy())
    with torch.device("meta"):
        model = GPT(config, vocab=None)
    with already_in_place():
        trainer = fsdp.Trainer(model, [], lambda model: make_optimizer(model, config), next_token_loss,
                               torch.device("cpu"), 1, NO_SNAPSHOT, options, False)
    with fake:
        model.to_empty(device="cpu")
        batch = tokens(args.batch_size, config.context)

    def step(saved):
        with saved:  # fsdp.py's step does not measure what autograd keeps: measured around it
            trainer._run_batch(*batch)

    return trainer, step, {"dp": dist.group.WORLD}, "every layer"


def gpt_rank(config, args, mesh, fake):
    """Step 6's job on this rank: gpt.py's Trainer wraps the GPT in DDP; a step is --microbatches calls of its
    _run_batch, the last one synchronised."""
    with torch.device("meta"):
        model = GPT(config, vocab=None)
    with fake, NewJobNumbers(), already_in_place():
        model.to_empty(device="cpu")
        batch = tokens(args.batch_size, config.context)
        trainer = gpt.Trainer(model, [batch], make_optimizer(model, config), next_token_loss, torch.device("cpu"), 1,
                              NO_SNAPSHOT, step_arguments(args))
    trainer.model.register_comm_hook(dist.group.WORLD, each_bucket_all_reduced)

    def step(saved):
        with saved:
            accumulated(trainer._run_batch, batch, args.microbatches)

    return trainer, step, {"dp": dist.group.WORLD}, "every layer"


def tensor_parallel_rank(config, args, mesh, fake):
    """Step 7's job on this rank, as tensor_parallel.py's main() builds it: each block split over the mesh's tp by its
    PLAN, then its Trainer's FSDP over dp (on the meta device; fake memory after)."""
    bf16 = torch.bfloat16 if args.precision == "bf16" else None
    options = dict(mp_policy=MixedPrecisionPolicy(bf16, reduce_dtype=torch.float32, output_dtype=torch.float32),
                   mesh=mesh["dp"])
    with torch.device("meta"):
        model = GPT(config, vocab=None)
    for block in list(model.children())[1:-1]:
        parallelize_module(block, mesh["tp"], tensor_parallel.PLAN)
    with already_in_place():
        trainer = tensor_parallel.Trainer(model, [], lambda model: make_optimizer(model, config), next_token_loss,
                                          torch.device("cpu"), 1, NO_SNAPSHOT, options, False)
    with fake:
        model.to_empty(device="cpu")
        batch = tokens(args.batch_size, config.context)
    groups = {"tp": mesh["tp"].get_group(), "dp": mesh["dp"].get_group()}

    def step(saved):
        with saved:
            trainer._run_batch(*batch)

    return trainer, step, groups, "every layer, its tp slice"


def expert_parallel_rank(config, args, mesh, fake):
    """Step 10's job on this rank, as expert_parallel.py's main() builds it: this rank's experts of every layer
    (split_experts over the mesh's ep), then its Trainer's DDPs; the routers' choices even (utils/fake_job.py)."""
    with torch.device("meta"):
        model = GPT(config, vocab=None)
    for layer in split_experts(model, mesh["ep"].get_group()):
        layer._dispatch = lambda routed, counts, layer=layer: even_routing(layer, routed, counts)
    with fake, NewJobNumbers(), already_in_place():
        model.to_empty(device="cpu")
        batch = tokens(args.batch_size, config.context)
        trainer = expert_parallel.Trainer(model, [batch], make_optimizer(model, config), next_token_loss,
                                          torch.device("cpu"), 1, NO_SNAPSHOT, step_arguments(args), mesh)
    for ddp in trainer.syncs:
        ddp.register_comm_hook(ddp.process_group, each_bucket_all_reduced)
    groups = {"ep": mesh["ep"].get_group(), "dp": mesh["dp"].get_group(), "all": dist.group.WORLD}

    def step(saved):
        with saved, EvenRouter():
            accumulated(trainer._run_batch, batch, args.microbatches)

    return trainer, step, groups, "its experts of every layer, the rest whole"


LAYOUTS = {"one_mesh": one_mesh_rank, "fsdp": fsdp_rank, "gpt": gpt_rank, "tensor_parallel": tensor_parallel_rank,
           "expert_parallel": expert_parallel_rank}


def step_arguments(args):
    """The step scripts' options, as their command lines would give them for this plan."""
    return Namespace(pp=args.pp, tp=args.tp, ep=args.ep, batch_size=args.batch_size, microbatches=args.microbatches,
                     grad_accum=args.microbatches, precision=args.precision, grad_clip=1.0, total_epochs=1,
                     checkpoint_activations=args.checkpoint_activations, async_save=False, timeout=60, compile=False,
                     aux_weight=0.01, peak_tflops=None)


def tokens(sequences, context):
    """A dp rank's batch: `sequences` of `context` token ids and their targets (fake: their values never matter)."""
    return torch.zeros(sequences, context, dtype=torch.long), torch.zeros(sequences, context, dtype=torch.long)


def accumulated(run_batch, batch, micro_batches):
    """A step of gpt.py's or expert_parallel.py's Trainer: `micro_batches` calls of its _run_batch, each with its part
    of the batch, the last one synchronising the gradients and stepping the optimizer."""
    sources, targets = batch
    parts = zip(sources.chunk(micro_batches), targets.chunk(micro_batches))
    for index, (source, target) in enumerate(parts):
        run_batch(source, target, micro_batches, index == micro_batches - 1)


def plan_rank(rank, config, args, count=True):
    """One rank of the job on the fake process group: the step's Trainer built, one step run on fake tensors. What it
    held (its weights, their gradients and the optimizer's state, as the step steps), what autograd kept for backward
    over the step (as one_mesh.py measures it), its peak (torch's MemTracker) and, with `count`, every collective."""
    with fake_job(rank, args.world):
        mesh = mesh_of(args)
        # Fake tensors: every tensor made under this mode has a shape, a dtype and a device, and no memory; an
        # operation computes the shape of its result, not its values. So one rank of an 8B model fits in a laptop.
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        trainer, run_step, groups, layers = LAYOUTS[args.step](config, args, mesh, fake)
        named = named_groups(groups)  # every process group of this rank, by the mesh dimension of the same ranks
        # What the rank holds once the optimizer has stepped: its weights, their gradients and the optimizer's state.
        held = {}

        def count_held(*_):
            held.update(state_bytes(trainer.model, trainer.optimizer))

        trainer.optimizer.register_step_post_hook(count_held)
        with fake:
            peak = PeakMemory()
            peak.track_external(trainer.model, trainer.optimizer)
            saved = saved_for_backward()
            began = time.perf_counter()
            # torch's comm-counting mode sees each collective the step calls, with its group and its tensors.
            with counting_collectives(named) if count else contextlib.nullcontext() as counting, peak:
                run_step(saved)
            seconds = time.perf_counter() - began
        where = ", ".join(f"{dim} {mesh[dim].get_local_rank()}" for dim in mesh.mesh_dim_names) if mesh else "dp"
    # MemTracker's peak on the first device it tracked: the fake tensors are all on the CPU.
    peak_bytes = list(peak.get_tracker_snapshot("peak").values())[0]["Total"]
    return dict(rank=rank, where=where, layers=layers, checkpointed=args.checkpoint_activations, seconds=seconds,
                **held, activations=saved.bytes, peak=peak_bytes,
                groups={label: ranks for label, ranks in named.values()},
                collectives=counting.collectives if count else None)


def tallied(collectives):
    """The step's collectives by (kind, group, ranks, bytes), with how many of each and what this rank sent for them."""
    rows = {}
    for collective in collectives:
        key = (collective["kind"], collective["group"], collective["ranks"], collective["bytes"])
        if key not in rows:
            rows[key] = dict(kind=collective["kind"], group=collective["group"], ranks=collective["ranks"],
                             bytes=collective["bytes"], count=0, sent=0.0)
        row = rows[key]
        row["count"] += 1
        row["sent"] += sent_per_rank(collective)
    return sorted(rows.values(), key=lambda row: -row["sent"])


def link_of(ranks, per_node):
    """The link a group's collectives cross: NVLink when all its ranks are GPUs of one node, else the network."""
    return "nvlink" if len({rank // per_node for rank in ranks}) == 1 else "network"


def estimate(plan, config, args, gpu):
    """The step's time and MFU on `gpu`, from the model FLOPs of this device's share and the bytes it sent on each
    link (utils/estimates.py: the formulas are docs/reference/plan-at-scale.md's)."""
    tp = args.tp if args.step in ("one_mesh", "tensor_parallel") else 1
    pp = args.pp if args.step == "one_mesh" else 1
    flops = device_flops(config, args.batch_size, tp, pp)
    recomputed = recomputed_flops(config, args.batch_size, tp, pp) if plan["checkpointed"] else 0.0
    links = {label: link_of(ranks, gpu.per_node) for label, ranks in plan["groups"].items()}
    # The bytes this rank sent on each group's link, over the step.
    sent = {}
    for label in links:
        sent[label] = sum(row["sent"] for row in plan["tally"] if row["group"] == label)
    # Whatever is not tensor or pipeline parallelism is data's (dp's, the experts' ep, DDP's all ranks): overlapped.
    data = sum(bytes_ for label, bytes_ in sent.items() if label not in ("tp", "pp"))
    data_links = [link for label, link in links.items() if label not in ("tp", "pp")]
    data_link = "network" if "network" in data_links else "nvlink"
    seconds = step_time(flops, gpu, sent.get("tp", 0.0), data, sent.get("pp", 0.0), links.get("tp", "nvlink"),
                        data_link, links.get("pp", "network"), pp, args.microbatches, recomputed=recomputed)
    return dict(seconds, flops=flops, mfu=mfu(flops, seconds["step"], gpu.flops), links=links, sent=sent)


# What the fake backend and fake tensors cannot run as a real job does, and how each step's plan counts it instead.
COUNTED = {"one_mesh": "the pipeline's sends are counted as each stage makes them (the fake backend takes a send as "
                       "it takes a collective; a receive is its peer's send)",
           "gpt": "DDP's all-reduce of each bucket goes through a Python hook that the fake backend completes (the "
                  "same collective, the same bytes)",
           "expert_parallel": "the routers' choices are even (fake tensors hold none): each expert gets top_k x "
                              "tokens / experts; a real router's all-to-alls differ rank to rank, their sum over "
                              "an ep group is this",
           "fsdp": "everything as a real job runs it", "tensor_parallel": "everything as a real job runs it"}


def report(plan, gpu):
    """What one rank holds, keeps and sends, and its step's time on `gpu`, as lines to print."""
    checkpointing = "with" if plan["checkpointed"] else "without"
    activations = (f"  activations  {plan['activations'] / GiB:.2f} GiB kept for backward {checkpointing} activation "
                   "checkpointing")
    peak = f"  peak         {plan['peak'] / GiB:.2f} GiB (torch's MemTracker)"
    # The same rank traced again with checkpointing switched over (--compare_checkpointing): its figures beside.
    other = plan.get("other")
    if other:
        other_checkpointing = "with" if other["checkpointed"] else "without"
        activations += f", {other['activations'] / GiB:.2f} GiB {other_checkpointing}"
        peak += f", {other['peak'] / GiB:.2f} GiB {other_checkpointing} checkpointing"
    peak += f"; an {gpu.name} has {gpu.memory / GiB:.1f} GiB"
    lines = [f"rank {plan['rank']} ({plan['where']}; {plan['layers']}), its step traced in {plan['seconds']:.1f} s:",
             f"  holds        params {plan['params'] / GiB:.2f} GiB + grads {plan['grads'] / GiB:.2f} GiB + "
             f"AdamW {plan['optim'] / GiB:.2f} GiB",
             activations,
             peak,
             f"  {'collectives of one step':<46}{'count':>6}{'bytes each':>13}{'sent':>13}"]
    for row in plan["tally"]:
        link = "NVLink" if plan["estimate"]["links"].get(row["group"]) == "nvlink" else "network"
        where = f"{row['group']}, {row['ranks']} ranks, {link}"
        lines.append(f"    {row['kind']:<15}{where:<27}{row['count']:>6}{row['bytes'] / MiB:>9.2f} MiB"
                     f"{row['sent'] / MiB:>9.1f} MiB")
    step = plan["estimate"]
    lines.append(f"  on {gpu.name}s at their peak: compute {step['compute']:.3f} s + bubble {step['bubble']:.3f} s + "
                 f"communication not hidden {step['exposed']:.3f} s = {step['step']:.3f} s a step; MFU "
                 f"{step['mfu']:.0%} at best")
    return "\n".join(lines)


def model_config(args):
    """The GPT to plan for: a named shape (utils/gpt.SHAPES; "cpu" and "gpu" with the vocabulary of --text or of the
    help pages), with any of --layers, --heads, --width, --vocab, --context, --experts and --top_k changed."""
    if args.size in SHAPES:
        config = SHAPES[args.size]
    else:
        config = dataclasses.replace(SIZES[args.size], vocab_size=len(set(load_text(args.text, 0)[1])))
    changes = dict(n_layer=args.layers, n_head=args.heads, n_embd=args.width, vocab_size=args.vocab,
                   context=args.context, experts=args.experts, top_k=args.top_k)
    config = dataclasses.replace(config, dropout=0.0, **{key: value for key, value in changes.items() if value})
    if args.step == "expert_parallel" and not config.experts:  # a mixture of experts to split: step 10's of a size
        config = dataclasses.replace(config, experts=MOE_EXPERTS.get(args.size, 8))
    return config


def rank_list(text):
    """--ranks: "all", or global ranks separated by commas."""
    return "all" if text == "all" else [int(rank) for rank in text.split(",")]


def require_layout_fits(config, args):
    """Stop with one line, before anything is traced, when the step cannot lay the GPT out this way (its own checks
    would stop the real job, or torch would fail inside the step)."""
    grid = args.pp * args.tp * args.ep
    problems = [
        (args.world % grid, f"--world {args.world} is not a whole number of pp x tp x ep = {grid} grids"),
        (config.n_head % args.tp or config.context % args.tp,
         f"--tp {args.tp} must divide the heads ({config.n_head}) and the context ({config.context:,})"),
        (2 * args.pp > config.n_layer + 2, f"--pp {args.pp} makes {2 * args.pp} stages, more than the GPT's "
                                           f"{config.n_layer + 2} layers (its blocks, the embedding and the head)"),
        (args.batch_size % args.microbatches, f"--microbatches {args.microbatches} must divide --batch_size "
                                              f"{args.batch_size}"),
        (args.step == "one_mesh" and args.microbatches % args.pp,
         f"--microbatches {args.microbatches} must be a multiple of --pp {args.pp} (rounds of pp)"),
        (args.step in ("fsdp", "tensor_parallel") and args.microbatches > 1,
         f"{args.step}.py takes one batch a step: --microbatches 1"),
        (config.experts % args.ep, f"--ep {args.ep} must divide the {config.experts} experts of a layer"),
    ]
    for problem, line in problems:
        if problem:
            raise SystemExit(f"error: {line}")


def plan_job(args, say=print):
    """The plan of args' job: {config, args, plans}, a plan per traced rank (plan_rank's figures, its collectives
    tallied, its step's estimate); each rank's report said as it is done."""
    config = model_config(args)
    args.pp = args.pp if args.step == "one_mesh" else 1
    args.tp = args.tp if args.step in ("one_mesh", "tensor_parallel") else 1
    args.ep = args.ep if args.step == "expert_parallel" else 1
    require_layout_fits(config, args)
    dp = args.world // (args.pp * args.tp * args.ep)
    gpu = GPUS[args.gpu]
    # One rank of each kind: a pipeline's first rank (the embedding) and its last (the head); elsewhere all are alike.
    ranks = args.ranks or ([0] if args.pp == 1 else [0, (args.pp - 1) * dp * args.tp])
    ranks = range(args.world) if ranks == "all" else ranks
    # The mesh's dimensions, dp always, the others where they split the job: "pp 8 x dp 16 x tp 8".
    sizes = {"pp": args.pp, "dp": dp, "tp": args.tp, "ep": args.ep}
    shape = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1 or name == "dp")
    gpt_line = (f"a GPT of {config.n_layer} blocks, {config.n_head} heads, {config.n_embd} wide, a vocabulary of "
                f"{config.vocab_size:,}, a context of {config.context:,}")
    if config.experts:
        gpt_line += f", {config.experts} experts (top {config.top_k})"
    say(f"plan: {gpt_line}; {args.world:,} ranks as {args.step}.py ({STEPS[args.step]}) lays them out: {shape}; "
        f"{args.batch_size} sequences a dp rank a step in {args.microbatches} micro-batches, {args.precision}")
    say(f"each rank below is traced alone in this process (torch's fake process group stands in for the others, fake "
        f"tensors for the memory); {COUNTED[args.step]}")
    plans = []
    # FSDP warns that a layer returns a view under the comm-counting mode's module hooks; no in-place operation
    # follows. Silenced here, for every caller: the command, the notebook and exercise 13's checker.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        for rank in ranks:
            plan = plan_rank(rank, config, args)
            plan["tally"] = tallied(plan["collectives"])
            plan["estimate"] = estimate(plan, config, args, gpu)
            if args.step == "one_mesh" and args.compare_checkpointing:
                # The same rank with activation checkpointing switched over (one_mesh.py's option): its memory alone.
                switched = Namespace(**vars(args))
                switched.checkpoint_activations = not args.checkpoint_activations
                other = plan_rank(rank, config, switched, count=False)
                plan["other"] = {key: other[key] for key in ("checkpointed", "activations", "peak")}
            say(report(plan, gpu))
            plans.append(plan)
    largest = max(plans, key=lambda plan: plan["peak"])
    say(f"the largest peak, rank {largest['rank']}'s: {largest['peak'] / GiB:.2f} GiB, "
        f"{largest['peak'] / gpu.memory:.0%} of an {gpu.name}'s {gpu.memory / GiB:.1f} GiB")
    return dict(config=dataclasses.asdict(config), args=dict(vars(args), ranks=list(ranks)), plans=plans)


def main(args):
    plan = plan_job(args, say=lambda line: print(line, flush=True))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(plan, file)


def parse(argv=None):
    """The command line's options (`argv`: a list, for a test or a checker that plans in its own process)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", default="one_mesh", choices=STEPS, help="Whose code lays the job out")
    parser.add_argument("--world", default=1024, type=positive_int, help="Ranks (GPUs) of the job")
    parser.add_argument("--pp", default=8, type=positive_int, help="one_mesh: pipeline ranks, two stages each")
    parser.add_argument("--tp", default=8, type=positive_int, help="one_mesh, tensor_parallel: tensor-parallel ranks")
    parser.add_argument("--ep", default=8, type=positive_int, help="expert_parallel: ranks that split the experts")
    parser.add_argument("--size", default="8b", choices=[*SHAPES, *SIZES], help="The GPT's shape (utils/gpt.py)")
    parser.add_argument("--text", help="Sizes cpu and gpu: the text whose characters are the vocabulary")
    for name in ("layers", "heads", "width", "vocab", "context", "experts", "top_k"):
        parser.add_argument(f"--{name}", type=positive_int, help=f"The GPT's {name}, instead of the size's")
    parser.add_argument("--batch_size", default=8, type=positive_int, help="Sequences per dp rank per step")
    parser.add_argument("--microbatches", default=8, type=positive_int, help="Micro-batches per step")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"], help="Compute dtype")
    parser.add_argument("--checkpoint_activations", action="store_true", help="one_mesh: recompute each block")
    parser.add_argument("--compare_checkpointing", action="store_true",
                        help="one_mesh: trace each rank again with checkpointing switched over (memory alone)")
    parser.add_argument("--ranks", type=rank_list, help="Ranks to trace (0,896 or all; default: one of each kind)")
    parser.add_argument("--gpu", default="h100", choices=GPUS, help="The GPU of the estimates")
    parser.add_argument("--json", help="Write the plan to this file as JSON")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
