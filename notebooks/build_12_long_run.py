"""Writes notebooks/12_long_run.ipynb (cells only; `python notebooks/execute.py notebooks/12_long_run.ipynb` runs it
and stores its outputs). Edit the cells here, not in the notebook, then run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 12 — the long run: steps, token files, and a cursor

Step 11 trained its mesh (pp × dp × tp) for a few epochs of a text held in memory. `long_run.py` keeps that mesh and
changes how the run is counted, fed and resumed, as a run of days needs:

* **steps, not epochs**: `long_run.py 36 6` trains for 36 optimizer steps and saves every 6; an epoch is whatever
  number of steps the data happens to fill;
* **token files read from disk**: `tools/prepare_data.py` writes a text's documents once as `train.bin` and `val.bin`
  (uint16 ids) with `meta.json`; every rank memory-maps them and reads only the rows it trains on;
* **a global batch of fixed size, whatever the layout**: `--global_batch` sequences a step, all dp ranks together,
  each dp rank reading a contiguous 1/dp of it (its share), in `--microbatches` micro-batches;
* **a cursor in the snapshot**: which rows global batch k holds depends on k alone, so the snapshot keeps the number
  of the next global batch (`NEXT_BATCH`) instead of a sampler's position on each rank, and any layout resumes from it;
* **snapshots every N steps, the last K kept**: `long_snapshots/step-00000012` and so on, the older ones removed
  (`--keep`);
* **the loss as the mean over every counted token**: each micro-batch's loss is summed over its tokens and divided by
  the tokens that count in the whole global batch, so the padding at a document's end and the way the batch is split
  change nothing;
* **a held-out loss every N steps** (`--eval_every`), computed through the same pipeline on every rank;
* **`--skip BEGIN:END`**: global batches never trained on (the batches before a loss spike, say), kept in the snapshot;
* **TensorBoard scalars** that rank 0 writes to `runs/long_run`.

This notebook looks at the token files and the order a run reads them in, runs the step on 8 CPU processes (pp 2 ×
dp 2 × tp 2), checks from the job's own records which rows every rank trained on, resumes its snapshot on a single
process, and reads the TensorBoard scalars back."""),
    new_code_cell("""import collections
import hashlib
import json
import shutil

import torch

from nbhelpers import print_job, scratch, show_diff
from harness.jobs import machine_summary, output, run, torchrun
from tools.prepare_data import short_help_pages
from utils import SEED, step_snapshot
from utils.data import IGNORE, Shares, TokenFile, batch_range, global_batch, read_meta
from utils.metrics import RUN_DIR_VARIABLE

print(machine_summary())"""),
    new_markdown_cell("""## The diff from step 11

Generated from the two files in the repository. The mesh, the stages and the schedule are step 11's. What changes is
the loop: a window of `--log_every` steps replaces the epoch, a list of global batch numbers from the cursor on
replaces the `DistributedSampler`, the snapshot goes into a folder of its own every `save_every` steps and holds the
cursor, and the loss is scaled by the global batch's count of tokens. What reads the data lives in `utils/data.py`."""),
    new_code_cell("""show_diff("one_mesh.py", "long_run.py")"""),
    new_markdown_cell("""## The token files

The tests and this notebook train on the help pages of at most 1,500 characters, written once by
`tools/prepare_data.py` (`short_help_pages()` returns their folder). Every document is cut into sequences of
context + 1 = 65 characters that overlap by one character, so that each of the 64 inputs has its next character as
target. The first nine tenths of the documents go to `train.bin`, the rest to `val.bin`, and `meta.json` records the
vocabulary (every character of the text, one id each), the context and the counts."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
data = short_help_pages()  # written once in a test session, shared with tests/test_long_run.py
meta = read_meta(data)
print(f"{meta['text']['name']}: {meta['text']['characters']:,} characters, a vocabulary of {len(meta['vocab'])}")
for split in ("train", "val"):
    counts, size = meta[split], (data / f"{split}.bin").stat().st_size
    print(f"{split}.bin: {counts['documents']} documents, {counts['sequences']} sequences of {meta['context']} + 1 ids "
          f"({size:,} bytes: 2 a token), {counts['targets']:,} targets that count")"""),
    new_markdown_cell("""`TokenFile` memory-maps the file for each read and lets the mapping go once it has copied the rows
asked for: a rank's memory holds the rows it reads, never the file. A document's last sequence is padded with id 65535 (`PAD`); `read` turns the padded targets
into `IGNORE` (-100, which `F.cross_entropy` leaves out) and gives the padded inputs id 0, which no position that
counts attends to (attention is causal, and the padding comes last). Below, the end of the first document and the
start of the second; `·` marks a padded position, and `⏎` a newline."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
train = TokenFile(data, "train")
inputs, targets = train.read(range(len(train)))


def text(ids, padded):
    \"\"\"The characters of `ids`, padded positions as ·, newlines as ⏎.\"\"\"
    return "".join("·" if pad else meta["vocab"][i].replace("\\n", "⏎") for i, pad in zip(ids.tolist(), padded))


first_end = int((targets == IGNORE).any(dim=1).nonzero()[0])  # the first row with padding
for row in (first_end - 1, first_end, first_end + 1):
    counted = int((targets[row] != IGNORE).sum())
    padded_inputs = [False] + (targets[row][:-1] == IGNORE).tolist()  # input j is padding when target j - 1 is
    print(f"sequence {row}: {counted} of {meta['context']} targets count")
    print(f"  inputs  {text(inputs[row], padded_inputs)}")
    print(f"  targets {text(targets[row].clamp(min=0), (targets[row] == IGNORE).tolist())}")"""),
    new_markdown_cell("""Sequence 17 ends the first document: its last character has no target (nothing follows it
in the document), and the positions after it are padding. Sequence 18 begins the next document.

### The draw: which sequences a global batch holds

A run reads the training sequences as one stream: every sequence once per epoch, in an order drawn anew each epoch
from the seed and the epoch's number (computed for the positions a batch reads alone: no rank holds a whole epoch's
order), cut into global batches of `--global_batch` sequences. Global batch k is
positions 16 k to 16 k + 15 of that stream (`utils.data.global_batch`), whatever the number of ranks. With 409
sequences an epoch is 25 global batches and 9 sequences: global batch 25 holds the last 9 of epoch 0 and the first 7
of epoch 1. Each epoch's order is drawn on its own, so a sequence that ends one epoch may begin the next, even in the
same global batch: every epoch still reads every sequence once."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
count, size = len(train), 16
for batch in (0, 1, 2, 25):
    print(f"global batch {batch:2}: {global_batch(count, batch, size, SEED).tolist()}")
stream = torch.cat([global_batch(count, batch, size, SEED) for batch in range(30)])
epoch0, epoch1 = stream[:count], stream[count:]
print(f"the first {count} sequences of the stream (epoch 0) hold every sequence once:",
      sorted(epoch0.tolist()) == list(range(count)))
print(f"global batch 25: {count - 25 * size} sequences of epoch 0, then {26 * size - count} of epoch 1; in both:",
      sorted(set(epoch0[25 * size:].tolist()) & set(epoch1[:26 * size - count].tolist())))
print("epoch 1 in another order:", epoch1.tolist() != epoch0[:len(epoch1)].tolist())"""),
    new_markdown_cell("""Each dp rank reads its share of a global batch, and no other row:
`Shares(tokens, 16, SEED, dp_rank, dp)[k]` gives rank `dp_rank` of `dp` the inputs and targets of rows `16/dp ×
dp_rank` onward of batch k. Put together, the shares are the same 16 rows on 1, 2 or 4 dp ranks. The step divides each
micro-batch's summed loss by the number of targets that count in the **whole** global batch: each rank counts its
share's, and one all-reduce over dp adds them up, a number a step. Batch 25's micro-batches (2 dp ranks × 2) count
different numbers of tokens, and a mean of their means would weigh a token of a short micro-batch more than one of a
long one."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
whole_inputs, whole_targets = Shares(train, size, SEED, 0, 1)[25]
for dp in (2, 4):
    shares = [Shares(train, size, SEED, rank, dp)[25] for rank in range(dp)]
    print(f"batch 25 read by {dp} dp ranks, {size // dp} rows each: the same 16 rows as one reads:",
          torch.equal(torch.cat([inputs for inputs, _ in shares]), whole_inputs),
          "| their counts add up to the whole batch's:",
          sum(int((targets != IGNORE).sum()) for _, targets in shares) == int((whole_targets != IGNORE).sum()))
shares = [Shares(train, size, SEED, rank, 2)[25] for rank in range(2)]
micro = [int((part != IGNORE).sum()) for _, targets in shares for part in targets.chunk(2)]
counted = int((whole_targets != IGNORE).sum())
print(f"batch 25: {counted} targets count, in the 4 micro-batches of 2 dp ranks: {micro}")"""),
    new_markdown_cell("""`--skip BEGIN:END` leaves global batches out of the list a run reads
(`utils.data.batch_range`): from the cursor 24, six steps with `--skip 26:29` read batches 24, 25, 29, 30, 31 and 32.
The snapshot keeps the range, so a restart with the same command skips it again, silently; a range the run has passed
stops it with one line."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
print(batch_range(24, 6, (26, 29), "", say=True))"""),
    new_markdown_cell("""## The uninterrupted job: 8 processes, pp 2 × dp 2 × tp 2

36 optimizer steps of global batches of 16 sequences (8 a dp rank, in 2 micro-batches of 4), the CPU-size GPT (2
blocks, a context of 64), dropout 0, fp32: about an epoch and a half. A line every 6 steps (`--log_every`), a snapshot
every 6 (the second argument) of which the last 5 stay (`--keep`), a held-out loss every 12 (`--eval_every`) and at
the end. The job is recorded (`record=True`): every process writes, before each optimizer step, a digest of every row
it trained on in that step (`batches.jsonl`). Each rank writes its per-window metrics to `runs/`."""),
    new_code_cell("""# shared=True: in the test suite, the job tests/test_long_run.py runs too is run once for both;
# in Jupyter it simply runs.
job = run(torchrun("long_run.py", 36, 6, "--data", data, "--workload", "gpt-cpu", "--dropout", 0, "--global_batch",
                   16, "--microbatches", 2, "--eval_every", 12, "--log_every", 6, "--keep", 5, "--pp", 2, "--tp", 2,
                   nproc=8),
          cwd=scratch("straight"), env={RUN_DIR_VARIABLE: "runs"}, timeout=300, record=True, shared=True)
print_job(job)"""),
    new_markdown_cell("""Each line covers the window of 6 steps that ends there: the tokens trained on since the start,
the mean loss over every token that counted in the window, and the whole job's pace (held-out losses and snapshots
included). The held-out loss at step 0 is that of the initial weights. Of the six snapshots, the last five
are left:"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
print(sorted(path.name for path in (job.cwd / "long_snapshots").iterdir()))"""),
    new_markdown_cell("""## Which rows every rank trained on

`batches.jsonl` holds a line per optimizer step and process: its rank, its place in the mesh, the step's number in
that process, and a digest of each row it trained on. Rank = 4 × pp + 2 × dp + tp, so the four ranks of dp 0 (ranks
0, 1, 4 and 5: both pipeline ranks, both tp ranks) must have read the same rows, and so must the four of dp 1; the
two shares, dp 0's then dp 1's, must be global batch `step - 1`. Below, the digests are turned back into sequence
indices (a few sequences are alike: two help pages hold the same text, and their indices are shown together)."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
def digest(x, y):
    \"\"\"A row's digest, as the recorder computes it: its inputs' and targets' bytes.\"\"\"
    return hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]


file_rows = [digest(x, y) for x, y in zip(inputs, targets)]  # every sequence of train.bin, in the file's order
indices_of = collections.defaultdict(list)
for index, row in enumerate(file_rows):
    indices_of[row].append(index)


def trained(ran, first_step=0):
    \"\"\"{step: the rows of its global batch, dp 0's share then dp 1's}, from batches.jsonl; the step counted from the
    run's start (a process that resumed at step 12 counts from there). Every rank of a dp share read the same
    rows.\"\"\"
    shares = collections.defaultdict(lambda: collections.defaultdict(set))
    for record in ran.records("batches.jsonl"):
        shares[first_step + record["step"]][record["mesh"]["dp"]].add(tuple(record["rows"]))
    assert all(len(rows) == 1 for step in shares.values() for rows in step.values()), "a dp share read two ways"
    return {step: [row for dp in sorted(by_dp) for row in next(iter(by_dp[dp]))]
            for step, by_dp in sorted(shares.items())}


def shown(rows, first=4):
    return ", ".join("/".join(map(str, indices_of[row])) for row in rows[:first]) + ", ..."


steps = trained(job)
print("ranks that recorded each step:", {len({r["rank"] for r in job.records("batches.jsonl") if r["step"] == s})
                                         for s in steps})
print("every step's rows are global batch step - 1's:",
      all(rows == [file_rows[i] for i in global_batch(count, step - 1, size, SEED)] for step, rows in steps.items()))
print("step  global batch  dp 0's share (ranks 0, 1, 4, 5)        dp 1's share (ranks 2, 3, 6, 7)")
for step in (1, 2, 3, 25, 26, 27):
    print(f"{step:4}  {step - 1:12}  {shown(steps[step][:8]):36}  {shown(steps[step][8:])}")"""),
    new_markdown_cell("""Step 26 trains on global batch 25, which ends epoch 0 and begins epoch 1. Read in order, the
rows of the first 409 sequences the job trained on are every sequence of `train.bin` once (a multiset: the sequences
that are alike count as often as the file holds them), in a drawn order, not the file's."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
read = [row for step in sorted(steps) for row in steps[step]]
print(f"{len(read)} rows read in {len(steps)} steps; the first {count} are every sequence once:",
      collections.Counter(read[:count]) == collections.Counter(file_rows))
print("in a drawn order:", read[:count] != file_rows)
print("the rest (epoch 1) repeats none:", not collections.Counter(read[count:]) - collections.Counter(file_rows))"""),
    new_markdown_cell("""## The snapshot after 12 steps, resumed by one process

The snapshot holds every weight and every Adam moment under the whole model's names, and the cursor: `STEPS_RUN` 12,
`NEXT_BATCH` 12, the tokens seen, the ranges skipped, and the global batch's size (a resume with another
`--global_batch` stops with one line). One process (`--pp 1 --tp 1`: the GPT in 2 stages, both on the one rank,
dp 1, the whole global batch of 16 in 2 micro-batches of 8) resumes it to the end, from a copy of that snapshot
alone."""),
    new_code_cell("""alone_dir = scratch("resume-1")
shutil.copytree(step_snapshot(job.cwd / "long_snapshots", 12), step_snapshot(alone_dir / "long_snapshots", 12))
alone = run(torchrun("long_run.py", 36, 6, "--data", data, "--workload", "gpt-cpu", "--dropout", 0, "--global_batch",
                     16, "--microbatches", 2, "--eval_every", 12, "--log_every", 6, "--keep", 5, "--pp", 1, "--tp", 1,
                     nproc=1),
            cwd=alone_dir, env={RUN_DIR_VARIABLE: "runs"}, timeout=300, record=True)
print_job(alone)"""),
    new_markdown_cell("""It resumed at step 12 and global batch 12. Its records count the steps from its own start, so
its step 1 is the job's step 13. Its losses come from `runs/rank0.jsonl`; the 8-rank job's from the two ranks that
count tokens (the first tp rank of each dp share's last stage: ranks 4 and 6), their losses weighted by the tokens
they counted. Every window's loss, unrounded, is the mean over all the window's tokens."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
def window_losses(ran):
    \"\"\"{step: the mean loss over every token of the window of steps that ends there}, from the per-rank
    metrics.\"\"\"
    windows = collections.defaultdict(list)
    for path in (ran.cwd / "runs").glob("rank*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            windows[record["step"]].append(record)
    return {step: sum(r["loss"] * r["samples"] for r in records) / sum(r["samples"] for r in records)
            for step, records in sorted(windows.items())}


resumed_at = output.step_resumes(alone.output)[0]
print("resumed at (step, global batch):", resumed_at)
ours = trained(alone, first_step=resumed_at[0])
print(f"its steps {min(ours)} to {max(ours)} read the 8-rank job's rows, in order:",
      ours == {step: rows for step, rows in steps.items() if step > 12})
mesh_losses, alone_losses = window_losses(job), window_losses(alone)
print("windows:", sorted(alone_losses), "| losses within 1e-5 of the 8-rank job's:",
      all(abs(loss - mesh_losses[step]) < 1e-5 for step, loss in alone_losses.items()))
mesh_held, alone_held = dict(output.held_out_losses(job.output)), dict(output.held_out_losses(alone.output))
print("held-out losses at steps", sorted(alone_held), "within 1e-4:",
      all(abs(loss - mesh_held[step]) <= 1e-4 for step, loss in alone_held.items()))"""),
    new_code_cell("""for step, loss in alone_losses.items():
    print(f"window ending at step {step}: 8 ranks {mesh_losses[step]:.7f} | one process {loss:.7f}")
print(f"the largest difference: {max(abs(loss - mesh_losses[step]) for step, loss in alone_losses.items()):.1e}")"""),
    new_markdown_cell("""The same rows, and the same losses up to float rounding: one process adds up a step's gradients
over 2 micro-batches of 8, where the mesh adds up tp's parts of each product and 4 micro-batches of 4 on two dp
shares, in other orders. The tests
go further: the snapshot resumed on 4 ranks, then on one process, reads exactly the uninterrupted job's batches, and
a job killed between two snapshots ends bit for bit where the uninterrupted one does.

## TensorBoard

Rank 0 writes four scalars to `runs/long_run` with `torch.utils.tensorboard.SummaryWriter`: `loss/train` and
`tokens_per_s` every window, `learning_rate`, and `loss/held_out` every `--eval_every` steps. A resume writes over
what a killed attempt wrote after its snapshot's step (`purge_step`); what it wrote up to that step, the held-out loss
included, was on disk before the snapshot, and a resume does not write it again: each step appears once. TensorBoard's own reader,
`EventAccumulator`, reads the event file back:"""),
    new_code_cell("""import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

board = EventAccumulator(str(job.cwd / "runs" / "long_run"))
board.Reload()
scalars = {tag: {event.step: event.value for event in board.Scalars(tag)} for tag in board.Tags()["scalars"]}
print("event file:", [path.name for path in (job.cwd / "runs" / "long_run").iterdir()])
print("scalars:", sorted(scalars))

figure, (losses, rate) = plt.subplots(1, 2, figsize=(11, 3.2))
for tag, marker in (("loss/train", "o"), ("loss/held_out", "s")):
    losses.plot(list(scalars[tag]), list(scalars[tag].values()), marker=marker, label=tag)
losses.set(xlabel="optimizer step", ylabel="loss (mean over every token)", title="The loss, read from TensorBoard")
losses.legend()
rate.plot(list(scalars["learning_rate"]), list(scalars["learning_rate"].values()), marker="o")
rate.set(xlabel="optimizer step", ylabel="learning rate", title="The learning rate after each window")
for ax in (losses, rate):
    ax.grid(alpha=0.3)
figure.tight_layout()
plt.show()"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
lines = output.step_lines(job.output)
print("loss/train at steps", sorted(scalars["loss/train"]), "is what the lines say:",
      {step: round(value, 4) for step, value in scalars["loss/train"].items()} ==
      {step: line["loss"] for step, line in lines.items()})
print("loss/held_out at steps", sorted(scalars["loss/held_out"]), "is what the lines say:",
      all(abs(value - mesh_held[step]) <= 5e-5 for step, value in scalars["loss/held_out"].items()))"""),
    new_markdown_cell("""To watch a run as it trains, start TensorBoard on the folder it runs in and open the address it
prints (http://localhost:6006 by default):

```bash
tensorboard --logdir runs
```

Each run's scalars are in a folder of their own under `runs/` (`--logdir` names it), so two runs side by side show
as two curves. `tools/plot_metrics.py` draws the per-rank metrics of `runs/rank*.jsonl` without TensorBoard.

[The step's page](../docs/long-run.md) walks through the token files, the cursor, the global batch and the loss line
by line, and says what the tests prove."""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "12_long_run.ipynb")


if __name__ == "__main__":
    main()
