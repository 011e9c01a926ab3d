"""Step 4 - several machines: one torchrun per node, all meeting at one rendezvous endpoint.

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        multinode.py 50 10                           # the same command on every node; HEAD: the first node
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, attempt_store, configure_cpu_threads, errors_said_once, evaluate, exit_without_teardown,
                   log_rank_metrics, make_workload, positive_int, replacing, require_epochs_left,
                   require_same_arguments, require_same_start, require_torchrun, require_written_by, said_once_per_node,
                   stop_if_unloadable, watch_this_worker, writable_path)


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
    def __init__(self, model, train_data, optimizer, loss_fn, device, save_every, snapshot_path):
        # LOCAL_RANK numbers the processes of this node (it picks the GPU); RANK numbers those of the whole job.
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        self.epochs_run = self._load_snapshot() if os.path.exists(snapshot_path) else 0  # epochs already done
        # Each node read the snapshot from its own disk.
        require_same_start(self.epochs_run, device)
        # DDP broadcasts rank 0's weights, then all-reduces (averages) the gradients inside backward().
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            snapshot = torch.load(self.snapshot_path, map_location=self.device, weights_only=True)  # no pickled code
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
            require_written_by("multinode.py", self.snapshot_path, snapshot)
            epochs_run = snapshot["EPOCHS_RUN"]
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # A new shuffle each epoch, the same on every rank.
        self.train_data.sampler.set_epoch(epoch)
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            totals[0] += self._run_batch(source, targets) * len(source)
            totals[1] += len(source)
        log_rank_metrics(epoch, len(self.train_data), totals, start)
        # Summed over the ranks: the loss below is their mean.
        dist.all_reduce(totals)
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {len(self.train_data)} | loss {mean_loss:.4f} | "
                  f"{samples_per_s:,.0f} samples/s")

    def _save_snapshot(self, epoch):
        # All it takes to go on exactly: the data order comes from the sampler's seed and the epoch.
        snapshot = dict(MODEL_STATE=self.model.module.state_dict(), OPTIMIZER_STATE=self.optimizer.state_dict(),
                        EPOCHS_RUN=epoch + 1, STEP="multinode.py")
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing(self.snapshot_path) as tmp:
            torch.save(snapshot, tmp)
        print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                # One writer in the whole job, not one per node.
                if self.global_rank == 0:
                    self._save_snapshot(epoch)
                # No rank runs ahead of a snapshot not on disk yet.
                dist.barrier()


def load_train_objs(args):
    # Data, model, optimizer and loss, as in every step.
    return make_workload(args.workload)


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(),
                      shuffle=False, sampler=DistributedSampler(dataset))  # each rank its own 1/world_size


def main(args):
    # Before the process group forms, a mistake that every rank finds alike: one line, said once on each node.
    with said_once_per_node(args.timeout):
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
    train_data = prepare_dataloader(workload.train_set, args.batch_size)
    # A snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        trainer = Trainer(workload.model, train_data, workload.optimizer, workload.loss_fn, device,
                          args.save_every, args.snapshot_path)
        require_epochs_left(trainer.epochs_run, args.total_epochs, args.snapshot_path)  # a finished job run again
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    if trainer.global_rank == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
    dist.destroy_process_group()
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per process")
    parser.add_argument("--workload", default="synthetic", choices=WORKLOADS, help="What to train")
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="snapshot.pt", type=writable_path, help="Where to save and resume")
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
