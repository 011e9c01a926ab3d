"""Step 8 - pipeline parallelism: the GPT cut into stages, one per rank, each batch fed through in micro-batches.

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        pipeline_parallel.py 50 10 --dp 2            # the same command on every node; HEAD: the first node
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, configure_cpu_threads, evaluate, exit_without_teardown, log_rank_metrics, make_workload,
                   positive_int, replacing)
from utils import attempt_store, require_epochs_left, require_torchrun, stop_if_unloadable, writable_path
from utils import require_same_arguments, require_same_start
from utils.pipeline import pipeline_stage, reassembled, require_pipeline_fits, stage_io
from utils.loop import WarmupCosine, add_gpt_arguments, check_options, generate, mfu, rng_state, set_rng_state


def ddp_setup(timeout_s):
    # torchrun has set LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each process it started.
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before init: each process its own GPU
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
        self.args, self.steps_per_epoch = args, len(train_data)  # an optimizer step per batch
        self.schedule = WarmupCosine(args.total_epochs * self.steps_per_epoch)  # warm-up, then a cosine
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)  # None: fp32
        torch.manual_seed(1 + self.global_rank)  # the weights are built: each rank its own dropout masks
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        self.epochs_run = self._load_snapshot() if os.path.exists(snapshot_path) else 0  # epochs already done
        require_same_start(self.epochs_run, device)  # each node read the snapshot from its own disk
        # DDP averages the gradients over this stage's copies in the other pipelines (dp), in the last micro-batch.
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                         process_group=mesh["dp"].get_group())
        # The stage sends its activations down the pipeline (pp) and their gradients back up, in buffers of the shapes
        # it is told (tokens or activations in, activations or logits out): it needs no trial forward through DDP.
        M, stage, stages = args.microbatches, mesh["pp"].get_local_rank(), mesh["pp"].size()
        inputs, outputs = stage_io(model, args.batch_size // M, stage, stages, self.dtype)
        self.stage = PipelineStage(self.model, stage, stages, device, inputs, outputs, group=mesh["pp"].get_group())
        # The schedule orders the passes. Each micro-batch's loss is divided by M: their gradients add up to the mean's.
        Schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
        self.pipeline = Schedule(self.stage, M, loss_fn=lambda logits, targets: loss_fn(logits, targets) / M)
        self.pipeline.scale_grads = False  # torch >= 2.7 would divide by M again; 2.6 never does

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            snapshot = torch.load(self.snapshot_path, map_location=self.device, weights_only=True)  # no pickled code
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
            self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
            set_rng_state(snapshot["RNG_STATES"], self.global_rank)  # this rank's dropout, where it left off
            epochs_run = snapshot["EPOCHS_RUN"]
        self.schedule.resume(self.scheduler.last_epoch, (self.args.total_epochs - epochs_run) * self.steps_per_epoch)
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _run_batch(self, source, targets):
        # The schedule replaces forward and backward. It cuts the batch into M micro-batches and runs their forwards
        # and backwards in its order, each stage waiting for the activations of the one before and the gradients of
        # the one after: (stages - 1) / (M + stages - 1) of the step, the bubble, every stage idles. Only the first
        # stage reads the tokens; only the last has the targets, the losses, and returns [summed loss, samples].
        inputs, losses = [source] if self.stage.is_first else [], []
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):  # weights stay fp32
            self.pipeline.step(*inputs, target=targets if self.stage.is_last else None, losses=losses)
        # Clip by the norm of the whole model's gradient: the stages add up their squared norms along the pipeline.
        squares = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters()]) ** 2
        dist.all_reduce(squares, group=self.stage.group)
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.args.grad_clip, squares.sqrt())
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return len(source) * torch.stack([sum(losses), torch.ones_like(losses[0])]).detach() if losses else 0

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        totals = torch.zeros(2, device=self.device)  # [summed loss, samples], kept on the device
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            totals += self._run_batch(source, targets)
        log_rank_metrics(epoch, self.steps_per_epoch, totals, start)
        dist.all_reduce(totals)  # summed over the ranks: the loss below is their mean
        mean_loss = (totals[0] / totals[1]).item()  # waits for the device: the clock below is honest
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        tokens_per_s = samples_per_s * source.shape[1]  # the whole job's
        utilisation = mfu(self.model, tokens_per_s, self.device, self.args.peak_tflops)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {self.steps_per_epoch} | loss {mean_loss:.4f} | "
                  f"{tokens_per_s:,.0f} tokens/s" + (f" | MFU {utilisation:.1%}" if utilisation else ""))

    def _save_snapshot(self, epoch, rng_states):
        # All it takes to go on exactly: the data order comes from the sampler's seed and the epoch.
        snapshot = dict(MODEL_STATE=self.model.module.state_dict(), OPTIMIZER_STATE=self.optimizer.state_dict(),
                        SCHEDULER_STATE=self.scheduler.state_dict(),
                        RNG_STATES=rng_states, EPOCHS_RUN=epoch + 1)
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing(self.snapshot_path) as tmp:
            torch.save(snapshot, tmp)
        print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        require_epochs_left(self.epochs_run, max_epochs, self.snapshot_path)
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                rng_states = [None] * dist.get_world_size()
                dist.all_gather_object(rng_states, rng_state())  # every rank's dropout generators
                if self.global_rank < self.stage.num_stages:  # one writer per stage: the first pipeline's
                    self._save_snapshot(epoch, rng_states)
                dist.barrier()  # no rank runs ahead of a snapshot not on disk yet


def load_train_objs(args):
    return make_workload(args.workload, text=args.text, dropout=args.dropout)  # data, model, optimizer and loss


def prepare_dataloader(dataset: Dataset, batch_size: int, dp):
    # The stages of a pipeline take the same batches, 1/dp of the data; whole ones: the stages' buffers have one shape.
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      drop_last=True, sampler=DistributedSampler(dataset, dp.size(), dp.get_local_rank()))


def main(args):
    check_options(args)  # a --grad_clip not above 0...: one line, before anything
    stages = require_pipeline_fits(args, int(os.environ["WORLD_SIZE"]))  # processes / --dp, if the GPT allows
    ddp_setup(args.timeout)
    require_same_arguments(args)  # every node started with the same command?
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    configure_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))  # only this node's processes share its cores
    workload = load_train_objs(args)
    # The ranks as a grid, rank = dp index * stages + stage: a pipeline along "pp", a stage's copies along "dp".
    mesh = init_device_mesh(device.type, (args.dp, stages), mesh_dim_names=("dp", "pp"))
    stage = pipeline_stage(workload.model, mesh["pp"].get_local_rank(), stages)  # the GPT less the other stages
    root, extension = os.path.splitext(args.snapshot_path)  # a snapshot file per stage: NAME.stageK.pt
    train_data = prepare_dataloader(workload.train_set, args.batch_size, mesh["dp"])
    trainer = Trainer(stage, train_data, workload.make_optimizer(stage), workload.loss_fn, device, args.save_every,
                      f"{root}.stage{mesh['pp'].get_local_rank()}{extension}", args, mesh)
    trainer.train(args.total_epochs)
    trainer.model = reassembled(trainer.model)  # every stage's weights gathered: the whole GPT, on every rank
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    if trainer.global_rank == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
        sample = generate(trainer.model, seed=0).strip("\n").splitlines()  # the same seed every run
        print(f"{trainer.tag} sample after {trainer.scheduler.last_epoch} optimizer steps:", *sample, sep="\n  | ")
    dist.destroy_process_group()
    exit_without_teardown()  # Python's teardown can abort under gloo: see utils


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per pipeline")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="pp_snapshot.pt", type=writable_path, help="NAME.stageK.pt each")
    parser.add_argument("--microbatches", default=4, type=positive_int, help="Micro-batches per batch (M)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"], help="The order of their passes")
    parser.add_argument("--dp", default=1, type=positive_int, help="Pipelines side by side, data-parallel")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast")
    parser.add_argument("--grad_clip", default=1.0, type=float, help="Largest gradient norm of a step (inf: no clip)")
    add_gpt_arguments(parser)  # --text, --dropout, --peak_tflops
    args = parser.parse_args()

    require_torchrun()
    main(args)
