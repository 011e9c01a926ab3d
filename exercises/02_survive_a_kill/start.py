"""Exercise 2 - make this torchrun job survive a kill: save a snapshot, and resume from it after a restart.

torchrun already starts the processes, and with --max_restarts=N restarts them all when one dies; but then
this script starts over from epoch 0. Work on a copy and follow the TODOs; check it with
    python exercises/check.py 2 my_restart.py
which runs `torchrun --standalone --nproc_per_node=2 --max_restarts=2 my_restart.py 4 1` and kills rank 1 as it
begins epoch 2: the job must go on at epoch 2, no epoch lost and none repeated.
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
                   log_rank_metrics, make_workload, positive_int, replacing, require_epochs_left, require_torchrun,
                   require_written_by, said_once_per_node, stop_if_unloadable, watch_this_worker, writable_path)


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
    def __init__(self, model, train_data, optimizer, loss_fn, device, save_every):  # TODO 1: + snapshot_path
        self.rank = dist.get_rank()
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[rank {self.rank}/{dist.get_world_size()} | {device}]"
        # TODO 1: if a snapshot exists, load it (_load_snapshot) and remember how many epochs it has run
        # DDP broadcasts rank 0's weights, then all-reduces (averages) the gradients inside backward().
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    # TODO 2: _load_snapshot(): torch.load(..., weights_only=True); restore model, optimizer and epochs run

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
        if self.rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {len(self.train_data)} | loss {mean_loss:.4f} | "
                  f"{samples_per_s:,.0f} samples/s")

    def _save_checkpoint(self, epoch):  # TODO 3: a snapshot: model, optimizer and epochs run, replacing the last
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing("checkpoint.pt") as tmp:  # TODO 3: to self.snapshot_path
            torch.save(self.model.module.state_dict(), tmp)  # .module: the model inside DDP
        print(f"{self.tag} epoch {epoch} | checkpoint saved to checkpoint.pt")

    def train(self, max_epochs):
        for epoch in range(max_epochs):  # TODO 4: start after the epochs already run
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                # The replicas are identical: one writer.
                if self.rank == 0:
                    self._save_checkpoint(epoch)  # TODO 3: then every rank waits until it is on disk


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
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    # The job's processes share this machine's cores.
    configure_cpu_threads(dist.get_world_size())
    train_data = prepare_dataloader(workload.train_set, args.batch_size)
    # A snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        trainer = Trainer(workload.model, train_data, workload.optimizer, workload.loss_fn, device,
                          args.save_every)  # TODO 1: and the snapshot path
        # TODO 4: no epochs left after the snapshot's (a finished job run again)? say so: require_epochs_left
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    if trainer.rank == 0:
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
    # TODO 5: --snapshot_path (default snapshot.pt, type=writable_path): where to save and resume from
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
