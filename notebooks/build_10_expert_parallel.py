"""Writes notebooks/10_expert_parallel.ipynb (cells only; `python notebooks/execute.py
notebooks/10_expert_parallel.ipynb` runs it and stores its outputs). Edit the cells here, not in the notebook, then
run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 10 — expert parallelism: a mixture of experts, each rank holding some of them

A **mixture of experts** (MoE) replaces a block's MLP by E MLPs of the same shape, the *experts*, and a small linear
layer, the **router**, that scores the E experts for each token. A token goes to its **top_k** experts only, and the
layer's output is their outputs added up, each weighted by its router probability. The weights of the MLPs grow E
times; a token's compute grows top_k times. More weights to learn with, for the compute of a much smaller model.

`expert_parallel.py` is `gpt.py` (step 6) with such MLPs (`--workload gpt-moe-cpu`: E = 4 experts, top_k 2 unless
`--top_k` says otherwise) and the experts split over `ep` ranks: each rank keeps E/ep of every layer's experts and
sends each token to the rank of its expert. This notebook draws that traffic, runs the step on 2 CPU processes
against one process, and shows what the router does to the experts' load with and without a load-balancing loss."""),
    new_code_cell("""from nbhelpers import print_job, scratch, show_diff
from harness.jobs import machine_summary, run, shared_file, torchrun
from utils.gpt import help_pages
from utils.metrics import RUN_DIR_VARIABLE

print(machine_summary())"""),
    new_markdown_cell("""## E times the weights, top_k times the compute

The CPU-size GPT, dense and as a mixture of 4 experts, built here in this process:"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
from utils import make_workload

for name in ("gpt-cpu", "gpt-moe-cpu"):
    model = make_workload(name).model
    mlps = sum(weight.numel() for key, weight in model.named_parameters() if ".mlp." in key)
    experts = f"{model.config.experts} experts, top_k {model.config.top_k}" if model.config.experts else "dense"
    print(f"{name:12} {sum(weight.numel() for weight in model.parameters()):8,} weights, of which the MLPs' "
          f"{mlps:8,} ({experts})")"""),
    new_markdown_cell("""The MLPs hold 4 times the weights (and the two routers 2 × 64 × 4 more). Each token runs
through 2 of the 4 experts: twice the MLP compute of the dense GPT, not 4 times.

## The diff from step 6

Generated from the two files in the repository. The loop is step 6's; what is new is the (dp, ep) mesh, the experts
split over ep (`split_experts`, from `utils/moe.py`, which holds the layer and its all-to-alls), a DDP per layer's
experts over dp and one for the rest over all ranks, the aux loss added to the loss, the gradient norm of the whole
model for clipping, and a sharded snapshot keyed by the whole model's names."""),
    new_code_cell("""show_diff("gpt.py", "expert_parallel.py")"""),
    new_markdown_cell("""## The two all-to-alls of a layer

ep = 2, E = 4: rank 0 holds experts 0 and 1, rank 1 experts 2 and 3; each rank has its own 4 tokens (top_k 1 here,
to keep the picture small; with top_k 2 every token is sent twice). In every MoE layer:

```
                    rank 0: experts 0, 1                    rank 1: experts 2, 3
their tokens        a  b  c  d                              e  f  g  h
router, top 1       a→2  b→0  c→1  d→3                      e→0  f→2  g→2  h→1
sorted by expert    b | c | a | d                           e | h | f g |
                    0   1   2   3                           0   1   2     3

    first, the counts: each rank tells every other how many rows it will send to each of its experts
    (all_to_all_single of E numbers), so that each knows how many rows it will receive

all-to-all 1        keeps b c,  sends a d  ─────────────►   a d
(dispatch)          e h  ◄─────────────────────────────     keeps f g,  sends e h
the rows here       b c e h                                 a d f g
by expert           expert 0: b e    expert 1: c h          expert 2: a f g    expert 3: d
                    (each runs its MLP on its rows)

all-to-all 2        outputs of a d  ◄──────────────────     (computed here)
(combine)           (computed here)  ──────────────────►     outputs of e h
                    each row goes home to its token's rank, in the order it left

then                each token adds its output × its gate (its router probability) to the residual stream
```

The rows' sizes differ from rank to rank and from step to step (whatever the router picked): uneven splits. The
backward runs the same two all-to-alls the other way, carrying the gradients. Attention, the routers and the
embeddings are whole on every rank, their gradients averaged as in DDP."""),
    new_markdown_cell("""## 2 processes against one

A 4,600-character excerpt of the help pages (64 sequences of 64 characters), batches of 4 per rank (8 in all), 2
epochs of 8 optimizer steps, dropout 0, `--ep 2` (one ep group of both ranks), top_k 2, the default aux loss weight
0.01. Each rank writes its per-epoch metrics (the mean loss of its own samples) to `runs/`."""),
    new_code_cell("""text = shared_file("help_excerpt.txt", help_pages()[:4600])  # a file named by its content
# shared=True: in the test suite, a run that a test makes too (tests/test_expert_parallel.py's) is made once for both;
# in Jupyter it simply runs.
job = run(torchrun("expert_parallel.py", 2, 1, "--workload", "gpt-moe-cpu", "--text", text, "--dropout", 0,
                   "--batch_size", 4, "--ep", 2, "--top_k", 2, nproc=2, launcher_args=["--max_restarts=1"]),
          cwd=scratch("equal"), env={RUN_DIR_VARIABLE: "runs"}, timeout=240, shared=True)
print_job(job)"""),
    new_markdown_cell("""One process, the same mixture of experts, the same batches of 8 in the same order, every
expert at hand (`harness/one_process.py`, the reference the tests use too). The aux loss counts each expert's share of
the whole batch's tokens, as one process does, so the two ranks must together compute what it computes: the job's
loss of an epoch is the mean over both ranks' samples."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
import json

from harness.one_process import train_gpt

alone = train_gpt(text, 8, 2, workload="gpt-moe-cpu", aux_weight=0.01, top_k=2)["losses"]
records = [json.loads(line) for rank in (0, 1) for line in (job.cwd / "runs" / f"rank{rank}.jsonl").open()]
both = {}
for epoch in range(2):
    mine = [r for r in records if r["epoch"] == epoch]
    both[epoch] = sum(r["loss"] * r["samples"] for r in mine) / sum(r["samples"] for r in mine)
    print(f"epoch {epoch}: 2 ranks {both[epoch]:.4f} | one process {alone[epoch]:.4f}")
farthest = max(abs(both[epoch] - alone[epoch]) for epoch in range(2))
print("equal within 1e-5:", farthest < 1e-5)"""),
    new_code_cell("""print(f"the largest difference: {farthest:.1e}")"""),
    new_markdown_cell("""No token is dropped (unless `--capacity_factor` asks for it) and each expert computes the
same rows wherever it lives, so splitting the experts changes only the order of some additions in floating point.

## The experts' load, with and without the aux loss

Nothing in the loss itself asks the router to spread the tokens. Two jobs on the first 240,000 characters of the help
pages, one epoch of 106 steps of 2 × 16 sequences, top_k 1, bf16, dropout 0.1: the first without the load-balancing
loss (`--aux_weight 0`), the second with
Switch Transformers' `E · Σₑ fₑ Pₑ` weighted 0.01 (fₑ: expert e's share of the batch's tokens, Pₑ: its mean router
probability). Rank 0's `runs/rank0.jsonl` holds `expert_tokens`: for every step, every layer's tokens per expert in
the whole batch."""),
    new_code_cell("""pages = shared_file("help_240k.txt", help_pages()[:240_000])
loads = {}
for weight in (0, 0.01):  # shared with tests/test_expert_parallel.py's two load jobs
    loads[weight] = run(torchrun("expert_parallel.py", 1, 1, "--workload", "gpt-moe-cpu", "--text", pages,
                                 "--batch_size", 16, "--ep", 2, "--top_k", 1, "--aux_weight", weight, "--precision",
                                 "bf16", "--dropout", 0.1, nproc=2),
                        cwd=scratch(f"load-{weight}"), env={RUN_DIR_VARIABLE: "runs"}, timeout=240, shared=True)
    print_job(loads[weight])"""),
    new_code_cell("""import matplotlib.pyplot as plt
import numpy as np


def busiest(ran):
    \"\"\"The busiest expert's tokens over an even share: an array (steps, layers), from rank 0's metrics.\"\"\"
    [epoch] = [json.loads(line) for line in (ran.cwd / "runs" / "rank0.jsonl").open()]
    tokens = np.array(epoch["expert_tokens"], dtype=float)  # (steps, layers, experts)
    return tokens.max(-1) / tokens.mean(-1)


ratios = {weight: busiest(ran) for weight, ran in loads.items()}
layers = ratios[0].shape[1]
figure, axes = plt.subplots(1, layers, figsize=(11, 3.4), sharey=True)
for layer, ax in enumerate(axes):
    for weight, label in ((0, "no aux loss"), (0.01, "aux loss, weight 0.01")):
        ax.plot(ratios[weight][:, layer], label=label)
    ax.axhline(1, color="gray", lw=0.8, ls="--")
    ax.axhline(4, color="gray", lw=0.8, ls=":")  # E = 4: one expert takes every token
    ax.set(title=f"layer {layer}", xlabel="optimizer step", ylim=(0.9, 4.1))
    ax.grid(alpha=0.3)
axes[0].set_ylabel("busiest expert / even share")
axes[0].legend()
figure.suptitle("The busiest of 4 experts: how many times an even share of the batch's tokens it gets "
                "(1: even, 4: all of them)")
plt.tight_layout()
plt.show()
for weight, ratio in ratios.items():
    print(f"aux weight {weight:<4}: the busiest expert, mean of the last 20 steps: "
          + ", ".join(f"layer {layer} {ratio[-20:, layer].mean():.2f}x" for layer in range(layers)))"""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
print("with the aux loss, the busiest expert gets less in every layer:",
      bool((ratios[0.01][-20:].mean(0) < ratios[0][-20:].mean(0)).all()))"""),
    new_markdown_cell("""Both layers start near even (1×) and within a few steps send every token to one expert (4×:
all of them). A router that favours an expert sends it more tokens, so more gradient: it learns faster, gets better
at the batch's tokens, and the router favours it more — a rich-get-richer loop, the router's **collapse** onto few
experts. Without the aux loss nothing pulls back: by the end layer 0's busiest expert still takes about 2× an even
share and layer 1's has drifted back up to about 3.5×. The other experts learn from fewer tokens, and on `ep` ranks
the rank holding the favourite computes most of the layer while the others wait for it. The aux loss is smallest
when fₑ and Pₑ are both uniform: its gradient pulls the router's probabilities towards an even spread, and the
busiest expert ends near 1.1-1.3×.

## The bytes

`all_to_all_bytes` in the metrics is what a rank sent to the other ranks of its ep group in the forwards'
all-to-alls of an epoch (it received as much; the backward moves as many again). The rows travel in the precision
the experts compute in: fp32 in the first job, bf16 (half the bytes) in the two above. With ep 2, about half of
a rank's routed rows leave it in the dispatch, and as many of the other rank's go back from it in the combine: about
one row sent per row it routes, so per routed row and per number of it (n_embd of them) a rank sends about one
number's bytes:"""),
    new_code_cell("""config = model.config  # the gpt-moe-cpu size built above: n_embd 64, context 64
for label, ran, batch, top_k in (("fp32, batch 4, top_k 2 ", job, 4, 2),
                                  ("bf16, batch 16, top_k 1", loads[0.01], 16, 1)):
    epochs = [json.loads(line) for line in (ran.cwd / "runs" / "rank0.jsonl").open()]
    steps = sum(len(epoch["expert_tokens"]) for epoch in epochs)  # one forward a step
    sent = sum(epoch["all_to_all_bytes"] for epoch in epochs)
    # Every step, each layer routes the rank's batch x context tokens, each to top_k experts.
    routed = steps * config.n_layer * batch * config.context * top_k
    print(f"{label}: {sent / steps / 2**10:6.1f} KiB a step | {sent / routed / config.n_embd:.2f} bytes per number "
          "of a routed row")"""),
    new_markdown_cell("""About 4 bytes a number in fp32, 2 in bf16: the two jobs move the same KiB a step, the
second twice the rows (16 sequences a rank, each token to 1 expert, against 4 and 2) at half the bytes. The bytes
grow with the batch, top_k and the width, not with E; across nodes they would cross the slowest links, which is why an ep
group's ranks are neighbours, on one node (ep is the mesh's innermost dimension).

`--capacity_factor c` (c > 0) bounds what one expert receives: at most c × an even share of a rank's routed tokens,
the rest dropped (they pass the layer by the residual connection alone), so a collapsed router can no longer
overload one rank, at the price of tokens the layer skips (the epoch line then prints the share dropped)."""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "10_expert_parallel.ipynb")


if __name__ == "__main__":
    main()
