"""Writes notebooks/08_pipeline.ipynb (cells only; `python notebooks/execute.py notebooks/08_pipeline.ipynb` runs it
and stores its outputs). Edit the cells here, not in the notebook, then run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 8 — pipeline parallelism: the GPT in stages, fed micro-batch by micro-batch

`pipeline_parallel.py` is `gpt.py` (step 6) with the model cut in depth: each rank holds a **stage**, a run of
consecutive blocks (the embedding goes with the first stage, the final norm and the head with the last). A batch is
cut into **M micro-batches**; the first stage runs micro-batch 0's forward and sends its activations to the next
stage, which starts on it while the first goes on with micro-batch 1, and so on; the gradients flow back the same way.
`torch.distributed.pipelining` does it: a `PipelineStage` per rank, and a **schedule** that orders the passes:

* **GPipe**: every forward, then every backward. Each stage holds the activations of all M micro-batches at its peak.
* **1F1B**: after filling the pipeline, one forward, one backward: a stage holds at most `stages` micro-batches.

While the pipeline fills and drains, a stage waits: in theory `(stages - 1) / (M + stages - 1)` of each step, the
**bubble**. More micro-batches shrink it. This notebook runs both schedules on 2 CPU processes and draws what the
stages did, pass by pass, as the job runner's recorder timed them."""),
    new_code_cell("""from nbhelpers import print_job, scratch, show_diff
from tools import pipeline_timeline
from harness.jobs import machine_summary, output, run, shared_file, torchrun
from utils.gpt import help_pages
from utils.metrics import RUN_DIR_VARIABLE

print(machine_summary())"""),
    new_markdown_cell("""## The diff from step 6

Generated from the two files in the repository. The loop keeps its shape (AdamW, the warm-up and cosine, clipping,
bf16, a snapshot that resumes); the schedule's `step()` replaces the forward and the backward, and only the first
stage reads the tokens, only the last has a loss."""),
    new_code_cell("""show_diff("gpt.py", "pipeline_parallel.py")"""),
    new_markdown_cell("""## Two runs: 1F1B and GPipe, 4 micro-batches each

A 4,600-character excerpt of the help pages (64 sequences of 64 characters to train on), batches of 8 (4
micro-batches of 2): 8 optimizer steps an epoch, 2 epochs, dropout 0. Stage 0 (rank 0) holds the embedding and
block 0, stage 1 (rank 1) block 1 and the head. The job runner records, for every micro-batch and stage, when its
forward and its backward ran, and how many bytes of activations autograd kept for the backward (and, per optimizer
step, the gradient norm each stage's DDP all-reduced); each rank writes its per-epoch metrics to `runs/`."""),
    new_code_cell("""text = shared_file("help_excerpt.txt", help_pages()[:4600])  # a file named by its content
args = ("--workload", "gpt-cpu", "--text", text, "--dropout", 0, "--batch_size", 8)
# shared=True: in the test suite, a run that a test makes too (tests/test_pipeline_parallel.py's 1F1B) is made once
# for both; in Jupyter it simply runs.
jobs = {schedule: run(torchrun("pipeline_parallel.py", 2, 2, *args, "--schedule", schedule, "--microbatches", 4),
                      cwd=scratch(schedule), env={RUN_DIR_VARIABLE: "runs"}, record_steps=True, timeout=240,
                      shared=True)
        for schedule in ("1f1b", "gpipe")}
print_job(jobs["1f1b"])"""),
    new_markdown_cell("""## The schedules, as they ran

One optimizer step of each (the fastest: other work on the machine only slows a step down), a row per stage, a box
per pass: light for a forward, dark for a backward, the micro-batch's number in it. The blank space on each row is
the bubble: the stage waits for an activation from the stage before, or a gradient from the one after."""),
    new_code_cell("""steps = {schedule: pipeline_timeline.by_step(job.records("pipeline.jsonl"))
         for schedule, job in jobs.items()}


def fastest_step(steps):
    return min(steps, key=lambda step: pipeline_timeline.idle(steps[step])[0])


titles = {"1f1b": "1F1B", "gpipe": "GPipe"}
pipeline_timeline.plot({f"{titles[schedule]}, M=4, step {fastest_step(s)}": s[fastest_step(s)]
                        for schedule, s in steps.items()})"""),
    new_markdown_cell("""The order of the passes is the schedule's, on every step (the times above depend on the
machine; this does not):"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
for schedule, recorded in steps.items():
    for stage in (0, 1):
        orders = {" ".join(pipeline_timeline.order(events, stage)) for events in recorded.values()}
        held = {pipeline_timeline.held(events, stage)[0] for events in recorded.values()}
        print(f"{schedule:5} stage {stage}: {' | '.join(sorted(orders))}   (at most {max(held)} held at once)")"""),
    new_markdown_cell("""## The bubble, measured against the formula

Each step's idle fraction per stage: the part of the step (from the first forward's start to the last backward's
end) in which the stage computed nothing. The formula assumes every pass takes the same time on every stage and
that sending costs nothing. Here a micro-batch is 2 sequences through one block of a small model: its compute is
short next to what every micro-batch pays anyway (sending its activations over gloo, the schedule's Python), so the
stages idle well beyond the formula, and a busy machine adds its own waits. `benchmarks/pipeline_bubble.py`
measures it for M = 1 to 8 with batches of 128, where the formula holds up to M = 4."""),
    new_code_cell("""for schedule, recorded in steps.items():
    idles = [pipeline_timeline.idle(events)[1] for events in recorded.values()]
    mean = {stage: sum(idle[stage] for idle in idles) / len(idles) for stage in (0, 1)}
    print(f"{schedule:5}: idle stage 0 {mean[0]:.0%}, stage 1 {mean[1]:.0%}; "
          f"formula {pipeline_timeline.bubble(2, 4):.0%}")"""),
    new_markdown_cell("""## The activations each stage holds

What autograd keeps for a micro-batch's backward, from the end of its forward to the end of its backward, added up
over the micro-batches a stage holds at once: GPipe's peak is the whole batch's, 1F1B's at most 2 micro-batches'."""),
    new_code_cell("""for schedule, recorded in steps.items():
    peaks = [max(pipeline_timeline.held(events, stage)[1] for events in recorded.values()) for stage in (0, 1)]
    print(f"{schedule:5}: stage 0 holds {peaks[0] / 2**20:.2f} MiB at most, stage 1 {peaks[1] / 2**20:.2f} MiB")"""),
    new_markdown_cell("""## The same model, whatever the schedule

GPipe and 1F1B run the same micro-batches and add up their gradients in the same order: only when each pass runs
differs, so they end with the same weights, bit for bit, and print the same losses. Each job saved one sharded
snapshot of the whole model (`pp_snapshot/`), every rank writing its stage's layers under the GPT's own names: a
snapshot of the model, not of the cut, which a job with another `--pp` loads too."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
import tempfile

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def whole(job):  # the snapshot's weights, every rank's part put together (no process group needed)
    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(job.cwd / "pp_snapshot", f"{folder}/whole.pt")
        return torch.load(f"{folder}/whole.pt", weights_only=False)["MODEL_STATE"]


layers = {}  # which file of the snapshot holds which layer's weights: the rank that holds the stage wrote them
for index, place in FileSystemReader(jobs["1f1b"].cwd / "pp_snapshot").read_metadata().storage_data.items():
    if index.fqn.startswith("MODEL_STATE.") and not index.fqn.startswith("MODEL_STATE._extra_state"):
        layers.setdefault(place.relative_path, set()).add(index.fqn.split(".")[1])
for file, names in sorted(layers.items()):
    print(f"pp_snapshot/{file}: {sorted(names)}")
a, b = whole(jobs["1f1b"]), whole(jobs["gpipe"])
print("the same weights:", all(torch.equal(a[k], b[k]) for k in a if k != "_extra_state"))
print("the same losses:", output.epoch_losses(jobs["1f1b"].output) == output.epoch_losses(jobs["gpipe"].output))"""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "08_pipeline.ipynb")


if __name__ == "__main__":
    main()
