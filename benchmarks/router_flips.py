"""How close a mixture of experts trained on ranks stays to one process over a realistic length: where a token first
goes to other experts than in one process, how near a tie its router was, and how far the losses part after.

    python benchmarks/router_flips.py                   # 40,000 characters, 2 epochs of 18 steps, top-1 and top-2
    python benchmarks/router_flips.py --top_k 1 --chars 20000

The reference is one process, harness.one_process.train_gpt, batches of 32, watched step by step
(harness/routes.py). Against it run expert_parallel.py (fp32, dropout 0, the aux loss weighted 0.01, the same 32
sequences a step): on 1 process (--ep 1), on 2 ranks as plain data parallelism (--ep 1, 16 a rank), on 2 ranks with
the experts split (--ep 2) and on 4 (--ep 2 x dp 2, 8 a rank); and, for contrast, the dense GPT of step 6 (gpt.py) on
2 ranks against train_gpt's dense GPT. For each job: the epoch losses and the held-out loss it printed; the first
forward whose routes differ from one process's (step, layer), how many tokens flipped there, the largest of their
one-process margins (the k-th best expert's probability less the next one's) and the forward's median margin; the
largest difference of a step's loss (the task's plus 0.01 x aux, the mean over the ranks) before that step (and
which step it was) and from that step on. The load average before and after says how quiet the machine was.
"""
import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/router_flips.py` from anywhere

from harness.jobs import machine_summary, output, run, torchrun  # noqa: E402
from harness.routes import first_flip, job_steps, reference_with_routes  # noqa: E402
from utils import positive_int  # noqa: E402
from utils.gpt import help_pages  # noqa: E402
from utils.metrics import RUN_DIR_VARIABLE  # noqa: E402

BATCH, AUX_WEIGHT = 32, 0.01  # sequences a step, all ranks together; the load-balancing loss's weight
# name: (processes, --ep); every job reads BATCH sequences a step in all.
LAYOUTS = {"1 process, --ep 1": (1, 1), "2 ranks, --ep 1 (data parallel)": (2, 1), "2 ranks, --ep 2": (2, 2),
           "4 ranks, --ep 2 x dp 2": (4, 2)}


def measure(step, text, epochs, processes, scratch, *options):
    """One recorded job of `step` on `text`, `processes` ranks sharing the BATCH sequences of a step, finished."""
    folder = Path(tempfile.mkdtemp(dir=scratch))
    command = torchrun(step, epochs, epochs, "--text", text, "--dropout", 0, "--batch_size", BATCH // processes,
                       *options, nproc=processes)
    return run(command, cwd=folder, env={RUN_DIR_VARIABLE: "runs"}, record=True, timeout=600)


def row(name, job, reference, processes, top_k):
    """A table row: the job's printed losses, its first flip against the reference, the step losses' differences."""
    steps = job_steps(job.samples, processes, top_k)
    flip = first_flip(reference, steps, top_k) if top_k else None
    differences = [abs(a - b) for a, b in zip(steps["losses"], reference["step_losses"])]
    split = flip["step"] if flip else len(differences)
    worst = max(range(split), key=differences.__getitem__, default=None)
    after = max(differences[split:], default=None)
    losses, held_out = output.epoch_losses(job.output), output.held_out(job.output)["loss"]
    flipped = (f"step {flip['step']}, layer {flip['layer']} | {flip['tokens']} | {max(flip['margins']):.1e} | "
               f"{flip['median_margin']:.1e}") if flip else "none | | |"
    return (f"| {name} | {' / '.join(f'{loss:.4f}' for loss in losses.values())} | {held_out:.4f} | {flipped} | "
            f"{'' if worst is None else f'{differences[worst]:.1e} (step {worst})'} | "
            f"{'' if after is None else f'{after:.1e}'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=positive_int, default=40_000, help="Learn the first CHARS of the help pages")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--top_k", type=positive_int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(machine_summary(), flush=True)
    with tempfile.TemporaryDirectory(prefix="router-flips-") as scratch:
        text = Path(scratch) / "text.txt"
        text.write_text(help_pages()[:args.chars])
        header = ("| job | epoch losses printed | held-out | first flip | tokens flipped | their largest margin | "
                  "median margin there | largest step-loss difference before it | after it |\n" + "|---" * 9 + "|")
        for top_k in args.top_k:
            reference = reference_with_routes(text, BATCH, args.epochs, top_k=top_k, workload="gpt-moe-cpu",
                                              aux_weight=AUX_WEIGHT)
            print(f"\ntop-{top_k}: one process (train_gpt) held-out {reference['held_out']:.4f}, "
                  f"{len(reference['step_losses'])} steps\n{header}", flush=True)
            for name, (processes, ep) in LAYOUTS.items():
                job = measure("expert_parallel.py", text, args.epochs, processes, scratch, "--workload", "gpt-moe-cpu",
                              "--ep", ep, "--top_k", top_k)
                print(row(name, job, reference, processes, top_k), flush=True)
        reference = reference_with_routes(text, BATCH, args.epochs, workload="gpt-cpu")
        job = measure("gpt.py", text, args.epochs, 2, scratch, "--workload", "gpt-cpu")
        print(f"\ndense GPT (gpt.py): one process (train_gpt) held-out {reference['held_out']:.4f}\n{header}")
        print(row("2 ranks (data parallel)", job, reference, 2, 0))
    print(machine_summary())


if __name__ == "__main__":
    main()
