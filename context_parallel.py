"""Step 9 - context parallelism: each sequence split over a group of cp ranks, the attention's keys and values passed.

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        context_parallel.py 50 10 --cp 2 --context 1024      # the same command on every node; HEAD: the first node
"""
import argparse
import contextlib
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, attempt_store, configure_cpu_threads, errors_said_once, evaluate, exit_without_teardown,
                   log_rank_metrics, make_workload, mesh_with_timeout, positive_int, replacing, require_epochs_left,
                   require_same_arguments, require_same_start, require_torchrun, require_written_by, said_once_per_node,
                   stop_if_unloadable, watch_this_worker, writable_path)
from utils.context import require_cp_fits, split_sequence
from utils.loop import (WarmupCosine, add_gpt_arguments, check_options, every_rank_rng_state, generate, mfu,
                        set_rng_state)


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
        self.steps_per_epoch = math.ceil(len(train_data) / args.grad_accum)  # K micro-batches a step
        self.schedule = WarmupCosine(args.total_epochs * self.steps_per_epoch)  # warm-up, then a cosine
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 underflows otherwise
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)  # None: fp32
        # The weights are built: each rank its own dropout masks.
        torch.manual_seed(1 + self.global_rank)
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        self.epochs_run = self._load_snapshot() if os.path.exists(snapshot_path) else 0  # epochs already done
        # Each node read the snapshot from its own disk.
        require_same_start(self.epochs_run, device)
        # Rank r of a cp group holds chunks r and 2cp-1-r of the sequence's 2cp: causal attention costs a late chunk
        # more than an early one, and the pairs even out the ranks' work (docs/context-parallel.md measures it).
        self.cp = mesh["cp"].get_group()
        cp = mesh["cp"].size()
        self.chunks_by_rank = [[r, 2 * cp - 1 - r] for r in range(cp)]
        # DDP broadcasts rank 0's weights, then averages the gradients over all dp x cp ranks: the gradient of the
        # batch's mean loss (a rank's hold, through the exchange, the other ranks' losses in its keys and values).
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        # Compile DDP(model), not DDP(compiled): dynamo cuts the graph at DDP's buckets, so all-reduces overlap.
        if args.compile:
            self.model = torch.compile(self.model)

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            snapshot = torch.load(self.snapshot_path, map_location=self.device, weights_only=True)  # no pickled code
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
            self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
            self.scaler.load_state_dict(snapshot["SCALER_STATE"])
            # This rank's dropout, where it left off.
            set_rng_state(snapshot["RNG_STATES"], self.global_rank)
            require_written_by("context_parallel.py", self.snapshot_path, snapshot)
            epochs_run = snapshot["EPOCHS_RUN"]
        self.schedule.resume(self.scheduler.last_epoch, (self.args.total_epochs - epochs_run) * self.steps_per_epoch)
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _run_batch(self, source, targets, micro_batches, last):
        # All but the last micro-batch of a step run inside no_sync(), the forward too (DDP arms its all-reduce
        # there): their gradients add up locally and backward all-reduces once per optimizer step, not K times.
        with contextlib.nullcontext() if last else self.model.no_sync():
            with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):  # weights stay fp32
                loss = self.loss_fn(self.model(source), targets)
            # Each micro-batch's loss divided by K: the gradients add up to their mean, not K times it.
            self.scaler.scale(loss / micro_batches).backward()
        if last:
            # Clip the true gradients, not fp16's scaled-up ones.
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
            scale = self.scaler.get_scale()
            # Skipped when fp16 overflowed: the scale then goes down.
            self.scaler.step(self.optimizer)
            self.scaler.update()
            # The schedule counts the steps really taken.
            if self.scaler.get_scale() >= scale:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # A new shuffle each epoch, the same on every rank.
        self.train_data.sampler.set_epoch(epoch)
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        batches = len(self.train_data)
        K = self.args.grad_accum
        for i, (source, targets) in enumerate(self.train_data):
            # The ranks of a cp group read the same sequences; each keeps the tokens of its own chunks.
            source, targets = source[:, self.positions].to(self.device), targets[:, self.positions].to(self.device)
            # K, or what is left for the epoch's last step.
            micro_batches = min(K, batches - i // K * K)
            totals[0] += self._run_batch(source, targets, micro_batches, i % K + 1 == micro_batches) * len(source)
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
        snapshot = dict(MODEL_STATE=self.model.module.state_dict(), OPTIMIZER_STATE=self.optimizer.state_dict(),
                        SCHEDULER_STATE=self.scheduler.state_dict(), SCALER_STATE=self.scaler.state_dict(),
                        RNG_STATES=rng_states, EPOCHS_RUN=epoch + 1, STEP="context_parallel.py")
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing(self.snapshot_path) as tmp:
            torch.save(snapshot, tmp)
        print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        # Inside it the model takes a rank's chunks, at their positions in the whole sequence, and every attention
        # exchanges K and V with the cp group (utils/context.py); after it, the model is whole again.
        with split_sequence(self.model, self.cp, self.chunks_by_rank, exchange=self.args.exchange) as positions:
            # The places of this rank's tokens in the whole sequence: each batch keeps those (_run_epoch).
            self.positions = positions
            for epoch in range(self.epochs_run, max_epochs):
                self._run_epoch(epoch)
                if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                    # Every rank's dropout generators, as bytes: no pickle.
                    rng_states = every_rank_rng_state()
                    # One writer in the whole job, not one per node.
                    if self.global_rank == 0:
                        self._save_snapshot(epoch, rng_states)
                    # No rank runs ahead of a snapshot not on disk yet.
                    dist.barrier()


def load_train_objs(args):
    # Data, model, optimizer and loss; the GPT's context, the positions it learns, as long as --context.
    return make_workload(args.workload, text=args.text, dropout=args.dropout, context=args.context)


def prepare_dataloader(dataset: Dataset, batch_size: int, dp):
    # The ranks of a cp group share every sequence: the data is split over the dp groups only, 1/dp each.
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset, dp.size(), dp.get_local_rank()))


def main(args):
    # Before the process group forms, a mistake that every rank finds alike: one line, said once on each node.
    with said_once_per_node(args.timeout):
        # An option that cannot run here: one line, before anything.
        check_options(args)
        # Whole cp groups, and a context that cuts into 2 x cp chunks of equal length: else one line, before anything.
        require_cp_fits(args, int(os.environ["WORLD_SIZE"]))
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
    # dp x cp, rank = d * cp + c: a cp group's ranks are neighbours, on one node, whose links K and V need most.
    mesh = init_device_mesh(device.type, (dist.get_world_size() // args.cp, args.cp), mesh_dim_names=("dp", "cp"))
    # The groups it made give up after --timeout too.
    mesh_with_timeout(mesh, args.timeout)
    train_data = prepare_dataloader(workload.train_set, args.batch_size, mesh["dp"])
    # A snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        trainer = Trainer(workload.model, train_data, workload.optimizer, workload.loss_fn, device,
                          args.save_every, args.snapshot_path, args, mesh)
        require_epochs_left(trainer.epochs_run, args.total_epochs, args.snapshot_path)  # a finished job run again
    trainer.train(args.total_epochs)
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
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per cp group")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="cp_snapshot.pt", type=writable_path, help="Where to save, resume")
    parser.add_argument("--cp", default=2, type=positive_int, help="Ranks per sequence; dp: the processes / cp")
    parser.add_argument("--context", default=512, type=positive_int, help="Tokens per sequence (the GPT's context)")
    parser.add_argument("--exchange", default="ring", choices=["ring", "allgather"], help="How K and V travel")
    parser.add_argument("--grad_accum", default=1, type=positive_int, help="Micro-batches per optimizer step (K)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="fp16: CUDA only")
    parser.add_argument("--grad_clip", default=1.0, type=float, help="Largest gradient norm of a step (inf: no clip)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (needs a C++ compiler)")
    add_gpt_arguments(parser)  # --text, --dropout, --peak_tflops
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
