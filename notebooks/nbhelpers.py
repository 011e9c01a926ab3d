"""What the walkthrough notebooks share: run a step the way a user runs it, show its diff, draw what it did.

Jobs run as real processes (a subprocess per command, bounded, in a scratch directory), through tests/support.py,
the same launcher the tests use; tests/audit/sitecustomize.py records which samples each rank trained on and who
saved what, and the pictures are drawn from those records and from the lines the scripts print.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from IPython.display import Markdown, display  # noqa: E402

from support import (PYTHON, TORCHRUN, epoch_losses, finish, free_port, job_env, kill_tree,  # noqa: E402,F401
                     recorded_samples, recorded_writes, script, start, torchrun, torchrun_node)
from tools.stepdiff import changed_lines, step_diff  # noqa: E402

RANK_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
# torch >= 2.5: restarted workers meet in the store the killed ones used, whose stale addresses can stall them
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def machine():
    """One line: what this machine will run the steps on."""
    gpus = torch.cuda.device_count()
    return f"{gpus} CUDA GPU(s): the steps use NCCL" if gpus else "no CUDA GPU: the steps run CPU processes on gloo"


def show_diff(old, new):
    """The diff between two step scripts, generated from the files in the repository."""
    display(Markdown(f"`{old}` → `{new}`: {changed_lines(old, new)} changed lines\n\n"
                     f"```diff\n{step_diff(old, new)}\n```"))


def scratch(name):
    """An empty directory for one run (checkpoints and snapshots land there, not in the repository)."""
    return Path(tempfile.mkdtemp(prefix=f"{name}-"))


def shown(cmd):
    """A command as a user types it: `python` and `torchrun` instead of this interpreter's path."""
    text = " ".join(map(str, cmd)).replace(" ".join(TORCHRUN), "torchrun").replace(PYTHON, "python")
    return text.replace(str(REPO) + os.sep, "")


class Run:
    """A finished job: its output, exit codes, and what the audit recorded (samples per rank and epoch, writes)."""

    def __init__(self, workdir, output, codes, timed_out):
        self.workdir, self.output, self.codes, self.timed_out = workdir, output, codes, timed_out
        self.samples = recorded_samples(workdir / "samples.jsonl")
        self.writes = recorded_writes(workdir / "writes.tsv")
        self.losses = epoch_losses(output)

    def writers(self):
        """The ranks that wrote files, and the files' names."""
        ranks = sorted({rank for _, rank, _ in self.writes}, key=str)
        files = sorted({Path(path).name.removesuffix(".tmp") for _, _, path in self.writes})  # .tmp: then renamed
        return ranks, files


def run_job(*commands, name="job", cwds=None, timeout=180, extra_env=None, quiet=False):
    """Run one command, or one per node, each in a scratch directory (or `cwds`), and print what they printed."""
    workdir = scratch(name)
    cwds = cwds or [workdir] * len(commands)
    env = job_env(extra_env, audit_file=workdir / "writes.tsv", samples_file=workdir / "samples.jsonl",
                  gpu=torch.cuda.is_available())
    logs = [workdir / f"node{n}.log" for n in range(len(commands))]
    for node, cmd in enumerate(commands):
        print(f"node {node} $" if len(commands) > 1 else "$", shown(cmd))
    codes = finish([start(cmd, cwd=cwd, env=env, log=log) for cmd, cwd, log in zip(commands, cwds, logs)], timeout)
    timed_out = None in codes  # still running at the deadline, then killed
    output = "".join(log.read_text() for log in logs)
    if not quiet:
        print_job_lines(output)
    if timed_out:
        print(f"(stopped after {timeout} s)")
    return Run(workdir, output, codes, timed_out)


def print_job_lines(output):
    """What the scripts printed; torchrun's and the C++ layer's own logging (kept in Run.output) only counted."""
    own = [line for line in output.splitlines() if not re.match(r"\[?[WEI]\d{4} |frame #|Exception raised from|"
                                                                 r"\[rank\d+\]:|\s|$", line)]
    print("\n".join(own))
    if len(own) < len(output.splitlines()):
        print(f"({len(output.splitlines()) - len(own)} more lines of launcher logging in .output)")


def plot_losses(runs):
    """Loss per epoch of each run ({label: Run}), as the scripts reported it."""
    fig, ax = plt.subplots(figsize=(6, 3))
    for label, run in runs.items():
        epochs = sorted(run.losses)
        ax.plot(epochs, [run.losses[e] for e in epochs], marker="o", label=label)
    ax.set(xlabel="epoch", ylabel="training loss (mean over all samples)", yscale="log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    ax.grid(alpha=0.3)
    plt.show()


def plot_shards(run, first=48, shown_in_order=12):
    """Which rank trained on each of the first `first` samples, epoch by epoch; and the order each rank saw."""
    epochs = sorted({row["number"] for row in run.samples})
    ranks = sorted({row["rank"] for row in run.samples})
    fig, (owner_ax, order_ax) = plt.subplots(1, 2, figsize=(11, 0.6 * len(epochs) + 1.6),
                                             gridspec_kw=dict(width_ratios=[3, 2]))
    for row in run.samples:
        color = RANK_COLORS[row["rank"] % len(RANK_COLORS)]
        mine = [i for i in row["indices"] if i < first]
        owner_ax.scatter(mine, [row["number"]] * len(mine), color=color, marker="s", s=40)
        lane = row["number"] + 0.3 * (ranks.index(row["rank"]) - (len(ranks) - 1) / 2)
        for position, index in enumerate(row["indices"][:shown_in_order]):
            order_ax.text(position, lane, str(index), color=color, ha="center", va="center", fontsize=8)
    for ax in (owner_ax, order_ax):
        ax.set_yticks(epochs, [f"epoch {e}" for e in epochs])
        ax.set_ylim(max(epochs) + 0.6, min(epochs) - 0.6)
    dataset_size = len(set().union(*(row["indices"] for row in run.samples)))
    owner_ax.set(xlabel=f"sample index (the first {first} of {dataset_size})", title="who trains on which sample")
    order_ax.set(xlim=(-0.5, shown_in_order - 0.5), xticks=[], title="the order (set_epoch reshuffles)",
                 xlabel=f"the first {shown_in_order} samples of each rank, in the order it trained on them")
    owner_ax.legend(handles=[plt.Line2D([], [], color=RANK_COLORS[r % len(RANK_COLORS)], marker="s", ls="",
                                        label=f"rank {r}") for r in ranks], loc="lower right", ncol=len(ranks),
                    bbox_to_anchor=(1, 1.08), frameon=False)
    fig.tight_layout()
    plt.show()


def shard_facts(run, show=8):
    """The partition in numbers: per epoch, each rank's share, the overlap, the coverage, the first samples."""
    for epoch in sorted({row["number"] for row in run.samples}):
        rows = sorted((row for row in run.samples if row["number"] == epoch), key=lambda row: row["rank"])
        shares = [set(row["indices"]) for row in rows]
        print(f"epoch {epoch}: " + ", ".join(f"rank {row['rank']} {len(row['indices'])} samples" for row in rows)
              + f" | shared by two ranks: {len(set.intersection(*shares))} | together: {len(set.union(*shares))}")
        for row in rows:
            print(f"    rank {row['rank']} starts with {row['indices'][:show]}")


class Timeline:
    """Lines of a running job with the second each arrived, plus events added from outside (the kill)."""

    def __init__(self):
        self.start, self.events = time.monotonic(), []

    def add(self, text):
        self.events.append((time.monotonic() - self.start, text))


def kill_after(cmd, trigger, victim_rank=0, name="fault", timeout=180, extra_env=FRESH_STORE):
    """Run a torchrun job; as soon as a line matches `trigger`, SIGKILL the worker of rank `victim_rank` (its pid
    comes from the audit's record of its saves); follow the job to its end. Return (Run, Timeline)."""
    workdir = scratch(name)
    env = job_env(extra_env, audit_file=workdir / "writes.tsv", samples_file=workdir / "samples.jsonl",
                  gpu=torch.cuda.is_available())
    print("$", " ".join(f"{key}={value}" for key, value in extra_env.items()), shown(cmd))
    timeline, lines = Timeline(), []
    proc = subprocess.Popen([str(part) for part in cmd], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watchdog = threading.Timer(timeout, kill_tree, (proc,))
    watchdog.start()
    killed = False
    try:
        for line in proc.stdout:
            line = line.rstrip()
            lines.append(line)
            timeline.add(line)
            if line.startswith("[rank ") or "closing signal" in line or "failed (exitcode" in line:
                print(line[:160])  # the job's own lines and torchrun's, not the tracebacks
            if not killed and re.search(trigger, line):
                pid = next(pid for pid, rank, _ in recorded_writes(workdir / "writes.tsv") if rank == victim_rank)
                os.kill(pid, signal.SIGKILL)
                killed = True
                timeline.add(f"KILL rank {victim_rank} (pid {pid})")
                print(f"---- SIGKILL sent to rank {victim_rank} (pid {pid}) ----")
        print(f"torchrun exited with code {proc.wait()}")
    finally:
        watchdog.cancel()
        kill_tree(proc)  # whatever is left of the job, workers included
    return Run(workdir, "\n".join(lines), [proc.returncode], False), timeline


def plot_timeline(timeline):
    """Epochs, snapshots, the kill, the restart and the resume of a job, along its wall-clock time."""
    fig, ax = plt.subplots(figsize=(11, 2.8))
    attempt, kill_at, end = 0, None, timeline.events[-1][0]
    for seconds, text in timeline.events:
        epoch = re.search(r"\] epoch (\d+) \| steps", text)
        snapshot = re.search(r"\] epoch (\d+) \| snapshot saved", text)
        resumed = re.search(r"\[rank 0/\d+[^\]]*\] resuming from epoch (\d+), restart (\d+)", text)
        if epoch:
            ax.plot(seconds, attempt, "o", color=RANK_COLORS[attempt])
            ax.annotate(epoch[1], (seconds, attempt), textcoords="offset points", xytext=(0, 7), ha="center",
                        fontsize=8)
        elif snapshot:
            ax.plot(seconds, attempt, "v", color="black", markersize=8)
        elif text.startswith("KILL"):
            kill_at = seconds
            ax.axvline(seconds, color="red", lw=2)
            ax.annotate(" SIGKILL", (seconds, 0.5), color="red")
        elif resumed:
            attempt = int(resumed[2])
            ax.axvspan(kill_at or 0, seconds, color="0.9")
            ax.annotate("torchrun stops the other worker\nand starts all of them again", ((kill_at + seconds) / 2,
                        0.5), ha="center", va="center", fontsize=8)
            ax.plot(seconds, attempt, "|", color=RANK_COLORS[attempt], markersize=20)
            ax.annotate(f"resuming from epoch {resumed[1]}", (seconds, attempt), xytext=(-4, -14),
                        textcoords="offset points", ha="right", fontsize=8, color=RANK_COLORS[attempt])
    ax.set(xlabel="seconds since torchrun started", xlim=(0, end * 1.02), ylim=(-0.6, attempt + 0.6),
           yticks=range(attempt + 1), yticklabels=[f"attempt {n}" for n in range(attempt + 1)])
    ax.plot([], [], "o", color="gray", label="epoch finished (its number above)")
    ax.plot([], [], "v", color="black", label="snapshot saved")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    plt.show()


def plot_layout(nodes, per_node, writers=(0,)):
    """The ranks of a multi-node job: global rank (in the job) and local rank (on its node, picks the GPU)."""
    fig, ax = plt.subplots(figsize=(3.2 * nodes, 1.9))
    for node in range(nodes):
        ax.add_patch(plt.Rectangle((node * 3.2, 0), 3, 1.6, fill=False, lw=1.5))
        ax.text(node * 3.2 + 1.5, 1.4, f"node {node}" + (" (rendezvous endpoint)" if node == 0 else ""),
                ha="center", fontsize=9)
        for local in range(per_node):
            rank = node * per_node + local
            x = node * 3.2 + 0.2 + local * 2.8 / per_node
            ax.add_patch(plt.Rectangle((x, 0.2), 2.6 / per_node, 0.9, color=RANK_COLORS[rank % 4], alpha=0.3))
            ax.text(x + 1.3 / per_node, 0.65, f"RANK {rank}\nLOCAL_RANK {local}"
                    + ("\nwrites the snapshot" if rank in writers else ""), ha="center", va="center", fontsize=8)
    ax.set(xlim=(-0.1, nodes * 3.2), ylim=(-0.1, 1.7))
    ax.axis("off")
    plt.show()
