"""What --precision and --compile do to gpt.py's speed here: tokens/s of each, against fp32, from real runs.

    python benchmarks/gpt_precision.py                         # fp32, bf16, fp32 + compile, bf16 + compile
    python benchmarks/gpt_precision.py --variants fp32 bf16 --epochs 3 --chars 60000

Each variant is one run of `torchrun --standalone --nproc_per_node=N gpt.py EPOCHS EPOCHS` (N: the GPUs, or 1 CPU
process with all the cores), the same text, batch and model size, dropout 0. The first epoch pays what starts once
(torch.compile builds its kernels then: its time is printed apart); the figure of a variant is its fastest later
epoch's tokens/s, and beside it the model-FLOPs utilisation where the GPU is known. On a CPU, bf16 is emulated on
most processors and runs slower than fp32, and compiling costs a minute or so up front: the table says how much on
this machine. The load average before and after says how quiet the machine was.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/gpt_precision.py` from anywhere

from harness.jobs import machine_summary, output, run, shown, torchrun  # noqa: E402
from utils import positive_int  # noqa: E402

VARIANTS = {"fp32": [], "bf16": ["--precision", "bf16"], "fp32+compile": ["--compile"],
            "bf16+compile": ["--precision", "bf16", "--compile"], "fp16": ["--precision", "fp16"]}


def measure(name, args, text, scratch, gpus):
    """One run of gpt.py as variant `name` asks, in `scratch`: its figures()."""
    # A snapshot of its own: the next variant must not resume this one's.
    command = torchrun("gpt.py", args.epochs, args.epochs, "--batch_size", args.batch_size, "--text", text,
                       "--dropout", 0, "--snapshot_path", scratch / f"{name}.pt", *VARIANTS[name], nproc=gpus or 1)
    print(f"$ {shown(command)}", flush=True)
    began = time.perf_counter()
    # One CPU process may use every core (the job runner gives a process one thread by default).
    job = run(command, cwd=scratch, gpu=True, timeout=args.timeout, env={"OMP_NUM_THREADS": None} if not gpus else None)
    return figures(time.perf_counter() - began, job.output)


def figures(seconds, printed):
    """A run's figures from what gpt.py printed: the run's seconds, epoch 0's tokens/s, the fastest later epoch's,
    and the best later MFU (None where the GPU is unknown)."""
    rates = output.throughputs(printed)
    return dict(seconds=seconds, first=rates[0][0],
                best=max(rate for epoch, (rate, _, _) in rates.items() if epoch > 0),
                mfu=max((mfu or 0) for epoch, (_, _, mfu) in rates.items() if epoch > 0) or None)


def report(rows, gpus, args):
    """The table of the variants' figures ({name: measure()'s dict}), each against fp32 (or the first, without it)."""
    base = rows.get("fp32", next(iter(rows.values())))["best"]
    print(f"\n{'GPU' if gpus else 'CPU'}, {gpus or 1} process(es), batch {args.batch_size}, {args.chars:,} characters:")
    print("| variant | whole run (s) | epoch 0 tokens/s | later epochs: tokens/s | against fp32 | MFU |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        mfu = f"{row['mfu']:.1f}%" if row["mfu"] else "n/a"
        print(f"| {name} | {row['seconds']:.0f} | {row['first']:,.0f} | {row['best']:,.0f} | "
              f"{row['best'] / base:.2f}x | {mfu} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        default=["fp32", "bf16", "fp32+compile", "bf16+compile"], help="What to compare")
    parser.add_argument("--epochs", type=positive_int, default=3, help="Epochs of each run (the first is set apart)")
    parser.add_argument("--chars", type=positive_int, default=100_000, help="Characters of Python's help pages")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="Sequences per process and step")
    parser.add_argument("--timeout", type=positive_int, default=900, help="Seconds a run may take")
    args = parser.parse_args()
    if args.epochs < 2:
        sys.exit("error: --epochs must be at least 2: the first epoch is set apart")
    import torch

    from utils.gpt import help_pages
    from utils.loop import compiler_missing

    gpus = torch.cuda.device_count()
    print(machine_summary())
    rows = {}
    with tempfile.TemporaryDirectory(prefix="gpt-precision-") as scratch:
        text = Path(scratch) / "text.txt"
        text.write_text(help_pages()[:args.chars])
        for name in args.variants:
            if "compile" in name and compiler_missing():
                print(f"{name}: left out ({compiler_missing()})")
                continue
            if name == "fp16" and not gpus:
                print("fp16: left out (CUDA only)")
                continue
            rows[name] = measure(name, args, text, Path(scratch), gpus)
    if not rows:
        sys.exit("error: no variant could run here")
    report(rows, gpus, args)
    print(machine_summary())
    return rows


if __name__ == "__main__":
    main()
