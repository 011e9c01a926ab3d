"""Step 1 - train on one device: the GPU if there is one, else the CPU.

    python single_gpu.py 50 10          # TOTAL_EPOCHS SAVE_EVERY
"""
import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

from utils import WORKLOADS, evaluate, log_rank_metrics, make_workload, positive_int, replacing, stop_on_signals


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, save_every):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[{device}]"

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            totals[0] += self._run_batch(source, targets) * len(source)
            totals[1] += len(source)
        log_rank_metrics(epoch, len(self.train_data), totals, start)
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        print(f"{self.tag} epoch {epoch} | steps {len(self.train_data)} | loss {mean_loss:.4f} | "
              f"{samples_per_s:,.0f} samples/s")

    def _save_checkpoint(self, epoch):
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing("checkpoint.pt") as tmp:
            torch.save(self.model.state_dict(), tmp)
        print(f"{self.tag} epoch {epoch} | checkpoint saved to checkpoint.pt")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_checkpoint(epoch)


def load_train_objs(args):
    # Data, model, optimizer and loss, as in every step.
    return make_workload(args.workload)


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(),
                      shuffle=True)


def main(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"Training on {device}" + ("" if device.type == "cuda" else " (no CUDA device found)"))
    workload = load_train_objs(args)
    train_data = prepare_dataloader(workload.train_set, args.batch_size)
    trainer = Trainer(workload.model, train_data, workload.optimizer, workload.loss_fn, device,
                      args.save_every)
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per process")
    parser.add_argument("--workload", default="synthetic", choices=WORKLOADS, help="What to train")
    args = parser.parse_args()

    # Ctrl-C: one line, and the last checkpoint whole.
    stop_on_signals()
    main(args)
