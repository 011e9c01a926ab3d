"""Writes notebooks/06_gpt.ipynb (cells only; `python notebooks/execute.py notebooks/06_gpt.ipynb` runs it and stores
its outputs). Edit the cells here, not in the notebook, then run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 6 — a small GPT, trained with the loop practitioners ship

`gpt.py` is `multinode.py` (step 4: DDP under torchrun, snapshots, any number of nodes) with the training loop a
real model needs:

* **Gradient accumulation** (`--grad_accum K`): K micro-batches per optimizer step, all but the last inside
  `model.no_sync()`, each loss divided by K. DDP then all-reduces once per optimizer step, not K times.
* **Mixed precision** (`--precision bf16|fp16`): autocast, and for fp16 (CUDA only) a `GradScaler`, unscaled before
  the gradient is clipped (`--grad_clip`).
* **AdamW with a warm-up and a cosine decay**, stepped once per optimizer step; **`--compile`**.
* **A snapshot of everything the loop depends on**: model, optimizer, schedule, scaler, steps, epochs and every
  rank's random state, so a killed and restarted job ends bit for bit where an uninterrupted one does.

The model (in `utils/gpt.py`) is a character-level GPT; it trains on Python's own help pages, which every Python
installation has. This notebook trains it on a short excerpt, to stay quick on a laptop."""),
    new_code_cell("""from nbhelpers import plot_losses, print_job, scratch, show_diff
from harness.jobs import REPO, machine_summary, output, run, shared_file, torchrun
from utils.gpt import help_pages
from utils.metrics import RUN_DIR_VARIABLE

print(machine_summary())"""),
    new_markdown_cell("""## The diff from step 4

Generated from the two files in the repository:"""),
    new_code_cell("""show_diff("multinode.py", "gpt.py")"""),
    new_markdown_cell("""## Training it: 2 processes, 2 micro-batches per optimizer step

A 4,600-character excerpt of the help pages (`--text`: 64 sequences of 64 characters to train on), 2 gloo processes
(the CPU; GPUs when there are some), batch 4 per process and `--grad_accum 2`: each optimizer step averages
2 × 2 × 4 = 16 sequences, 4 optimizer steps an epoch, 2 epochs, dropout 0. The job runner records every optimizer
step: the learning rate it used, and the gradient all-reduces DDP ran for it (a DDP communication hook counts
them). Each rank also writes its own per-epoch metrics (`TUTORIAL_RUN_DIR=runs`: in the folder the job runs in)."""),
    new_code_cell("""text = shared_file("help_excerpt.txt", help_pages()[:4600])  # a file named by its content
args = ("--workload", "gpt-cpu", "--text", text, "--batch_size", 4, "--grad_accum", 2, "--dropout", 0)
# shared=True: in the test suite, a run that a test makes too (tests/test_gpt.py's) is made once for both; in
# Jupyter it simply runs.
gpt = run(torchrun("gpt.py", 2, 2, *args), cwd=scratch("gpt"), env={RUN_DIR_VARIABLE: "runs"}, record_steps=True,
          timeout=240, shared=True)
print_job(gpt)"""),
    new_markdown_cell("""## The loss falls, and the learning rate follows its schedule per optimizer step"""),
    new_code_cell("""plot_losses({"gpt.py, 2 ranks, K=2": gpt}, title="The GPT's training loss")
lrs = [step["lr"] for step in gpt.steps if step["rank"] == 0]
print("learning rate at optimizer steps 0, 1, ... (warm-up, then cosine):",
      ", ".join(f"{lr:.2e}" for lr in lrs[:6]), "...", f"{lrs[-1]:.2e}")"""),
    new_markdown_cell("""## Tokens per second, rank by rank

Each rank reports its own epoch (samples per second, times 64 characters a sample). The line rank 0 prints is the
whole job's: the ranks together."""),
    new_code_cell("""import json

for rank in (0, 1):
    for line in (gpt.cwd / "runs" / f"rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        print(f"rank {rank} | epoch {record['epoch']} | {record['samples_per_s'] * 64:8,.0f} tokens/s")
print("the whole job, as rank 0 printed it:",
      {epoch: f"{rate:,.0f} {unit}/s" for epoch, (rate, unit, _) in output.throughputs(gpt.output).items()})"""),
    new_markdown_cell("""## What it writes

At the end rank 0 samples 200 characters from the model (a fixed prompt and seed, so the same model always writes
the same text). Eight optimizer steps on a tiny excerpt teach it little more than which characters are common, and
that spaces come between them; `make demo` trains on all the help pages, and its sample has words."""),
    new_code_cell("""[(steps, sample)] = output.samples(gpt.output)
print(f"after {steps} optimizer steps:\\n{sample}")"""),
    new_markdown_cell("""## `no_sync`: one all-reduce per optimizer step, not one per micro-batch

The same training with the `no_sync()` line taken out (a copy of `gpt.py` in a scratch folder), for one epoch on one
process (DDP all-reduces even over a single rank, so one is enough to count): every micro-batch's backward
all-reduces the gradients, K times the communication for the same optimizer step. The results are equal (the sum of
averages is the average of sums); only the traffic differs, and on a network it is the traffic that costs."""),
    new_code_cell("""source = (REPO / "gpt.py").read_text()
line = "with contextlib.nullcontext() if last else self.model.no_sync():"
assert line in source, "gpt.py's no_sync line changed: update this cell"
without = scratch("without") / "gpt_without_no_sync.py"
without.write_text(source.replace(line, "with contextlib.nullcontext():"))
plain = run(torchrun(without, 1, 1, *args, nproc=1), cwd=without.parent, record_steps=True, timeout=240)"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
def rounds(job):
    return sorted({step["rounds"] for step in job.steps})


print("gradient all-reduce rounds per optimizer step (K = 2 micro-batches):")
print(f"  with no_sync():    {rounds(gpt)}")
print(f"  without no_sync(): {rounds(plain)}")"""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "06_gpt.ipynb")


if __name__ == "__main__":
    main()
