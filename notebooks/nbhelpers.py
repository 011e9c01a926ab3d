"""The walkthrough notebooks' pictures: a step's code and diff, the loss per epoch, who trained on which sample, the
timeline of a fault, the ranks of a multi-node job, the memory each rank holds.

The notebooks run the steps themselves, as real processes, through harness/jobs (the job runner of the tests, the
exercise checker and the demo); everything drawn here comes from a finished job: the lines it printed, and what its
processes recorded (harness/jobs/recorder/sitecustomize.py: the samples each rank trained on, who saved which file).
"""
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the notebooks run from notebooks/: the repository's packages

import matplotlib.pyplot as plt  # noqa: E402
from IPython.display import Markdown, display  # noqa: E402

from harness.jobs import output, shown  # noqa: E402
from harness.stepdiff import changed_lines, step_diff  # noqa: E402

__all__ = ["print_job", "plot_layout", "plot_losses", "plot_memory", "plot_mesh", "plot_shards", "plot_slices",
           "plot_timeline", "scratch", "shard_facts", "show_code", "show_diff"]
RANK_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]


def show_code(name):
    """A step script as it is in the repository."""
    display(Markdown(f"`{name}` ({len((REPO / name).read_text().splitlines())} lines)\n\n"
                     f"```python\n{(REPO / name).read_text()}```"))


def show_diff(old, new):
    """The diff between two step scripts, generated from the files in the repository."""
    display(Markdown(f"`{old}` → `{new}`: {changed_lines(old, new)} changed lines\n\n"
                     f"```diff\n{step_diff(old, new)}\n```"))


def scratch(name):
    """An empty directory for one run (checkpoints and snapshots land there, not in the repository)."""
    return Path(tempfile.mkdtemp(prefix=f"{name}-"))


def print_job(job):
    """The commands of a finished job as a learner types them, and the steps' own lines; torchrun's logging and the
    C++ layer's are only counted (they stay in job.output)."""
    for node, command in enumerate(job.commands):
        print(f"node {node} $" if len(job.commands) > 1 else "$", shown(command))
    lines = job.output.splitlines()
    own = output.own_lines(job.output)
    print("\n".join(own))
    if len(own) < len(lines):
        print(f"({len(lines) - len(own)} more lines of launcher logging in job.output)")
    if job.timed_out:
        print("(stopped at the deadline)")


def plot_losses(jobs, title="The training loss falls"):
    """Loss per epoch of each job ({label: job}), as the scripts reported it."""
    fig, ax = plt.subplots(figsize=(6, 3))
    for label, job in jobs.items():
        epochs = sorted(job.losses)
        ax.plot(epochs, [job.losses[e] for e in epochs], marker="o", label=label)
    ax.set(xlabel="epoch", ylabel="training loss (mean over all samples)", yscale="log", title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    ax.grid(alpha=0.3)
    plt.show()


def plot_shards(job, first=48, shown_in_order=12):
    """Which rank trained on each of the first `first` samples, epoch by epoch; and the order each rank saw."""
    epochs = sorted({row["number"] for row in job.samples})
    ranks = sorted({row["rank"] for row in job.samples})
    fig, (owner_ax, order_ax) = plt.subplots(1, 2, figsize=(11, 0.6 * len(epochs) + 1.6),
                                             gridspec_kw=dict(width_ratios=[3, 2]))
    for row in job.samples:
        color = RANK_COLORS[row["rank"] % len(RANK_COLORS)]
        mine = [i for i in row["indices"] if i < first]
        owner_ax.scatter(mine, [row["number"]] * len(mine), color=color, marker="s", s=40)
        lane = row["number"] + 0.3 * (ranks.index(row["rank"]) - (len(ranks) - 1) / 2)
        for position, index in enumerate(row["indices"][:shown_in_order]):
            order_ax.text(position, lane, str(index), color=color, ha="center", va="center", fontsize=8)
    for ax in (owner_ax, order_ax):
        ax.set_yticks(epochs, [f"epoch {e}" for e in epochs])
        ax.set_ylim(max(epochs) + 0.6, min(epochs) - 0.6)
    dataset_size = len(set().union(*(row["indices"] for row in job.samples)))
    owner_ax.set(xlabel=f"sample index (the first {first} of {dataset_size})", title="who trains on which sample")
    order_ax.set(xlim=(-0.5, shown_in_order - 0.5), xticks=[], title="the order (set_epoch reshuffles)",
                 xlabel=f"the first {shown_in_order} samples of each rank, in the order it trained on them")
    owner_ax.legend(handles=[plt.Line2D([], [], color=RANK_COLORS[r % len(RANK_COLORS)], marker="s", ls="",
                                        label=f"rank {r}") for r in ranks], loc="lower right", ncol=len(ranks),
                    bbox_to_anchor=(1, 1.08), frameon=False)
    fig.tight_layout()
    plt.show()


def shard_facts(job, show=8):
    """The partition in numbers: per epoch, each rank's share, the overlap, the coverage, the first samples."""
    for epoch in sorted({row["number"] for row in job.samples}):
        rows = sorted((row for row in job.samples if row["number"] == epoch), key=lambda row: row["rank"])
        shares = [set(row["indices"]) for row in rows]
        together = set.union(*shares)
        print(f"epoch {epoch}: " + ", ".join(f"rank {row['rank']} {len(row['indices'])} samples" for row in rows)
              + f" | trained on by more than one rank: {sum(map(len, shares)) - len(together)}"
              + f" | together: {len(together)}")
        for row in rows:
            print(f"    rank {row['rank']} starts with {row['indices'][:show]}")


def plot_timeline(job, title="A worker killed: torchrun restarts the job, which resumes from its last snapshot"):
    """Epochs, snapshots, the kills, the restarts and the resumes of a job, along its wall-clock time. An epoch that a
    kill threw away (finished, but after the last snapshot, so trained again by a later attempt) is drawn hollow."""
    events, attempt = [], 0  # (seconds, attempt, kind, detail)
    for seconds, _, text in job.timeline:
        epoch, saved, resumed = (pattern.search(text) for pattern in (output.EPOCH, output.SAVED, output.RESUMED))
        if epoch:
            events.append((seconds, attempt, "epoch", int(epoch["epoch"])))
        elif saved:
            events.append((seconds, attempt, "saved", None))
        elif text.startswith("SIGKILL"):
            events.append((seconds, attempt, "kill", None))
        elif resumed and resumed["rank"] == "0":
            attempt = int(resumed["restart"])
            events.append((seconds, attempt, "resumed", int(resumed["epoch"])))
    trained_in = {}  # epoch -> the attempts that finished it
    for _, run, kind, detail in events:
        if kind == "epoch":
            trained_in.setdefault(detail, []).append(run)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.8 * (attempt + 1)))
    kill_at, end = None, job.timeline[-1][0]
    for seconds, run, kind, detail in events:
        color = RANK_COLORS[run % len(RANK_COLORS)]
        if kind == "epoch":
            lost = run != trained_in[detail][-1]
            ax.plot(seconds, run, "o", color=color, markerfacecolor="white" if lost else color, markersize=7)
            ax.annotate(str(detail), (seconds, run), textcoords="offset points", xytext=(0, 7), ha="center",
                        fontsize=8)
        elif kind == "saved":
            ax.plot(seconds, run, "v", color="black", markersize=8)
        elif kind == "kill":
            kill_at = seconds
            ax.axvline(seconds, color="red", lw=2)
            ax.annotate(" SIGKILL", (seconds, run + 0.3), color="red")
        elif kind == "resumed":
            ax.axvspan(kill_at or 0, seconds, color="0.9")
            ax.annotate("restart", ((kill_at + seconds) / 2, run - 0.5), ha="center", va="center", fontsize=8)
            ax.plot(seconds, run, "|", color=color, markersize=20)
            ax.annotate(f"resuming from epoch {detail}", (seconds, run), xytext=(-4, -14),
                        textcoords="offset points", ha="right", fontsize=8, color=color)
    ax.set(xlabel="seconds since torchrun started", xlim=(0, end * 1.02), ylim=(-0.6, attempt + 0.6), title=title)
    ax.set_yticks(range(attempt + 1), [f"attempt {n}" for n in range(attempt + 1)])
    ax.plot([], [], "o", color="gray", label="epoch finished (its number above)")
    ax.plot([], [], "o", color="gray", markerfacecolor="white", label="epoch lost to a kill: trained again")
    ax.plot([], [], "v", color="black", label="snapshot saved")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    plt.show()


def plot_layout(ranks, writers=(0,), title="Each node numbers its processes from 0 (LOCAL_RANK); the job numbers "
                                           "them all (RANK)"):
    """The ranks of a multi-node job, as its workers were started: ranks is {global rank: (node, local rank)}, with
    node the number of the launcher (the first command started is node 0)."""
    nodes = sorted({node for node, _ in ranks.values()})
    per_node = max(sum(1 for node, _ in ranks.values() if node == n) for n in nodes)
    fig, ax = plt.subplots(figsize=(3.2 * len(nodes), 2.1))
    for node in nodes:
        ax.add_patch(plt.Rectangle((node * 3.2, 0), 3, 1.6, fill=False, lw=1.5))
        ax.text(node * 3.2 + 1.5, 1.4, f"node {node}: torchrun started " + ("first" if node == 0 else "second"),
                ha="center", fontsize=9)
        mine = sorted((local, rank) for rank, (n, local) in ranks.items() if n == node)
        for local, rank in mine:
            x = node * 3.2 + 0.2 + local * 2.8 / per_node
            ax.add_patch(plt.Rectangle((x, 0.2), 2.6 / per_node, 0.9, color=RANK_COLORS[rank % 4], alpha=0.3))
            ax.text(x + 1.3 / per_node, 0.65, f"RANK {rank}\nLOCAL_RANK {local}"
                    + ("\nwrites the\nsnapshot" if rank in writers else ""), ha="center", va="center", fontsize=8)
    ax.set(xlim=(-0.1, len(nodes) * 3.2), ylim=(-0.1, 1.7))
    ax.set_title(title, fontsize=10)
    ax.axis("off")
    plt.show()


def plot_memory(jobs, stage="end"):
    """The training state each rank holds at `stage` ({label: job} of `fsdp.py --verbose` runs): parameters,
    gradients and optimizer state per rank, stacked, one group of bars per job."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    parts = [("params MiB", "parameters"), ("grads MiB", "gradients"), ("optim MiB", "optimizer state (Adam)")]
    labels, x = [], 0
    for label, job in jobs.items():
        for row in output.memory_tables(job.output)[stage]:
            bottom = 0
            for (column, name), color in zip(parts, ["tab:blue", "tab:orange", "tab:green"]):
                ax.bar(x, row[column], bottom=bottom, color=color, label=name if x == 0 else None)
                bottom += row[column]
            labels.append(f"{label}\nrank {row['rank']}")
            x += 1
    ax.set_xticks(range(len(labels)), labels)
    ax.set(ylabel="MiB held by the rank", title="Training state per rank: FSDP holds a 1/world_size share")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    plt.show()



def plot_mesh(job, epoch=0, show=6):
    """The ranks of a tensor-parallel job in their mesh (recorded: each rank's dp and tp coordinates), each with the
    first `show` samples it trained on in `epoch`: along a row (a tp group) the same, down a column different."""
    rows = [row for row in job.samples if row["epoch"] == epoch and row.get("mesh")]
    dp_size = 1 + max(row["mesh"]["dp"] for row in rows)
    tp_size = 1 + max(row["mesh"]["tp"] for row in rows)
    fig, ax = plt.subplots(figsize=(2.9 * tp_size + 1.6, 1.25 * dp_size + 0.9))
    for row in rows:
        dp, tp = row["mesh"]["dp"], row["mesh"]["tp"]
        ax.add_patch(plt.Rectangle((tp * 3, -dp * 1.3), 2.7, 1.0, color=RANK_COLORS[tp % 4], alpha=0.3))
        ax.text(tp * 3 + 1.35, -dp * 1.3 + 0.5, f"rank {row['rank']}  (dp {dp}, tp {tp})\nsamples "
                + ", ".join(map(str, row["indices"][:show])) + ", ...", ha="center", va="center", fontsize=8)
    for dp in range(dp_size):
        ax.text(tp_size * 3 - 0.1, -dp * 1.3 + 0.5, f"tp group {dp}:\none model,\nthe same batches", fontsize=8,
                va="center")
    ax.set(xlim=(-0.2, tp_size * 3 + 1.6), ylim=(-(dp_size - 1) * 1.3 - 0.2, 1.2))
    ax.set_title(f"The mesh: dp {dp_size} x tp {tp_size}; down a column (a dp group), different data (epoch {epoch})",
                 fontsize=10)
    ax.axis("off")
    plt.show()


def plot_slices(job, heads=None):
    """What each rank holds of every matrix of a block (`tensor_parallel.py --verbose`'s slices table): each matrix
    drawn to its shape (rows: its outputs, columns: its inputs), coloured by the tp rank that computes with that part;
    the lighter band of each part is what its other dp rank stores (FSDP splits every tp slice once more). With
    `heads` (the model's), the row slices of q, k and v are labelled with the heads they compute."""
    from harness.jobs.output import slices

    rows = slices(job.output)
    matrices = list(dict.fromkeys(row["matrix"] for row in rows))
    fig, axes = plt.subplots(1, len(matrices), figsize=(2.1 * len(matrices), 3.4))
    for ax, name in zip(axes, matrices):
        mine = [row for row in rows if row["matrix"] == name]
        out_features, in_features = mine[0]["full"]
        tp_size = max(row["tp"] for row in mine) + 1
        for row in mine:
            split_rows = row["tp_slice"][0] < out_features
            height, width = row["tp_slice"]
            top, left = (row["tp"] * height, 0) if split_rows else (0, row["tp"] * width)
            stored = row["stored"][0]  # FSDP splits the slice's first dimension over dp
            ax.add_patch(plt.Rectangle((left, top + row["dp"] * stored), width, stored, lw=0.5, ec="white",
                                       color=RANK_COLORS[row["tp"] % 4], alpha=0.8 if row["dp"] == 0 else 0.35))
            if heads and row["dp"] == 0 and name.split(".")[1] in ("q", "k", "v"):
                first = row["tp"] * heads // tp_size
                ax.text(width / 2, top + height / 2, f"heads {first}-{first + heads // tp_size - 1}", ha="center",
                        va="center", fontsize=7)
        ax.set(xlim=(0, in_features), ylim=(out_features, 0), aspect="equal", xticks=[], yticks=[])
        ax.set_title(f"{name.rsplit('.', 1)[0]}\n{out_features} x {in_features}", fontsize=9)
    axes[0].set_ylabel("outputs (rows)")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[tp % 4], alpha=alpha,
                                      label=f"tp {tp}, stored by dp {dp}")
                        for tp in sorted({row["tp"] for row in rows}) for dp, alpha in ((0, 0.8), (1, 0.35))
                        if any(row["dp"] == dp for row in rows)],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Which rank holds which part of each matrix of a block (rows: outputs, columns: inputs)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    plt.show()
