"""Step 8 - pipeline parallelism: the GPT cut into stages, one per rank, each batch fed through in micro-batches.

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        pipeline_parallel.py 50 10 --pp 2            # the same command on every node; HEAD: the first node
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, attempt_store, configure_cpu_threads, errors_said_once, evaluate, exists_on_any_rank,
                   exit_without_teardown, log_rank_metrics, make_workload, mesh_with_timeout, positive_int, replacing,
                   require_epochs_left, require_same_arguments, require_same_start, require_torchrun,
                   require_written_by, said_once_per_node, stop_if_unloadable, watch_this_worker, writable_path)
from utils.loop import (WarmupCosine, add_gpt_arguments, check_options, every_rank_rng_state, generate, mfu,
                        set_rng_state)
from utils.pipeline import reassembled, require_a_batch, require_pipeline_fits, stage_io
from utils.snapshot_reader import SnapshotReader

# The optimizer's state saved weight by weight, under the weights' names, its settings too (block3.mlp.fc.weight's
# lr): the stages' optimizers hold different weights, whose lists would collide in the one snapshot of the model.
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


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
    def __init__(self, model, train_data, optimizer, loss_fn, device, save_every, snapshot_path, args, mesh):
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
        self.schedule = WarmupCosine(args.total_epochs * self.steps_per_epoch)  # warm-up, then a cosine
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)  # None: fp32
        # The weights are built: each rank its own dropout masks.
        torch.manual_seed(1 + self.global_rank)
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        # DCP's load is a collective: if any rank finds a snapshot, all of them load it.
        self.epochs_run = self._load_snapshot() if exists_on_any_rank(snapshot_path, device) else 0
        # Each node read the snapshot from its own disk.
        require_same_start(self.epochs_run, device)
        # DDP averages the gradients over this stage's copies in the other pipelines (dp), in the last micro-batch.
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                         process_group=mesh["dp"].get_group())
        # The stage sends its activations down the pipeline (pp) and their gradients back up, in buffers of the shapes
        # it is told (tokens or activations in, activations or logits out): it needs no trial forward through DDP.
        M = args.microbatches
        stage = mesh["pp"].get_local_rank()
        stages = mesh["pp"].size()
        inputs, outputs = stage_io(model, args.batch_size // M, stage, stages, self.dtype)
        self.stage = PipelineStage(self.model, stage, stages, device, inputs, outputs, group=mesh["pp"].get_group())
        # The schedule orders the passes. Each micro-batch's loss is divided by M: their gradients add up to the mean's.
        Schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
        self.pipeline = Schedule(self.stage, M, loss_fn=lambda logits, targets: loss_fn(logits, targets) / M)
        # So that no torch version divides the gradients by M once more (2.7 and later would; 2.6 never does).
        self.pipeline.scale_grads = False

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            # Read once, as data only: a planted folder runs no code.
            reader = SnapshotReader(self.snapshot_path)
            require_written_by("pipeline_parallel.py", self.snapshot_path, reader)
            # Each rank reads its own stage's weights and optimizer state, by their names: from a snapshot of any cut.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
            snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                            SCHEDULER_STATE=self.scheduler.state_dict(), RNG_STATES=(), EPOCHS_RUN=0)
            dcp.load(snapshot, storage_reader=reader)  # fills the tensors above in place
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                           options=BY_NAME)
            self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
            # This rank's dropout, where it left off.
            set_rng_state(snapshot["RNG_STATES"], self.global_rank)
            epochs_run = snapshot["EPOCHS_RUN"]
        self.schedule.resume(self.scheduler.last_epoch, (self.args.total_epochs - epochs_run) * self.steps_per_epoch)
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _run_batch(self, source, targets):
        # The schedule replaces forward and backward. It cuts the batch into M micro-batches and runs their forwards
        # and backwards in its order, each stage waiting for the activations of the one before and the gradients of
        # the one after: (stages - 1) / (M + stages - 1) of the step, the bubble, every stage idles. Only the first
        # stage reads the tokens; only the last has the targets, and the micro-batches' losses.
        inputs = [source] if self.stage.is_first else []
        target = targets if self.stage.is_last else None
        losses = []
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):  # weights stay fp32
            self.pipeline.step(*inputs, target=target, losses=losses)
        # Clip by the norm of the whole model's gradient: the stages add up their squared norms along the pipeline.
        squares = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters()]) ** 2
        dist.all_reduce(squares, group=self.stage.group)
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.args.grad_clip, squares.sqrt())
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The batch's mean loss, each micro-batch's having been divided by M; None on the stages without the losses.
        return sum(losses).detach() if losses else None

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # A new shuffle each epoch, the same on every rank.
        self.train_data.sampler.set_epoch(epoch)
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss = self._run_batch(source, targets)
            # The last stage of each pipeline counts its samples: once per pipeline, over the ranks.
            if loss is not None:
                totals[0] += loss * len(source)
                totals[1] += len(source)
        log_rank_metrics(epoch, self.steps_per_epoch, totals, start)
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

    def _save_snapshot(self, epoch, rng_states):
        # All it takes to go on exactly: the data order comes from the sampler's seed and the epoch.
        # Each rank saves its stage's part under the whole model's names: a snapshot of the model, not of the cut.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
        snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                        SCHEDULER_STATE=self.scheduler.state_dict(), RNG_STATES=tuple(rng_states),
                        EPOCHS_RUN=epoch + 1, STEP="pipeline_parallel.py")
        # Every rank writes its part into one folder of the job's; rank 0 then swaps it in for the last snapshot.
        tmp = f"{self.snapshot_path}.{os.environ['TORCHELASTIC_RUN_ID']}.tmp"
        with replacing(self.snapshot_path, tmp, rename=self.global_rank == 0):
            dcp.save(snapshot, checkpoint_id=tmp)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                # Every rank's dropout generators, as bytes: no pickle.
                rng_states = every_rank_rng_state()
                self._save_snapshot(epoch, rng_states)  # sharded: every rank writes its part
                # No rank runs ahead of a snapshot not on disk yet.
                dist.barrier()


def load_train_objs(args):
    return make_workload(args.workload, text=args.text, dropout=args.dropout)  # data, model, optimizer and loss


def cut(model, stage, stages):
    # Pipeline parallelism cuts the GPT in depth: stage `stage` of `stages` keeps a run of consecutive blocks (runs
    # that differ by one block at most), the first stage the embedding too and the last the head; the other layers
    # are deleted. The layers keep the whole model's names (block3 stays block3), which the snapshots are keyed by.
    blocks = [name for name, _ in model.named_children() if name.startswith("block")]
    keep = blocks[stage * len(blocks) // stages:(stage + 1) * len(blocks) // stages]
    if stage == 0:
        keep.append("embed")
    if stage == stages - 1:
        keep.append("head")
    for name in [name for name, _ in model.named_children() if name not in keep]:
        delattr(model, name)
    return model


def prepare_dataloader(dataset: Dataset, batch_size: int, dp):
    # The stages of a pipeline take the same batches, 1/dp of the data; whole ones: the stages' buffers have one shape.
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      drop_last=True, sampler=DistributedSampler(dataset, dp.size(), dp.get_local_rank()))


def main(args):
    # Before the process group forms, a mistake that every rank finds alike: one line, said once on each node.
    with said_once_per_node(args.timeout):
        # An option that cannot run here: one line, before anything.
        check_options(args)
        # Pipelines of --pp stages, if the GPT's blocks and the batch allow them: else one line, before anything starts.
        require_pipeline_fits(args, int(os.environ["WORLD_SIZE"]))
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
    # The ranks as a grid of pp x dp, rank = stage * dp + d: the copies of a stage are consecutive ranks, on one node,
    # and a pipeline crosses the nodes, where only one activation per micro-batch travels between neighbours.
    mesh = init_device_mesh(device.type, (args.pp, dist.get_world_size() // args.pp), mesh_dim_names=("pp", "dp"))
    # The groups it made give up after --timeout too.
    mesh_with_timeout(mesh, args.timeout)
    stage = cut(workload.model, mesh["pp"].get_local_rank(), args.pp)
    train_data = prepare_dataloader(workload.train_set, args.batch_size, mesh["dp"])
    # A --batch_size larger than a pipeline's share of the data, which would leave it nothing to train on, and a
    # snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        require_a_batch(train_data)
        trainer = Trainer(stage, train_data, workload.make_optimizer(stage), workload.loss_fn, device, args.save_every,
                          args.snapshot_path, args, mesh)
        require_epochs_left(trainer.epochs_run, args.total_epochs, args.snapshot_path)  # a finished job run again
    trainer.train(args.total_epochs)
    # Every stage's weights gathered on every rank, the whole GPT again: for the held-out loss and a sample.
    trainer.model = reassembled(trainer.model)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    if trainer.global_rank == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
        sample = generate(trainer.model, seed=0).strip("\n").splitlines()  # the same seed every run
        print(f"{trainer.tag} sample after {trainer.scheduler.last_epoch} optimizer steps:")
        for line in sample:
            print(f"  | {line}")
    dist.destroy_process_group()
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per pipeline")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="pp_snapshot", type=writable_path, help="Sharded snapshot folder")
    parser.add_argument("--pp", default=2, type=positive_int, help="Stages per pipeline; dp: the processes / pp")
    parser.add_argument("--microbatches", default=4, type=positive_int, help="Micro-batches per batch (M)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"], help="The order of their passes")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast")
    parser.add_argument("--grad_clip", default=1.0, type=float, help="Largest gradient norm of a step (inf: no clip)")
    add_gpt_arguments(parser)  # --text, --dropout, --peak_tflops
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
