"""What one more process costs: the CPU time the processes of the steps spend, most of it before they train a step.
This is what bounds `make test` on a small machine, where every test runs the steps as real processes.

    python benchmarks/process_cost.py                  # each command 3 times, the median
    python benchmarks/process_cost.py --repeats 5 --only import_torch import_dynamo

Each command runs through harness/jobs in a folder of its own, as the tests run it. Its CPU time is its user + system
time together with that of every process it waited for (a torchrun launcher waits for its ranks), read from this
process's account of its finished children, so other programs on the machine do not count. The steps train one
epoch of the synthetic workload here (32 steps of 64 samples): training is a small part of what a process costs.
"""
import argparse
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.jobs import PYTHON, machine_summary, python, run, torchrun  # noqa: E402
from utils import positive_int  # noqa: E402

COMMANDS = {  # name: (what it is, the command)
    "import_torch": ("a process that imports torch and ends", [PYTHON, "-c", "import torch"]),
    # DDP's constructor imports torch._dynamo (to ask whether compiled DDP is on), even when nothing is compiled.
    "import_dynamo": ("one that imports torch._dynamo too, as DDP's constructor does",
                      [PYTHON, "-c", "import torch._dynamo"]),
    "single_gpu": ("step 1: one process, one epoch", python("single_gpu.py", 1, 1)),
    "torchrun_1": ("step 3: torchrun and 1 DDP rank, one epoch", torchrun("multigpu_torchrun.py", 1, 1, nproc=1)),
    "torchrun_2": ("step 3: torchrun and 2 DDP ranks, one epoch", torchrun("multigpu_torchrun.py", 1, 1, nproc=2)),
}


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds(command, timeout=120):
    """CPU seconds of one run of `command` and of every process it waited for, in a fresh folder."""
    with tempfile.TemporaryDirectory(prefix="process-cost-") as workdir:
        before = children_cpu()
        run(command, cwd=workdir, timeout=timeout)
        return children_cpu() - before


def derived(medians):
    """Lines that split the costs: what torch._dynamo adds to an import, and what a DDP rank and the launcher add."""
    lines = []
    if {"import_torch", "import_dynamo"} <= medians.keys():
        lines.append(f"importing torch._dynamo after torch: {medians['import_dynamo'] - medians['import_torch']:.2f} s")
    if {"torchrun_1", "torchrun_2"} <= medians.keys():
        rank = medians["torchrun_2"] - medians["torchrun_1"]
        lines.append(f"one more DDP rank (torchrun_2 - torchrun_1): {rank:.2f} s")
        lines.append(f"the torchrun launcher (torchrun_1 - that rank): {medians['torchrun_1'] - rank:.2f} s")
    return lines


def report(samples):
    """A table of {name: [CPU seconds of each run]}: median and range, then the derived lines."""
    print("| command | what it is | CPU s (median) | runs (min - max) |")
    print("|---|---|---|---|")
    for name, seconds in samples.items():
        print(f"| {name} | {COMMANDS[name][0]} | {statistics.median(seconds):.2f} | "
              f"{len(seconds)} ({min(seconds):.2f} - {max(seconds):.2f}) |")
    for line in derived({name: statistics.median(seconds) for name, seconds in samples.items()}):
        print(line)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--only", nargs="+", choices=sorted(COMMANDS), default=list(COMMANDS),
                        help="measure these commands only")
    args = parser.parse_args()
    print(machine_summary())
    samples = {name: [] for name in args.only}
    for _ in range(args.repeats):  # rounds of every command, so a machine that gets busier skews all of them alike
        for name in args.only:
            samples[name].append(cpu_seconds(COMMANDS[name][1]))
    report(samples)


if __name__ == "__main__":
    main()
