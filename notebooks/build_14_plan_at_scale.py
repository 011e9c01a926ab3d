"""Writes notebooks/14_plan_at_scale.ipynb (cells only; `python notebooks/execute.py notebooks/14_plan_at_scale.ipynb`
runs it and stores its outputs). Edit the cells here, not in the notebook, then run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 14 — plan a big job on a laptop, with the tutorial's own code

Before renting a cluster you want to know whether the model fits on each GPU in the layout you chose, and how many
bytes each link carries in a step. `plan_at_scale.py` answers both without the cluster: it becomes **one rank of the
big job** in this one process, lays the model out with the step's own code (the Trainers of steps 5, 7 and 11), runs
one training step and counts what that rank holds and sends. Two things of torch make that possible:

* the **fake process group** (`init_process_group("fake", ...)`): every collective returns at once and moves nothing,
  so this process can be rank 0 of 64 without the other 63;
* **fake tensors**: tensors with a shape and a dtype but no memory; every operation computes only the shape of its
  result. A rank of a model of billions of weights fits in a laptop's memory.

This notebook first checks the planner against a real job this machine runs (8 processes of step 11), collective by
collective; then plans three layouts of the same model on the same 64 GPUs and draws what each rank holds (memory per
rank) and sends (traffic per link), to see why a layout is chosen."""),
    new_code_cell("""import warnings
from collections import Counter

import matplotlib.pyplot as plt

from nbhelpers import scratch
import plan_at_scale
from tools.jobs import machine_summary, output, run, shared_file, shown, torchrun
from utils.estimates import GPUS
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages

# FSDP warns that a layer returns a view under the comm-counting mode's hooks; no in-place operation follows.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
GiB, MiB = 2**30, 2**20


def plan(*options, size="8b", text=None, ranks=None, say=print):
    \"\"\"plan_at_scale.py's plan, as `python plan_at_scale.py OPTIONS --size SIZE` makes it, in this process: a dict
    whose "plans" hold one plan per traced rank (what it holds, keeps and sends, and its step on paper).\"\"\"
    argv = [*map(str, options), "--size", size, *(["--text", str(text)] if text else []),
            *(["--ranks", ranks] if ranks else [])]
    return plan_at_scale.plan_job(plan_at_scale.parse(argv), say=say)


print(machine_summary())"""),
    new_markdown_cell("""## Can it be trusted? A job this machine runs

Step 11's job on 8 processes (pp 2 × dp 2 × tp 2: 2 pipeline ranks, each stage's blocks split over 2 tensor-parallel
ranks, FSDP over the 2 data-parallel ranks left), the CPU-size GPT on an excerpt of the help pages, one epoch. The job
runner's **traffic recorder** (`JOB_RECORD_PLUGINS=traffic`) watches every rank as it trains: after each optimizer step
it writes down every collective the rank called (its kind, the ranks of its group, its bytes) and the bytes of
weights, gradients and Adam's state the rank holds. The script is not changed for it."""),
    new_code_cell("""text = shared_file("help_excerpt.txt", help_pages()[:4600])  # a file named by its content
# shared=True: in the test suite, the job tests/test_plan_at_scale.py compares with runs once for both; in Jupyter
# it simply runs.
real = run(torchrun("one_mesh.py", 1, 1, "--workload", "gpt-cpu", "--batch_size", 4, "--pp", 2, "--tp", 2,
                    "--microbatches", 2, nproc=8), cwd=scratch("real"), record=True, timeout=300, shared=True,
           env={"JOB_RECORD_PLUGINS": "traffic", TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0})
print("$", shown(real.commands[0]))
lines = output.own_lines(real.output)
# Under the recorder's counting of collectives, FSDP warns that a layer returns a view; no in-place operation follows.
print("\\n".join(line for line in lines if "FSDP2-wrapped module" not in line))
print(f"({sum('FSDP2-wrapped module' in line for line in lines)} lines of FSDP's warning about views, which the "
      "recorder's hooks set off, left out)")"""),
    new_markdown_cell("""Now the planner, on the same job: `--world 8 --pp 2 --tp 2`, the same batch and micro-batches,
fp32 as the job trains. It traces two ranks, one of each kind: rank 0 (the first pipeline rank: the embedding) and
rank 4 (the last: the head and the loss). The other ranks of a kind hold and send the same; the tests compare every
rank. Its reports are left unsaid here (`say`): they count in GiB, which read 0.00 for a model of 0.12M weights; the
comparison below counts bytes."""),
    new_code_cell("""small = plan("--step", "one_mesh", "--world", 8, "--pp", 2, "--tp", 2, "--batch_size", 4, "--microbatches", 2,
             "--precision", "fp32", size="cpu", text=text, ranks="0,4", say=lambda line: None)
print("traced:", ", ".join(f"rank {p['rank']} ({p['layers']}) in {p['seconds']:.1f} s" for p in small["plans"]))"""),
    new_markdown_cell("""Side by side: every collective of one optimizer step, as the planner counted it and as the real
rank called it, in the real job's third optimizer step (as in the tests: a step past the first ones, which may set
things up). A collective is its kind, the group it runs over (named by the mesh dimension of its ranks) and
its bytes; the columns count how many times the step called it."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
records = {record["rank"]: record for record in real.records("traffic.jsonl") if record["step"] == 3}
for planned in small["plans"]:
    rank, recorded = planned["rank"], records[planned["rank"]]
    label = {tuple(members): name for name, members in planned["groups"].items()}
    mine = Counter((c["kind"], tuple(c["members"]), c["bytes"]) for c in planned["collectives"])
    theirs = Counter((kind, tuple(members), size) for kind, members, size in recorded["collectives"])
    print(f"rank {rank} ({planned['where']})")
    print(f"  {'collective':15}{'group':>6}{'bytes':>9}{'planned':>9}{'real':>6}")
    for kind, members, size in sorted(mine | theirs, key=lambda key: (label.get(key[1], "?"), key[0], -key[2])):
        print(f"  {kind:15}{label.get(members, str(members)):>6}{size:>9,}{mine[kind, members, size]:>9}"
              f"{theirs[kind, members, size]:>6}")
    print(f"  every collective the same, as many times: {mine == theirs}")
    for key in ("params", "grads", "optim"):
        print(f"  {key:7} planned {planned[key]:>7,} bytes, real {recorded[key]:>7,}")"""),
    new_markdown_cell("""The same collectives, to the byte, and the same state held: the planner is not a model of the
code, it is the code. On the real job the numbers moved over gloo; on the planner nothing moved, and the other 7
ranks never existed. The tests (`tests/test_plan_at_scale.py`) make the same comparison for every rank of five steps'
jobs (DDP, FSDP, 2D, this mesh and experts), and compare the activations too.

## One model, 64 GPUs, three layouts

The model: **the 8B GPT's shape** (4,096 wide, 32 heads, a vocabulary of 128,256, a context of 8,192) **with 2 of its
32 blocks**, so that each rank traces in a few seconds of CPU here (the cost grows with the blocks a rank runs and its
micro-batches; the whole 8B on 1,024 GPUs takes minutes: [the step's page](../docs/plan-at-scale.md) shows it). A
block holds and sends exactly what one of the 8B's does; the embedding and the head are the 8B's, and with 2 blocks
they weigh more than the blocks. The job: 64 GPUs in 8 nodes of 8, bf16, a global batch of 64 sequences a step, laid
out three ways:

* **FSDP over all 64** (step 5, `--step fsdp`): each rank holds 1/64 of every layer, gathers each layer whole before it
  computes with it, and trains on one sequence;
* **dp 8 × tp 8** (step 7, `--step tensor_parallel --tp 8`): each block's matrices split over the 8 GPUs of a node
  (**tensor parallelism**, tp), FSDP over the 8 nodes (**data parallelism**, dp); the 8 GPUs of a node work on the
  same 8 sequences;
* **pp 2 × dp 4 × tp 8** (step 11, `--step one_mesh --pp 2 --tp 8`): the layers cut into 2 pipeline halves (**pipeline
  parallelism**, pp), each half's blocks split over a node, FSDP over the 4 groups left; 16 sequences a dp group, in 2
  micro-batches of 8. Its first and last pipeline ranks hold different layers: both are traced.

A **link** is what a group's bytes cross: **NVLink** between the GPUs of one node (450 GB/s each way on an H100), the
**network** (InfiniBand, 50 GB/s) between nodes. The planner puts a group on NVLink when all its ranks are one
node's GPUs."""),
    new_code_cell("""MODEL = ["--layers", 2, "--world", 64]
LAYOUTS = {"FSDP 64": ["--step", "fsdp", "--batch_size", 1, "--microbatches", 1],
           "dp 8 × tp 8": ["--step", "tensor_parallel", "--tp", 8, "--batch_size", 8, "--microbatches", 1],
           "pp 2 × dp 4 × tp 8": ["--step", "one_mesh", "--pp", 2, "--tp", 8, "--batch_size", 16,
                                  "--microbatches", 2]}
plans = {}
for name, options in LAYOUTS.items():
    print(f"=== {name}")
    plans[name] = plan(*MODEL, *options)


def kind(name, rank_plan):
    \"\"\"A traced rank as the figures name it: its layout, its rank, and on a pipeline the layers it holds.\"\"\"
    if not name.startswith("pp"):
        return f"{name}\\nrank {rank_plan['rank']}"
    layers = ", ".join(stage.split(": ")[1] for stage in rank_plan["layers"].split("; "))  # "stage 0: embed; ..."
    return f"{name}\\nrank {rank_plan['rank']} ({layers})"


kinds = {kind(name, p): p for name, planned in plans.items() for p in planned["plans"]}"""),
    new_markdown_cell("""## Memory per rank

What each kind of rank holds, stacked: its shards of the weights (fp32), their gradients, AdamW's two moments, and
what autograd keeps for backward over the step (the **activations**). The black tick is the rank's **peak**, the most
memory it held at once in the step (torch's MemTracker): it adds the step's working memory, such as FSDP's gathered
copies of the layer it computes with and the logits' gradients. The dashed line is an H100's memory."""),
    new_code_cell("""H100 = GPUS["h100"]
figure, ax = plt.subplots(figsize=(10, 4))
parts = [("params", "weights", "tab:blue"), ("grads", "gradients", "tab:orange"),
         ("optim", "AdamW's moments", "tab:green"), ("activations", "kept for backward", "tab:red")]
for x, p in enumerate(kinds.values()):
    bottom = 0
    for key, name, color in parts:
        ax.bar(x, p[key] / GiB, bottom=bottom, color=color, label=name if x == 0 else None)
        bottom += p[key] / GiB
    ax.plot([x - 0.4, x + 0.4], [p["peak"] / GiB] * 2, color="black", lw=2, label="peak" if x == 0 else None)
    ax.annotate(f"peak {p['peak'] / GiB:.1f} GiB", (x, p["peak"] / GiB), xytext=(0, 3), textcoords="offset points",
                ha="center", fontsize=8)
ax.axhline(H100.memory / GiB, color="gray", ls="--", lw=1, label=f"an H100: {H100.memory / GiB:.1f} GiB")
ax.set_xticks(range(len(kinds)), list(kinds), fontsize=8)
ax.set(ylabel="GiB", title="One rank of 64 GPUs, three layouts: the 8B's shape with 2 of its blocks, bf16")
ax.legend(fontsize=8, loc="upper left")
ax.grid(axis="y", alpha=0.3)
plt.show()

print(f"{'':44}{'weights':>8}{'grads':>8}{'AdamW':>8}{'activations':>13}{'peak':>8}  (GiB)")
for name, p in kinds.items():
    print(f"{name.replace(chr(10), ', '):44}" + "".join(f"{p[key] / GiB:8.2f}" for key in ("params", "grads", "optim"))
          + f"{p['activations'] / GiB:13.2f}{p['peak'] / GiB:8.2f}")"""),
    new_markdown_cell("""Read it left to right:

* **FSDP over 64**: the training state split 64 ways is a sliver; what fills the GPU is the step itself, the
  activations of its one sequence of 8,192 tokens and, at the peak, the step's working memory (the layer it gathered,
  the logits over a vocabulary of 128,256 for each token). It fits with room to spare;
* **dp 8 × tp 8**, as step 7 splits it, **does not fit**. Its tp ranks share the blocks' matrices, but outside them each
  computes all 8 of its group's sequences whole: the embedding's output, the norms, and the head's logits over the
  whole vocabulary (step 7 splits neither the embedding nor the head over tp, so it also holds more of them);
* **pp 2 × dp 4 × tp 8**, as step 11 splits it, keeps only its share of the positions between the matrices and leaves
  the logits split over the vocabulary. Its two pipeline ranks are not alike: the first (the embedding and a block)
  peaks low; the last (a block and the head, whose logits of a micro-batch of 8 sequences and their gradients are the
  step's largest tensors) comes close to the line. A pipeline's last rank is where a layout stops fitting: check it first.

## Traffic per link

What each rank sends in one step, by the group it sends over (a ring all-gather or reduce-scatter sends (n − 1)/n of
the buffer, an all-reduce twice that, a pipeline send its tensor whole), solid on NVLink and hatched on the network:"""),
    new_code_cell("""GROUP_COLORS = {"tp": "tab:purple", "dp": "tab:cyan", "pp": "tab:brown"}
figure, ax = plt.subplots(figsize=(10, 3.6))
widest = max(sum(p["estimate"]["sent"].values()) for p in kinds.values()) / GiB
for y, p in enumerate(kinds.values()):
    left = 0
    for group, color in GROUP_COLORS.items():
        sent = p["estimate"]["sent"].get(group, 0) / GiB
        if sent:
            network = p["estimate"]["links"][group] == "network"
            ax.barh(y, sent, left=left, color=color, hatch="//" if network else None, edgecolor="white")
            if sent > widest / 25:  # a label where it fits
                ax.annotate(f"{group}\\n{sent:.1f}", (left + sent / 2, y), ha="center", va="center", fontsize=7)
            left += sent
ax.set_yticks(range(len(kinds)), list(kinds), fontsize=8)
ax.invert_yaxis()
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=color, label=f"over {group}")
                   for group, color in GROUP_COLORS.items()]
          + [plt.Rectangle((0, 0), 1, 1, fc="white", ec="gray", label="on NVLink"),
             plt.Rectangle((0, 0), 1, 1, fc="white", ec="gray", hatch="//", label="on the network")],
          fontsize=8, loc="lower right")
ax.set(xlabel="GiB the rank sends in one step", title="What a rank sends a step, and over which link")
ax.grid(axis="x", alpha=0.3)
plt.show()

for name, p in kinds.items():
    step = p["estimate"]
    on = {link: sum(sent for group, sent in step["sent"].items() if step["links"][group] == link) / GiB
          for link in ("nvlink", "network")}
    print(f"{name.replace(chr(10), ', '):44} NVLink {on['nvlink']:4.1f} GiB, network {on['network']:4.1f} GiB | "
          f"a step on H100s: compute {step['compute'] * 1e3:3.0f} ms + bubble {step['bubble'] * 1e3:2.0f} ms + "
          f"communication not hidden {step['exposed'] * 1e3:3.0f} ms = {step['step'] * 1e3:3.0f} ms")"""),
    new_markdown_cell("""Why the layouts are what they are:

* **FSDP over 64** sends every layer's weights twice a step (gathered for forward and again for backward) and its
  gradients once, all of it over the network, since its group spans the 8 nodes. At 50 GB/s that takes longer than
  the compute it is meant to hide behind: the step waits for the network;
* **dp 8 × tp 8** puts tensor parallelism's traffic (an all-reduce of the activations after each split matrix pair,
  forward and backward) on NVLink, 9 times faster; but the network still carries FSDP's gathers of the embedding and
  the head, which step 7 does not split over tp;
* **pp 2 × dp 4 × tp 8** sends gigabytes over tp, all inside a node, and little over the network: over dp a rank
  gathers and reduces only its tp slice (an eighth) of its half of the layers, embedding and head included, and the
  pipeline sends only the activations at each cut, once a micro-batch. It pays with a **bubble**: at the start and
  end of each step some pipeline ranks wait for the others.

That is why tensor parallelism goes inside a node and data and pipeline parallelism across nodes. The step's time on
paper (the printed lines) adds the compute at the GPU's peak, the pipeline's bubble and the communication the compute
does not hide (FSDP's traffic over dp runs beside the compute; tensor parallelism's and the pipeline's sit in its
path). It is a bound: no kernel runs at the peak.

In numbers, what each traced rank holds, keeps and sends (bytes, the same on any machine):"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
for name, p in kinds.items():
    held = (p["params"] + p["grads"] + p["optim"]) / MiB
    sent = ", ".join(f"{group} {sent / MiB:,.0f}" for group, sent in sorted(p["estimate"]["sent"].items()))
    print(f"{name.replace(chr(10), ', '):44} holds {held:6,.0f} MiB, keeps {p['activations'] / MiB:6,.0f} MiB; "
          f"sends (MiB) {sent}")"""),
    new_markdown_cell("""## What to try

* Tensor parallelism across nodes: `"--tp", 16` and `"--batch_size", 4` in the second layout (dp 4 × tp 16): the tp
  group spans 2 nodes, and its bytes go on the network.
* The last pipeline rank's peak: more, smaller micro-batches (`"--microbatches", 4`) in the third layout.
* More blocks (`"--layers", 4`): the blocks' bytes double, the embedding's and the head's stay; the trace takes longer.
* The whole 8B on 1,024 GPUs, from a terminal (a few minutes here):
  `python plan_at_scale.py --world 1024 --pp 8 --tp 8 --size 8b --checkpoint_activations`.
* The workshop's exercise 13 (`exercises/13_plan_a_layout/`) hands you a model and a cluster and checks your layout
  with this planner.

[The step's page](../docs/plan-at-scale.md) explains the planner's lines, and its
[reference page](../docs/reference/plan-at-scale.md) the formulas behind every figure above."""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "14_plan_at_scale.ipynb")


if __name__ == "__main__":
    main()
