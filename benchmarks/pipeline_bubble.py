"""The pipeline's bubble, measured: GPipe and 1F1B over M micro-batches on 2 stages of the CPU-size GPT, each step's
idle fraction against the formula (stages - 1) / (M + stages - 1), and the activations each stage holds, in one run.

    python benchmarks/pipeline_bubble.py                          # M = 1 2 4 8, batch 128, 3 rounds
    python benchmarks/pipeline_bubble.py --microbatches 2 4 8 16 --batch_size 256

Two processes (one CPU thread each, gloo) hold the two stages: the embedding and block 0, then block 1 and the head.
For every schedule and M they build pipeline_parallel.py's own Trainer (its stage, DDP, schedule, clipping, AdamW)
and take --steps optimizer steps on batches of --batch_size sequences of 64 characters, round after round (the
order reversed every other round, so that the load on the machine drifts against no one; round 0 warms up). The job
runner's recorder times every micro-batch's forward and backward on each stage (harness/jobs/recorder: pipeline.jsonl)
and counts the bytes autograd keeps for each forward's backward. Per configuration, the fastest step's (other work
on the machine only ever slows a step down: a stage preempted mid-pass looks busy, its peer idle):
  step ms     from the first forward's start to the last backward's end (the optimizer step is not in it)
  busy ms     the time a stage computed in that span (the mean of the stages): the work, without the waits
  idle        the fraction of that span each stage did not compute (waiting for an activation or a gradient)
  formula     (stages - 1) / (M + stages - 1): the idle fraction if every pass took the same time
  held        the most micro-batches whose activations a stage held at once, and their bytes (stage 0's, the most)
GPipe runs every forward before any backward, so stage 0 holds all M micro-batches: the whole batch's activations
whatever M is; 1F1B starts a micro-batch's backward as soon as it can and holds at most `stages` of them. A PNG
draws the fastest 1F1B and GPipe steps at one M (--draw, --plot).
"""
import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/pipeline_bubble.py` from anywhere

from tools import pipeline_timeline  # noqa: E402
from harness.jobs import RECORDER, free_port, machine_summary, spawned_result  # noqa: E402
from utils import exit_without_teardown, positive_int  # noqa: E402

STAGES = 2


def configurations(microbatches):
    """(schedule, M) pairs: GPipe at every M, 1F1B where it can fill the pipeline (M >= stages)."""
    return [(schedule, M) for M in microbatches for schedule in ("gpipe", "1f1b") if schedule == "gpipe" or M >= STAGES]


def trainer(rank, schedule, M, args, text_path, folder, mesh):
    """pipeline_parallel.py's own Trainer of stage `rank` of STAGES (its stage, DDP, schedule, clipping, AdamW), with
    `schedule` over M micro-batches of batches of --batch_size; its snapshots (never written) would go in `folder`."""
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import pipeline_parallel
    from utils import make_workload

    workload = make_workload("gpt-cpu", text=text_path)
    stage = pipeline_parallel.cut(workload.model, rank, STAGES)
    loader = DataLoader(workload.train_set, batch_size=args.batch_size, drop_last=True,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    options = Namespace(total_epochs=1000, microbatches=M, schedule=schedule, batch_size=args.batch_size,
                        precision="fp32", grad_clip=1.0, peak_tflops=None)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return pipeline_parallel.Trainer(stage, loader, workload.make_optimizer(stage), workload.loss_fn,
                                         torch.device("cpu"), 1000, str(Path(folder) / f"none.{schedule}{M}"),
                                         options, mesh)


def take_turns(runs, args):
    """Each configuration's steps, round after round: `runs` is {key: (its DataLoader, a function that takes one step
    on a batch's source and targets)}; --steps steps per turn, the order reversed every other round, so that the load
    on the machine drifts against no one; round 0 warms up. {key: [the numbers of its measured steps]}, the steps of
    all configurations counted from 0 in the order they ran: the recorder's numbers, with one stage per process."""
    import torch.distributed as dist

    steps, taken = {key: [] for key in runs}, 0
    for round_ in range(args.rounds + 1):
        for key in list(runs) if round_ % 2 else list(runs)[::-1]:
            batches, step = runs[key]
            dist.barrier()
            for _, (source, targets) in zip(range(args.steps), batches):
                step(source, targets)
                if round_ > 0:  # round 0 warms up
                    steps[key].append(taken)
                taken += 1
    return steps


def worker(rank, args, text_path, result_path):
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES, timeout=timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (STAGES, 1), mesh_dim_names=("pp", "dp"))
    trainers = {(schedule, M): trainer(rank, schedule, M, args, text_path, Path(result_path).parent, mesh)
                for schedule, M in configurations(args.microbatches)}
    steps = take_turns({key: (trainer.train_data, trainer._run_batch) for key, trainer in trainers.items()}, args)
    if rank == 0:
        Path(result_path).write_text(json.dumps([[schedule, M, numbers] for (schedule, M), numbers in steps.items()]))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


def recorded(job, args, nprocs, timeout, record_dir, what):
    """Run job(rank, *args, result_path) in `nprocs` spawned workers (spawned_result) with the recorder loaded, which
    writes each stage's passes to record_dir: (what rank 0 wrote, the recorded passes: pipeline.jsonl's records)."""
    import json

    paths = [str(RECORDER), str(REPO), os.environ.get("PYTHONPATH")]  # the recorder loads in the spawned workers
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                      CUDA_VISIBLE_DEVICES="", JOB_RECORD_DIR=str(record_dir),
                      PYTHONPATH=os.pathsep.join(filter(None, paths)))
    result = spawned_result(job, args, nprocs, timeout, what)
    records = [json.loads(line) for line in (Path(record_dir) / "pipeline.jsonl").read_text().splitlines()]
    return result, records


def measure(args, text_path, record_dir):
    """[(schedule, M, {step: [event, ...]} of its measured steps)]."""
    measured, records = recorded(worker, (args, text_path), STAGES, args.timeout, record_dir, "the pipeline benchmark")
    steps = pipeline_timeline.by_step(records)
    return [(schedule, M, {number: steps[number] for number in numbers}) for schedule, M, numbers in measured]


def summary(schedule, M, steps):
    """The fastest step of one configuration (other work on the machine only ever slows a step down), its figures."""
    spans = {number: pipeline_timeline.idle(events)[0] for number, events in steps.items()}
    fastest = min(spans, key=spans.get)
    span, idles = pipeline_timeline.idle(steps[fastest])
    held = {stage: pipeline_timeline.held(steps[fastest], stage) for stage in range(STAGES)}
    busy = statistics.mean(span * (1 - fraction) for fraction in idles.values())
    return dict(schedule=schedule, M=M, ms=span * 1e3, busy=busy * 1e3, idle=idles,
                formula=pipeline_timeline.bubble(STAGES, M), held=held, mean_idle=statistics.mean(idles.values()),
                events=steps[fastest])


def table(rows):
    yardstick = next(row["ms"] for row in rows if row["M"] == min(r["M"] for r in rows))
    lines = ["| schedule | M | step ms | vs M=1 | busy ms | idle stage 0 | idle stage 1 | formula | held stage 0 | "
             "held stage 1 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        held = [f"{count} ({size / 2**20:.1f} MiB)" for count, size in (r["held"][s] for s in range(STAGES))]
        lines.append(f"| {r['schedule']} | {r['M']} | {r['ms']:.0f} | {r['ms'] / yardstick:.2f}x | "
                     f"{r['busy']:.0f} | {r['idle'][0]:.0%} | {r['idle'][1]:.0%} | {r['formula']:.0%} | {held[0]} | "
                     f"{held[1]} |")
    return "\n".join(lines)


def report(measured, draw, plot_path):
    """From the recorded steps of each configuration (measure()'s list): the table, each schedule's idle fractions
    against the formula, and the plot of the fastest steps at M = `draw`."""
    rows = [summary(*configuration) for configuration in measured]
    rows.sort(key=lambda row: (row["M"], row["schedule"] != "gpipe"))
    print(f"\n{table(rows)}\n")
    for schedule in ("gpipe", "1f1b"):
        mine = [row for row in rows if row["schedule"] == schedule]
        print(f"{schedule}: mean idle " + ", ".join(f"M={r['M']} {r['mean_idle']:.0%} (formula {r['formula']:.0%})"
                                                   for r in mine))
    drawn = {f"{'GPipe' if row['schedule'] == 'gpipe' else '1F1B'}, M={row['M']}: {row['ms']:.0f} ms":
             row["events"] for row in rows if row["M"] == draw}
    Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
    pipeline_timeline.plot(drawn, plot_path, "One optimizer step of 2 pipeline stages (the fastest of its "
                                             "configuration): F = forward, B = backward of a micro-batch")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                        help="values of M (default 1 2 4 8)")
    parser.add_argument("--batch_size", type=positive_int, default=128, help="sequences per step (default 128)")
    parser.add_argument("--steps", type=positive_int, default=5, help="optimizer steps per turn (default 5)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--chars", type=positive_int, default=60000,
                        help="characters of Python's help pages to train on (default 60000)")
    parser.add_argument("--timeout", type=positive_int, default=600, help="seconds the run may take")
    parser.add_argument("--draw", type=positive_int, default=4, help="the M whose steps the PNG draws (default 4)")
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "pipeline_timeline.png"),
                        help="PNG to write (default benchmarks/results/pipeline_timeline.png)")
    args = parser.parse_args()
    if any(args.batch_size % M for M in args.microbatches):
        sys.exit(f"error: every M must divide --batch_size {args.batch_size}")

    from utils.gpt import help_pages

    print(f"2 pipeline stages of the CPU-size GPT, batch {args.batch_size} x 64 characters, {args.steps} steps x "
          f"{args.rounds} rounds per configuration, on {machine_summary()}", flush=True)
    os.environ.pop("TUTORIAL_RUN_DIR", None)  # the trainer's per-rank metrics files are not wanted here
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        text_path = Path(scratch) / "help_pages.txt"
        text_path.write_text(help_pages()[:args.chars])
        measured = measure(args, str(text_path), scratch)
    report(measured, args.draw, args.plot)
    print(f"plot: {args.plot}\n{time.perf_counter() - began:.0f} s; at the end: {machine_summary()}")


if __name__ == "__main__":
    main()
