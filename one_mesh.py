"""Step 11 - every parallelism on one mesh: pipeline stages (pp), FSDP over the replicas (dp), tensor and sequence
parallelism inside a node (tp); the model built on the meta device, checkpointed without stopping the training.

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        one_mesh.py 50 10 --pp 2 --tp 8      # the same command on every node; HEAD: the first node
"""
import argparse
import contextlib
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
from torch.utils.data.distributed import DistributedSampler

from utils import (SEED, WORKLOADS, attempt_store, being_written, configure_cpu_threads, dcp_folder, errors_said_once,
                   evaluate, exists_on_any_rank, exit_without_teardown, log_rank_metrics, make_workload,
                   mesh_with_timeout, positive_int, replacing, require_epochs_left, require_same_arguments,
                   require_same_start, require_torchrun, require_written_by, said_once_per_node, stop_if_unloadable,
                   watch_this_worker, writable_path)
from utils.loop import WarmupCosine, add_gpt_arguments, check_options, generate, mfu
from utils.memory import saved_for_backward, state_bytes
from utils.pipeline import exported, require_a_batch, require_mesh_fits, stage_io
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
    def __init__(self, model, stages, train_data, optimizer, loss_fn, device, save_every, snapshot_path, args, mesh):
        # LOCAL_RANK numbers the processes of this node (it picks the GPU); RANK numbers those of the whole job.
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.args = args
        self.steps_per_epoch = len(train_data)  # an optimizer step per batch
        self.mesh = mesh
        self.schedule = WarmupCosine(args.total_epochs * self.steps_per_epoch)  # warm-up, then a cosine
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)  # None: fp32
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        # The snapshot being written, while a save is under way: its folder, its epoch, and an asynchronous save's
        # future (None for a save written at once).
        self.saving_to = None
        self.saving_epoch = None
        self.saving_future = None
        # An asynchronous save writes in a thread, over a process group of its own: its collectives never meet the
        # training's in one queue. They too give up after --timeout.
        saver_timeout = timedelta(seconds=args.timeout)
        self.saver = dist.new_group(backend="gloo", timeout=saver_timeout) if args.async_save else None
        # DCP's load is a collective: if any rank finds a snapshot, all of them load it.
        self.epochs_run = self._load_snapshot() if exists_on_any_rank(snapshot_path, device) else 0
        # Each node read the snapshot from its own disk.
        require_same_start(self.epochs_run, device)
        # Two stages on each rank, rank r holding stages r and r + pp: each micro-batch passes every rank twice, so the
        # pipeline fills in half the time (the bubble halves) for twice the sends.
        M = args.microbatches
        pp = mesh["pp"]
        self.stages = []
        for index, part in stages:
            inputs, outputs = stage_io(model, args.batch_size // M, index, 2 * pp.size(), self.dtype, mesh["tp"].size())
            self.stages.append(PipelineStage(part, index, 2 * pp.size(), device, inputs, outputs, group=pp.get_group()))
        self.pipeline = ScheduleInterleaved1F1B(self.stages, M, loss_fn=lambda out, y: loss_fn(out, y) / M)
        # Each micro-batch's loss is divided by M already, on every torch version.
        self.pipeline.scale_grads = False

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            # Read once, as data only: a planted folder runs no code.
            reader = SnapshotReader(self.snapshot_path)
            require_written_by("one_mesh.py", self.snapshot_path, reader)
            # Each rank reads its own shards of its own layers, by their names: from a snapshot of any mesh.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
            snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                            SCHEDULER_STATE=self.scheduler.state_dict(), EPOCHS_RUN=0)
            dcp.load(snapshot, storage_reader=reader)  # fills the tensors above in place
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                           options=BY_NAME)
            self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
            epochs_run = snapshot["EPOCHS_RUN"]
        self.schedule.resume(self.scheduler.last_epoch, (self.args.total_epochs - epochs_run) * self.steps_per_epoch)
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _run_batch(self, source, targets, saved):
        # The schedule runs the micro-batches' forwards and backwards through both stages of every rank; the logits
        # stay split over the vocabulary, so the loss and its gradient are computed inside loss_parallel.
        inputs = [source] if self.stages[0].is_first else []
        last = any(stage.is_last for stage in self.stages)
        target = targets if last else None
        losses = []
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
        # The batch's mean loss, each micro-batch's having been divided by M; None on the stages without the losses.
        return sum(loss.full_tensor() for loss in losses).detach() if losses else None

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # A new shuffle each epoch, the same on every rank.
        self.train_data.sampler.set_epoch(epoch)
        # Dropout seeded anew each epoch by the epoch and the rank: every rank drops in its own positions or heads.
        torch.manual_seed(hash((SEED, epoch, self.global_rank)))
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        # The activations of the epoch's first step, measured.
        saved = saved_for_backward()
        for step, (source, targets) in enumerate(self.train_data):
            source, targets = source.to(self.device), targets.to(self.device)
            loss = self._run_batch(source, targets, saved if step == 0 else contextlib.nullcontext())
            # The last stage of each pipeline counts its samples: once per pipeline, over the ranks.
            if loss is not None and self.mesh["tp"].get_local_rank() == 0:  # its tp ranks have the same loss
                totals[0] += loss * len(source)
                totals[1] += len(source)
            if self.saving_future is not None and self.saving_future.done():
                # The snapshot written in the background is whole: it becomes the last one.
                self._finish_save()
        log_rank_metrics(epoch, self.steps_per_epoch, totals, start, activation_bytes=saved.bytes, **self.held)
        # Summed over the ranks: the loss below is their mean.
        dist.all_reduce(totals)
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        tokens_per_s = samples_per_s * source.shape[1]  # the whole job's
        utilisation = mfu(self.model, tokens_per_s, self.device, self.args.peak_tflops)
        # The MFU where the device's peak is known (a GPU's, or --peak_tflops).
        mfu_text = f" | MFU {utilisation:.1%}" if utilisation else ""
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {self.steps_per_epoch} | loss {mean_loss:.4f} | "
                  f"{tokens_per_s:,.0f} tokens/s{mfu_text}")

    def _save_snapshot(self, epoch):
        # All it takes to go on exactly: the data order comes from the sampler's seed and the epoch.
        # Each rank saves its stages' part under the whole model's names: a snapshot of the model, not of the mesh.
        # The save before this one: on disk first.
        self._finish_save()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
        snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                        SCHEDULER_STATE=self.scheduler.state_dict(), EPOCHS_RUN=epoch + 1, STEP="one_mesh.py")
        # Every rank writes its shards into one folder of this save's; rank 0 makes it the last snapshot once whole.
        # Until then a Ctrl-C removes it, also while a thread writes it in the background.
        tmp = being_written(f"{self.snapshot_path}.{os.environ['TORCHELASTIC_RUN_ID']}.{epoch}.tmp")
        self.saving_to = tmp
        self.saving_epoch = epoch
        # Copies the state to memory, then writes it in a thread while the training goes on.
        if self.saver:
            self.saving_future = dcp.async_save(snapshot, checkpoint_id=tmp, process_group=self.saver)
        else:
            dcp.save(snapshot, checkpoint_id=tmp)
            self._finish_save()

    def _finish_save(self):
        if self.saving_to is None:
            return
        # A kill before this line leaves the last snapshot as it was, never one cut short; the new one, whole.
        with replacing(self.snapshot_path, self.saving_to, rename=self.global_rank == 0):
            # An asynchronous save: wait until every rank wrote.
            if self.saving_future is not None:
                self.saving_future.result()
        if self.global_rank == 0:
            print(f"{self.tag} epoch {self.saving_epoch} | snapshot saved to {self.snapshot_path}")
        self.saving_to = None
        self.saving_future = None

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)  # sharded: every rank writes its part
        self._finish_save()
        # No rank goes on before the last snapshot is on disk.
        dist.barrier()


def load_train_objs(args):
    # The model on the meta device: its shapes, no memory. Each rank gives memory to its own shards only, later.
    return make_workload(args.workload, text=args.text, dropout=args.dropout, device="meta")  # data, model, optimizer


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


def prepare_dataloader(dataset: Dataset, batch_size: int, dp):
    # The stages of a pipeline take the same batches, 1/dp of the data; whole ones: the stages' buffers have one shape.
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      drop_last=True, sampler=DistributedSampler(dataset, dp.size(), dp.get_local_rank()))


def main(args):
    # Before the process group forms, a mistake that every rank finds alike: one line, said once on each node.
    with said_once_per_node(args.timeout):
        # An option that cannot run here: one line, before anything.
        check_options(args)
        # Whole grids, whole heads, stages: else one line.
        require_mesh_fits(args, int(os.environ["WORLD_SIZE"]))
        # Its data read: missing data stops it here, too.
        workload = load_train_objs(args)
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
    model, stages = parallelize(workload.model, mesh, args)
    # Memory for this rank's shards alone, then its part of one process's initial weights, drawn again whole on every
    # rank: the same model on any mesh. Or those weights read from a DCP folder of them, each rank its shards.
    model.to_empty(device=device)
    model.init_weights(seed=SEED)
    if args.seed_checkpoint:
        # A folder that every rank finds unusable: one line on each node.
        with said_once_per_node(args.timeout):
            load_seed_checkpoint(model, args.seed_checkpoint)
    train_data = prepare_dataloader(workload.train_set, args.batch_size, mesh["dp"])
    # A --batch_size larger than a pipeline's share of the data, which would leave it nothing to train on, and a
    # snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        require_a_batch(train_data)
        trainer = Trainer(model, stages, train_data, workload.make_optimizer(model), workload.loss_fn, device,
                          args.save_every, args.snapshot_path, args, mesh)
        require_epochs_left(trainer.epochs_run, args.total_epochs, args.snapshot_path)  # a finished job run again
    trainer.train(args.total_epochs)
    # The whole GPT written to one plain file beside the snapshot by rank 0, weight by weight as each arrives from the
    # ranks that hold it: no rank ever holds the whole model. Rank 0 goes on alone with the file, as a user would.
    full_path = os.path.join(os.path.dirname(args.snapshot_path), "mesh_model_full.pt")
    model = exported(trainer.model, full_path)
    dist.destroy_process_group()
    if trainer.global_rank == 0:
        print(f"{trainer.tag} full model saved to {full_path}")
        metrics = evaluate(model, workload.eval_set, workload.loss_fn, device)
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
        sample = generate(model, seed=0).strip("\n").splitlines()  # the same seed every run
        print(f"{trainer.tag} sample after {trainer.scheduler.last_epoch} optimizer steps:")
        for line in sample:
            print(f"  | {line}")
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per dp rank")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="mesh_snapshot", type=writable_path, help="Sharded snapshot folder")
    parser.add_argument("--pp", default=2, type=positive_int, help="Pipeline ranks, two stages each")
    parser.add_argument("--tp", default=2, type=positive_int, help="Ranks that split each block (tensor parallel)")
    parser.add_argument("--microbatches", default=4, type=positive_int, help="Micro-batches per batch (M)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: FSDP's mixed precision")
    parser.add_argument("--grad_clip", default=1.0, type=float, help="Largest gradient norm of a step (inf: no clip)")
    parser.add_argument("--checkpoint_activations", action="store_true", help="Recompute each block in backward")
    parser.add_argument("--async_save", action="store_true", help="Write snapshots while the training goes on")
    parser.add_argument("--seed_checkpoint", type=dcp_folder, help="Initial weights (tools/seed_checkpoint.py)")
    add_gpt_arguments(parser)  # --text, --dropout, --peak_tflops
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
