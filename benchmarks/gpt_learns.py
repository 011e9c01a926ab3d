"""Does the GPT learn visibly in the time a learner gives it? Step 6's CPU command from the README, timed, with the
held-out loss it reaches and how much of its sample is real words of its text.

    python benchmarks/gpt_learns.py                      # the README's command: 2 processes, 10 epochs, save every 5
    python benchmarks/gpt_learns.py --epochs 4 --chars 100000

It runs `torchrun --standalone --nproc_per_node=2 gpt.py EPOCHS EPOCHS/2 --batch_size 16 --grad_accum 2` in a fresh
folder (on a text of --chars characters of Python's help pages; all of them by default), as a learner types it: one
CPU thread per process, unbuffered. It prints the wall time of the whole command (start-up, training, evaluation,
the sample), the held-out loss against the untrained model's, the sample, and the part of its words of 3+ letters
that are words of the text. The goals the tutorial sets for the README's command: within about 90 s on 2 quiet
cores, a held-out loss of at most 1.8, and at least a third of the sample's words real. The load average before and
after says how quiet the machine was.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/gpt_learns.py` from anywhere

from harness.jobs import machine_summary, output, run, shown, torchrun  # noqa: E402
from utils import evaluate, make_workload, positive_int  # noqa: E402

GOALS = dict(seconds=90, held_out=1.8, known_words=1 / 3)


def report(epochs, steps, seconds, held_out, untrained, sample, known):
    """The run's figures and, for each goal, whether they meet it ({goal: True or False}, printed too)."""
    print(f"\n{epochs} epochs, {steps} optimizer steps in {seconds:.0f} s (the whole command)")
    print(f"held-out loss {held_out:.3f} (untrained: {untrained:.3f})")
    print("sample:\n" + "\n".join("  | " + line for line in sample.strip("\n").splitlines()))
    print(f"words of 3+ letters that are words of the text: {'none written' if known is None else f'{known:.0%}'}")
    met = {"time": seconds <= GOALS["seconds"], "held-out loss": held_out <= GOALS["held_out"],
           "words": known is not None and known >= GOALS["known_words"]}
    print(f"goals (within {GOALS['seconds']} s, held-out <= {GOALS['held_out']}, >= a third of the words real): " +
          ", ".join(f"{name} {'met' if ok else 'NOT met'}" for name, ok in met.items()))
    return met


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=10, help="TOTAL_EPOCHS (SAVE_EVERY: half of them)")
    parser.add_argument("--chars", type=positive_int, help="Train on the first CHARS characters of the help pages")
    parser.add_argument("--timeout", type=positive_int, default=600, help="Stop the command after this many seconds")
    args = parser.parse_args()
    import torch

    from utils.gpt import help_pages

    print(machine_summary())
    with tempfile.TemporaryDirectory(prefix="gpt-learns-") as scratch:
        text_path = Path(scratch) / "text.txt"
        text_path.write_text(help_pages()[:args.chars])
        command = torchrun("gpt.py", args.epochs, max(1, args.epochs // 2), "--batch_size", 16, "--grad_accum", 2,
                           *(["--text", text_path] if args.chars else []))
        print(f"$ {shown(command)}")
        began = time.perf_counter()
        job = run(command, cwd=scratch, timeout=args.timeout)
        seconds = time.perf_counter() - began
        printed = job.output
        untrained = make_workload("gpt-cpu", text=str(text_path) if args.chars else None)
    before = evaluate(untrained.model, untrained.eval_set, untrained.loss_fn, torch.device("cpu"))["loss"]
    held_out = output.held_out(printed)["loss"]
    [(steps, sample)] = output.samples(printed)
    known = output.known_words(sample, help_pages()[:args.chars])
    met = report(args.epochs, steps, seconds, held_out, before, sample, known)
    print(machine_summary())
    return dict(seconds=seconds, held_out=held_out, known_words=known, met=met)


if __name__ == "__main__":
    main()
