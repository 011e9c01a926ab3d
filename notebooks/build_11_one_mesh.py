"""Writes notebooks/11_one_mesh.ipynb (cells only; `python notebooks/execute.py notebooks/11_one_mesh.ipynb` runs it
and stores its outputs). Edit the cells here, not in the notebook, then run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 11 — one mesh: pipeline stages, FSDP and tensor parallelism together

Steps 5, 7 and 8 split the model one way each. `one_mesh.py` does all three at once, on one `DeviceMesh` of three
dimensions, `("pp", "dp", "tp")`:

* **pp**, outermost: the GPT cut into 2 × pp stages, pipeline rank p holding stages p and p + pp, run by the
  interleaved 1F1B schedule;
* **dp**: each rank's layers sharded by FSDP2 over the ranks that hold the same slice, gradients reduced in fp32;
* **tp**, innermost: every block split over tp as in step 7, with sequence parallelism between the matrices (each tp
  rank holds context/tp of the positions there) and the loss computed on logits split over the vocabulary.

The model is built on the meta device: no rank ever holds it whole. This notebook runs the step on 8 CPU processes
(pp 2 × dp 2 × tp 2), reads from the job's own files who holds what and how much, compares its training with one
process's, and resumes its snapshot on a single process."""),
    new_code_cell("""import json
import shutil

from nbhelpers import print_job, scratch, show_diff
from harness.jobs import machine_summary, run, shared_file, torchrun
from utils.gpt import help_pages
from utils.metrics import RUN_DIR_VARIABLE

print(machine_summary())"""),
    new_markdown_cell("""## The diff from step 8

Generated from the two files in the repository. The loop and the sharded snapshot are step 8's; what is new is
`parallelize` (the tensor-parallel plan, two stages a rank, FSDP over dp, activation checkpointing on request), the
interleaved schedule inside `loss_parallel`, the model built on the meta device and given one process's weights, the
asynchronous snapshots, and the export of the whole model to one file, weight by weight."""),
    new_code_cell("""show_diff("pipeline_parallel.py", "one_mesh.py")"""),
    new_markdown_cell("""## 8 processes: pp 2 × dp 2 × tp 2

A 4,600-character excerpt of the help pages (64 sequences of 64 characters), batches of 4 per dp rank (8 in all) in
2 micro-batches, 3 epochs of 8 optimizer steps, dropout 0, fp32. The model is built on the meta device (shapes, no
memory); each rank gives memory to its shards alone, then **draws one process's initial weights** again, one weight at
a time, on the CPU, keeping its part of each (`init_weights(seed=SEED)`). So the job starts from the very weights one
process starts from, which the comparison below needs, with no seed checkpoint (`--seed_checkpoint` reads the same
weights from a DCP folder instead). Each rank writes its per-epoch metrics to `runs/`."""),
    new_code_cell("""text = shared_file("help_excerpt.txt", help_pages()[:4600])  # a file named by its content
# shared=True: in the test suite, the job tests/test_one_mesh.py runs too is run once for both; in Jupyter it simply
# runs.
job = run(torchrun("one_mesh.py", 3, 1, "--workload", "gpt-cpu", "--text", text, "--dropout", 0,
                   "--batch_size", 4, "--pp", 2, "--tp", 2, "--microbatches", 2, nproc=8), cwd=scratch("mesh8"), env={RUN_DIR_VARIABLE: "runs"}, timeout=240, shared=True)
print_job(job)"""),
    new_markdown_cell("""## Who holds what, read from the snapshot

`init_device_mesh(..., (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))` numbers the ranks pp first, tp last: rank =
4 × pp + 2 × dp + tp. The GPT's layers are `[embed, block0, block1, head]`, cut into 4 stages of one layer each;
pipeline rank 0 holds stages 0 and 2 (`embed`, `block1`), pipeline rank 1 stages 1 and 3 (`block0`, `head`).

The snapshot says the rest. Every rank wrote its own shards into `mesh_snapshot/__<rank>_0.distcp`, and the folder's
`.metadata` records, for every weight, which block of it (its offsets and sizes) each file holds. Below, for every
rank: the layers its file holds, the rows of its block's attention queries (`q.weight`, 64 × 64, a row per output:
tp splits them by heads, FSDP splits each tp slice again over dp), and its rows of the character table (the
embedding's on pipeline rank 0, the head's on pipeline rank 1: 57 characters, split over tp, then over dp)."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
import torch.distributed.checkpoint as dcp

metadata = dcp.FileSystemReader(job.cwd / "mesh_snapshot").read_metadata()
held = {}  # rank -> {weight name: (first row, rows)}
for index, stored in metadata.storage_data.items():
    if index.fqn.startswith("MODEL_STATE.") and index.offset is not None:
        name = index.fqn.removeprefix("MODEL_STATE.")
        sizes = next(chunk.sizes for chunk in metadata.state_dict_metadata[index.fqn].chunks
                     if chunk.offsets == index.offset)
        rank = int(stored.relative_path.split("_")[2])  # "__5_0.distcp": rank 5's file
        held.setdefault(rank, {})[name] = (index.offset[0], sizes[0])


def rows(name, rank):
    first, count = held[rank][name]
    return f"{name}: rows {first}-{first + count - 1}"


print("rank  pp dp tp  layers in its file   its block's queries                    its rows of the characters")
for rank in sorted(held):
    layers = sorted({name.split(".")[0] for name in held[rank]}, key=["embed", "block0", "block1", "head"].index)
    block = next(layer for layer in layers if layer.startswith("block"))
    table = "embed.token.weight" if "embed" in layers else "head.linear.weight"
    print(f"{rank:4}  {rank // 4:2} {rank // 2 % 2:2} {rank % 2:2}  {', '.join(layers):19}  "
          f"{rows(block + '.attention.q.weight', rank):37}  {rows(table, rank)}")"""),
    new_markdown_cell("""Along a tp group (ranks 0 and 1) the queries are split by heads: rows 0-31 (heads 0 and 1)
on tp 0, rows 32-63 (heads 2 and 3) on tp 1. Along a dp group (ranks 0 and 2) FSDP halves each tp slice: rows 0-15
and 16-31. The character table is split the same two ways, 29 + 28 characters over tp, then about half of each over
dp. The LayerNorms and the biases added after a row-wise matrix are not split over tp: both tp ranks hold them (each
rank's FSDP shard of them), and the snapshot writes one copy.

## What each rank holds, in bytes

Every rank recorded, after each optimizer step, the bytes of its own shards (`params`), of their gradients
(`grads`) and of AdamW's state for them (`optim`: two moments and a 4-byte step count per tensor), and how many bytes
autograd kept for backward in the epoch's first step (`activation_bytes`: every micro-batch through both its stages,
weights excluded). Epoch 1's records (every epoch's are the same), against one process that holds the whole model
and runs the whole batch of 8 sequences:"""),
    new_code_cell("""import matplotlib.pyplot as plt
import torch

from utils import make_workload
from utils.memory import saved_for_backward

records = {rank: [json.loads(line) for line in (job.cwd / "runs" / f"rank{rank}.jsonl").open()][1]
           for rank in range(8)}
# One process: the whole GPT, its gradients and Adam's moments (4 bytes a number each), and the activations of one
# forward of the batch of 8, measured the way the ranks measure theirs.
alone = make_workload("gpt-cpu", text=str(text), dropout=0)
whole = sum(param.numel() * 4 for param in alone.model.parameters())
source, targets = (torch.stack(part) for part in zip(*(alone.train_set[i] for i in range(8))))
saved = saved_for_backward()
with saved:
    alone.loss_fn(alone.model(source), targets).backward()
columns = {"one process": dict(params=whole, grads=whole, optim=2 * whole, activation_bytes=saved.bytes)}
columns.update({f"rank {rank}": record for rank, record in records.items()})

print(f"{'':12} {'params':>9} {'grads':>9} {'optim':>9} {'activations':>12}  (KiB)")
for label, record in columns.items():
    print(f"{label:12} " + " ".join(f"{record[key] / 2**10:9.1f}" for key in ("params", "grads", "optim"))
          + f" {record['activation_bytes'] / 2**10:12.1f}")

figure, ax = plt.subplots(figsize=(10, 3.4))
bottom = [0] * len(columns)
for key, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optim", "tab:green"),
                   ("activation_bytes", "tab:red")):
    heights = [record[key] / 2**10 for record in columns.values()]
    ax.bar(list(columns), heights, bottom=bottom, color=color, label=key)
    bottom = [b + h for b, h in zip(bottom, heights)]
ax.set(ylabel="KiB", title="What one process holds for the batch of 8, and what each of the 8 ranks holds")
ax.legend()
ax.grid(axis="y", alpha=0.3)
plt.show()"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
# The LayerNorms and the biases after a row-wise split are held by both ranks of a tp group: the rest once.
replicated = sum(param.numel() * 4 for name, param in alone.model.named_parameters()
                 if "norm" in name or "proj.bias" in name)
print("the 8 ranks hold the model once, and what tp replicates twice:",
      sum(record["params"] for record in records.values()) == whole + replicated)
print("every rank holds less than a seventh of the weights:", all(7 * r["params"] < whole for r in records.values()))
print("every rank holds a gradient per weight, two moments:",
      all(r["grads"] == r["params"] and 2 * r["params"] < r["optim"] for r in records.values()))"""),
    new_markdown_cell("""A rank holds about an eighth of the weights, of their gradients and of Adam's state: the
model is cut in two along pp, each half in two along tp, each slice in two along dp. Its activations are those of
its dp group's 4 sequences (half the batch), of 2 of the 4 layers, and between the matrices of 1/tp of the positions.
With `--checkpoint_activations` a block keeps only its input and runs its forward again in backward: measured on this
job with it, 35 KiB instead of 583 on the ranks of pp 0, 160 instead of 708 on those of pp 1 (the head's logits stay).

## The same training as one process

One process, the same GPT from the same initial weights, the same batches of 8 in the same order
(`harness/one_process.py`, the reference the tests use too): 3 epochs, and a fourth for the resume below, the schedule's
cosine ending after the third as the job's does. The job's loss of an epoch is the mean over the samples of the two
ranks that count them (the first tp rank of each dp group's last stage); its final weights are in
`mesh_model_full.pt`, the whole model rank 0 wrote, weight by weight, as one plain file."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
from harness.one_process import train_gpt

reference = train_gpt(text, 8, 4, 3, drop_last=True)


def job_losses(ran):
    \"\"\"Each epoch's mean loss over the ranks that counted samples, from the per-rank metrics.\"\"\"
    epochs = {}
    for path in (ran.cwd / "runs").glob("rank*.jsonl"):
        for record in map(json.loads, path.open()):
            summed, samples = epochs.get(record["epoch"], (0.0, 0))
            epochs[record["epoch"]] = summed + record["loss"] * record["samples"], samples + record["samples"]
    return {epoch: summed / samples for epoch, (summed, samples) in sorted(epochs.items())}


def farthest(ran, epochs):
    \"\"\"The largest difference between the job's exported weights and one process's after `epochs` epochs.\"\"\"
    exported = torch.load(ran.cwd / "mesh_model_full.pt", weights_only=False)
    return max((exported[name] - weight).abs().max().item() for name, weight in reference["weights"][epochs].items())


mesh_losses = job_losses(job)
for epoch, loss in mesh_losses.items():
    print(f"epoch {epoch}: 8 ranks {loss:.4f} | one process {reference['losses'][epoch]:.4f}")
loss_gap = max(abs(loss - reference["losses"][epoch]) for epoch, loss in mesh_losses.items())
print("losses equal within 1e-5:", loss_gap < 1e-5)
print("weights equal within 2e-4:", farthest(job, 3) < 2e-4)"""),
    new_code_cell("""print(f"the largest differences: losses {loss_gap:.1e}, weights {farthest(job, 3):.1e}")"""),
    new_markdown_cell("""Equal up to float rounding: the mesh sums each matrix product's parts over tp, each
micro-batch's gradients, and the dp ranks' shards in other orders than one process does, and Adam's division by the
gradients' running magnitude magnifies those last bits in a few weights. One process training other batches ends
about 0.15 away (the tests check that too).

## The snapshot, resumed by one process

The snapshot holds every weight and every Adam moment under the whole model's names, each rank's shards in its own
file: nothing in it is tied to the mesh that wrote it. One process (`--pp 1 --tp 1`: both stages on the one rank, dp
1, the whole batch of 8) resumes it for a fourth epoch, and its epoch is one process's fourth."""),
    new_code_cell("""alone_dir = scratch("resume-1")
shutil.copytree(job.cwd / "mesh_snapshot", alone_dir / "mesh_snapshot")
resumed = run(torchrun("one_mesh.py", 4, 1, "--workload", "gpt-cpu", "--text", text, "--dropout", 0,
                       "--batch_size", 8, "--pp", 1, "--tp", 1, "--microbatches", 2, nproc=1),
              cwd=alone_dir, env={RUN_DIR_VARIABLE: "runs"}, timeout=240)
print_job(resumed)"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
print("resumed from epoch 3:", "resuming from epoch 3" in resumed.output)
print(f"epoch 3: 1 process from the snapshot {job_losses(resumed)[3]:.4f} | one process {reference['losses'][3]:.4f}")
print("equal within 1e-5:", abs(job_losses(resumed)[3] - reference["losses"][3]) < 1e-5,
      "| weights within 2e-4:", farthest(resumed, 4) < 2e-4)"""),
    new_markdown_cell("""The same snapshot resumes on 4 ranks too (the tests run 8 → 4 → 1), and the exported
`mesh_model_full.pt` loads into a fresh GPT with `load_state_dict`, without `torch.distributed`.

Which layout for which model: [the step's page](../docs/one-mesh.md) explains the order of the dimensions and what
each one sends, and its memory plan computes, per rank, what a layout holds before any GPU is asked."""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "11_one_mesh.ipynb")


if __name__ == "__main__":
    main()
