"""Draw a run's per-rank metrics: training loss per rank, and throughput per epoch (each rank and all together).

    TUTORIAL_RUN_DIR=runs/try1 torchrun --standalone --nproc_per_node=2 multigpu_torchrun.py 10 5
    python tools/plot_metrics.py runs/try1                 # -> runs/try1/metrics.png
    python tools/plot_metrics.py runs/try1 -o loss.png

The loss is each rank's own mean over its share of the data (not the all-reduced one the scripts print), so
the lines differ a little from rank to rank; throughput is samples per second per epoch (the long run, step 12:
tokens per second per --log_every window), drawn at the optimizer step each ends at. plot_speedups() draws the
scaling benchmarks' speed-up curves.
"""
import argparse
import json
import os
import sys


def read_run(directory):
    """{rank: [record, ...]} from a run directory (utils/metrics.py writes it), each rank's records in order."""
    runs = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as lines:
                records = [json.loads(line) for line in lines if line.strip()]
            if records:
                runs[records[0]["rank"]] = records
    return dict(sorted(runs.items()))


def plot(runs, out_path, title):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (loss_axes, speed_axes) = plt.subplots(1, 2, figsize=(11, 4))
    # x: the optimizer steps taken at the end of each record (an epoch; in the long run, a --log_every window).
    unit = next(iter(runs.values()))[0].get("unit", "samples")
    for rank, records in runs.items():
        counted = [r for r in records if r["samples"]]  # a rank that computes no loss (a pipeline's first stage)
        if counted:
            loss_axes.plot([r["step"] for r in counted], [r["loss"] for r in counted], marker=".", label=f"rank {rank}")
        speed_axes.plot([r["step"] for r in records], [r["samples_per_s"] for r in records], marker=".",
                        label=f"rank {rank}")
    if len(runs) > 1:  # the job's throughput: every rank's samples of an epoch (a window), at the slowest's pace
        by_step = {}
        for records in runs.values():
            for r in records:
                by_step.setdefault(r["step"], []).append(r)
        steps = sorted(step for step, rs in by_step.items() if len(rs) == len(runs))
        total = [sum(r["samples"] for r in by_step[s]) / max(r["seconds"] for r in by_step[s]) for s in steps]
        speed_axes.plot(steps, total, marker="o", color="black", label="all ranks")
    loss_axes.set(xlabel="optimizer step", ylabel="training loss (this rank's mean)", title="loss per rank")
    speed_axes.set(xlabel="optimizer step", ylabel=f"{unit}/s", title="throughput")
    speed_axes.set_ylim(bottom=0)
    speed_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axes in (loss_axes, speed_axes):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out_path, dpi=100)
    plt.close(figure)


def plot_speedups(curves, ylabel, out_path, title, ideal=False):
    """The scaling benchmarks' picture: each curve (label, processes, values, matplotlib style and options) against
    the number of processes, from 0 up; with ideal, the N x line too."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4.5))
    for label, procs, values, style, options in curves:
        axes.plot(procs, values, style, label=label, **options)
    widest = max(max(procs) for _, procs, _, _, _ in curves)
    if ideal:
        axes.plot([1, widest], [1, widest], ":", color="grey", label="ideal (N x)")
    axes.set(xlabel="processes (N)", ylabel=ylabel, title=title)
    axes.set_xticks(range(1, widest + 1))
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out_path, dpi=100)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the TUTORIAL_RUN_DIR of a run (holds rank0.jsonl, rank1.jsonl...)")
    parser.add_argument("-o", "--out", help="PNG to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args()
    if not os.path.isdir(args.run_dir):
        sys.exit(f"error: no run directory {args.run_dir} (set TUTORIAL_RUN_DIR when training to create one)")
    runs = read_run(args.run_dir)
    if not runs:
        sys.exit(f"error: no rank*.jsonl metrics in {args.run_dir} (was TUTORIAL_RUN_DIR set when training?)")
    out_path = args.out or os.path.join(args.run_dir, "metrics.png")
    plot(runs, out_path, f"{args.run_dir}: {len(runs)} rank(s)")
    # A record is an epoch's, or in the long run (step 12, which counts tokens) a --log_every window's.
    records = "windows" if next(iter(runs.values()))[0].get("unit") == "tokens" else "epochs"
    print(f"wrote {out_path} ({len(runs)} ranks, {max(len(r) for r in runs.values())} {records})")


if __name__ == "__main__":
    main()
