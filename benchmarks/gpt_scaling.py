"""GPT tokens/s on CPU processes: 1 vs N DDP processes against this machine's own ceiling, with and without gradient
accumulation, in one run.

    python benchmarks/gpt_scaling.py                               # 1 and 2 processes, --grad_accum 1 and 4
    python benchmarks/gpt_scaling.py --rounds 6 --grad_accum 1 2 4 8 --chars 200000

For each world size N, N processes start (one CPU thread each, gloo) and, for each K of --grad_accum, take turns
round after round (ABBA order, the first round a warm-up) between two ways of training the CPU-size GPT on the same
text, micro-batch --batch_size per process:
  DDP:         N epochs of gpt.py's Trainer (its _run_epoch: no_sync for all but the last of K micro-batches, one
               gradient all-reduce per optimizer step, clipping, AdamW, the schedule)
  independent: one epoch in every process of the same loop without DDP: the same compute, no communication
so every process trains on the whole text once per turn either way. A turn's tokens/s is all the processes' tokens
over the slowest one's time; each figure is the best round's (other work only ever slows a turn down).

- speed-up = DDP(N) / DDP(1) at the same K; ceiling = independent(N) / independent(1): what N processes reach here
  with nothing to share (cores share caches and memory bandwidth, so it is often below N).
- of ceiling = speed-up / ceiling: the part of the reachable speed-up DDP delivers (goal >= 0.9). Accumulating K
  micro-batches per all-reduce divides the communication per token by K, which is where the gap closes.
The header and the last line print the load average: on a busy machine DDP's ranks wait for each other at every
all-reduce, so they lose more than independent processes do.
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from argparse import Namespace
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/gpt_scaling.py` from anywhere; gpt.py imports too

from harness.jobs import free_port, machine_summary, spawned_result  # noqa: E402
from tools.plot_metrics import plot_speedups  # noqa: E402
from utils import exit_without_teardown, positive_int  # noqa: E402

GOAL = 0.9  # the part of the ceiling DDP should deliver


def independent_epoch(workload, loader, K, clip):
    """One epoch of gpt.py's optimizer steps without DDP: K micro-batches, each loss / K, clip, AdamW."""
    import torch

    for i, (source, targets) in enumerate(loader):
        (workload.loss_fn(workload.model(source), targets) / K).backward()
        if (i + 1) % K == 0 or i + 1 == len(loader):
            torch.nn.utils.clip_grad_norm_(workload.model.parameters(), clip)
            workload.optimizer.step()
            workload.optimizer.zero_grad(set_to_none=True)


def worker(rank, world_size, args, text_path, result_path):
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import gpt
    from utils import make_workload

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout))
    results = {}
    for K in args.grad_accum:
        # The same text and the same initial weights, twice.
        alone, shared = (make_workload("gpt-cpu", text=text_path) for _ in range(2))
        loader = DataLoader(alone.train_set, batch_size=args.batch_size,
                            sampler=DistributedSampler(alone.train_set, num_replicas=1, rank=0))
        options = Namespace(total_epochs=1000, grad_accum=K, precision="fp32", grad_clip=1.0, compile=False,
                            peak_tflops=None)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            trainer = gpt.Trainer(shared.model, gpt.prepare_dataloader(shared.train_set, args.batch_size),
                                  shared.optimizer, shared.loss_fn, torch.device("cpu"), 1,
                                  str(Path(result_path).parent / "none.pt"), options)
        context = alone.train_set.tensors[0].shape[1]  # tokens per sequence
        tokens = {"independent": world_size * len(loader.sampler) * context,  # one epoch of all the data, each
                  "ddp": world_size * world_size * len(trainer.train_data.sampler) * context}  # N epochs of 1/N
        turns = {"independent": lambda epoch: independent_epoch(alone, loader, K, 1.0),
                 "ddp": lambda epoch: trainer._run_epoch(epoch)}
        rates = {kind: [] for kind in turns}
        for round_ in range(args.rounds + 1):
            for kind in (list(turns) if round_ % 2 else list(turns)[::-1]):  # ABBA: drift favours neither
                dist.barrier()
                start = time.perf_counter()
                with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                    for epoch in range(round_ * world_size, (round_ + 1) * world_size) if kind == "ddp" else [0]:
                        turns[kind](epoch)
                slowest = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest process sets the pace
                if round_ > 0:  # round 0 warms up
                    rates[kind].append(tokens[kind] / slowest.item())
        results[K] = {kind: max(r) for kind, r in rates.items()}
    if rank == 0:
        Path(result_path).write_text(json.dumps(results))
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


def measure(procs, args, text_path):
    """{K: {"ddp": tokens/s, "independent": tokens/s}} for `procs` processes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                      CUDA_VISIBLE_DEVICES="")
    rates = spawned_result(worker, (procs, args, text_path), procs, args.timeout, f"{procs} processes")
    return {int(K): rate for K, rate in rates.items()}


def table(rows):
    lines = ["| K | processes | DDP tokens/s | speed-up | independent tokens/s | ceiling | DDP of ceiling |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['K']} | {r['procs']} | {r['ddp']:,.0f} | {r['speedup']:.2f}x | {r['independent']:,.0f} | "
              f"{r['ceiling']:.2f}x | {r['of_ceiling']:.2f} |" for r in rows]
    return "\n".join(lines)


def plot(rows, out_path, title):
    curves = [(f"DDP, --grad_accum {K}", [r["procs"] for r in rows if r["K"] == K],
               [r["speedup"] for r in rows if r["K"] == K], "o-", {}) for K in sorted({r["K"] for r in rows})]
    ceiling = [r for r in rows if r["K"] == rows[0]["K"]]
    curves.append(("ceiling (independent processes)", [r["procs"] for r in ceiling], [r["ceiling"] for r in ceiling],
                   "s--", dict(color="grey")))
    plot_speedups(curves, "tokens/s over one process", out_path, title)


def report(measured, plot_path, title):
    """From the measured tokens/s ({processes: {K: {"ddp": ..., "independent": ...}}}): the table, for each K what the
    most processes deliver against the goal, and the plot."""
    rows = []
    for K in measured[1]:
        for procs in measured:
            rates, one = measured[procs][K], measured[1][K]
            speedup, ceiling = rates["ddp"] / one["ddp"], rates["independent"] / one["independent"]
            rows.append(dict(K=K, procs=procs, **rates, speedup=speedup, ceiling=ceiling,
                             of_ceiling=speedup / ceiling))
    print(f"\n{table(rows)}\n")
    for row in rows:
        if row["procs"] == max(measured):
            verdict = "met" if row["of_ceiling"] >= GOAL else "NOT met"
            print(f"--grad_accum {row['K']}: {row['procs']} processes deliver {row['of_ceiling']:.2f} of the "
                  f"{row['ceiling']:.2f}x ceiling (goal >= {GOAL}): {verdict}")
    Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
    plot(rows, plot_path, title)
    print(f"plot: {plot_path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_procs", type=positive_int, default=2, help="largest world size (default 2)")
    parser.add_argument("--grad_accum", type=positive_int, nargs="+", default=[1, 4], help="values of K (default 1 4)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="measured turns of each kind (default 3)")
    parser.add_argument("--batch_size", type=positive_int, default=8, help="micro-batch per process (default 8)")
    parser.add_argument("--chars", type=positive_int, default=30000,
                        help="characters of Python's help pages to train on (default 30000: ~420 sequences)")
    parser.add_argument("--timeout", type=positive_int, default=600, help="seconds one world size may take")
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "gpt_scaling.png"),
                        help="PNG to write (default benchmarks/results/gpt_scaling.png)")
    args = parser.parse_args()

    from utils.gpt import help_pages

    print(f"GPT (CPU size) tokens/s, micro-batch {args.batch_size} per process, {args.chars:,} characters, "
          f"{args.rounds} rounds, on {machine_summary()}", flush=True)
    os.environ.pop("TUTORIAL_RUN_DIR", None)  # the trainer's per-rank metrics files are not wanted here
    with tempfile.TemporaryDirectory() as scratch:
        text_path = Path(scratch) / "help_pages.txt"
        text_path.write_text(help_pages()[:args.chars])
        measured = {}
        for procs in range(1, args.max_procs + 1):
            measured[procs] = measure(procs, args, str(text_path))
            for K, rates in measured[procs].items():
                print(f"  N={procs} K={K}: DDP {rates['ddp']:,.0f} tokens/s, independent "
                      f"{rates['independent']:,.0f} tokens/s", flush=True)
    report(measured, args.plot, f"GPT on CPU processes, micro-batch {args.batch_size}")
    print(f"at the end: {machine_summary()}")


if __name__ == "__main__":
    main()
