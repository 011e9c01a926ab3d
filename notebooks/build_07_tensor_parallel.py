"""Writes notebooks/07_tensor_parallel.ipynb (cells only; `python notebooks/execute.py
notebooks/07_tensor_parallel.ipynb` runs it and stores its outputs). Edit the cells here, not in the notebook, then
run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 7 — tensor parallelism, and 2D (FSDP × TP)

Steps 2 to 6 split the *data*: every rank runs the whole model (DDP), or gathers each block whole just before it
runs (FSDP). Tensor parallelism splits the *layers*: the ranks of a **tp group** each hold a slice of every matrix of
a block and compute one forward pass together, adding up their partial results with an all-reduce.
`tensor_parallel.py` is `fsdp.py` with

* a 2D `DeviceMesh` of `dp × tp` ranks (`--tp N`);
* each GPT block split Megatron-style with `parallelize_module`: the queries, keys, values and the MLP's first matrix
  by output rows (each rank computes `n_head / tp` whole heads), the matrices after them by input columns;
* FSDP over the `dp` dimension only, as in step 5;
* **the data split over `dp` only**: the ranks of a tp group train on the same batches.

This notebook runs it on 4 CPU processes (dp 2 × tp 2), looks at what each rank trained on and what it holds, and
counts what DDP, FSDP, TP, 2D and CP (step 9) communicate per optimizer step."""),
    new_code_cell("""from nbhelpers import plot_mesh, plot_slices, print_job, scratch, show_diff
from harness.jobs import PYTHON, machine_summary, output, run, script, shared_file, torchrun
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages

print(machine_summary())"""),
    new_markdown_cell("""## The diff from step 5

Generated from the two files in the repository:"""),
    new_code_cell("""show_diff("fsdp.py", "tensor_parallel.py")"""),
    new_markdown_cell("""## Training it: 4 processes, dp 2 × tp 2

The CPU-size GPT (4 heads, 64 wide) on a 4,600-character excerpt of the help pages (64 sequences of 64 characters),
dropout 0, batch 4 per dp rank, 2 epochs, `--verbose`. The job runner records which samples every rank trained on,
and its place in the mesh."""),
    new_code_cell("""text = shared_file("help_excerpt.txt", help_pages()[:4600])  # a file named by its content
env = {TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0}
# shared=True: in the test suite, a run that a test makes too (tests/test_tensor_parallel.py's) is made once for
# both; in Jupyter it simply runs.
job = run(torchrun("tensor_parallel.py", 2, 1, "--tp", 2, "--batch_size", 4, "--verbose", "--workload", "gpt-cpu",
                   nproc=4), cwd=scratch("tensor_parallel"), env=env, record=True, timeout=300, shared=True)
print_job(job)"""),
    new_markdown_cell("""## The mesh, and who trained on what

`init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))` puts ranks 0 and 1 in one tp group and ranks 2 and 3
in the other. The `DistributedSampler` takes the **dp** rank and size, so both ranks of a tp group get the same
batches, and the two tp groups disjoint halves of the data:"""),
    new_code_cell("""plot_mesh(job)"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
for epoch in (0, 1):
    rows = sorted((row for row in job.samples if row["epoch"] == epoch), key=lambda row: row["rank"])
    groups = {}
    for row in rows:
        groups.setdefault(row["mesh"]["dp"], []).append(row)
    facts = [f"tp group {dp} (ranks {', '.join(str(row['rank']) for row in members)}): "
             + ("the same" if all(row["indices"] == members[0]["indices"] for row in members) else "DIFFERENT")
             + f" {len(members[0]['indices'])} samples" for dp, members in sorted(groups.items())]
    shared = set(groups[0][0]["indices"]) & set(groups[1][0]["indices"])
    print(f"epoch {epoch}: " + "; ".join(facts) + f"; shared between the groups: {len(shared)}")"""),
    new_markdown_cell("""## What each rank holds

`--verbose` prints, for every rank, each matrix of a block: its full shape, the slice over `tp` the rank computes
with, and what it stores: FSDP splits that slice once more over `dp` (and gathers it back just before the block
runs). `q`, `k`, `v` and `mlp.fc` are split by rows (outputs: for `q`, `k`, `v` that is whole heads), `attention.proj`
and `mlp.proj` by columns (inputs: the partial sums are all-reduced over the tp group)."""),
    new_code_cell("""plot_slices(job, heads=4)  # the CPU-size GPT has 4 heads per block"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
for row in output.slices(job.output):
    if row["rank"] == 1:
        print(f"rank 1 (dp 0, tp 1) {row['matrix']:22} full {row['full']}, tp slice {row['tp_slice']}, "
              f"stored {row['stored']}")"""),
    new_markdown_cell("""## Communication per optimizer step

`benchmarks/communication.py` wraps the same GPT several ways on 4 processes, runs one optimizer step of the same global
batch under torch's `CommDebugMode` (which sees every collective each rank calls) and weighs every collective's
buffer. DDP all-reduces the gradients once per step (in buckets: one, for a model this small); FSDP all-gathers each
block's weights before its forward and again before its backward, and reduce-scatters its gradients; TP all-reduces
*activations* twice per block in the forward and twice in the backward, on the critical path of every layer; 2D does
both, each over its own group. The last three rows train step 10's mixture-of-experts GPT: DDP of it whole, then
its experts split over ep ranks, which send each layer's tokens to their experts and back by all-to-all (how many
bytes depends on where the routers send the tokens; how many all-to-alls does not). The tokens/s here say little: 4
processes share 2 cores (see the load average)."""),
    new_code_cell("""quick = ["--steps", 1, "--rounds", 1, "--chars", 20000]  # the counts need one step, timings more
bench = run([PYTHON, script("benchmarks/communication.py"), *quick], cwd=scratch("communication"), timeout=300,
            shared=True)  # made once in the test suite, with tests/test_benchmarks.py's
print(bench.output)"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
for line in bench.output.splitlines():
    if line.startswith("| ") and not line.startswith("| layout"):
        layout, mesh, collectives = (cell.strip() for cell in line.strip("|").split("|")[:3])
        print(f"{layout:7} ({mesh}): {collectives}")"""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "07_tensor_parallel.ipynb")


if __name__ == "__main__":
    main()
