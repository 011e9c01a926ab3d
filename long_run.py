"""Step 12 - the long run: step 11's mesh trained for a number of optimizer steps on token files read from disk, in
global batches that stay the same on any layout, with snapshots every N steps that resume anywhere, on any layout.

    python tools/prepare_data.py data/help --workload gpt-gpu      # once: the help pages as token files

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        long_run.py 5000 500 --pp 2 --tp 8     # the same command on every node; HEAD: the first node
"""
import argparse
import contextlib
import itertools
import os
import time
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

from utils import (SEED, WORKLOADS, attempt_store, being_written, configure_cpu_threads, dcp_folder, errors_said_once,
                   exists_on_any_rank, exit_without_teardown, log_rank_metrics, mesh_with_timeout, non_negative_int,
                   positive_int, remove, replacing, require_epochs_left, require_same_arguments, require_same_start,
                   require_torchrun, require_written_by, said_once_per_node, snapshot_folder, snapshot_to_resume,
                   step_snapshot, stop_if_unloadable, watch_this_worker, whole_snapshots)
from utils.data import HeldOut, IGNORE, Shares, TokenFile, batch_range, model_of, skip_range, token_loss
from utils.loop import WarmupCosine, add_gpt_arguments, check_options, generate, mfu
from utils.memory import saved_for_backward, state_bytes
from utils.pipeline import exported, held_out_loss, require_mesh_fits, stage_io
from utils.snapshot_reader import SnapshotReader, load_seed_checkpoint

# The optimizer's state saved weight by weight, under the weights' names, its settings too (block3.mlp.fc.weight's
# lr): the ranks' optimizers hold different weights, whose lists would collide in the one snapshot of the model.
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
# Step 7's plan with sequence parallelism: between the matrices each tp rank holds 1/tp of the positions (the norms and
# dropouts work on them alone); the matrices' inputs are all-gathered, their outputs reduce-scattered back to 1/tp.
PLAN = {"norm1": SequenceParallel(), "norm2": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
        "attention.proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}
# The embeddings split by rows (each rank looks up the ids in its part) and their sums reduce-scattered over the
# positions; the head's logits left split over the vocabulary: loss_parallel computes the loss without gathering them.
EDGES = {"embed.token": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
         "embed.position": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
         "head.norm": SequenceParallel(),
         "head.linear": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def ddp_setup(timeout_s):
    # torchrun has set LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each process it started.
    if torch.cuda.is_available():
        # Before the process group forms: each process its own GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # The processes meet in torchrun's store, under keys of this attempt's own: after a restart the keys of the
    # workers that died are still there (docs/steps.md explains). A collective stuck past the timeout fails.
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", store=attempt_store(timeout_s),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=timeout_s))


class Trainer:
    def __init__(self, model, stages, train_data, held_out, optimizer, device, save_every, snapshot_path, resume, args,
                 mesh):
        # LOCAL_RANK numbers the processes of this node (it picks the GPU); RANK numbers those of the whole job.
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.held_out = held_out
        self.optimizer = optimizer
        self.save_every = save_every
        self.args = args
        self.mesh = mesh
        self.schedule = WarmupCosine(args.total_steps)  # warm-up, then a cosine
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)  # None: fp32
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        # The snapshot being written, while a save is under way: its folder, its step, and an asynchronous save's
        # future (None for a save written at once).
        self.saving_to = None
        self.saving_step = None
        self.saving_future = None
        # An asynchronous save writes in a thread, over a process group of its own: its collectives never meet the
        # training's in one queue. They too give up after --timeout.
        saver_timeout = timedelta(seconds=args.timeout)
        self.saver = dist.new_group(backend="gloo", timeout=saver_timeout) if args.async_save else None
        # Where the run is: the optimizer steps taken, the next global batch of the data (its cursor), the tokens
        # trained on, the batches --skip left out. That is all a resume needs to go on, on any number of ranks.
        self.steps_run = 0
        self.next_batch = 0
        self.tokens = 0
        self.skipped = ""
        # DCP's load is a collective: if any rank finds the snapshot to go on from, all of them load it.
        if exists_on_any_rank(resume, device):
            self._load_snapshot(resume)
        # Each node read the snapshot from its own disk.
        require_same_start(self.steps_run, device, unit="steps")
        # Two stages on each rank, rank r holding stages r and r + pp: each micro-batch passes every rank twice, so the
        # pipeline fills in half the time (the bubble halves) for twice the sends.
        M = args.microbatches
        pp = mesh["pp"]
        self.stages = []
        for index, part in stages:
            inputs, outputs = stage_io(model, train_data.share // M, index, 2 * pp.size(), self.dtype,
                                       mesh["tp"].size())
            self.stages.append(PipelineStage(part, index, 2 * pp.size(), device, inputs, outputs, group=pp.get_group()))
        # Each micro-batch's loss summed over its tokens, times dp over the tokens that count in the whole global batch:
        # FSDP averages the gradients over dp, so the step's is that of the mean over every token the batch counts.
        self.pipeline = ScheduleInterleaved1F1B(self.stages, M, loss_fn=lambda out, y: token_loss(out, y) * self.scale)
        # The losses are scaled above, on every torch version.
        self.pipeline.scale_grads = False
        # TensorBoard's scalars, written by rank 0 (`tensorboard --logdir runs`); a resume writes over what a killed
        # attempt wrote after its snapshot's step (what it wrote up to that step was on disk before the snapshot).
        self.board = SummaryWriter(args.logdir, purge_step=self.steps_run + 1) if self.global_rank == 0 else None

    def _load_snapshot(self, path):
        with stop_if_unloadable(path):
            # Read once, as data only: a planted folder runs no code.
            reader = SnapshotReader(path)
            require_written_by("long_run.py", path, reader)
            # Each rank reads its own shards of its own layers, by their names: from a snapshot of any mesh.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
            snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                            SCHEDULER_STATE=self.scheduler.state_dict(), STEPS_RUN=0, NEXT_BATCH=0, TOKENS=0,
                            SKIPPED="", GLOBAL_BATCH=0)
            dcp.load(snapshot, storage_reader=reader)  # fills the tensors above in place
            # The cursor counts global batches of the snapshot's size: another size would read other rows.
            if snapshot["GLOBAL_BATCH"] != self.args.global_batch:
                raise SystemExit(f"error: {path} was trained in global batches of {snapshot['GLOBAL_BATCH']} "
                                 f"sequences, not --global_batch {self.args.global_batch}'s: resume it with its own")
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                           options=BY_NAME)
            self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
            self.steps_run = snapshot["STEPS_RUN"]
            self.next_batch = snapshot["NEXT_BATCH"]
            self.tokens = snapshot["TOKENS"]
            self.skipped = snapshot["SKIPPED"]
        self.schedule.resume(self.scheduler.last_epoch, self.args.total_steps - self.steps_run)
        print(f"{self.tag} resuming from step {self.steps_run} at global batch {self.next_batch}, restart "
              f"{os.environ['TORCHELASTIC_RESTART_COUNT']}")

    def _run_batch(self, source, targets, counted, saved):
        # The schedule runs the micro-batches' forwards and backwards through both stages of every rank; the logits
        # stay split over the vocabulary, so the loss and its gradient are computed inside loss_parallel.
        inputs = [source] if self.stages[0].is_first else []
        last = any(stage.is_last for stage in self.stages)
        target = targets if last else None
        losses = []
        # What the pipeline's loss_fn (made in __init__) multiplies each micro-batch's summed loss by.
        self.scale = self.mesh["dp"].size() / counted
        with loss_parallel(), saved:
            self.pipeline.step(*inputs, target=target, losses=losses)
        # Clip by the norm of the whole model's gradient: the stages add up their squared norms along the pipeline.
        # Each weight is a DTensor: its norm is over its mesh (dp x tp) already.
        parameters = list(self.model.parameters())
        squares = torch.nn.utils.get_total_norm([p.grad for p in parameters]).full_tensor() ** 2
        dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        torch.nn.utils.clip_grads_with_norm_(parameters, self.args.grad_clip, squares.sqrt())
        self.optimizer.step()
        # The weights, gradients and Adam's state this rank holds.
        self.held = state_bytes(self.model, self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # This dp rank's share of the batch's loss, summed over its tokens; None on the stages without the losses.
        return sum(loss.full_tensor() for loss in losses).detach() / self.scale if losses else None

    def _run_steps(self, steps, batches, total_steps):
        # A window of --log_every steps, as step 11's epoch: a line with its mean loss over every token it counted.
        start = time.perf_counter()
        # [summed loss, tokens that count], kept on the device.
        totals = torch.zeros(2, device=self.device)
        # The activations of the window's first step, measured.
        saved = saved_for_backward()
        for step, (batch, (source, targets)) in enumerate(itertools.islice(batches, steps)):
            # Dropout seeded anew each step by the step and the rank: every rank drops in its own positions or heads.
            torch.manual_seed(hash((SEED, self.steps_run, self.global_rank)))
            source, targets = source.to(self.device), targets.to(self.device)
            # The tokens that count in the whole global batch, the loss's divisor: each dp rank read its share alone.
            counted = (targets != IGNORE).sum()
            dist.all_reduce(counted, group=self.mesh["dp"].get_group())
            loss = self._run_batch(source, targets, counted.item(), saved if step == 0 else contextlib.nullcontext())
            self.steps_run += 1
            self.next_batch = batch + 1
            self.tokens += counted.item()
            # The last stage of each pipeline counts its tokens: once per pipeline, over the ranks.
            if loss is not None and self.mesh["tp"].get_local_rank() == 0:  # its tp ranks have the same loss
                totals[0] += loss
                totals[1] += (targets != IGNORE).sum()
            if self.steps_run % self.args.eval_every == 0 or self.steps_run == total_steps:
                # Before the snapshot of these weights, which a resume goes on from.
                self._evaluate()
            if self.steps_run % self.save_every == 0 or self.steps_run == total_steps:
                self._save_snapshot()  # sharded: every rank writes its part
            if self.saving_future is not None and self.saving_future.done():
                # The snapshot written in the background is whole: it becomes the last one.
                self._finish_save()
        log_rank_metrics(None, steps, totals, start, step=self.steps_run, unit="tokens", activation_bytes=saved.bytes,
                         **self.held)
        # Summed over the ranks: the loss below is their mean.
        dist.all_reduce(totals)
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        # Held-out losses and snapshots included: the run's pace, which the time left is computed from.
        seconds = time.perf_counter() - start
        tokens_per_s = totals[1].item() / seconds  # the whole job's
        utilisation = mfu(self.model, tokens_per_s, self.device, self.args.peak_tflops)
        # The MFU where the device's peak is known (a GPU's, or --peak_tflops).
        mfu_text = f" | MFU {utilisation:.1%}" if utilisation else ""
        minutes_left = seconds / steps * (total_steps - self.steps_run) / 60
        if self.global_rank == 0:
            print(f"{self.tag} step {self.steps_run}/{total_steps} | {self.tokens:,} tokens | loss {mean_loss:.4f} | "
                  f"{tokens_per_s:,.0f} tokens/s{mfu_text} | {minutes_left:.1f} min left")
            scalars = {"loss/train": mean_loss, "tokens_per_s": tokens_per_s,
                       "learning_rate": self.scheduler.get_last_lr()[0]}
            for name, value in scalars.items():
                self.board.add_scalar(name, value, self.steps_run)
            self.board.flush()

    def _evaluate(self, on_board=True):
        # Every rank runs the whole held-out file through the pipeline, its share of each batch: the mean over every
        # held-out token, the same on any layout. The last batch is filled up with rows that count nothing.
        self.scale = 1.0  # each micro-batch's loss summed
        loss = held_out_loss(self.pipeline, self.stages, self.mesh, self.held_out)
        if self.global_rank == 0:
            print(f"{self.tag} step {self.steps_run} | held-out loss {loss:.4f}")
            if on_board:
                self.board.add_scalar("loss/held_out", loss, self.steps_run)
                # On disk before the snapshot of these weights.
                self.board.flush()

    def _save_snapshot(self):
        # All it takes to go on exactly: where the run is in the data (the next global batch), not a rank's place in
        # a sampler. Each rank saves its stages' part under the whole model's names: a snapshot of the model.
        # The save before this one: on disk first.
        self._finish_save()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
        snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                        SCHEDULER_STATE=self.scheduler.state_dict(), STEPS_RUN=self.steps_run,
                        NEXT_BATCH=self.next_batch, TOKENS=self.tokens, SKIPPED=self.skipped,
                        GLOBAL_BATCH=self.args.global_batch, REWOUND_TO=self.args.resume_from or 0, STEP="long_run.py")
        # Every rank writes its shards into one folder of this save's; rank 0 makes it the last snapshot once whole.
        # Until then a Ctrl-C removes it, also while a thread writes it in the background.
        path = step_snapshot(self.snapshot_path, self.steps_run)
        tmp = being_written(f"{path}.{os.environ['TORCHELASTIC_RUN_ID']}.tmp")
        self.saving_to = tmp
        self.saving_step = self.steps_run
        # Copies the state to memory, then writes it in a thread while the training goes on.
        if self.saver:
            self.saving_future = dcp.async_save(snapshot, checkpoint_id=tmp, process_group=self.saver)
        # Written at once, inside replacing(): a save cut short (a full disk) is removed, and said in one line.
        else:
            self._finish_save(snapshot)

    def _finish_save(self, snapshot=None):
        if self.saving_to is None:
            return
        path = step_snapshot(self.snapshot_path, self.saving_step)
        # A kill before this line leaves the last snapshot as it was, never one cut short; the new one, whole.
        with replacing(path, self.saving_to, rename=self.global_rank == 0):
            if self.saving_future is None:
                # A synchronous save: every rank writes its shards now.
                dcp.save(snapshot, checkpoint_id=self.saving_to)
            else:
                # An asynchronous save: wait until every rank wrote.
                self.saving_future.result()
        if self.global_rank == 0:
            for old in whole_snapshots(self.snapshot_path)[:-self.args.keep]:
                remove(old)  # only the last --keep snapshots stay
            print(f"{self.tag} step {self.saving_step} | snapshot saved to {path}")
        self.saving_to = None
        self.saving_future = None

    def train(self, total_steps):
        # The global batches this run reads, from the cursor on, less those --skip names (a line says which).
        numbers, self.skipped = batch_range(self.next_batch, total_steps - self.steps_run, self.args.skip,
                                            self.skipped, say=self.global_rank == 0)
        batches = zip(numbers, prepare_dataloader(self.train_data, numbers, self.args))
        # The held-out loss it starts from; a resume's is on the board already, written before the snapshot was.
        if self.steps_run % self.args.eval_every == 0:
            self._evaluate(on_board=self.steps_run == 0)
        while self.steps_run < total_steps:
            self._run_steps(min(self.args.log_every - self.steps_run % self.args.log_every,
                                total_steps - self.steps_run), batches, total_steps)
        self._finish_save()
        # No rank goes on before the last snapshot is on disk.
        dist.barrier()


def load_train_objs(args):
    # The token files, memory-mapped: read from disk as the batches need them, never held whole. The model on the meta
    # device, of their vocabulary: its shapes, no memory. Each rank gives memory to its own shards only, later.
    model, make_optimizer = model_of(args.data, args.workload, args.dropout)
    return TokenFile(args.data, "train"), TokenFile(args.data, "val"), model, make_optimizer


def parallelize(model, mesh, args):
    """Split the blocks over tp, cut the GPT into 2 x pp stages, two per rank, and shard each rank's layers over dp."""
    parallelize_module(model, mesh["tp"], EDGES)
    layers = [name for name, _ in model.named_children()]  # embed, block0 ... blockN-1, head
    for name in layers[1:-1]:
        parallelize_module(model.get_submodule(name), mesh["tp"], PLAN)
    pp = mesh["pp"].size()
    rank = mesh["pp"].get_local_rank()
    # (index, stage) of this rank's two stages, and the names of the layers they hold.
    stages = []
    mine = []
    # bf16 compute, and the gradients reduce-scattered in fp32 (a bf16 sum over many ranks loses their low bits).
    policy = MixedPrecisionPolicy(torch.bfloat16 if args.precision == "bf16" else None, reduce_dtype=torch.float32)
    for index in (rank, rank + pp):
        keep = layers[index * len(layers) // (2 * pp):(index + 1) * len(layers) // (2 * pp)]
        for name in keep:
            if args.checkpoint_activations and name.startswith("block"):
                # Recompute the block's forward in backward: keep its input, not its activations.
                model.register_module(name, checkpoint_wrapper(model.get_submodule(name)))
            fully_shard(model.get_submodule(name), mesh=mesh["dp"], reshard_after_forward=False, mp_policy=policy)
        # Each stage one FSDP unit over its layers: the schedule has its gradients reduce-scattered in the last
        # micro-batch's backward only, and each layer's weights, gathered in the first forward, kept until then.
        stage = nn.Sequential(OrderedDict((name, model.get_submodule(name)) for name in keep))
        stages.append((index, fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=policy)))
        mine += keep
    # The other ranks' layers.
    for name in layers:
        if name not in mine:
            delattr(model, name)
    return model, stages


def prepare_dataloader(dataset: Dataset, batches, args):
    # The numbers of the global batches to read, in order: the dataset hands this dp rank its share of each. --workers
    # processes read ahead; which rows a batch holds depends on its number alone.
    return DataLoader(dataset, batch_size=None, sampler=batches, num_workers=args.workers,
                      pin_memory=torch.cuda.is_available())


def main(args):
    # Before the process group forms, a mistake that every rank finds alike: one line, said once on each node.
    with said_once_per_node(args.timeout):
        # An option that cannot run here: one line, before anything.
        check_options(args)
        # Whole grids, whole heads, stages, shares.
        require_mesh_fits(args, int(os.environ["WORLD_SIZE"]))
        # The snapshot to go on from: the last one in the folder, or --resume_from's (kept, and no later ones left).
        resume = snapshot_to_resume(args.snapshot_path, args.resume_from)
        train_tokens, held_out_tokens, model, make_optimizer = load_train_objs(args)  # files with sequences in them
    # From here on this worker stops with one line, never a hang or a traceback: the group must form within --timeout,
    # torchrun must stay alive, and Ctrl-C or a collective that gave up ends it (utils/launch.py).
    watch_this_worker(args.timeout)
    ddp_setup(args.timeout)
    # Every node started with the same command?
    require_same_arguments(args)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    # Only this node's processes share its cores.
    configure_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    # pp outermost, tp innermost, as torchtitan orders them: tp's all-gathers in every block need the fastest links
    # (a node's), a pipeline sends one activation per micro-batch between stages (across nodes), and dp's reduce-
    # scatter once a step goes in between.
    shape = (args.pp, dist.get_world_size() // (args.pp * args.tp), args.tp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp", "tp"))
    # The groups it made give up after --timeout too.
    mesh_with_timeout(mesh, args.timeout)
    model, stages = parallelize(model, mesh, args)
    # Memory for this rank's shards alone, then its part of one process's initial weights, drawn again whole on every
    # rank: the same model on any mesh. Or those weights read from a DCP folder of them, each rank its shards.
    model.to_empty(device=device)
    model.init_weights(seed=SEED)
    if args.seed_checkpoint:
        # A folder that every rank finds unusable: one line on each node.
        with said_once_per_node(args.timeout):
            load_seed_checkpoint(model, args.seed_checkpoint)
    # Each dp rank reads its share of every global batch; the pipeline's stages and tp ranks, the same share.
    dp_rank = mesh["dp"].get_local_rank()
    dp_size = mesh["dp"].size()
    train_data = Shares(train_tokens, args.global_batch, SEED, dp_rank, dp_size)
    held_out = DataLoader(HeldOut(held_out_tokens, args.global_batch, SEED, dp_rank, dp_size), batch_size=None)
    # A snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        trainer = Trainer(model, stages, train_data, held_out, make_optimizer(model), device, args.save_every,
                          args.snapshot_path, resume, args, mesh)
        require_epochs_left(trainer.steps_run, args.total_steps, args.snapshot_path, unit="steps")  # run again
    trainer.train(args.total_steps)
    # The whole GPT written to one plain file beside the snapshots by rank 0, weight by weight as each arrives from
    # the ranks that hold it: no rank ever holds the whole model. Rank 0 goes on alone with the file, as a user would.
    full_path = os.path.join(os.path.dirname(os.path.normpath(args.snapshot_path)), "long_model_full.pt")
    model = exported(trainer.model, full_path)
    dist.destroy_process_group()
    if trainer.global_rank == 0:
        trainer.board.close()
        print(f"{trainer.tag} full model saved to {full_path}")
        sample = generate(model, seed=0).strip("\n").splitlines()  # the same seed every run
        print(f"{trainer.tag} sample after {trainer.scheduler.last_epoch} optimizer steps:")
        for line in sample:
            print(f"  | {line}")
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_steps", type=positive_int, help="Optimizer steps to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in optimizer steps)")
    parser.add_argument("--global_batch", default=64, type=positive_int, help="Sequences a step, all dp ranks'")
    parser.add_argument("--data", default="data/help", help="Token files (tools/prepare_data.py writes them)")
    parser.add_argument("--eval_every", default=100, type=positive_int, help="Steps between held-out losses")
    parser.add_argument("--log_every", default=10, type=positive_int, help="Steps between lines (and scalars)")
    parser.add_argument("--logdir", default="runs/long_run", help="TensorBoard's folder (rank 0 writes it)")
    parser.add_argument("--keep", default=3, type=positive_int, help="Snapshots kept: the last ones")
    parser.add_argument("--skip", type=skip_range, help="Global batches BEGIN:END not to train on")
    parser.add_argument("--resume_from", type=positive_int, help="Rewind: go on from this step's snapshot, not the last")
    parser.add_argument("--workers", default=0, type=non_negative_int, help="Loader processes that read ahead")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="long_snapshots", type=snapshot_folder, help="Snapshots' folder")
    parser.add_argument("--pp", default=2, type=positive_int, help="Pipeline ranks, two stages each")
    parser.add_argument("--tp", default=2, type=positive_int, help="Ranks that split each block (tensor parallel)")
    parser.add_argument("--microbatches", default=4, type=positive_int, help="Micro-batches per batch (M)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: FSDP's mixed precision")
    parser.add_argument("--grad_clip", default=1.0, type=float, help="Largest gradient norm of a step (inf: no clip)")
    parser.add_argument("--checkpoint_activations", action="store_true", help="Recompute each block in backward")
    parser.add_argument("--async_save", action="store_true", help="Write snapshots while the training goes on")
    parser.add_argument("--seed_checkpoint", type=dcp_folder, help="Initial weights (tools/seed_checkpoint.py)")
    add_gpt_arguments(parser, text=False)  # --dropout, --peak_tflops
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
