"""Writes notebooks/09_context_parallel.ipynb (cells only; `python notebooks/execute.py
notebooks/09_context_parallel.ipynb` runs it and stores its outputs). Edit the cells here, not in the notebook, then
run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 9 — context parallelism: each sequence split over the ranks, attention by a ring

`context_parallel.py` is `gpt.py` (step 6) with every sequence cut into pieces, one group of `cp` ranks sharing
it: each rank holds the whole model and T/cp of the positions. Everything but attention treats each position on its
own; attention needs the keys and values of the positions before it, which other ranks hold, so they travel: around
a **ring** (each rank's block passes from rank to rank, cp steps, merged by an online softmax), or **all-gathered**.

This notebook draws which rank computes which part of the causal attention under the two ways of cutting a
sequence, runs the step on 2 CPU processes, and checks it against one process training on whole sequences."""),
    new_code_cell("""from nbhelpers import print_job, scratch, show_diff
from harness.jobs import machine_summary, output, run, shared_file, torchrun
from utils.gpt import help_pages
from utils.metrics import RUN_DIR_VARIABLE

print(machine_summary())"""),
    new_markdown_cell("""## The diff from step 6

Generated from the two files in the repository. The loop is step 6's; what is new is the (dp, cp) mesh, the sampler
over dp only (the ranks of a cp group read the same sequences), the chunks each rank holds, the batch cut to them,
and the model switched to a rank's chunks around the training loop (`split_sequence`, from `utils/context.py`)."""),
    new_code_cell("""show_diff("gpt.py", "context_parallel.py")"""),
    new_markdown_cell("""## Who computes what: the contiguous split and the balanced one

The causal mask lets a query see the keys before it: the lower triangle of the T × T scores. Cut the sequence into
cp contiguous pieces, and rank r's queries (its rows) see r + 1 pieces of keys: the last rank does the most. Cut it
into 2·cp chunks and give rank r chunks r and 2cp−1−r: every rank gets an early chunk and a late one, and the same
work. Each square below is a pair of chunks, coloured by the rank whose queries it holds; white pairs are hidden by
the mask, and the ring skips them."""),
    new_code_cell("""import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
import numpy as np

cp = 4
splits = {"contiguous: rank r holds piece r": [[r] for r in range(cp)],
          "balanced: rank r holds chunks r and 2cp-1-r": [[r, 2 * cp - 1 - r] for r in range(cp)]}
figure, axes = plt.subplots(1, 2, figsize=(10, 4.6))
colours = ListedColormap(["white", "tab:blue", "tab:orange", "tab:green", "tab:red"])
work = {}
for ax, (title, chunks_by_rank) in zip(axes, splits.items()):
    n = sum(map(len, chunks_by_rank))
    owner = {chunk: rank for rank, chunks in enumerate(chunks_by_rank) for chunk in chunks}
    grid = np.array([[owner[a] + 1 if b <= a else 0 for b in range(n)] for a in range(n)])
    ax.imshow(grid, cmap=colours, vmin=0, vmax=4)
    ax.set(title=title, xlabel="keys (chunk)", ylabel="queries (chunk)", xticks=range(n), yticks=range(n))
    work[title] = [int((grid == rank + 1).sum()) for rank in range(cp)]
figure.suptitle(f"cp = {cp}: the chunk pairs each rank computes (colour: the rank)")
plt.tight_layout()
plt.show()"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
for title, pairs in work.items():
    print(f"{title.split(':')[0]:10}  chunk pairs per rank: {pairs}")"""),
    new_markdown_cell("""A pair on the diagonal is half masked, so the contiguous split's imbalance in time is a little less than
its count of pairs: `benchmarks/context_parallel.py` measures it (docs/context-parallel.md quotes it).

## The step on 2 processes, and one process on whole sequences

A 4,600-character excerpt of the help pages (64 sequences of 64 characters to train on), a context of 64 (4 chunks
of 16 at cp = 2), batches of 8, 8 optimizer steps an epoch, 2 epochs, dropout 0, the ring. Each rank writes its
per-epoch metrics (its own tokens' mean loss) to `runs/`."""),
    new_code_cell("""text = shared_file("help_excerpt.txt", help_pages()[:4600])  # a file named by its content
# shared=True: in the test suite, a run that a test makes too (tests/test_context_parallel.py's ring job) is made once
# for both; in Jupyter it simply runs.
job = run(torchrun("context_parallel.py", 2, 1, "--workload", "gpt-cpu", "--text", text, "--context", 64,
                   "--dropout", 0, "--batch_size", 8, "--cp", 2, "--exchange", "ring", nproc=2,
                   launcher_args=["--max_restarts=1"]),
          cwd=scratch("ring"), env={RUN_DIR_VARIABLE: "runs"}, timeout=240, shared=True)
print_job(job)"""),
    new_markdown_cell("""One process, the same GPT, the same batches in the same order, on whole sequences
(`harness/one_process.py`, the reference the tests and the workshop checker use too): what the two ranks must have
computed together. Each epoch's mean loss of the job is the mean over both ranks' tokens (each rank's
metrics file holds its own half)."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
import json

import torch

from harness.one_process import train_gpt

alone = train_gpt(text, batch_size=8, epochs=2, context=64)  # AdamW, the schedule, clipping: the step's loop
records = [json.loads(line) for rank in (0, 1) for line in (job.cwd / "runs" / f"rank{rank}.jsonl").open()]
for epoch in range(2):
    mine = [r for r in records if r["epoch"] == epoch]
    split = sum(r["loss"] * r["samples"] for r in mine) / sum(r["samples"] for r in mine)
    print(f"epoch {epoch}: 2 ranks {split:.4f} (rank 0's tokens {mine[0]['loss']:.4f}, rank 1's "
          f"{mine[1]['loss']:.4f}) | one process {alone['losses'][epoch]:.4f} | equal to 1e-5: "
          f"{abs(split - alone['losses'][epoch]) < 1e-5}")
snapshot = torch.load(job.cwd / "cp_snapshot.pt", weights_only=True)["MODEL_STATE"]
farthest = max((snapshot[name] - value).abs().max().item() for name, value in alone["weights"][2].items())
print("the weights equal one process's to 2e-4:", farthest < 2e-4)"""),
    new_markdown_cell("""The two ranks' own losses differ (rank 0 predicts the first and the last chunk of every sequence, rank 1
the two in the middle), and their mean is one process's. The snapshot holds the whole model, as every rank does: `--cp 1`, or any other
`--cp`, resumes from it."""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "09_context_parallel.ipynb")


if __name__ == "__main__":
    main()
