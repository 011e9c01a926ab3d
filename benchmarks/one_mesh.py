"""Step 11's trades, measured on the CPU-size GPT in one run: the interleaved schedule's bubble against 1F1B's, the
memory activation checkpointing saves against the time it costs, and sequence parallelism's activations against step
7's plan; and, on its own, each rank's memory and traffic against the memory plan (tools/memory_plan.py).

    python benchmarks/one_mesh.py                         # M = 2 4 8, batch 128; AC and SP at batch 32
    python benchmarks/one_mesh.py --microbatches 4 8 --zero_bubble_fsdp --parts pipeline
    python benchmarks/one_mesh.py --parts plan --chars 4600   # 8 processes; the tests' excerpt of the help pages

1. The bubble. Two processes (one CPU thread each, gloo) form a pipeline of 2 ranks and train batches of --batch_size
sequences of 64 characters, each step in M micro-batches, with five schedules:
  1f1b                 step 8's: pipeline_parallel.py's own Trainer, one stage per rank (the embedding and block 0 |
                       block 1 and the head), Schedule1F1B
  interleaved          step 11's: one_mesh.parallelize cuts the GPT into 4 stages (embed | block0 | block1 | head),
                       rank r holding stages r and r + 2, each layer and stage under FSDP over a dp of one rank and
                       split over a tp of one rank; one_mesh.Trainer runs ScheduleInterleaved1F1B
  interleaved-plain    the same 4 stages as plain modules (pp only: no FSDP, no DTensor), ScheduleInterleaved1F1B
  zero-bubble-plain    the same, ScheduleInterleavedZeroBubble
  zbv-plain            the same cut placed as a V (rank r holds stages r and 3 - r), ScheduleZBVZeroBubble
The configurations take --steps steps per turn, round after round, the order reversed every other round, round 0 a
warm-up (pipeline_bubble.take_turns). The job runner's recorder (harness/jobs/recorder: pipeline.jsonl) times every
micro-batch's forward and backward on each stage. The zero-bubble schedules split a backward in two: the inputs'
gradient first (the recorder times it as a backward), the weights' later, to fill the waits (W passes, which the worker
times into the same file). Per configuration, the fastest step's (other work on the machine only ever slows a step
down):
  stages        the stages each rank ran (rank 0 / rank 1)
  passes        the forwards, backwards and W passes a rank ran in the step (rank 0's)
  step ms       from the first forward's start to the last pass's end (the optimizer step is not in it)
  vs 1f1b       the step's time over 1F1B's at the same M
  busy ms       the time a rank computed in that span (the mean of the 2 ranks): its stages' passes, without the waits
  idle          the fraction of that span each rank did not compute (waiting for an activation or a gradient)
  formula       the idle fraction if every stage's passes took the same time: with p ranks of v stages each,
                (p - 1) / (v M + p - 1); v = 1 is 1F1B's (p - 1) / (M + p - 1). The zero-bubble schedules have none
                here: with equal forward, input-gradient and weight-gradient passes they would leave no idle time.
The interleaved formula comes from Narayanan et al. (2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", their interleaved schedule): when each rank holds v chunks of 1/v of its layers, the
pipeline fills and drains in chunk-sized passes, so the bubble's time shrinks v-fold, to (p - 1) / v of a micro-batch's
forward and backward through a whole rank, against M of useful work. Their bubble fraction, (p - 1) / (v M), is over
the useful time; over the whole step, as measured here, it is (p - 1) / (v M + p - 1).
What a 2-core CPU can show, and what it cannot. It shows each schedule's structure (the stages of each rank, the passes
of a step, the W passes of the zero-bubble ones), that the pp-only schedules compute one process's gradients, and
1F1B's bubble near its formula while micro-batches are large. It cannot show the interleaved schedule's gain: the
CPU-size GPT has 2 blocks, so the 4 stages are unequal (the embedding and the head are small next to a block; the V of
ZBV puts both small ones on rank 0, which idles most of the step), each micro-batch crosses between the ranks 3 times
instead of once, and each rank runs twice the passes (three times with zero bubble), each paying a fixed cost (a gloo
send, the schedule's Python) that micro-batches of a few sequences do not dwarf on a CPU; step 11's own row pays
DTensor's and FSDP's dispatch on every operation too. The step time is printed for that reason: the idle fraction
alone would hide a step that idles less but takes longer.
Then the gradients of one step of each pp-only schedule, against one process's whole GPT on the same batch and
weights: the largest difference, and the parameters left without a gradient (none, if the schedule works). With
--zero_bubble_fsdp, the same check on 4 processes, pp 2 x dp 2 without TP, every layer and every stage under FSDP
over dp (fully_shard, as one_mesh.parallelize wraps them), each dp rank half of the batch.

2. Activation checkpointing. Two processes, pp 1 x dp 1 x tp 2 (one_mesh.parallelize and one_mesh.Trainer: the 2
stages of the pipeline's one rank, split over tp 2 with sequence parallelism), batches of --ac_batch sequences in
--ac_microbatches micro-batches, with and without checkpoint_activations:
  saved MiB     what autograd kept for backward during one step on rank 0, every micro-batch through both stages
                (utils.memory.saved_for_backward, as one_mesh.py's activation_bytes)
  step ms       the fastest whole step of the turns (forward, backward, clipping and AdamW), rank 0's clock
3. Sequence parallelism. The same 2 processes: one block of the GPT split over tp 2 by one_mesh.PLAN (sequence
parallel: each rank holds 1/tp of the positions outside the matrices) and by tensor_parallel.PLAN (step 7's: the
whole sequence on every rank between the matrices), one forward and backward of --ac_batch sequences:
  saved MiB     what autograd kept for backward on rank 0
  ms            the fastest forward and backward of --rounds x --steps
4. The memory plan (--parts plan). Eight processes run one_mesh.py's Trainer (as in part 2) on four layouts
(plan_layouts: the tests' pp 2 x dp 2 x tp 2; the same in bf16 with checkpointing and two rounds of micro-batches; FSDP
alone over 8 ranks in bf16 with checkpointing; tp 4), two steps on one batch, the second measured: every allocation
of the CPU allocator, named by what holds it (MemoryTimeline), and the collectives of a third step, weighed as in
benchmarks/communication.py. For every rank, the most it held at once of each of the plan's columns, measured against
the plan (KiB; the difference in bytes if any):
  gathered      FSDP's unsharded weights and the gradients accumulated in them
  peak_act      what autograd kept for backward (less the stages' inputs, which lie in pipeline buffers)
  logits        the last stage's logits the schedule kept
  pipeline      the stages' receive buffers and the tensors sent
  held          all of the above with the shards, AdamW's state and the batch, at a moment between two passes
  loss          the most the memory rose in the loss's backward (up to the logits' gradient)
  total         everything the allocator held at any moment, temporaries inside a pass included
  pp, dp, tp_bytes   sent a step over each mesh dimension (a ring's share of each collective, a send's whole)
--plan_json writes the measured figures (tests/test_memory_plan.py compares them with the plan).
"""
import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from argparse import Namespace
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/one_mesh.py` from anywhere; the steps import from there

from benchmarks import pipeline_bubble  # noqa: E402
from tools import pipeline_timeline  # noqa: E402
from harness.jobs import free_port, machine_summary, spawned_result  # noqa: E402
from utils import SEED, exit_without_teardown, positive_int  # noqa: E402

PP, TP, DP = 2, 2, 2  # the pipeline's ranks (part 1), the tp group (parts 2 and 3), the dp of --zero_bubble_fsdp
SCHEDULES = ["1f1b", "interleaved", "interleaved-plain", "zero-bubble-plain", "zbv-plain"]
PLAIN = {"interleaved-plain": "ScheduleInterleaved1F1B", "zero-bubble-plain": "ScheduleInterleavedZeroBubble",
         "zbv-plain": "ScheduleZBVZeroBubble"}
ZERO_BUBBLE = {"zero-bubble-plain", "zbv-plain"}
MiB = 2**20


def placement(schedule, rank):
    """The 2 of the 2 x PP stages that pipeline rank `rank` holds: r and r + PP (interleaved), or r and 2 PP - 1 - r
    (the V of ScheduleZBVZeroBubble: the first and the last stage on rank 0)."""
    return (rank, 2 * PP - 1 - rank) if schedule == "zbv-plain" else (rank, rank + PP)


def cut(model, indices, stages):
    """[(index, its layers as an nn.Sequential)] for the stages `indices` of `stages`: one_mesh.parallelize's cut of
    the list [embed, block0, ..., head] (stage i holds layers i n / stages to (i + 1) n / stages), without its tensor
    parallelism and FSDP. The layers keep their names; the model keeps all of them."""
    from collections import OrderedDict

    from torch import nn

    layers = [name for name, _ in model.named_children()]
    return [(index, nn.Sequential(OrderedDict((name, model.get_submodule(name)) for name in
                                              layers[index * len(layers) // stages:(index + 1) * len(layers) //
                                                     stages])))
            for index in indices]


def plain_pipeline(schedule, M, micro_batch, text_path, mesh, dp=None):
    """A pp-only pipeline of `schedule` (a key of PLAIN) on this rank: (a function that runs one step of it on a
    batch's source and targets, this rank's stages as modules, the workload whose GPT they are cut from). With `dp` (a
    mesh dimension) each layer and each stage is sharded over it by FSDP, as one_mesh.parallelize does."""
    import torch
    import torch.distributed.pipelining as pipelining
    from torch.distributed.fsdp import fully_shard

    from utils import make_workload
    from utils.pipeline import stage_io

    workload = make_workload("gpt-cpu", text=text_path, dropout=0)
    parts = cut(workload.model, placement(schedule, mesh["pp"].get_local_rank()), 2 * PP)
    if dp is not None:
        for _, part in parts:
            for layer in part.children():
                fully_shard(layer, mesh=dp, reshard_after_forward=False)
            fully_shard(part, mesh=dp, reshard_after_forward=False)
    stages = [pipelining.PipelineStage(part, index, 2 * PP, torch.device("cpu"),
                                       *stage_io(workload.model, micro_batch, index, 2 * PP),
                                       group=mesh["pp"].get_group()) for index, part in parts]
    # Each micro-batch's loss divided by M: their gradients add up to the batch mean's, as in the steps.
    pipeline = getattr(pipelining, PLAIN[schedule])(stages, M, loss_fn=lambda out, y: workload.loss_fn(out, y) / M,
                                                    scale_grads=False)
    first, last = any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)

    def step(source, targets):
        # The stage that holds the embedding is fed the tokens, the one that holds the head the targets.
        pipeline.step(*([source] if first else []), target=targets if last else None)

    return step, [part for _, part in parts], workload


def step11_trainer(mesh, M, batch_size, text_path, folder, checkpoint_activations=False, precision="fp32"):
    """one_mesh.py's own Trainer on `mesh` (pp, dp, tp), as its main() builds it: the GPT on the meta device,
    one_mesh.parallelize, memory for this rank's shards, GPT-2's initial weights drawn on them; `precision` its
    --precision (bf16: FSDP's mixed precision)."""
    import torch

    import one_mesh
    from utils import make_workload

    options = Namespace(pp=mesh["pp"].size(), tp=mesh["tp"].size(), microbatches=M, batch_size=batch_size,
                        precision=precision, grad_clip=1.0, checkpoint_activations=checkpoint_activations,
                        async_save=False, timeout=600, total_epochs=1000, peak_tflops=None)
    workload = make_workload("gpt-cpu", text=text_path, dropout=0, device="meta")
    model, stages = one_mesh.parallelize(workload.model, mesh, options)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    loader = one_mesh.prepare_dataloader(workload.train_set, batch_size, mesh["dp"])
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return one_mesh.Trainer(model, stages, loader, workload.make_optimizer(model), workload.loss_fn,
                                torch.device("cpu"), 1000, str(Path(folder) / f"none.{M}.{checkpoint_activations}"),
                                options, mesh)


def quiet_dtensor():
    """Silence two notices of DTensor that one_mesh.Trainer's steps print on CPU processes and that change nothing
    here: dropout of probability 0 draws nothing, but passes its check of random operators all the same; and the
    gradients' norm over a mesh of dp x tp takes an all-reduce over each dimension (one of them a group of one)."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def record_weight_passes():
    """Time each W pass of the zero-bubble schedules (a stage's backward_weight_one_chunk: the weights' gradients of
    a micro-batch whose inputs' gradient went back earlier) into the recorder's pipeline.jsonl, as pass "weight": the
    recorder times forward_one_chunk and backward_one_chunk only."""
    import torch.distributed as dist
    from torch.distributed.pipelining import stage as stage_module

    base = stage_module._PipelineStageBase
    weight_one_chunk = base.backward_weight_one_chunk

    def timed(self, chunk, *args, **kwargs):
        began = time.time()
        result = weight_one_chunk(self, chunk, *args, **kwargs)
        with open(Path(os.environ["JOB_RECORD_DIR"]) / "pipeline.jsonl", "a") as record:
            record.write(json.dumps(dict(pid=os.getpid(), rank=dist.get_rank(), restart=0, stage=self.stage_index,
                                         step=None, microbatch=chunk, began=began, ended=time.time(),
                                         **{"pass": "weight"})) + "\n")
        return result

    base.backward_weight_one_chunk = timed


def gradient_check(schedule, M, batch, text_path, mesh, dp=None):
    """One step of a pp-only schedule against one process's whole GPT on the whole batch, from the same initial
    weights: (the largest difference of a gradient, the parameters of this rank left without one). With `dp`, FSDP
    over it and each dp rank its part of the batch (FSDP averages the gradients over dp)."""
    from utils import make_workload

    share = len(batch[0]) // (dp.size() if dp is not None else 1)
    step, parts, workload = plain_pipeline(schedule, M, share // M, text_path, mesh, dp)
    reference = make_workload("gpt-cpu", text=text_path, dropout=0).model
    workload.loss_fn(reference(batch[0]), batch[1]).backward()
    mine = slice(dp.get_local_rank() * share, (dp.get_local_rank() + 1) * share) if dp is not None else slice(None)
    step(batch[0][mine], batch[1][mine])
    worst, missing = 0.0, []
    for part in parts:
        for name, param in part.named_parameters():
            if param.grad is None:
                missing.append(name)
                continue
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            worst = max(worst, float((grad - reference.get_parameter(name).grad).abs().max()))
    return worst, missing


def gathered_checks(checks):
    """Every rank's {schedule: (worst, missing)} gathered: {schedule: (the worst over the ranks, all missing)}."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, checks)
    return {schedule: (max(mine[schedule][0] for mine in everyone),
                       sorted({name for mine in everyone for name in mine[schedule][1]})) for schedule in checks}


def pipeline_worker(rank, args, text_path, result_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import one_mesh

    torch.set_num_threads(1)
    quiet_dtensor()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=timedelta(seconds=args.timeout))
    record_weight_passes()
    # Step 11's mesh with a dp and a tp of one rank each; step 8's Trainer reads its "pp" and "dp" alone.
    mesh = init_device_mesh("cpu", (PP, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    folder = Path(result_path).parent
    # When each step ran on this rank (time.time(), the recorder's clock), in the order take_turns runs them: a step's
    # passes are the ones recorded in its window. (The recorder numbers the steps by the forwards of micro-batch 0,
    # which a rank holding two stages runs twice a step.)
    windows, runs = [], {}

    def timed(step):
        def run(source, targets):
            began = time.time()
            step(source, targets)
            windows.append((began, time.time()))
        return run

    for M in args.microbatches:
        for schedule in args.schedules:
            if schedule == "1f1b":
                trainer = pipeline_bubble.trainer(rank, "1f1b", M, args, text_path, folder, mesh)
                runs[schedule, M] = trainer.train_data, trainer._run_batch
            elif schedule == "interleaved":
                trainer = step11_trainer(mesh, M, args.batch_size, text_path, folder)
                runs[schedule, M] = trainer.train_data, (
                    lambda source, targets, trainer=trainer: trainer._run_batch(source, targets,
                                                                                contextlib.nullcontext()))
            else:
                run_step, parts, workload = plain_pipeline(schedule, M, args.batch_size // M, text_path, mesh)

                # No optimizer (the span measured ends before it in the Trainers' steps too): each step's gradients
                # are dropped, not added to the next one's.
                def step(source, targets, run_step=run_step, parts=parts):
                    run_step(source, targets)
                    for part in parts:
                        part.zero_grad(set_to_none=True)

                loader = one_mesh.prepare_dataloader(workload.train_set, args.batch_size, mesh["dp"])
                runs[schedule, M] = loader, step
    steps = pipeline_bubble.take_turns({key: (batches, timed(step)) for key, (batches, step) in runs.items()}, args)
    everyone = [None] * PP
    dist.all_gather_object(everyone, windows)
    batch = next(iter(runs[next(iter(runs))][0]))
    checks = gathered_checks({schedule: gradient_check(schedule, min(args.microbatches), batch, text_path, mesh)
                              for schedule in args.schedules if schedule in PLAIN})
    if rank == 0:
        Path(result_path).write_text(json.dumps(dict(
            configurations=[[schedule, M, [[window[n] for window in everyone] for n in numbers]]
                            for (schedule, M), numbers in steps.items()], checks=checks)))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


def fsdp_worker(rank, args, text_path, result_path):
    """--zero_bubble_fsdp: PP x DP processes, each pp-only schedule's gradients with FSDP over dp."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from utils import make_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PP * DP, timeout=timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    M = min(args.microbatches)
    data = make_workload("gpt-cpu", text=text_path, dropout=0).train_set
    batch = [torch.stack(tensors) for tensors in zip(*(data[i] for i in range(M * DP)))]  # M x DP sequences
    checks = gathered_checks({schedule: gradient_check(schedule, M, batch, text_path, mesh, mesh["dp"])
                              for schedule in args.schedules if schedule in PLAIN})
    if rank == 0:
        Path(result_path).write_text(json.dumps(checks))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()


def memory_worker(rank, args, text_path, result_path):
    """Parts 2 and 3 on a tp group of TP ranks."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import one_mesh
    import tensor_parallel
    from utils import make_workload
    from utils.memory import saved_for_backward

    torch.set_num_threads(1)
    quiet_dtensor()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=TP, timeout=timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (1, 1, TP), mesh_dim_names=("pp", "dp", "tp"))
    folder = Path(result_path).parent
    clock, saved, runs = [], {}, {}  # every timed step's seconds, in the order take_turns runs them
    for checkpoint in (False, True):
        trainer = step11_trainer(mesh, args.ac_microbatches, args.ac_batch, text_path, folder, checkpoint)
        source, targets = next(iter(trainer.train_data))
        counted = saved_for_backward()
        trainer._run_batch(source, targets, counted)  # one step, its activations counted
        saved["ac" if checkpoint else "no ac"] = counted.bytes

        def step(source, targets, trainer=trainer):
            began = time.perf_counter()
            trainer._run_batch(source, targets, contextlib.nullcontext())
            clock.append(time.perf_counter() - began)

        runs["ac" if checkpoint else "no ac"] = trainer.train_data, step
    # One block, split by either plan; its input as the layer before hands it over: 1/TP of the positions (sequence
    # parallel) or all of them (step 7).
    gpt = make_workload("gpt-cpu", text=text_path, dropout=0).model
    block, config = gpt.block0, gpt.config
    for name, plan, positions in [("sp", one_mesh.PLAN, config.context // TP),
                                  ("step 7", tensor_parallel.PLAN, config.context)]:
        split = parallelize_module(copy.deepcopy(block), mesh["tp"], plan)
        torch.manual_seed(SEED)
        inputs = torch.randn(args.ac_batch, positions, config.n_embd, requires_grad=True)
        with saved_for_backward() as counted:
            output = split(inputs)
            output.backward(torch.ones_like(output))
        saved[name] = counted.bytes

        def step(source, targets, split=split, inputs=inputs):
            began = time.perf_counter()
            output = split(inputs)
            output.backward(torch.ones_like(output))
            clock.append(time.perf_counter() - began)

        runs[name] = [(None, None)] * args.steps, step
    steps = pipeline_bubble.take_turns(runs, args)
    if rank == 0:
        Path(result_path).write_text(json.dumps(dict(saved=saved, seconds={key: min(clock[n] for n in numbers)
                                                                           for key, numbers in steps.items()})))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()


def plan_layouts():
    """Part 4's layouts of 8 ranks (tools/memory_plan.Layout): the tests' mesh; two rounds of micro-batches in bf16
    with checkpointing (both stages' gradients accumulating at once); FSDP alone, as the page's 8B verdict, in bf16
    with checkpointing, 8 micro-batches of one sequence; tp 4, which cuts a vocabulary of 57 into 15, 15, 15 and 12."""
    from tools.memory_plan import Layout

    return {"pp 2 x dp 2 x tp 2": Layout(2, 2, 2, batch_size=4, microbatches=2),
            "pp 2 x dp 2 x tp 2, M 4, bf16, AC": Layout(2, 2, 2, 8, 4, "bf16", checkpoint_activations=True),
            "pp 1 x dp 8, M 8, bf16, AC": Layout(1, 8, 1, 8, 8, "bf16", checkpoint_activations=True),
            "pp 1 x dp 2 x tp 4": Layout(1, 2, 4, batch_size=4, microbatches=2)}


# What a rank holds, by what holds it (a storage seen in two of them counts in the first): FSDP's unsharded weights
# and gradients, AdamW's state, the gradients' shards, the last stage's logits the schedule keeps, the pipeline's
# receive buffers and sent tensors, what autograd keeps for backward. The rest is "temporary".
CATEGORIES = ("gathered", "optim", "grads", "logits", "pipeline", "saved")


class MemoryTimeline:
    """Every byte one rank of one_mesh.Trainer allocates in its steps, by what holds it, over time. torch's profiler
    (profile_memory=True) records each allocation and free of the CPU allocator with its address; at marks between the
    schedule's passes (before and after each stage's forward, backward and gradient reduction, and when the logits'
    gradient is made) the storages the step holds are named by what holds them: FSDP's state, the optimizer's, the
    stages' buffers, caches and sent tensors, and autograd's saved tensors (a saved-tensor hook keeps a weak reference
    to each). Replayed (replay()), each allocation takes the category it was seen in at a mark; one never
    seen there is a temporary. torch has no allocator statistics on CPU; this is the CPU's equivalent of
    torch.cuda.max_memory_allocated, split by holder.

    The profiler sees the allocations and frees of the thread that runs the step: a buffer that gloo's thread frees
    last (a collective's input, say) shows no free. Such an allocation, if no tensor holds its storage at the end of
    the step (a scan of the garbage collector's tensors), is counted freed at the mark after it was made, and one
    whose address is allocated again before that is freed then: an upper bound, for buffers a pass's collectives use."""

    def __init__(self, trainer):
        import weakref

        self.trainer, self.marks, self.sent, self.saved = trainer, [], [], weakref.WeakValueDictionary()
        self.profiler, self.patched, self.packed = None, [], 0

    def __enter__(self):
        import torch
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining import stage as stage_module
        from torch.profiler import ProfilerActivity, profile

        def around(owner, name, labelled):
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                self.mark(f"before {labelled(*args)}")
                result = original(*args, **kwargs)
                self.mark(f"after {labelled(*args)}")
                return result

            self.patched.append((owner, name, original))
            setattr(owner, name, wrapper)

        for name in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad"):
            around(stage_module._PipelineStageBase, name,
                   lambda stage, *args, name=name: f"{name} {stage.stage_index} {args[:1]}")

        # The schedule's sends: it waits for them at the step's end only, and holds their tensors until then.
        def noting_sends(ops, *args, original=schedules._batch_p2p, **kwargs):
            self.sent.extend(op.tensor for op in ops if op.op in (torch.distributed.isend, torch.distributed.send))
            return original(ops, *args, **kwargs)

        self.patched.append((schedules, "_batch_p2p", schedules._batch_p2p))
        schedules._batch_p2p = noting_sends

        # The loss's backward ends when the logits' gradient is made: the window of its temporaries.
        def marked_loss(output, target, original=self.trainer.pipeline._loss_fn):
            output.register_hook(lambda gradient: self.mark("logits' gradient"))
            return original(output, target)

        self.patched.append((self.trainer.pipeline, "_loss_fn", self.trainer.pipeline._loss_fn))
        self.trainer.pipeline._loss_fn = marked_loss
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with kineto_quiet():
            self.profiler.__enter__()
        return self

    def __exit__(self, *error):
        import torch

        with kineto_quiet():
            self.profiler.__exit__(*error)
        for owner, name, original in reversed(self.patched):
            setattr(owner, name, original)
        self.events = []

        def walk(nodes):
            for node in nodes:
                if node.typed[0] == torch._C._profiler._EventType.Allocation and node.typed[1].device.type == "cpu":
                    self.events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].ptr, None))
                elif node.name.startswith("mark "):
                    self.events.append((node.start_time_ns, 0, None, int(node.name.split()[1])))
                walk(node.children)

        walk(self.profiler.profiler.kineto_results.experimental_event_tree())
        self.events.sort(key=lambda event: event[0])

    def step(self, source, targets):
        """One step of the Trainer, from a mark "start" to a mark "end" (with the scan for buffers freed elsewhere)."""
        import torch

        self.mark("start")
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.trainer._run_batch(source, targets, hooks)
        # The schedule waited for its sends at the step's end.
        self.sent.clear()
        self.mark("end", scan=True)

    def _pack(self, tensor):
        import torch

        # A weight, or a view of one, is not an activation (as utils.memory.saved_for_backward).
        if not isinstance(tensor if tensor._base is None else tensor._base, torch.nn.Parameter):
            self.packed += 1
            self.saved[self.packed] = tensor
        return tensor

    def mark(self, label, scan=False):
        """Name the storages the step holds now, and put a mark for them in the profiler's record."""
        import gc

        import torch
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.utils._pytree import tree_leaves

        seen = {}

        def note(tensors, category):
            for tensor in (t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)):
                address, size = storage_of(tensor)
                if size and CATEGORIES.index(seen.get(address, category)) >= CATEGORIES.index(category):
                    seen[address] = category

        for stage in self.trainer.stages:
            for module in stage.submod.modules():
                group = fully_shard.state(module)._fsdp_param_group if isinstance(module, FSDPModule) else None
                for param in group.fsdp_params if group else []:
                    unsharded = getattr(param, "_unsharded_param", None)
                    note([unsharded, getattr(unsharded, "grad", None),
                          getattr(param, "unsharded_accumulated_grad", None)], "gathered")
            infos = [*stage.args_recv_info.values(), *getattr(stage, "grad_recv_info", {}).values()]
            note([info.buffer for recv in infos for info in recv if hasattr(info, "buffer")], "pipeline")
            outputs = [output for output, _ in stage.fwd_cache.values()]
            note([outputs, stage.output_chunks], "logits" if stage.is_last else "pipeline")
            note(list(stage.bwd_cache.values()), "pipeline")
        note([p.grad for p in self.trainer.model.parameters()], "grads")
        note(list(self.trainer.optimizer.state.values()), "optim")
        note(self.sent, "pipeline")
        note(list(self.saved.values()), "saved")
        alive = None
        if scan:
            alive = set()
            for thing in gc.get_objects():
                if issubclass(type(thing), torch.Tensor):
                    # A tensor without a storage of its own (sparse, or a wrapper of others) has nothing to add.
                    try:
                        address, size = storage_of(thing)
                    except Exception:
                        continue
                    if size:
                        alive.add(address)
        with torch.profiler.record_function(f"mark {len(self.marks)}"):
            self.marks.append(dict(label=label, seen=seen, alive=alive))

    def figures(self, step, batch_bytes, params_bytes):
        """Step `step`'s (0: the first) peaks, in bytes: each category's; `held`, all categories together at a mark
        between passes, at most; `total`, everything at any moment; `loss`, the most the memory rose from the start of
        the last stage's backward until the logits' gradient was made. The step's ids and targets (batch_bytes) and
        the parameters' shards (params_bytes), there before the profiler started, are added to held and total."""
        timeline = replay(self.events, self.marks)
        starts = [i for i, (label, _) in enumerate(timeline) if label == "start"]
        ends = [i for i, (label, _) in enumerate(timeline) if label == "end"]
        window = timeline[starts[step]:ends[step] + 1]
        everything = [sum(sums.values()) for _, sums in window]
        result = {category: max(sums[category] for _, sums in window) for category in CATEGORIES}
        result["held"] = (max(sum(sums[c] for c in CATEGORIES) for label, sums in window if label) + batch_bytes
                          + params_bytes)
        result["total"] = max(everything) + batch_bytes + params_bytes
        result["loss"], backward = 0, None
        for i, (label, _) in enumerate(window):
            if label and label.startswith("before backward"):
                backward = i
            if label == "logits' gradient":
                result["loss"] = max(result["loss"], max(everything[backward:i + 1]) - everything[backward])
        return result


@contextlib.contextmanager
def kineto_quiet():
    """The process's stderr (file descriptor 2) to /dev/null while the profiler starts or stops: its C++ library
    writes a line each time on CPU-only machines (a start, a stop, no GPU found), eight processes' worth per layout."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def storage_of(tensor):
    """(address, bytes) of the storage behind `tensor` on this rank: a DTensor's local part, an all-gather's result
    once it arrived; (None, 0) for a tensor without memory."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local = local.wait() if hasattr(local, "wait") else local
    if local.device.type == "meta":
        return None, 0
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def replay(events, marks):
    """[(a mark's label or None, {category: bytes held})] after each of MemoryTimeline's events (time, bytes allocated
    (negative: freed), address, mark index): an allocation takes the first category (CATEGORIES' order) it was seen in
    at a mark while it lived, else "temporary"; one whose free the profiler did not see (another thread freed it) ends
    when its address is allocated again or, if nothing holds its storage at the next scan, at the first mark after it
    was made."""
    live, allocations, mark_positions = {}, [], []
    # The first pass gives each allocation its category and its end.
    for position, (_, size, address, mark) in enumerate(events):
        if mark is not None:
            mark_positions.append(position)
            for seen_address, category in marks[mark]["seen"].items():
                allocation = allocations[live[seen_address]] if seen_address in live else None
                if allocation and (allocation["category"] is None
                                   or CATEGORIES.index(category) < CATEGORIES.index(allocation["category"])):
                    allocation["category"] = category
            if marks[mark]["alive"] is not None:
                for gone in [address for address in live if address not in marks[mark]["alive"]]:
                    allocation = allocations[live.pop(gone)]
                    allocation["end"] = next(p for p in mark_positions if p > allocation["start"])
        elif size > 0:
            if address in live:
                allocations[live[address]]["end"] = position
            live[address] = len(allocations)
            allocations.append(dict(size=size, start=position, end=None, category=None))
        elif address in live:
            allocations[live.pop(address)]["end"] = position
    # The second pass adds them up, event by event.
    starting, ending = {}, {}
    for allocation in allocations:
        starting[allocation["start"]] = allocation
        if allocation["end"] is not None:
            ending.setdefault(allocation["end"], []).append(allocation)
    sums, timeline = {category: 0 for category in (*CATEGORIES, "temporary")}, []
    for position, (_, _, _, mark) in enumerate(events):
        for allocation in ending.get(position, []):
            sums[allocation["category"] or "temporary"] -= allocation["size"]
        if position in starting:
            sums[starting[position]["category"] or "temporary"] += starting[position]["size"]
        timeline.append((None if mark is None else marks[mark]["label"], dict(sums)))
    return timeline


def plan_worker(rank, args, text_path, result_path):
    """Part 4 on 8 ranks: for each layout of plan_layouts(), one_mesh.py's Trainer as its main() builds it, two
    steps on one batch measured by MemoryTimeline (the second one's figures: the first allocates the schedule's
    buffers and AdamW's state), then a third step's collectives counted (benchmarks/communication.py's counter)."""
    import contextlib
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from utils.traffic import counting_collectives, named_groups, sent_per_rank
    from utils.memory import state_bytes

    torch.set_num_threads(1)
    quiet_dtensor()
    # Under CommDebugMode's module tracker FSDP warns that a layer returns a view, as in benchmarks/communication.py.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=8, timeout=timedelta(seconds=args.timeout))
    measured = {}
    for name, layout in plan_layouts().items():
        mesh = init_device_mesh("cpu", (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
        trainer = step11_trainer(mesh, layout.microbatches, layout.batch_size, text_path, Path(result_path).parent,
                                 layout.checkpoint_activations, layout.precision)
        source, targets = next(iter(trainer.train_data))
        with MemoryTimeline(trainer) as timeline:
            for _ in range(2):
                timeline.step(source, targets)
        figures = timeline.figures(1, source.nbytes + targets.nbytes,
                                   state_bytes(trainer.model, trainer.optimizer)["params"])
        # Every process group this rank is in, named after the mesh dimension of the same ranks (utils.traffic).
        groups = named_groups({dim: mesh[dim].get_group() for dim in ("tp", "dp", "pp")})
        with counting_collectives(groups) as counting:
            trainer._run_batch(source, targets, contextlib.nullcontext())
        for dim in ("pp", "dp", "tp"):
            figures[f"{dim}_bytes"] = round(sum(sent_per_rank(c) for c in counting.collectives if c["group"] == dim))
        measured[name] = dict(figures, **trainer.held)
        # The layout's tensors are freed before the next layout is measured.
        del trainer, timeline
        gc.collect()
    everyone = [None] * 8
    dist.all_gather_object(everyone, measured)
    if rank == 0:
        Path(result_path).write_text(json.dumps({name: [mine[name] for mine in everyone] for name in measured}))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()


def by_window(records, windows):
    """{n: the passes of measured step n}: `windows` holds, per step, each rank's (start, end) of it."""
    return {n: sorted((record for record in records if ranks[record["rank"]][0] <= record["began"]
                       and record["ended"] <= ranks[record["rank"]][1]), key=lambda record: record["began"])
            for n, ranks in enumerate(windows)}


def by_rank(events):
    """A step's events with each pass on its rank's row: pipeline_timeline measures rows by their "stage"."""
    return [dict(event, stage=event["rank"]) for event in events]


def summary(schedule, M, steps):
    """The fastest step of one configuration (other work on the machine only ever slows a step down), its figures."""
    spans = {number: pipeline_timeline.idle(events)[0] for number, events in steps.items()}
    fastest = steps[min(spans, key=spans.get)]
    span, idles = pipeline_timeline.idle(by_rank(fastest))
    stages = {rank: sorted({event["stage"] for event in fastest if event["rank"] == rank}) for rank in range(PP)}
    per_rank = 1 if schedule == "1f1b" else 2
    return dict(schedule=schedule, M=M, ms=span * 1e3, idle=idles, stages=stages,
                passes=sum(event["rank"] == 0 for event in fastest),
                busy=statistics.mean(span * (1 - fraction) for fraction in idles.values()) * 1e3,
                formula=None if schedule in ZERO_BUBBLE else pipeline_timeline.bubble(PP, M, per_rank),
                mean_idle=statistics.mean(idles.values()))


def pipeline_table(rows):
    yardstick = {row["M"]: row["ms"] for row in rows if row["schedule"] == "1f1b"}
    lines = ["| schedule | stages | M | passes | step ms | vs 1f1b | busy ms | idle rank 0 | idle rank 1 | formula |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        stages = " / ".join(" ".join(map(str, r["stages"][rank])) for rank in range(PP))
        versus = f"{r['ms'] / yardstick[r['M']]:.2f}x" if r["M"] in yardstick else "-"
        formula = "-" if r["formula"] is None else f"{r['formula']:.0%}"
        lines.append(f"| {r['schedule']} | {stages} | {r['M']} | {r['passes']} | {r['ms']:.0f} | {versus} | "
                     f"{r['busy']:.0f} | {r['idle'][0]:.0%} | {r['idle'][1]:.0%} | {formula} |")
    return "\n".join(lines)


def check_lines(checks, where):
    """One line per schedule: do its gradients match one process's, and does every parameter get one?"""
    return [f"{schedule} ({PLAIN[schedule]}), {where}: gradients within {worst:.1e} of one process's; "
            + (f"NO gradient for {', '.join(missing)}" if missing else "every parameter has one")
            for schedule, (worst, missing) in checks.items()]


def report_pipeline(measured, checks, fsdp_checks=None):
    """Part 1 from the recorded steps of each configuration ([(schedule, M, {step: events})]) and the gradient
    checks ({schedule: (worst, missing)})."""
    rows = [summary(*configuration) for configuration in measured]
    rows.sort(key=lambda row: (row["M"], SCHEDULES.index(row["schedule"])))
    print(f"\n1. The bubble: {PP} pipeline ranks\n\n{pipeline_table(rows)}\n")
    for schedule in SCHEDULES:
        mine = [row for row in rows if row["schedule"] == schedule]
        if mine:
            print(f"{schedule}: mean idle " + ", ".join(
                f"M={r['M']} {r['mean_idle']:.0%}" + ("" if r["formula"] is None else f" (formula {r['formula']:.0%})")
                for r in mine))
    print()
    print(*check_lines(checks, f"pp {PP}"), sep="\n")
    if fsdp_checks is not None:
        print(*check_lines(fsdp_checks, f"pp {PP} x dp {DP} under FSDP"), sep="\n")


def report_memory(result):
    """Parts 2 and 3 from the memory job's {saved: {key: bytes}, seconds: {key: fastest}}."""
    saved, seconds = result["saved"], result["seconds"]
    print(f"\n2. Activation checkpointing: pp 1 x dp 1 x tp {TP}, one step\n\n| checkpoint_activations | saved MiB | "
          "step ms |\n|---|---:|---:|")
    for key, label in [("no ac", "no"), ("ac", "yes")]:
        print(f"| {label} | {saved[key] / MiB:.2f} | {seconds[key] * 1e3:.0f} |")
    print(f"\nactivation checkpointing keeps {saved['ac'] / saved['no ac']:.2f}x the activations "
          f"({(saved['no ac'] - saved['ac']) / MiB:.2f} MiB less per rank) for {seconds['ac'] / seconds['no ac']:.2f}x "
          "the step time")
    print(f"\n3. Sequence parallelism: one block at tp {TP}, one forward and backward\n\n| plan | saved MiB | ms |"
          "\n|---|---:|---:|")
    for key, label in [("step 7", "step 7 (tensor_parallel.PLAN)"), ("sp", "sequence parallel (one_mesh.PLAN)")]:
        print(f"| {label} | {saved[key] / MiB:.2f} | {seconds[key] * 1e3:.1f} |")
    print(f"\nsequence parallelism keeps {saved['sp'] / saved['step 7']:.2f}x step 7's activations per rank "
          f"({(saved['step 7'] - saved['sp']) / MiB:.2f} MiB less) in {seconds['sp'] / seconds['step 7']:.2f}x its "
          "time")


def report_plan(result, text_path):
    """Part 4: each rank's measured figures, layout by layout, against tools/memory_plan.py's plan of the layout."""
    from tools.memory_plan import config_of, plan

    config = config_of("cpu", text_path)
    columns = "gathered peak_act logits pipeline held loss total pp_bytes dp_bytes tp_bytes".split()
    measured_as = dict(peak_act="saved")
    differences = {column: [] for column in columns}
    print("\n4. The memory plan, measured: one_mesh.py's Trainer on 8 ranks, its second step (KiB per rank, the most "
          "at once; a difference from tools/memory_plan.py's figure in bytes after it, if any)")
    for name, ranks in result.items():
        layout = plan_layouts()[name]
        print(f"\n{name}, {layout.batch_size} sequences per dp rank\n\n| rank | " + " | ".join(columns) + " |\n|"
              + "---:|" * (len(columns) + 1))
        for row, figures in zip(plan(config, layout, device="cpu"), ranks):
            cells = []
            for column in columns:
                measured, planned = figures[measured_as.get(column, column)], row[column]
                differences[column].append((measured - planned, row, figures))
                cells.append(f"{measured / 1024:.2f}" + (f" ({measured - planned:+d})" if measured != planned else ""))
            print(f"| {row['rank']} | " + " | ".join(cells) + " |")
    ranks = len(differences["held"])
    print(f"\nover the {ranks} ranks of the {len(result)} layouts, measured - planned:")
    for column in ("gathered", "peak_act", "logits", "pipeline", "held"):
        spread = [difference for difference, _, _ in differences[column]]
        print(f"  {column}: {min(spread):+d} to {max(spread):+d} bytes")
    # The loss's temporaries: a few numbers a position beside the logits' slices; per position, of the ranks that hold
    # the head.
    layouts = [plan_layouts()[name] for name in result for _ in result[name]]
    per_position = [difference / (layout.batch_size // layout.microbatches * config.context)
                    for (difference, row, _), layout in zip(differences["loss"], layouts) if "head" in row["layers"]]
    print(f"  loss: {min(per_position):+.1f} to {max(per_position):+.1f} bytes a position")
    shares = [difference / row["pass_temporaries"] for difference, row, _ in differences["total"]]
    print(f"  total: {min(shares):.2f} to {max(shares):.2f} of the temporaries a pass may hold beyond the plan (a "
          "block's activations and the rank's largest layer gathered)")
    for column in ("pp_bytes", "dp_bytes", "tp_bytes"):
        spread = [difference for difference, _, _ in differences[column]]
        print(f"  {column}: {min(spread):+d} to {max(spread):+d} bytes")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=positive_int, nargs="+", default=[2, 4, 8],
                        help="values of M, multiples of 2 (default 2 4 8)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=SCHEDULES,
                        help="the pipeline schedules to run (default all; 1f1b is the yardstick)")
    parser.add_argument("--batch_size", type=positive_int, default=128,
                        help="sequences per pipeline step (default 128)")
    parser.add_argument("--ac_batch", type=positive_int, default=32,
                        help="sequences per step of parts 2 and 3 (default 32)")
    parser.add_argument("--ac_microbatches", type=positive_int, default=2, help="M of part 2 (default 2)")
    parser.add_argument("--steps", type=positive_int, default=3, help="steps per turn (default 3)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="measured rounds (default 2)")
    parser.add_argument("--chars", type=positive_int, default=30000,
                        help="characters of Python's help pages to train on (default 30000)")
    parser.add_argument("--parts", nargs="+", choices=["pipeline", "memory", "plan"], default=["pipeline", "memory"],
                        help="part 1 (pipeline), parts 2 and 3 (memory), part 4 (plan: 8 processes); default: "
                             "pipeline memory")
    parser.add_argument("--plan_json", type=Path, help="also write part 4's measured figures to this file")
    parser.add_argument("--zero_bubble_fsdp", action="store_true",
                        help=f"also check the zero-bubble schedules' gradients under FSDP ({PP * DP} processes)")
    parser.add_argument("--timeout", type=positive_int, default=600, help="seconds each job may take")
    args = parser.parse_args()
    if any(M % PP or args.batch_size % M for M in args.microbatches):
        sys.exit(f"error: every M must be a multiple of {PP} and divide --batch_size {args.batch_size}")
    if args.ac_batch % args.ac_microbatches:
        sys.exit(f"error: --ac_microbatches {args.ac_microbatches} must divide --ac_batch {args.ac_batch}")

    from utils import make_workload
    from utils.gpt import help_pages

    timed = {"pipeline", "memory"} & set(args.parts)
    print("The CPU-size GPT, gloo, one CPU thread per process; " + (
        f"batches of {args.batch_size} (pipeline) and {args.ac_batch} (memory) sequences of 64 characters, "
        f"{args.steps} steps x {args.rounds} rounds per configuration, " if timed else "")
        + f"the first {args.chars} characters of the help pages; on {machine_summary()}", flush=True)
    # The steps' per-rank metrics files are not wanted here, and the GPT trains without dropout whatever is set.
    for variable in ("TUTORIAL_RUN_DIR", "TUTORIAL_GPT_DROPOUT"):
        os.environ.pop(variable, None)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        text_path = Path(scratch) / "help_pages.txt"
        text_path.write_text(help_pages()[:args.chars])
        sequences = len(make_workload("gpt-cpu", text=str(text_path)).train_set)
        if timed and max(args.batch_size, args.ac_batch) * args.steps > sequences:
            sys.exit(f"error: --chars {args.chars} make {sequences} training sequences: fewer than --steps batches")
        if "pipeline" in args.parts:
            result, records = pipeline_bubble.recorded(pipeline_worker, (args, str(text_path)), PP, args.timeout,
                                                       scratch, "the pipeline part of the one-mesh benchmark")
            # The jobs below record nothing: the recorder's hooks around each pass would hide the ones they count.
            os.environ.pop("JOB_RECORD_DIR")
            fsdp_checks = None
            if args.zero_bubble_fsdp:
                os.environ["MASTER_PORT"] = str(free_port())
                fsdp_checks = spawned_result(fsdp_worker, (args, str(text_path)), PP * DP, args.timeout,
                                             "the zero-bubble check under FSDP")
            report_pipeline([(schedule, M, by_window(records, windows))
                             for schedule, M, windows in result["configurations"]], result["checks"], fsdp_checks)
        if "memory" in args.parts:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                              CUDA_VISIBLE_DEVICES="")
            report_memory(spawned_result(memory_worker, (args, str(text_path)), TP, args.timeout,
                                         "the memory part of the one-mesh benchmark"))
        if "plan" in args.parts:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                              CUDA_VISIBLE_DEVICES="")
            measured = spawned_result(plan_worker, (args, str(text_path)), 8, args.timeout,
                                      "the memory plan part of the one-mesh benchmark")
            if args.plan_json:
                args.plan_json.write_text(json.dumps(measured))
            report_plan(measured, str(text_path))
    print(f"\n{time.perf_counter() - began:.0f} s; at the end: {machine_summary()}")


if __name__ == "__main__":
    main()
