"""The pictures of the steps' pages, each drawn from a real run of the step: the run goes through harness/jobs, as a
test's does, and what it printed, recorded or saved is drawn with matplotlib into docs/figures/<page>.png.

    python tools/figures.py                      # every figure: one or two short jobs of each step
    python tools/figures.py tensor-parallel      # one of them: docs/figures/tensor-parallel.png
    python tools/figures.py --list               # the figures, and the run each is drawn from

Each figure is named by the page that shows it (docs/fsdp.md shows figures/fsdp.png) and says at its foot the command
it was drawn from and how busy the machine was. What is drawn comes from the run only: who holds which block of a
weight is read from the run's sharded snapshot (its .metadata names the file, one per rank, that holds each block),
the pipeline's passes and the routers' choices from the job runner's recorder (harness/jobs/recorder), the ring's sends
from its record of every collective, the memory from the tables `--verbose` prints. The seven of steps 5-11 took 33 minutes on a
shared 2-core machine at load 20 to 40 (the expert-parallel one, an epoch of the help pages, the longest: 8 minutes);
the four of steps 1-4 took 2.5 to 8.5 minutes each at load 15 to 38 (step 3's, two restarts, the longest); step 13's,
a heal, 3.5 minutes at load 10 to 27 (35 s of CPU: most of it the killed group's restart, importing torch again).
Step 12's, its run killed once and restarted, takes 2 minutes (75 s of CPU) at load 6 to 9.
"""
import argparse
import json
import re
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python tools/figures.py`: the repository's packages

from tools import pipeline_timeline  # noqa: E402
from harness.jobs import (free_port, lighthouse, machine_summary, next_heal, output, python,  # noqa: E402
                        replica_groups, run, shared_file, shown, start, torchrun, torchrun_node)
from harness.jobs.processes import process_env  # noqa: E402
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages  # noqa: E402
from utils.metrics import RUN_DIR_VARIABLE  # noqa: E402

FOLDER = REPO / "docs" / "figures"
RANK_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
# The excerpt of the help pages that the GPT steps' exact jobs learn (64 training sequences of 64 characters): the
# jobs below that learn it are the tests' own, and in a test session run once for both (harness.jobs.run(shared=True)).
EXCERPT_CHARS = 4600


def excerpt(chars=EXCERPT_CHARS):
    """The first `chars` characters of the help pages, as a file named by its content."""
    return shared_file("help_excerpt.txt" if chars == EXCERPT_CHARS else f"help_{chars}.txt", help_pages()[:chars])


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def footer(figure, jobs, name):
    """The commands the figure was drawn from (of a job, or of a list of them), and the machine they ran on, at the
    figure's foot."""
    width = int(figure.get_figwidth() * 15)  # characters of 7 points in a line of the figure's width
    commands = "\n".join(textwrap.fill(re.sub(r"\S*/(?:[0-9a-f]+-)?(help_[\w.]+)", r"\1", shown(command)), width,
                                       subsequent_indent="    ")
                         for job in (jobs if isinstance(jobs, list) else [jobs]) for command in job.commands)
    text = f"drawn by python tools/figures.py {name}, from:\n{commands}\n{machine_summary()}"
    figure.text(0.005, 0.005, text, fontsize=7, color="dimgray", va="bottom", family="monospace")
    # The drawing above the footer's lines (7 points each, and a margin).
    figure.tight_layout(rect=(0, (text.count("\n") + 2) * 0.14 / figure.get_figheight(), 1, 1))


def mkdir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(figure, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot().close(figure)


def blocks_held(snapshot, prefix="MODEL_STATE."):
    """{weight's name: (its whole shape, [(rank, offsets, sizes), ...])}: which rank's file of a DCP snapshot holds
    which block of every weight (a block several ranks hold alike is written, and listed, once)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(snapshot)).read_metadata()
    files = {(index.fqn, tuple(index.offset)): info.relative_path for index, info in metadata.storage_data.items()
             if index.offset is not None}
    held = {}
    for fqn, tensor in metadata.state_dict_metadata.items():
        if fqn.startswith(prefix) and hasattr(tensor, "chunks"):
            pieces = [(int(re.match(r"__(\d+)_", files[fqn, tuple(chunk.offsets)])[1]), tuple(chunk.offsets),
                       tuple(chunk.sizes)) for chunk in tensor.chunks]
            held[fqn[len(prefix):]] = (tuple(tensor.size), sorted(pieces))
    return held


def draw_blocks(axes, shape, pieces, title, labels):
    """A weight as a rectangle of its rows and columns, each rank's block in the rank's color and named."""
    rows, columns = shape if len(shape) == 2 else (shape[0], 1)
    for rank, offsets, sizes in pieces:
        top, left = offsets[0], offsets[1] if len(offsets) > 1 else 0
        height, width = sizes[0], sizes[1] if len(sizes) > 1 else 1
        axes.add_patch(pyplot().Rectangle((left, top), width, height, facecolor=RANK_COLORS[rank], alpha=0.75,
                                          edgecolor="black", linewidth=0.8))
        axes.text(left + width / 2, top + height / 2, labels(rank, offsets, sizes), ha="center", va="center",
                  fontsize=8)
    axes.set(xlim=(0, columns), ylim=(rows, 0), aspect="equal", title=title)
    axes.set_xticks([0, columns]), axes.set_yticks([0, rows])
    axes.tick_params(labelsize=7)
    axes.title.set_fontsize(9)


def ranges(offsets, sizes, shape=None):
    """'rows 16-31', or 'rows 0-31' and 'cols 32-63' on two lines: a block's rows and columns (a dimension the block
    spans whole, of a weight of `shape`, left out)."""
    names = ["rows", "cols"]
    return "\n".join(f"{names[dim]} {offsets[dim]}-{offsets[dim] + sizes[dim] - 1}" for dim in range(len(sizes))
                     if shape is None or sizes[dim] != shape[dim])


# --- step 1: one device --------------------------------------------------------------------------------------------

def single_device(work, epochs=50, save_every=5):
    """single_gpu.py for 50 epochs, a checkpoint every 5: the training loss of every epoch (printed), and the held-out
    loss of every checkpoint, copied as it was saved and scored here on the 512 held-out samples with utils.evaluate."""
    import torch

    from utils import evaluate, make_workload

    folder = mkdir(work / "single_device")
    held_out = {}
    workload = make_workload()
    with start(python("single_gpu.py", epochs, save_every), cwd=folder) as job:
        for _ in range(epochs // save_every):
            saved = job.wait_for(output.SAVED, timeout=900)
            # The next save comes save_every epochs later: the file is whole and stays so while it is read.
            weights = torch.load(folder / saved["path"], weights_only=True)
            workload.model.load_state_dict(weights)
            held_out[int(saved["epoch"]) + 1] = evaluate(workload.model, workload.eval_set, workload.loss_fn,
                                                         torch.device("cpu"))["loss"]
        job.wait(timeout=900)
    assert job.ok, job.output[-2000:]
    training = {epoch + 1: loss for epoch, loss in job.losses.items()}
    final = output.held_out(job.output)["loss"]

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(11, 4.4))
    axes.plot(list(training), list(training.values()), "o-", color="tab:blue", markersize=3,
              label="training loss of each epoch (printed)")
    axes.plot(list(held_out), list(held_out.values()), "s-", color="tab:orange", markersize=6,
              label="held-out loss of each checkpoint (512 samples it never trained on)")
    axes.axhline(0.01, color="gray", linestyle="--", linewidth=1)
    axes.text(epochs, 0.0105, "the noise floor, 0.01: no model does better on new samples", ha="right", va="bottom",
              fontsize=8, color="gray")
    best = min(held_out, key=held_out.get)
    axes.annotate(f"lowest held-out loss: {held_out[best]:.4f}\nafter epoch {best}", (best, held_out[best]),
                  xytext=(best + 3, held_out[best] * 2.2), fontsize=8, arrowprops=dict(arrowstyle="->"))
    axes.set(yscale="log", xlabel="epochs trained", ylabel="mean squared error (log scale)", xlim=(0, epochs + 1),
             title="the training loss goes on falling, below the noise floor; the held-out loss stops improving: "
                   "the model learns the noise of its 2,048 samples")
    axes.title.set_fontsize(9)
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8, loc="lower left")  # the upper right holds the lowest held-out loss's note
    figure.suptitle("single_gpu.py: a small MLP learns a teacher network's outputs from 2,048 noisy samples",
                    fontsize=10)
    return figure, job, dict(training=training, held_out=held_out, final=final)


# --- step 2: DDP -----------------------------------------------------------------------------------------------------

def one_process_losses(batch_size, epochs):
    """single_gpu.py's Trainer, in this process, fed batches of `batch_size` in the order a DistributedSampler deals
    the samples (one replica: the whole shuffled order, which 2 ranks split as positions r, r + 2, ...): the loss of
    every step, and the order of every epoch."""
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import single_gpu
    from utils import make_workload

    workload = make_workload()
    loader = DataLoader(workload.train_set, batch_size=batch_size,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    trainer = single_gpu.Trainer(workload.model, loader, workload.optimizer, workload.loss_fn, torch.device("cpu"),
                                 save_every=epochs)
    losses, orders = [], []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        orders.append(list(loader.sampler))
        losses += [trainer._run_batch(source, targets).item() for source, targets in loader]
    return losses, orders


def ddp(work, epochs=4, positions=20):
    """multigpu.py on 2 processes, batch 32 each, every pass over the data recorded (the samples each rank trained on,
    in order, and the loss of each of its steps) and every optimizer step (DDP's gradient all-reduces); against
    single_gpu.py's Trainer fed batches of 64 in the order the sampler dealt them, in this process, and single_gpu.py
    run with batch 64 and its own shuffle."""
    job = run(python("multigpu.py", epochs, epochs), cwd=mkdir(work / "multigpu"), record_steps=True, timeout=900)
    alone = run(python("single_gpu.py", epochs, epochs, "--batch_size", 64), cwd=mkdir(work / "single_gpu"),
                record=True, timeout=900)
    passes = {(row["rank"], row["epoch"]): row for row in job.samples}
    ranks = sorted({rank for rank, _ in passes})
    # The order the sampler dealt in each epoch: rank r trained on positions r, r + 2, r + 4...
    dealt = {epoch: [passes[position % 2, epoch]["indices"][position // 2] for position in range(2 * positions)]
             for epoch in range(epochs)}
    reference, orders = one_process_losses(64, epochs)
    assert all(orders[epoch][:2 * positions] == dealt[epoch] for epoch in range(epochs)), "not the sampler's order"
    per_rank = {rank: [loss for epoch in range(epochs) for loss in passes[rank, epoch]["losses"]] for rank in ranks}
    mean = [sum(losses) / len(losses) for losses in zip(*per_rank.values())]
    own_shuffle = [loss for row in sorted(alone.samples, key=lambda row: row["number"]) for loss in row["losses"]]
    steps = job.steps
    rounds = Counter(step["rounds"] for step in steps if step["rank"] == 0)
    equal_params = all(passes[0, epoch]["params"] == passes[1, epoch]["params"] for epoch in range(epochs))

    plt = pyplot()
    figure = plt.figure(figsize=(12, 6.6))
    grid = figure.add_gridspec(2, 1, height_ratios=[1, 1.6])
    deal = figure.add_subplot(grid[0])
    for row, epoch in enumerate(range(2)):
        for position, index in enumerate(dealt[epoch]):
            deal.add_patch(plt.Rectangle((position, row), 0.94, 0.8, facecolor=RANK_COLORS[position % 2], alpha=0.7,
                                         edgecolor="black", linewidth=0.5))
            deal.text(position + 0.47, row + 0.4, str(index), ha="center", va="center", fontsize=7)
    deal.set(xlim=(0, 2 * positions), ylim=(2, -0.15), xlabel="position in the epoch's shuffled order (the first "
             f"{2 * positions} of 2,048)", title="DistributedSampler deals one shuffled order, position by position: "
             "rank 0 (blue) gets positions 0, 2, 4..., rank 1 (orange) 1, 3, 5...; set_epoch(epoch) shuffles anew")
    deal.set_yticks([0.4, 1.4], ["epoch 0", "epoch 1"])
    deal.set_xticks([])
    deal.title.set_fontsize(9)
    losses = figure.add_subplot(grid[1])
    numbers = range(1, len(mean) + 1)
    for rank in ranks:
        losses.plot(numbers, per_rank[rank], color=RANK_COLORS[rank], linewidth=0.7, alpha=0.6,
                    label=f"rank {rank}: the loss of its own 32 samples")
    losses.plot(numbers, reference, color="tab:green", linewidth=5, alpha=0.35,
                label="one process (single_gpu.py's Trainer), batch 64 in the sampler's order")
    losses.plot(numbers, mean, color="black", linewidth=0.9, linestyle="--",
                label="the two ranks' mean: on the green line, step for step")
    losses.plot(numbers, own_shuffle, color="gray", linewidth=0.8, alpha=0.8,
                label="single_gpu.py --batch_size 64: the same samples in its own shuffle (close, not equal)")
    gap = max(abs(a - b) / b for a, b in zip(mean, reference))
    counted = (f"once in each of the {len(mean)} steps" if set(rounds) == {1} else
               ", ".join(f"{times} times in {count} steps" for times, count in sorted(rounds.items())))
    losses.set(yscale="log", xlabel="optimizer step (32 an epoch)", ylabel="loss (log scale)",
               title=f"every step: the ranks' losses differ (other samples), their mean is one process's loss on the "
                     f"64 together (largest difference {gap:.0e});\nDDP all-reduced the gradients {counted} "
                     f"(recorded); the two ranks' weights were equal after every epoch: {equal_params}")
    losses.title.set_fontsize(9)
    losses.grid(alpha=0.3, which="both")
    losses.legend(fontsize=8, loc="upper right")
    for epoch in range(1, epochs):
        losses.axvline(epoch * len(mean) // epochs + 0.5, color="gray", linestyle=":")
    figure.suptitle("multigpu.py, 2 ranks of batch 32: each rank its own half of every epoch, and together one "
                    "process's steps with batch 64", fontsize=10)
    return figure, [job, alone], dict(dealt={epoch: dealt[epoch] for epoch in range(2)}, gap=gap,
                                      rounds=dict(rounds), equal_params=equal_params, steps=len(mean))


# --- step 3: torchrun, restarts and snapshots -------------------------------------------------------------------------

def attempts(job):
    """The events of a torchrun job that was killed and restarted, from its timeline: [(seconds, attempt, kind,
    detail)] with kind "epoch" (rank 0 finished it), "saved", "kill" or "resumed" (rank 0 resumed from that epoch)."""
    events, attempt = [], 0
    for seconds, _, text in job.timeline:
        epoch, saved, resumed = (pattern.search(text) for pattern in (output.EPOCH, output.SAVED, output.RESUMED))
        if epoch:
            events.append((seconds, attempt, "epoch", int(epoch["epoch"])))
        elif saved:
            events.append((seconds, attempt, "saved", int(saved["epoch"])))
        elif text.startswith("SIGKILL"):
            events.append((seconds, attempt, "kill", text))
        elif resumed and resumed["rank"] == "0":
            attempt = int(resumed["restart"])
            events.append((seconds, attempt, "resumed", int(resumed["epoch"])))
    return events


def torchrun_figure(work):
    """multigpu_torchrun.py on 2 processes under torchrun --max_restarts=2, 6 epochs of batch 8 and a snapshot every
    3: rank 0 SIGKILLed right after the snapshot of epoch 2, rank 1 of the restarted job once it finished epoch 4;
    the epochs, snapshots, kills and resumes as the job printed them, in time."""
    command = torchrun("multigpu_torchrun.py", 6, 3, "--batch_size", 8, launcher_args=["--max_restarts=2"])
    with start(command, cwd=mkdir(work / "torchrun"), record=True) as job:
        job.wait_for(r"epoch 2 \| snapshot saved", timeout=900)
        job.kill_worker(rank=0)
        job.wait_for(r"resuming from epoch 3, restart 1", timeout=900)
        job.wait_for(r"\] epoch 4 \| steps", timeout=900)
        job.kill_worker(rank=1, restart=1)
        job.wait(timeout=900)
    assert job.ok, job.output[-2000:]
    events = attempts(job)
    finished_in = {}
    for _, attempt, kind, epoch in events:
        if kind == "epoch":
            finished_in.setdefault(epoch, []).append(attempt)
    lost = sorted(epoch for epoch, runs in finished_in.items() if len(runs) > 1)
    last = max(attempt for _, attempt, _, _ in events)

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(12, 3.9))
    kill_at, restarts = None, []
    for seconds, attempt, kind, detail in events:
        color = RANK_COLORS[attempt]
        if kind == "epoch":
            thrown = attempt != finished_in[detail][-1]
            axes.plot(seconds, attempt, "o", color=color, markerfacecolor="white" if thrown else color, markersize=9)
            axes.annotate(str(detail), (seconds, attempt), textcoords="offset points", xytext=(0, 8), ha="center",
                          fontsize=8)
        elif kind == "saved":  # just below the epoch's circle, which it follows by milliseconds
            axes.plot(seconds, attempt + 0.22, "v", color="black", markersize=7)
        elif kind == "kill":
            kill_at = seconds
            axes.axvline(seconds, color="red", linewidth=2)
            axes.annotate(" " + detail.split(" (")[0], (seconds, attempt + 0.45), color="red", fontsize=8,
                          va="center")
        elif kind == "resumed":
            axes.axvspan(kill_at, seconds, color="0.88")
            restarts.append(seconds - kill_at)
            # On the row of the attempt that died, which ends at the kill: the span's middle is free.
            axes.annotate(f"restart: {seconds - kill_at:.1f} s", ((kill_at + seconds) / 2, attempt - 1),
                          ha="center", va="center", fontsize=8)
            # Left of the resume, over the restart's span: the epochs after it keep their room.
            axes.annotate(f"resuming from epoch {detail}", (seconds, attempt), xytext=(-4, -2), ha="right",
                          va="center", textcoords="offset points", fontsize=8, color=color)
    axes.set(xlabel="seconds since torchrun started", ylim=(last + 0.7, -0.8),
             xlim=(0, job.timeline[-1][0] * 1.02),
             title=f"a kill right after a snapshot loses nothing; a kill two epochs after one loses those epochs "
                   f"({', '.join(map(str, lost))}: hollow), which the next attempt trains again")
    axes.set_yticks(range(last + 1), [f"attempt {attempt}\n(restart {attempt})" for attempt in range(last + 1)],
                    fontsize=8)
    axes.title.set_fontsize(9)
    axes.plot([], [], "o", color="gray", label="an epoch rank 0 finished (its number above)")
    axes.plot([], [], "o", color="gray", markerfacecolor="white", label="an epoch lost to a kill, trained again")
    axes.plot([], [], "v", color="black", label="snapshot saved")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the attempts, not over them
    axes.grid(axis="x", alpha=0.3)
    figure.suptitle("multigpu_torchrun.py under torchrun --max_restarts=2: a worker SIGKILLed twice; torchrun starts "
                    "both workers again, and they resume from the last snapshot", fontsize=10)
    return figure, job, dict(events=events, lost=lost, restarts=restarts, resumes=job.resumes)


# --- step 4: several machines ----------------------------------------------------------------------------------------

def multinode(work, per_node=2):
    """multinode.py as two torchrun "nodes" of 2 processes each on this machine, meeting at a c10d rendezvous on
    127.0.0.1: each worker's RANK, LOCAL_RANK and node read from its environment while it ran, the samples each rank
    trained on in epoch 0 (recorded), which rank wrote the snapshot, and the lines each node's terminal showed."""
    node_command = torchrun_node("multinode.py", 3, 3, nnodes=2, nproc=per_node,
                                 endpoint=f"127.0.0.1:{free_port()}", run_id="figure")
    places = {}  # global rank -> (node, local rank, pid)
    with start(node_command, node_command, cwd=mkdir(work / "multinode"), record=True) as job:
        for node in (0, 1):
            for rank, pid in job.workers(node=node, nproc=per_node, timeout=900).items():
                environment = process_env(pid)
                places[rank] = (node, int(environment["LOCAL_RANK"]), pid, environment["GROUP_RANK"])
        job.wait(timeout=900)
    assert job.ok, job.output[-2000:]
    writers = job.writers()[0]
    first = {row["rank"]: row["indices"] for row in job.samples if row["epoch"] == 0}
    printed = {node: [line for line in job.node_output(node).splitlines() if line.startswith("[rank")]
               for node in (0, 1)}

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(12, 4.6))
    width = 5.6
    for node in (0, 1):
        left = node * (width + 0.4)
        axes.add_patch(plt.Rectangle((left, 0), width, 2.55, fill=False, linewidth=1.5))
        group_rank = next(place[3] for place in places.values() if place[0] == node)
        axes.text(left + width / 2, 2.38, f"node {node}: the torchrun started {'first' if node == 0 else 'second'} "
                                          f"(the rendezvous made it node {group_rank})", ha="center", fontsize=9)
        mine = sorted((local, rank, pid) for rank, (n, local, pid, _) in places.items() if n == node)
        for local, rank, pid in mine:
            x = left + 0.15 + local * (width - 0.15) / per_node
            axes.add_patch(plt.Rectangle((x, 0.75), (width - 0.15) / per_node - 0.15, 1.45,
                                         facecolor=RANK_COLORS[rank], alpha=0.3, edgecolor="black"))
            text = (f"RANK {rank}   LOCAL_RANK {local}\n(pid {pid})\nepoch 0: samples\n"
                    + ", ".join(map(str, first[rank][:3])) + ", ...\n" + f"({len(first[rank])} of them)"
                    + ("\nwrites snapshot.pt" if rank in writers else ""))
            axes.text(x + ((width - 0.15) / per_node - 0.15) / 2, 1.47, text, ha="center", va="center", fontsize=8)
        lines = printed[node]
        axes.text(left + 0.15, 0.38, f"its terminal: {len(lines)} lines of the step"
                  + (f', e.g. "{lines[0].split("] ")[0]}] ..."' if lines else " (its workers train as hard)"),
                  fontsize=8, va="center", family="monospace")
    axes.set(xlim=(-0.1, 2 * width + 0.5), ylim=(-0.05, 2.7))
    axes.axis("off")
    axes.set_title("LOCAL_RANK numbers the processes of a node (it picks the GPU); RANK numbers those of the job "
                   "(it picks the one writer and the one that prints)", fontsize=9)
    figure.suptitle("multinode.py on two torchrun nodes of 2 processes each, one c10d rendezvous: the ranks as the "
                    "workers' environment gave them", fontsize=10)
    return figure, job, dict(places=places, writers=writers, printed={node: len(lines) for node, lines in
                                                                       printed.items()})


# --- step 5: FSDP ----------------------------------------------------------------------------------------------------

def fsdp(work):
    """fsdp.py's wide model on 2 processes, sharded and copied: the rows of one weight each rank holds, and each rank's
    training state, from the memory table `--verbose` prints after training."""
    wide = ["--workload", "wide", "--batch_size", 64, "--verbose"]
    # The DDP run is tests/test_fsdp.py's and notebook 05's: in a test session, one run for all three.
    runs = {"FSDP (the default)": run(torchrun("fsdp.py", 2, 1, *wide), cwd=mkdir(work / "fsdp"), timeout=900),
            "DDP (--strategy ddp)": run(torchrun("fsdp.py", 2, 1, *wide, "--strategy", "ddp"),
                                        cwd=mkdir(work / "ddp"), timeout=900, shared=True)}
    weight = "1.linear.weight"
    shape, pieces = blocks_held(runs["FSDP (the default)"].cwd / "snapshot")[weight]
    state = {label: {row["rank"]: row for row in output.memory_tables(job.output)["end"]}
             for label, job in runs.items()}

    plt = pyplot()
    figure, (ddp_axes, fsdp_axes, bars) = plt.subplots(1, 3, figsize=(12, 4.2),
                                                       gridspec_kw=dict(width_ratios=[1.5, 1, 1.6]))
    # DDP: a whole copy on each rank, side by side.
    copies = (shape[0], shape[1] * 2 + shape[1] // 6)
    draw_blocks(ddp_axes, copies, [(0, (0, 0), shape), (1, (0, copies[1] - shape[1]), shape)],
                f"DDP: {weight} ({shape[0]}x{shape[1]}), a copy on each rank",
                lambda rank, offsets, sizes: f"rank {rank}\nall of it")
    ddp_axes.set_xticks([0, shape[1], copies[1] - shape[1], copies[1]], [0, shape[1], 0, shape[1]])
    draw_blocks(fsdp_axes, shape, pieces, f"FSDP: {weight}, read from the snapshot",
                lambda rank, offsets, sizes: f"rank {rank}\n{ranges(offsets, sizes, shape)}")
    parts = {"params MiB": ("parameters", 0.95), "grads MiB": ("gradients", 0.6), "optim MiB": ("Adam's state", 0.3)}
    y, ticks = 0, []
    for label, rows in state.items():
        for rank, row in sorted(rows.items()):
            left = 0
            for part, (_, alpha) in parts.items():
                bars.barh(y, row[part], left=left, color=RANK_COLORS[rank], alpha=alpha, edgecolor="black",
                          linewidth=0.5)
                left += row[part]
            bars.text(left + 0.2, y, f"{left:.2f} MiB", va="center", fontsize=8)
            ticks.append((y, f"{label.split(' ')[0]}, rank {rank}"))
            y += 1
        y += 0.5
    bars.legend([plt.Rectangle((0, 0), 1, 1, facecolor="gray", alpha=alpha, edgecolor="black")
                 for _, alpha in parts.values()], [name for name, _ in parts.values()], fontsize=8,
                loc="upper right")
    bars.set_yticks([tick for tick, _ in ticks], [text for _, text in ticks], fontsize=8)
    bars.invert_yaxis()
    bars.set(xlabel="MiB each rank holds after training (--verbose's table)", title="the training state per rank")
    bars.set_xlim(0, max(sum(row[part] for part in parts) for rows in state.values() for row in rows.values()) * 1.3)
    bars.title.set_fontsize(9)
    figure.suptitle("FSDP: each rank holds its half of every weight, gradient and Adam state; DDP: all of it",
                    fontsize=10)
    totals = {label: {rank: sum(row[part] for part in parts) for rank, row in rows.items()}
              for label, rows in state.items()}
    return figure, list(runs.values()), dict(shape=shape, pieces=pieces, state=totals)


# --- step 6: the GPT -------------------------------------------------------------------------------------------------

def gpt(work):
    """gpt.py on 2 processes, 2 micro-batches a step, every optimizer step recorded: the loss of each step (both
    ranks' micro-batches), the learning rate the schedule gave it, and how many times DDP all-reduced for it."""
    epochs, accumulation = 2, 2
    job = run(torchrun("gpt.py", epochs, epochs, "--batch_size", 16, "--grad_accum", accumulation),
              cwd=mkdir(work / "gpt"), record_steps=True, timeout=900)
    steps = sorted((step for step in job.records("steps.jsonl") if step["rank"] == 0), key=lambda step: step["step"])
    per_epoch = len(steps) // epochs
    # Each micro-batch's loss as backward() got it, divided by the micro-batches of its step: times them again.
    step_losses = {}
    for epoch_pass in job.records("samples.jsonl"):
        losses = epoch_pass["losses"]
        for first in range(0, len(losses), accumulation):
            group = losses[first:first + accumulation]
            step = epoch_pass["number"] * per_epoch + first // accumulation
            step_losses.setdefault(step, []).extend(loss * len(group) for loss in group)
    numbers = sorted(step_losses)
    plt = pyplot()
    figure, (loss_axes, rate_axes) = plt.subplots(2, 1, figsize=(11, 5.2), sharex=True)
    loss_axes.plot([n + 1 for n in numbers], [sum(step_losses[n]) / len(step_losses[n]) for n in numbers],
                   color="tab:blue", linewidth=1)
    loss_axes.set(ylabel="loss (mean of the step's\n2 ranks x 2 micro-batches)",
                  title="the loss of every optimizer step: it falls from about ln(vocabulary) as the GPT learns")
    rate_axes.plot(range(1, len(steps) + 1), [step["lr"] for step in steps], color="tab:green")
    rounds = Counter(step["rounds"] for step in steps)
    counted = (f"once in each of the {len(steps)} steps" if set(rounds) == {1} else
               ", ".join(f"{times} times in {steps_with} of the {len(steps)} steps"
                         for times, steps_with in sorted(rounds.items())))
    rate_axes.set(xlabel="optimizer step", ylabel="learning rate",
                  title=f"the learning rate: a warm-up, then a cosine down to a tenth of its peak; DDP all-reduced the "
                        f"gradients {counted} (recorded)")
    for axes in (loss_axes, rate_axes):
        axes.grid(alpha=0.3)
        axes.title.set_fontsize(9)
    for epoch in range(1, epochs):
        for axes in (loss_axes, rate_axes):
            axes.axvline(epoch * per_epoch + 0.5, color="gray", linestyle=":")
        loss_axes.text(epoch * per_epoch + 1, loss_axes.get_ylim()[1] * 0.97, f" epoch {epoch}", va="top", fontsize=8,
                       color="gray")
    figure.suptitle("gpt.py: two ranks, gradient accumulation over 2 micro-batches, AdamW with a warm-up and a cosine",
                    fontsize=10)
    return figure, job, dict(steps=len(steps), rounds=dict(rounds), first_loss=step_losses[numbers[0]],
                             last_loss=step_losses[numbers[-1]], peak_lr=max(step["lr"] for step in steps))


# --- step 7: tensor parallelism, and 2D ------------------------------------------------------------------------------

TP_MATRICES = {"attention.q.weight": "ColwiseParallel: rows (heads) split by tp",
               "attention.proj.weight": "RowwiseParallel: columns split by tp",
               "mlp.fc.weight": "ColwiseParallel:\nrows split by tp",
               "mlp.proj.weight": "RowwiseParallel: columns split by tp"}


def tensor_parallel(work):
    """tensor_parallel.py on 4 processes, dp 2 x tp 2 (the tests' and notebook 07's job: in a test session, one run
    for all): the mesh the ranks formed (recorded), and which block of each matrix of block0 each rank holds, read
    from the run's sharded snapshot: tp's slice, then FSDP's half of it over dp."""
    env = {TEXT_VARIABLE: excerpt(), DROPOUT_VARIABLE: 0}
    job = run(torchrun("tensor_parallel.py", 2, 1, "--tp", 2, "--batch_size", 4, "--verbose", "--workload",
                       "gpt-cpu", nproc=4), cwd=mkdir(work / "tensor_parallel"), env=env, record=True, timeout=900,
              shared=True)
    mesh = {row["rank"]: row["mesh"] for row in job.samples if row["restart"] == 0}
    held = blocks_held(job.cwd / "tp_snapshot")

    plt = pyplot()
    figure = plt.figure(figsize=(12, 7.2))
    grid = figure.add_gridspec(2, 4, width_ratios=[1.2, 1, 1, 0.6])
    draw_mesh_2d(figure.add_subplot(grid[0, 0]), mesh, ("dp", "tp"))
    note = figure.add_subplot(grid[1, 0])
    note.axis("off")
    note.text(0, 0.95, "A tp group (a row of the mesh) computes\none model: each of its ranks holds a\nslice of "
                       "every matrix. FSDP (a column)\nsplits that slice again over dp, and\ngathers it back just "
                       "before the block\nruns. The two tp groups train on\ndifferent halves of each batch.",
              va="top", fontsize=9)
    spots = [grid[0, 1], grid[0, 2], grid[:, 3], grid[1, 1:3]]
    for spot, (matrix, style) in zip(spots, TP_MATRICES.items()):
        shape, pieces = held[f"block0.{matrix}"]
        draw_blocks(figure.add_subplot(spot), shape, pieces, f"block0.{matrix} ({shape[0]}x{shape[1]})\n{style}",
                    lambda rank, offsets, sizes, shape=shape: f"rank {rank}\n{ranges(offsets, sizes, shape)}")
    figure.suptitle("tensor_parallel.py on 4 ranks, dp 2 x tp 2: which block of each matrix every rank holds "
                    "(read from the run's snapshot)", fontsize=10)
    return figure, job, dict(mesh=mesh, held={name: held[f"block0.{name}"] for name in TP_MATRICES})


def draw_mesh_2d(axes, mesh, names):
    """The ranks of a 2-D mesh as a grid, a row per coordinate of names[0], a column per coordinate of names[1]."""
    rows, columns = names
    for rank, place in mesh.items():
        axes.add_patch(pyplot().Rectangle((place[columns], place[rows]), 0.92, 0.92, facecolor=RANK_COLORS[rank],
                                          alpha=0.75, edgecolor="black"))
        axes.text(place[columns] + 0.46, place[rows] + 0.46, f"rank {rank}\n{rows} {place[rows]}, {columns} "
                                                             f"{place[columns]}", ha="center", va="center", fontsize=8)
    size = [max(place[name] for place in mesh.values()) + 1 for name in names]
    axes.set(xlim=(-0.05, size[1]), ylim=(size[0], -0.05), aspect="equal",
             title=f"the mesh (recorded): a row is\na {columns} group, a column a {rows} group")
    axes.set_xticks([]), axes.set_yticks([])
    axes.title.set_fontsize(9)


# --- step 8: pipeline parallelism ------------------------------------------------------------------------------------

def pipeline_parallel(work):
    """pipeline_parallel.py on 2 processes, 2 stages, batches of 128 sequences in 4 micro-batches, GPipe then 1F1B,
    every pass of every stage recorded: of each, the fastest of its ten steps after the first (other work only ever
    slows a step down)."""
    text = excerpt(100_000)
    jobs, steps = {}, {}
    for schedule in ("gpipe", "1f1b"):
        jobs[schedule] = run(torchrun("pipeline_parallel.py", 1, 1, "--schedule", schedule, "--microbatches", 4,
                                      "--batch_size", 128, "--text", text, "--dropout", 0),
                             cwd=mkdir(work / schedule), record=True, timeout=900)
        by_step = pipeline_timeline.by_step(jobs[schedule].records("pipeline.jsonl"))
        later = {step: events for step, events in by_step.items() if step > 0}
        steps[schedule] = min(later.values(), key=lambda events: pipeline_timeline.idle(events)[0])
    plt = pyplot()
    figure, axes = plt.subplots(2, 1, figsize=(11, 4.6))
    facts = {}
    for row, (schedule, events) in zip(axes, steps.items()):
        span, idles = pipeline_timeline.idle(events)
        title = {"gpipe": "GPipe: every forward, then every backward",
                 "1f1b": "1F1B: fill the pipeline, then one backward, one forward"}[schedule]
        pipeline_timeline.draw(row, events, f"{title} ({span * 1e3:.0f} ms; the formula's bubble: "
                                            f"{pipeline_timeline.bubble(2, 4):.0%})")
        row.title.set_fontsize(9)
        facts[schedule] = dict(order={stage: pipeline_timeline.order(events, stage) for stage in (0, 1)},
                               idle=idles, held={stage: pipeline_timeline.held(events, stage)[0] for stage in (0, 1)})
    figure.suptitle("pipeline_parallel.py, 2 stages, 4 micro-batches: a box per pass (light: forward, dark: backward, "
                    "its micro-batch's number); white: the bubble", fontsize=10)
    return figure, list(jobs.values()), facts


# --- step 9: context parallelism -------------------------------------------------------------------------------------

def context_parallel(work, step=2):
    """context_parallel.py on 4 processes, one cp group of 4 (the ring), bf16, every send recorded: the chunks of the
    sequence each rank holds, and every send of one optimizer step, rank by rank, in time."""
    job = run(torchrun("context_parallel.py", 1, 1, "--cp", 4, "--context", 64, "--batch_size", 8, "--precision",
                       "bf16", "--text", excerpt(), "--dropout", 0, nproc=4),
              cwd=mkdir(work / "context_parallel"), record_collectives=True, timeout=900)
    positions = {row["rank"]: row["context"]["positions"] for row in job.samples}
    events = [event for event in job.records("collectives.jsonl") if event["step"] == step]
    sends = [event for event in events if event["event"] == "call" and event["op"] == "isend"]
    backwards = {event["rank"]: event for event in events if event["event"] == "backward"}
    start = min(event["began"] for event in sends)

    def kind(send):
        if not send["in_backward"]:
            return "forward: a block of keys and values"
        return "backward: the gradients of a block (float32)" if "float32" in send["dtypes"] else \
            "backward: a block of keys and values, again"

    plt = pyplot()
    figure, (split_axes, time_axes) = plt.subplots(2, 1, figsize=(11, 6.2), gridspec_kw=dict(height_ratios=[1, 3]))
    context = sum(len(held) for held in positions.values())
    for rank, held in positions.items():
        for position in held:
            split_axes.add_patch(plt.Rectangle((position, 0), 1, 1, facecolor=RANK_COLORS[rank], alpha=0.75,
                                               edgecolor="white", linewidth=0.3))
    chunk = context // (2 * len(positions))
    for number in range(2 * len(positions)):
        owner = next(rank for rank, held in positions.items() if number * chunk in held)
        split_axes.text((number + 0.5) * chunk, 0.5, f"chunk {number}\nrank {owner}", ha="center", va="center",
                        fontsize=8)
    split_axes.set(xlim=(0, context), ylim=(0, 1), yticks=[], xlabel="position in the sequence",
                   title=f"the split (recorded): {context} positions in {2 * len(positions)} chunks, rank r holds "
                         f"chunks r and {2 * len(positions) - 1} - r")
    markers = {"forward: a block of keys and values": ("tab:blue", "v"),
               "backward: a block of keys and values, again": ("tab:orange", "v"),
               "backward: the gradients of a block (float32)": ("tab:red", "D")}
    for rank, event in backwards.items():
        time_axes.axvspan((event["began"] - start) * 1e3, (event["ended"] - start) * 1e3,
                          ymin=1 - (rank + 0.9) / len(positions), ymax=1 - (rank + 0.1) / len(positions),
                          color="gray", alpha=0.12)
    counts = Counter()
    for send in sends:
        label = kind(send)
        counts[label, send["rank"]] += 1
        color, marker = markers[label]
        at = (send["began"] - start) * 1e3
        # An arrow down from the sender's row, toward the next rank (rank 3's goes round to rank 0).
        time_axes.annotate("", xy=(at, send["rank"] + 0.42), xytext=(at, send["rank"]),
                           arrowprops=dict(arrowstyle="->", color=color, alpha=0.7, linewidth=1))
        time_axes.plot(at, send["rank"], marker=marker, color=color, markersize=5, linestyle="none", label=label)
    handles = dict(zip(*reversed(time_axes.get_legend_handles_labels())))
    time_axes.legend(handles.values(), handles.keys(), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2),
                     ncol=3)
    peers = {send["rank"]: send["peer"] for send in sends}
    time_axes.set(ylim=(len(positions) - 0.4, -0.4), yticks=range(len(positions)),
                  yticklabels=[f"rank {rank}\nsends to {peers[rank]}" for rank in range(len(positions))],
                  xlabel=f"milliseconds since the first send of optimizer step {step} (grey: the rank's backward)",
                  title="every send of one optimizer step, as it was posted: 3 hops a layer, 2 layers, forward "
                        "then backward")
    for axes in (split_axes, time_axes):
        axes.title.set_fontsize(9)
    figure.suptitle("context_parallel.py, one cp group of 4: each rank holds 2 chunks of every sequence, and keys and "
                    "values go round the ring", fontsize=10)
    return figure, job, dict(positions=positions, sends={f"{label} | rank {rank}": count
                                                         for (label, rank), count in sorted(counts.items())})


# --- step 10: expert parallelism -------------------------------------------------------------------------------------

def expert_parallel(work, experts=4, top_k=2):
    """expert_parallel.py on 2 processes, --ep 2, one epoch of the help pages, every router's choices recorded: the
    share of each expert in every step, layer by layer, and how many assignments each rank sent to each rank."""
    job = run(torchrun("expert_parallel.py", 1, 1, "--ep", 2, "--top_k", top_k), cwd=mkdir(work / "expert_parallel"),
              record=True, timeout=900)
    routes = {row["rank"]: row["routes"] for row in job.samples if row["routes"]}
    layers = 2
    ep = len(routes)
    holder = {expert: expert * ep // experts for expert in range(experts)}
    # shares[layer][step][expert]: the expert's share of every rank's assignments in that forward.
    shares = [[] for _ in range(layers)]
    sent = Counter()
    for forward in range(len(routes[0])):
        step, layer = divmod(forward, layers)
        counts = Counter()
        for rank, passes in routes.items():
            chosen = bytes.fromhex(passes[forward])
            counts.update(chosen)
            for expert in chosen:
                sent[rank, holder[expert]] += 1
        total = sum(counts.values())
        shares[layer].append([counts[expert] / total for expert in range(experts)])
    plt = pyplot()
    figure = plt.figure(figsize=(12, 4.8))
    grid = figure.add_gridspec(1, 3, width_ratios=[1.6, 1.6, 1])
    shades = {0: ["#1f77b4", "#9ecae1"], 1: ["#ff7f0e", "#fdbe85"]}
    for layer in range(layers):
        axes = figure.add_subplot(grid[0, layer])
        steps = range(1, len(shares[layer]) + 1)
        axes.stackplot(steps, *zip(*shares[layer]), colors=[shades[holder[e]][e % 2] for e in range(experts)],
                       labels=[f"expert {e} (on rank {holder[e]})" for e in range(experts)], alpha=0.9)
        for boundary in range(1, experts):
            axes.axhline(boundary / experts, color="black", linewidth=0.6, linestyle=":")
        axes.set(xlim=(1, len(shares[layer])), ylim=(0, 1), xlabel="optimizer step",
                 ylabel="share of the step's assignments" if layer == 0 else None,
                 title=f"block{layer}'s router: each expert's share of the step\n(dotted: an even split, "
                       f"{1 / experts:.0%} each)")
        axes.title.set_fontsize(9)
        if layer == 0:
            axes.legend(fontsize=7, loc="upper right", framealpha=0.9)
    matrix = figure.add_subplot(grid[0, 2])
    table = [[sent[source, target] for target in range(ep)] for source in range(ep)]
    matrix.imshow([[count / sum(row) for count in row] for row in table], cmap="Blues", vmin=0, vmax=1)
    for source in range(ep):
        for target in range(ep):
            share = table[source][target] / sum(table[source])
            matrix.text(target, source, f"{table[source][target]:,}\n({share:.0%})", ha="center", va="center",
                        fontsize=9, color="white" if share > 0.6 else "black")
    matrix.set(xticks=range(ep), yticks=range(ep), xlabel="to the rank holding the expert",
               ylabel="from the rank whose token it is", title="assignments in the epoch, by rank:\n"
                                                               "off the diagonal, sent by all-to-all")
    matrix.set_xticklabels([f"rank {rank}" for rank in range(ep)]), matrix.set_yticklabels(
        [f"rank {rank}" for rank in range(ep)])
    matrix.title.set_fontsize(9)
    figure.suptitle(f"expert_parallel.py on 2 ranks, --ep 2, top-{top_k}: where the routers sent the tokens, step by "
                    f"step (recorded)", fontsize=10)
    return figure, job, dict(steps=len(shares[0]), first=[shares[layer][0] for layer in range(layers)],
                             last=[shares[layer][-1] for layer in range(layers)], sent=dict(sent))


# --- step 11: one mesh -----------------------------------------------------------------------------------------------

MESH_MATRICES = ["embed.token.weight", "block0.attention.q.weight", "block1.mlp.proj.weight"]


def one_mesh(work, pp=2, tp=2):
    """one_mesh.py on 8 processes, pp 2 x dp 2 x tp 2 (the tests' and notebook 11's job: in a test session, one run
    for all): the layers every rank holds, and the block of three weights each rank holds, read from the run's
    sharded snapshot."""
    job = run(torchrun("one_mesh.py", 3, 1, "--workload", "gpt-cpu", "--text", excerpt(), "--dropout", 0,
                       "--batch_size", 4, "--pp", pp, "--tp", tp, "--microbatches", 2, nproc=8, launcher_args=[]),
              cwd=mkdir(work / "one_mesh"), env={RUN_DIR_VARIABLE: "runs"}, timeout=900, shared=True)
    held = blocks_held(job.cwd / "mesh_snapshot")
    ranks = 8
    dp = ranks // (pp * tp)
    order = ["embed", *sorted({name.split(".")[0] for name in held if name.startswith("block")}), "head"]
    layers = {rank: [layer for layer in order if any(name.split(".")[0] == layer and holder == rank
                                                     for name, (_, pieces) in held.items() for holder, _, _ in pieces)]
              for rank in range(ranks)}
    plt = pyplot()
    figure = plt.figure(figsize=(12, 6))
    grid = figure.add_gridspec(2, 3, height_ratios=[1.15, 1], width_ratios=[1, 1, 1.6])
    axes = figure.add_subplot(grid[0, :])
    for rank in range(ranks):
        p, d, t = rank // (dp * tp), rank // tp % dp, rank % tp
        left, top = p * (tp + 0.6) + t, d
        axes.add_patch(plt.Rectangle((left, top), 0.94, 0.9, facecolor=RANK_COLORS[rank], alpha=0.7,
                                     edgecolor="black"))
        stages = ", ".join(f"{layer} (stage {order.index(layer) * 2 * pp // len(order)})" for layer in layers[rank])
        axes.text(left + 0.47, top + 0.45, f"rank {rank}: pp {p}, dp {d}, tp {t}\n{stages}", ha="center",
                  va="center", fontsize=8)
    for p in range(pp):
        axes.text(p * (tp + 0.6) + tp / 2, -0.12, f"pipeline rank {p}: stages {p} and {p + pp}", ha="center",
                  fontsize=9)
    for p in range(pp - 1):
        for arrow, y in (("->", dp / 2 - 0.1), ("<-", dp / 2 + 0.1)):
            axes.annotate("", xy=((p + 1) * (tp + 0.6) - 0.02, y), xytext=(p * (tp + 0.6) + tp - 0.02, y),
                          arrowprops=dict(arrowstyle=arrow, color="black"))
        axes.text((p + 1) * (tp + 0.6) - 0.31, dp / 2 + 0.3, "a micro-batch:\nstage 0 -> 1 -> 2 -> 3,\n"
                  "its gradients back", ha="center", va="top", fontsize=7)
    axes.set(xlim=(-0.1, pp * (tp + 0.6) - 0.5), ylim=(dp, -0.35))
    axes.axis("off")
    axes.set_title("the mesh (pp, dp, tp): a row of a pipeline rank's box is a tp group, a column a dp group; the "
                   "layers each rank holds, from the snapshot", fontsize=9)
    for spot, name in zip([grid[1, 0], grid[1, 1], grid[1, 2]], MESH_MATRICES):
        shape, pieces = held[name]
        draw_blocks(figure.add_subplot(spot), shape, pieces, f"{name} ({shape[0]}x{shape[1]})",
                    lambda rank, offsets, sizes, shape=shape: f"rank {rank}\n{ranges(offsets, sizes, shape)}")
    figure.suptitle("one_mesh.py on 8 ranks, pp 2 x dp 2 x tp 2: who holds what (read from the run's sharded "
                    "snapshot)", fontsize=10)
    return figure, job, dict(layers=layers, held={name: held[name] for name in MESH_MATRICES})


def plan_at_scale(work, world=1024, pp=8, tp=8):
    """plan_at_scale.py (step 14) on the learner page's job, the 8B GPT on 1,024 GPUs as step 11 lays it out (pp 8 x
    dp 16 x tp 8, recomputation, 8 micro-batches): the two kinds of rank it traces, what each holds and peaks at
    against an H100's memory, and the bytes each sends in a step over every group, on NVLink or the network."""
    job = run(python("plan_at_scale.py", "--world", world, "--pp", pp, "--tp", tp, "--size", "8b",
                     "--checkpoint_activations", "--json", "plan.json"),
              cwd=mkdir(work / "plan_at_scale"), timeout=3600)
    plan = json.loads((job.cwd / "plan.json").read_text())
    gib = 2**30
    plt = pyplot()
    figure, (memory, traffic) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw=dict(width_ratios=[1, 1.6]))
    names = [f"rank {rank['rank']}\n({rank['where']})" for rank in plan["plans"]]
    for index, rank in enumerate(plan["plans"]):
        state = (rank["params"] + rank["grads"] + rank["optim"]) / gib
        kept = rank["activations"] / gib
        rest = rank["peak"] / gib - state - kept
        memory.bar(index, state, color="tab:blue", label="weights, gradients, AdamW" if index == 0 else None)
        memory.bar(index, kept, bottom=state, color="tab:orange",
                   label="kept for backward" if index == 0 else None)
        memory.bar(index, rest, bottom=state + kept, color="tab:gray",
                   label="the rest of the peak (gathered layers, logits, buffers)" if index == 0 else None)
        memory.text(index, rank["peak"] / gib, f"{rank['peak'] / gib:.1f} GiB", ha="center", va="bottom", fontsize=8)
    h100 = 81559 * 2**20 / gib
    memory.axhline(h100, color="black", linestyle="--")
    memory.text(-0.4, h100, "an H100's 80 GB", va="bottom", fontsize=8)
    memory.set(xticks=range(len(names)), xticklabels=names, ylabel="GiB", ylim=(0, h100 * 1.15),
               title="each traced rank's peak memory (torch's MemTracker)")
    memory.legend(fontsize=7, loc="upper right")
    colors = {"nvlink": "tab:green", "network": "tab:red"}
    width = 0.8 / len(plan["plans"])
    groups = sorted({row["group"] for rank in plan["plans"] for row in rank["tally"]})
    for index, rank in enumerate(plan["plans"]):
        links = rank["estimate"]["links"]
        sent = {group: sum(row["sent"] for row in rank["tally"] if row["group"] == group) / gib for group in groups}
        for position, group in enumerate(groups):
            traffic.bar(position + index * width, sent[group], width, color=colors[links[group]],
                        edgecolor="black", hatch="//" if index else None)
            traffic.text(position + index * width, sent[group], f"{sent[group]:.2f}", ha="center", va="bottom",
                         fontsize=7)
    traffic.set(xticks=[position + width * (len(plan["plans"]) - 1) / 2 for position in range(len(groups))],
                xticklabels=[f"{group} ({plan['plans'][0]['estimate']['links'][group]})" for group in groups],
                ylabel="GiB sent a step", title="bytes a rank sends in a step, by group (plain: " + names[0].split(
                    "\n")[0] + ", hatched: " + names[-1].split("\n")[0] + "; green NVLink, red network)")
    traffic.title.set_fontsize(9)
    figure.suptitle("plan_at_scale.py: one rank of a 1,024-GPU job of an 8B GPT (pp 8 x dp 16 x tp 8), traced on a "
                    "laptop", fontsize=10)
    return figure, job, dict(plans=[{key: rank[key] for key in ("rank", "params", "grads", "optim", "activations",
                                                                 "peak")} for rank in plan["plans"]])


# --- step 12: the long run -----------------------------------------------------------------------------------------

def long_run(work, total=36, kill_at=17):
    """long_run.py on 2 processes (pp 2) on the short help pages (the tests' token files and batches: global batches of
    16, a snapshot every 6 steps), a line every step and a held-out loss every 6; rank 1 SIGKILLs itself before an
    optimizer step after step 12's snapshot, and torchrun starts both again from that snapshot: the training loss of
    every step of each attempt, the held-out losses, the kill and the resume, read from what the run printed."""
    from tools.prepare_data import short_help_pages

    job = run(torchrun("long_run.py", total, 6, "--data", short_help_pages(), "--workload", "gpt-cpu", "--dropout", 0,
                       "--global_batch", 16, "--microbatches", 2, "--eval_every", 6, "--log_every", 1, "--pp", 2,
                       "--tp", 1, nproc=2, launcher_args=["--max_restarts=1"]),
              cwd=mkdir(work / "long_run"), record=True, kill_at_step=(0, 1, kill_at), timeout=600)
    resumed = output.STEP_RESUMED.search(job.output)
    before, after = job.output[:resumed.start()], job.output[resumed.start():]
    first = {int(match["step"]): float(match["loss"]) for match in output.STEP.finditer(before)}
    second = {int(match["step"]): float(match["loss"]) for match in output.STEP.finditer(after)}
    held_out = dict(output.held_out_losses(job.output))  # a step's held-out loss printed twice is the same number
    resume_step, resume_batch = int(resumed["step"]), int(resumed["batch"])
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(10, 5))
    again = [step for step in second if step in first]
    same = all(first[step] == second[step] for step in again)
    # The first attempt drawn wide and pale under the second: where both trained a step, the dots fall in its rings.
    axes.plot(list(first), list(first.values()), color="tab:gray", marker="o", markersize=9, fillstyle="none",
              linewidth=3, alpha=0.5, label="training loss, first attempt")
    axes.plot(list(second), list(second.values()), color="tab:blue", marker=".",
              label=f"training loss, after the restart (steps {again[0]}-{again[-1]} again: "
                    f"{'the same losses' if same else 'other losses'})")
    axes.plot(list(held_out), list(held_out.values()), color="tab:orange", marker="o",
              label="held-out loss (every 6 steps, all 55 held-out sequences)")
    axes.axvline(max(first) + 0.5, color="tab:red", linestyle=":")
    axes.text(max(first) + 0.3, max(first.values()), f"rank 1 SIGKILLed\nbefore step {max(first) + 1}",
              color="tab:red", fontsize=8, va="top", ha="right")
    axes.axvline(resume_step, color="black", linestyle="--")
    axes.text(resume_step - 0.3, max(first.values()), f"resumed from the snapshot\nof step {resume_step}: global "
              f"batch {resume_batch}\nnext (the cursor)", fontsize=8, va="top", ha="right")
    axes.set(xlabel="optimizer step (a global batch of 16 sequences each)", ylabel="loss (mean over every token)",
             title="the steps after the snapshot are trained again, on the same global batches")
    axes.title.set_fontsize(9)
    axes.legend(fontsize=8, loc="upper right")
    figure.suptitle("long_run.py on 2 ranks (pp 2): a kill between snapshots, torchrun's restart, the run resumed at "
                    "its cursor", fontsize=10)
    return figure, job, dict(first=first, second=second, held_out=held_out, resumed=(resume_step, resume_batch),
                             trained_again=again, same_losses=same)


# --- step 13: replica groups -----------------------------------------------------------------------------------------

def group_steps(job, node):
    """[(seconds, step, participants)] of the steps a group's rank 0 printed as committed, in order."""
    return [(seconds, int(match["step"]), int(match["participants"])) for seconds, where, line in job.timeline
            if where == node for match in [output.GROUP_STEP.search(line)] if match]


def fault_tolerance_at_scale(work, together=100, after=40):
    """fault_tolerant.py as two replica groups of one rank under --max_restarts=1, at a lighthouse with a heartbeat
    timeout of 2 s: group 1's worker SIGKILLed once it has committed `together` steps with group 0; the steps each
    group committed against the seconds, the kill, group 1's load of its snapshot, its heal, and the job stopped
    `after` steps past the heal."""
    port = free_port()
    commands = [lighthouse(port), *replica_groups("fault_tolerant.py", 100, 2, "--timeout", 20, port=port,
                                                  launcher_args=["--max_restarts=1"])]
    with start(*commands, cwd=mkdir(work / "fault_tolerant"), services=1) as job:
        # Group 1 may start late (it then heals at its first step): the kill comes once it has trained `together`
        # steps with group 0, past a snapshot of its own (one every 64 steps), whatever step it began at.
        trained = 0
        while trained < together:
            match = job.wait_for(output.GROUP_STEP, timeout=300)
            trained += match["group"] == "1" and match["participants"] == "2"
        killed_after = int(match["step"])
        job.kill_worker(rank=0, node=2)  # node 2 is group 1's torchrun (node 0 the lighthouse); rank 0 its worker
        healed = next_heal(job, group=1, timeout=300)
        printed = healed  # the last step group 1 printed, until it is `after` steps past its heal
        while printed < healed + after:
            match = job.wait_for(output.GROUP_STEP, timeout=300)
            printed = int(match["step"]) if match["group"] == "1" else printed
        job.note(f"stops the job, {after} steps after group 1's heal")
    # Node 0 is the lighthouse, node g + 1 group g's torchrun.
    survivor, returned = group_steps(job, 1), group_steps(job, 2)
    killed_at = next(seconds for seconds, node, line in job.timeline if node is None and line.startswith("SIGKILL"))
    before = [row for row in returned if row[0] < killed_at]
    back = [row for row in returned if row[0] > killed_at]
    resumed_at, on_disk = next((seconds, int(match["epoch"]) * 32) for seconds, node, line in job.timeline
                               if node == 2 for match in [output.RESUMED.search(line)] if match)
    healed_at = next(seconds for seconds, node, line in job.timeline
                     if node == 2 and seconds > killed_at and output.HEALED.search(line))
    # Group 0's longest wait between two committed steps in the few steps after the kill.
    waited = max((pair for pair in zip(survivor, survivor[1:]) if pair[1][0] > killed_at and
                  pair[1][1] <= killed_after + 5), key=lambda pair: pair[1][0] - pair[0][0])
    (wait_from, wait_step, _), (wait_to, _, _) = waited
    alone = [step for _, step, participants in survivor if participants == 1 and step > killed_after]

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(12, 5))
    for points, label in ((before, "group 1 (its first worker, then the one its torchrun started again)"),
                          (back, None)):
        axes.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=8, alpha=0.35,
                  color="tab:orange", label=label)
    for participants, color, label in ((2, "tab:blue", "group 0, a step of 2 groups"),
                                       (1, "tab:cyan", "group 0, a step alone (participants 1)")):
        points = [p for p in survivor if p[2] == participants]
        axes.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=3, color=color, label=label)
    axes.axvline(killed_at, color="red", linewidth=1.5)
    axes.annotate(f" SIGKILL to group 1's worker\n (after step {killed_after})", (killed_at, healed * 0.15),
                  color="red", fontsize=8)
    axes.axvspan(killed_at, healed_at, color="0.92")
    axes.annotate(f"group 0 waits {wait_to - wait_from:.1f} s after step {wait_step}\n(the lighthouse's heartbeat "
                  f"timeout), then trains {len(alone)} steps alone", (wait_to, wait_step), xytext=(12, 8),
                  textcoords="offset points", fontsize=8, arrowprops=dict(arrowstyle="->"))
    axes.plot(resumed_at, on_disk, "v", color="tab:orange", markersize=9, markeredgecolor="black")
    axes.annotate(f"group 1 back {resumed_at - killed_at:.1f} s after the kill: loads its own snapshot, step {on_disk}",
                  (resumed_at, on_disk), xytext=(-10, -4), textcoords="offset points", ha="right", fontsize=8)
    axes.annotate("", (healed_at, healed), (resumed_at, on_disk),
                  arrowprops=dict(arrowstyle="->", color="tab:orange", linewidth=1.5))
    axes.plot(healed_at, healed, "*", color="tab:orange", markersize=14, markeredgecolor="black")
    axes.annotate(f"healed at step {healed} from group 0, not from disk;\nfrom it on, both print the same weights",
                  (healed_at, healed), xytext=(-10, 10), textcoords="offset points", ha="right", fontsize=8)
    axes.set(xlabel="seconds since the job started", ylabel="step committed",
             title="group 0 never stops; group 1, killed, comes back at the step the job is at, with group 0's state")
    axes.title.set_fontsize(9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", markerscale=2)
    figure.suptitle("fault_tolerant.py: two replica groups of one rank at a lighthouse; group 1's worker SIGKILLed, "
                    "its torchrun starts it again", fontsize=10)
    return figure, job, dict(killed_after=killed_after, wait=wait_to - wait_from, wait_step=wait_step,
                             alone=len(alone), back=resumed_at - killed_at, on_disk=on_disk, healed=healed,
                             healed_after=healed_at - killed_at)


# --- drawing them ----------------------------------------------------------------------------------------------------

# Each figure, by the page that shows it (docs/<page>.md shows figures/<page>.png).
FIGURES = {"single-device": single_device, "ddp": ddp, "torchrun": torchrun_figure, "multinode": multinode,
           "fsdp": fsdp, "gpt": gpt, "tensor-parallel": tensor_parallel, "pipeline-parallel": pipeline_parallel,
           "context-parallel": context_parallel, "expert-parallel": expert_parallel, "one-mesh": one_mesh,
           "plan-at-scale": plan_at_scale, "fault-tolerance-at-scale": fault_tolerance_at_scale,
           "long-run": long_run}


def path_of(name, folder=FOLDER):
    return Path(folder) / f"{name}.png"


def draw(name, folder=FOLDER, work=None):
    """Run the figure's job in `work` (a new temporary folder by default), draw it to `folder`/<name>.png; what it
    drew (the facts the picture shows), as a dict."""
    work = Path(work or tempfile.mkdtemp(prefix=f"figure-{name}-"))
    figure, job, facts = FIGURES[name](work)
    footer(figure, job, name)
    save(figure, path_of(name, folder))
    return facts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"the figures to draw, of {', '.join(FIGURES)} (all)")
    parser.add_argument("--list", action="store_true", help="list the figures and what each is drawn from")
    parser.add_argument("--out", default=str(FOLDER), help="the folder of the PNGs (default docs/figures)")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in FIGURES]
    if unknown:
        parser.error(f"no figure named {', '.join(unknown)}: choose from {', '.join(FIGURES)}")
    if args.list:
        for name, function in FIGURES.items():
            print(f"{name}: {' '.join(function.__doc__.split())}")
        return
    for name in args.names or FIGURES:
        began = time.perf_counter()
        draw(name, args.out)
        print(f"{path_of(name, args.out)}: drawn in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
