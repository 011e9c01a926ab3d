"""Exercise 1 - turn this one-device script into DDP with mp.spawn: one process per GPU, or N CPU processes.

It runs as it is, in one process. Work on a copy and follow the TODOs; check it with
    python exercises/check.py 1 my_ddp.py
It must run as `python my_ddp.py 3 1 --world_size 2` (the options and the imports are already there).
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, configure_cpu_threads, evaluate, exit_without_teardown, log_rank_metrics, make_workload,
                   positive_int, rendezvous_port, replacing, require_a_gpu_each, stop_on_signals)


# TODO 1: ddp_setup(rank, world_size, timeout_s): init_process_group (gloo on CPU, nccl on GPU) with a timeout


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, save_every):
        # TODO 2: remember this process's rank (dist.get_rank())
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[{device}]"  # TODO 2: say which rank this is: [rank 0/2 | cpu]
        # TODO 3: wrap the model in DistributedDataParallel

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # TODO 4: a new shuffle every epoch, the same on every rank
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            totals[0] += self._run_batch(source, targets) * len(source)
            totals[1] += len(source)
        log_rank_metrics(epoch, len(self.train_data), totals, start)
        # TODO 5: sum the totals over the ranks, so that the loss below is every rank's mean
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        print(f"{self.tag} epoch {epoch} | steps {len(self.train_data)} | loss {mean_loss:.4f} | "  # TODO 5: rank 0
              f"{samples_per_s:,.0f} samples/s")

    def _save_checkpoint(self, epoch):
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing("checkpoint.pt") as tmp:
            torch.save(self.model.state_dict(), tmp)  # TODO 6: the model inside DDP
        print(f"{self.tag} epoch {epoch} | checkpoint saved to checkpoint.pt")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_checkpoint(epoch)  # TODO 6: one writer is enough


def load_train_objs(args):
    # Data, model, optimizer and loss, as in every step.
    return make_workload(args.workload)


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(),
                      shuffle=True)  # TODO 7: each rank must get its own share of the data


def main(args):  # TODO 8: main(rank, world_size, args): join the group first, leave it (destroy) last
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # TODO 8: this process's own GPU
    print(f"Training on {device}" + ("" if device.type == "cuda" else " (no CUDA device found)"))  # TODO 8: share
    # the cores instead (configure_cpu_threads); __main__ says how many processes run where
    workload = load_train_objs(args)
    train_data = prepare_dataloader(workload.train_set, args.batch_size)
    trainer = Trainer(workload.model, train_data, workload.optimizer, workload.loss_fn, device,
                      args.save_every)
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")  # TODO 8: rank 0 prints it


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per process")
    parser.add_argument("--workload", default="synthetic", choices=WORKLOADS, help="What to train")
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--world_size", type=positive_int, help="Processes (default: every GPU, or 2 on CPU)")
    args = parser.parse_args()

    # TODO 9: world_size processes (one GPU each), MASTER_ADDR and a free MASTER_PORT, then mp.spawn(main, ...)
    # Ctrl-C: one line, and the last checkpoint whole.
    stop_on_signals()
    main(args)  # TODO 9: mp.spawn instead
