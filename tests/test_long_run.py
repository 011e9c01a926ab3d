"""Step 12, long_run.py: a run counted in optimizer steps, on token files read from disk, in global batches that stay
the same on any layout. A job killed between two snapshots ends bit for bit where the uninterrupted one does; a run
snapshotted on 8 ranks (pp 2 x dp 2 x tp 2), resumed on 4 (dp 4), then on one process, reads exactly the batches the
uninterrupted run reads, in order, with not one sequence repeated or skipped over an epoch (each epoch's order is
computed for the positions read alone, and a read leaves nothing of the file mapped), and goes on within float
rounding of it (from the start, one process ends about as near as it is to itself split otherwise); the loss is the
mean over every token that counts, however the global batch is split; every layout prints the same held-out loss on
the same weights; each dp rank reads its own rows and no other; a rewind (--resume_from) with --skip leaves out
exactly the batches it names; TensorBoard's scalars are what the lines say, each step once; bad input (token files
without sequences, a missing --data said once, a rewind over later snapshots) and a disk that fills during a save stop
with one line.

The jobs train the CPU-size GPT (2 blocks, a context of 64) on the help pages of at most 1,500 characters
(tools/prepare_data.py --max_chars 1500: 34 documents of 202 to 1,473 characters, 409 training sequences, 55 held out),
in global batches of 16 sequences, 2 micro-batches a dp rank's share, fp32 and dropout 0: 36 steps, a little over an
epoch (batch 25 holds the end of epoch 0 and the start of epoch 1), a snapshot every 6 steps (the last 5 kept), a
held-out loss every 12, a line every 6. Every process records the rows it trains on in each step (the recorder's
batches.jsonl).
"""
import collections
import hashlib
import itertools
import json
import os
import re
import runpy
import shutil
import sys

import pytest
import torch

from expect import (assert_a_peer_gone_is_one_line_a_rank, assert_bitwise_equal, assert_only_own_lines, farthest,
                    sharded_snapshot, small_disk, stopped_as_rank_0)
from tools import plot_metrics
from harness.jobs import REPO, output, run, torchrun
from tools.prepare_data import short_help_pages
from tools.seed_checkpoint import seed_checkpoint_beside
from utils import SEED, snapshot_to_resume, step_snapshot
from utils.data import IGNORE, HeldOut, Shares, TokenFile, batch_range, global_batch, model_of, token_loss
from utils.metrics import RUN_DIR_VARIABLE

GLOBAL_BATCH, TOTAL, SAVE_EVERY, EVAL_EVERY, LOG_EVERY, KEEP = 16, 36, 6, 12, 6, 5
SNAPSHOTS = "long_snapshots"
# Equal up to float rounding, from the uninterrupted run's snapshot after 12 steps (measured here, torch 2.14.1, x86:
# the windows' losses within 2.5e-7, the weights within 3.8e-5 after 12 steps on 4 ranks and after 12 more on one
# process): one process sums a step's gradients at once, the mesh over tp's parts of each product, the micro-batches
# and the dp shards in other orders. The run that trained 3 other batches ends 5.3e-3 away.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 2e-4
# From the very start the roundings may grow larger: Adam's first steps move each weight by about the learning rate,
# whatever the size of its gradient, so a weight whose gradient is near 0 (a sum of terms that cancel, below Adam's
# eps of 1e-8) moves by what the rounding decides, and how far that spreads depends on the batches. So the mesh is held
# to a few times what one process differs from itself with its batch split into 4 micro-batches instead of 2. Measured
# here after 36 steps: the mesh 1.3e-4 from one process, one process 1.2e-4 from itself; their windows' losses 6.7e-6
# and 1.2e-5 apart.
FROM_SCRATCH_LOSS, FROM_SCRATCH_RATIO = 1e-4, 5


@pytest.fixture(scope="module")
def data():
    """The token files: written once in a test session (notebook 12 trains on the same)."""
    return short_help_pages()


def long_run(folder, data, *args, total=TOTAL, nproc=8, layout=(2, 2), **options):
    """A job of long_run.py in `folder` (which may hold a snapshot to resume), recorded, per-rank metrics in runs/;
    `layout`: (pp, tp), dp the rest. A job that injects a kill may start again once (if it asks: max_restarts)."""
    pp, tp = layout
    return run(torchrun("long_run.py", total, SAVE_EVERY, "--data", data, "--workload", "gpt-cpu", "--dropout", 0,
                        "--global_batch", GLOBAL_BATCH, "--microbatches", 2, "--eval_every", EVAL_EVERY, "--log_every",
                        LOG_EVERY, "--keep", KEEP, "--pp", pp, "--tp", tp, *args, nproc=nproc,
                        launcher_args=options.pop("launcher_args", ())), cwd=folder, env={RUN_DIR_VARIABLE: "runs"},
               timeout=300, record=True, **options)


def resumed_from(tmp_path_factory, name, job, steps):
    """A fresh folder holding `job`'s snapshot after `steps` steps, as the only one."""
    folder = tmp_path_factory.mktemp(name)
    shutil.copytree(step_snapshot(job.cwd / SNAPSHOTS, steps), step_snapshot(folder / SNAPSHOTS, steps))
    return folder


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data):
    """The uninterrupted run on 8 ranks. notebooks/12_long_run.ipynb runs the same job: shared, it runs once."""
    return long_run(tmp_path_factory.mktemp("straight"), data, shared=True)


@pytest.fixture(scope="module")
def killed(tmp_path_factory, data):
    """The same run with 2 loader processes a rank: rank 5 SIGKILLs itself just before its 17th optimizer step (after
    its forward and backward: no snapshot step), torchrun starts the eight again, and they resume from step 12."""
    return long_run(tmp_path_factory.mktemp("killed"), data, "--workers", 2, kill_at_step=(0, 5, 17),
                    launcher_args=["--max_restarts=1"])


@pytest.fixture(scope="module")
def chain(tmp_path_factory, data, straight):
    """The uninterrupted run's snapshot after 12 steps resumed on 4 ranks (pp 1, tp 1: dp 4) with 2 loader processes a
    rank, rank 0 killed before its 13th step (step 25: the job fails, its last snapshot is step 24's, as when a job is
    preempted); that snapshot resumed by one process to the end: (the 4 ranks' job, the one process's job)."""
    four = long_run(resumed_from(tmp_path_factory, "four", straight, 12), data, "--workers", 2, nproc=4,
                    layout=(1, 1), kill_at_step=(0, 0, 13), check=False)
    alone = long_run(resumed_from(tmp_path_factory, "one", four, 24), data, nproc=1, layout=(1, 1))
    return four, alone


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data):
    """The whole run on one process, from the start: its share of 16 sequences in 2 micro-batches of 8, then in 4 of 4
    (the same sums in another order)."""
    return [long_run(tmp_path_factory.mktemp("one_process"), data, "--microbatches", micro, nproc=1, layout=(1, 1))
            for micro in (2, 4)]


def trained(job):
    """{step: the global batch's rows trained on in that step (a digest each), every dp rank's share in dp order}, the
    step counted from the start of the run; a step run twice (before and after a restart) counts once: the last
    attempt's. Every rank of a dp group (its stages and tp ranks) must have trained on the same rows."""
    resumed = {restart: step for restart, (step, _) in output.step_resumes(job.output).items()}
    by_step = {}
    for record in job.records("batches.jsonl"):
        attempts = by_step.setdefault(resumed.get(record["restart"], 0) + record["step"], {})
        attempts.setdefault(record["restart"], {}).setdefault(record["mesh"]["dp"], set()).add(tuple(record["rows"]))
    steps = {}
    for step, attempts in sorted(by_step.items()):
        shares = attempts[max(attempts)]
        assert all(len(rows) == 1 for rows in shares.values()), f"step {step}: a dp group's ranks read different rows"
        steps[step] = [row for dp in sorted(shares) for row in next(iter(shares[dp]))]
    return steps


def file_rows(data, split="train"):
    """A digest of every sequence of a token file, as the recorder digests what a step trains on."""
    inputs, targets = TokenFile(data, split).read(range(len(TokenFile(data, split))))
    return [hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16] for x, y in zip(inputs, targets)]


def weights(job, steps=TOTAL):
    return {name: value for name, value in sharded_snapshot(step_snapshot(job.cwd / SNAPSHOTS, steps))
            ["MODEL_STATE"].items() if isinstance(value, torch.Tensor)}


def window_losses(job):
    """{step: the mean loss over every token of the window of steps ending there}, unrounded, from the per-rank
    metrics (the last stage's first tp rank of each pipeline counts the tokens; a window run twice: the last)."""
    windows = {}
    for path in (job.cwd / "runs").glob("rank*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            windows.setdefault(record["step"], {})[record["rank"]] = record
    return {step: sum(r["loss"] * r["samples"] for r in ranks.values()) / sum(r["samples"] for r in ranks.values())
            for step, ranks in sorted(windows.items())}


# --- a kill between snapshots -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_job_killed_between_snapshots_ends_bitwise_equal_to_the_uninterrupted_one(straight, killed):
    """Killed at step 17, resumed from step 12 at global batch 12, with loader processes where the uninterrupted run has
    none: the same rows in every step, the same weights and Adam's state bit for bit, the same held-out losses. The
    killed rank's peers say so in one line each."""
    assert 17 % SAVE_EVERY and output.step_resumes(killed.output) == {1: (12, 12)}, killed.output[-3000:]
    assert trained(killed) == trained(straight)
    ours, theirs = (sharded_snapshot(step_snapshot(job.cwd / SNAPSHOTS, TOTAL)) for job in (killed, straight))
    assert_bitwise_equal(ours["MODEL_STATE"], theirs["MODEL_STATE"], "weights")
    assert_bitwise_equal(ours["OPTIMIZER_STATE"], theirs["OPTIMIZER_STATE"], "Adam's state")
    assert (ours["NEXT_BATCH"], ours["TOKENS"]) == (theirs["NEXT_BATCH"], theirs["TOKENS"]) == (36, 35522)
    assert output.held_out_losses(killed.output)[-2:] == output.held_out_losses(straight.output)[-2:]
    assert_a_peer_gone_is_one_line_a_rank(killed)


# --- another layout, the same batches ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_resumed_on_4_ranks_then_on_one_process_it_reads_the_uninterrupted_runs_batches(data, straight, chain):
    """Steps 1 to 12 on 8 ranks, 13 to 24 on 4, 25 to 36 on one process: the rows of every step's global batch are the
    uninterrupted run's, in the same order; over the first epoch every sequence of the file once, and the part of the
    next epoch that follows holds none twice."""
    four, alone = chain
    assert output.step_resumes(four.output)[0] == (12, 12) and output.step_resumes(alone.output)[0] == (24, 24)
    steps = {**{s: rows for s, rows in trained(straight).items() if s <= 12},
             **{s: rows for s, rows in trained(four).items() if 12 < s <= 24}, **trained(alone)}
    assert sorted(steps) == list(range(1, TOTAL + 1))
    assert steps == trained(straight)
    stream, every_sequence = list(itertools.chain(*steps.values())), file_rows(data)
    epoch = len(every_sequence)
    assert collections.Counter(stream[:epoch]) == collections.Counter(every_sequence), "an epoch reads each once"
    # As a multiset: two documents hold the same text (their sequences alike), so a sequence's digest is not unique.
    assert not collections.Counter(stream[epoch:]) - collections.Counter(every_sequence), "a sequence twice in epoch 1"
    assert stream[:epoch] != every_sequence, "in a drawn order, not the file's"


@pytest.mark.slow
def test_resumed_on_other_layouts_it_goes_on_within_float_rounding(straight, chain, skipped):
    """From the 8-rank run's snapshot after 12 steps, 12 steps on 4 ranks and 12 on one process: the windows' losses
    and the weights within float rounding of the uninterrupted run's; the run that skipped 3 batches (and trained on 3
    others) ends over ten times as far."""
    four, alone = chain
    reference = window_losses(straight)
    resumed = {**{s: v for s, v in window_losses(four).items() if s <= 24}, **window_losses(alone)}
    assert sorted(resumed) == [18, 24, 30, 36] and sorted(reference) == list(range(6, 37, 6))
    assert resumed == pytest.approx({s: reference[s] for s in resumed}, abs=LOSS_TOLERANCE)
    assert farthest(weights(four, 24), weights(straight, 24)) <= WEIGHT_TOLERANCE
    assert farthest(weights(alone), weights(straight)) <= WEIGHT_TOLERANCE
    assert farthest(weights(skipped, 30), weights(straight, 30)) > 10 * WEIGHT_TOLERANCE, \
        "the tolerance tells these batches from others"


@pytest.mark.slow
def test_from_the_start_the_mesh_ends_about_as_near_one_process_as_one_process_to_itself(straight, one_process):
    """The 8-rank run and one process, 36 steps from the same initial weights: their windows' losses within 1e-4, and
    the weights no farther apart than a few times one process from itself with its batch split otherwise."""
    alone, split_otherwise = one_process
    assert window_losses(alone) == pytest.approx(window_losses(straight), abs=FROM_SCRATCH_LOSS)
    assert window_losses(split_otherwise) == pytest.approx(window_losses(alone), abs=FROM_SCRATCH_LOSS)
    rounding = farthest(weights(split_otherwise), weights(alone))
    assert 0 < farthest(weights(alone), weights(straight)) <= FROM_SCRATCH_RATIO * rounding


@pytest.mark.slow
def test_every_layout_prints_the_same_held_out_loss_on_the_same_weights(data, straight, chain, one_process):
    """The held-out file (55 sequences: 3 global batches and 7 rows, the rest of the last filled with rows that count
    nothing) on every layout: the initial weights' loss on 8 ranks and on one process, step 12's on 8 ranks and on
    4 (which resumed there), step 24's on 4 ranks and on one process; and the initial weights' as this process computes
    it directly, the mean over every held-out token. Every job ended."""
    four, alone = chain
    assert len(TokenFile(data, "val")) % GLOBAL_BATCH, "a held-out set that does not divide"
    printed = {name: dict(output.held_out_losses(job.output)) for name, job in
               dict(straight=straight, four=four, alone=alone, one_process=one_process[0]).items()}
    assert printed["straight"][0] == printed["one_process"][0] == pytest.approx(initial_held_out_loss(data), abs=1e-4)
    assert printed["four"][12] == printed["straight"][12] and printed["alone"][24] == printed["four"][24]
    assert sorted(printed["straight"]) == [0, 12, 24, 36], printed


def initial_held_out_loss(data):
    """The held-out loss of one process's initial weights, computed here over the whole file at once."""
    model, _ = model_of(data, "gpt-cpu", 0)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    inputs, targets = TokenFile(data, "val").read(range(len(TokenFile(data, "val"))))
    with torch.no_grad():
        return (token_loss(model(inputs), targets) / (targets != IGNORE).sum()).item()


# --- the order, and what a rank holds of the file -----------------------------------------------------------------------

def test_every_epoch_reads_every_sequence_once_in_an_order_of_its_own():
    """The stream of global batches, for files of 1 to 70 sequences, 1,025 (just past a power of 4) and 409 (the tests'
    file), cut into batches of 1, 3 and 16: each epoch's part of it holds every sequence once, and two epochs are read
    in different orders (the file is large enough to tell)."""
    for count, size in itertools.product([*range(1, 71), 409, 1025], (1, 3, 16)):
        stream = torch.cat([global_batch(count, batch, size, SEED) for batch in range(-(-3 * count // size))])
        epochs = stream[:3 * count].view(3, count)
        assert all(sorted(epoch.tolist()) == list(range(count)) for epoch in epochs), (count, size)
        if count >= 8:
            assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[0], torch.arange(count)), count


def test_a_read_leaves_nothing_of_the_file_mapped_in_the_rank(data):
    """After a global batch is read, the token file is no longer mapped in the process: the pages a read touched leave
    with its mapping, so a rank's memory does not fill up with the file over an epoch (benchmarks/long_run.py measures
    it on larger files)."""
    tokens = TokenFile(data, "train")
    inputs, _ = Shares(tokens, GLOBAL_BATCH, SEED, 0, 2)[3]
    assert inputs.shape == (GLOBAL_BATCH // 2, 64)
    with open("/proc/self/maps") as maps:
        assert os.path.realpath(tokens.path) not in maps.read(), "the token file is still mapped after the read"


def test_each_dp_rank_reads_its_own_rows_and_no_other(monkeypatch, data):
    """Global batch 25 (it spans an epoch's end) and the last held-out batch (filled up with rows that count nothing)
    read by 1, 2, 4, 8 and 16 dp ranks: each rank asks the token file for its global_batch / dp rows and no other, the
    shares put together are the batch one rank reads, and their counts of the targets that count add up to the whole
    batch's, the one number the step all-reduces over dp. (Every rank used to read the whole global batch to count its
    tokens, and keep its share.)"""
    asked, read = [], TokenFile.read
    monkeypatch.setattr(TokenFile, "read", lambda self, indices: asked.append(len(indices)) or read(self, indices))
    for dataset, split, batch in ((Shares, "train", 25), (HeldOut, "val", 3)):
        tokens = TokenFile(data, split)
        whole_inputs, whole_targets = dataset(tokens, GLOBAL_BATCH, SEED, 0, 1)[batch]
        for dp in (1, 2, 4, 8, 16):
            asked.clear()
            inputs, targets = zip(*[dataset(tokens, GLOBAL_BATCH, SEED, rank, dp)[batch] for rank in range(dp)])
            assert asked == [GLOBAL_BATCH // dp] * dp, (dataset.__name__, dp, asked)
            assert torch.equal(torch.cat(inputs), whole_inputs) and torch.equal(torch.cat(targets), whole_targets)
            assert sum((share != IGNORE).sum() for share in targets) == (whole_targets != IGNORE).sum() > 0


# --- the loss: every token once ---------------------------------------------------------------------------------------

def test_the_loss_is_the_mean_over_every_token_however_the_global_batch_is_split(data):
    """One global batch of documents of different lengths (padded rows) split as dp 1, 2 and 4 ranks of 1, 2 and 4
    micro-batches, each micro-batch's loss summed over its tokens times dp over the batch's counted tokens, and the
    gradients averaged over dp as FSDP does: the same loss and gradients, in float64, to 1e-12. The mean of the
    micro-batches' means, the usual shortcut, is another number: a million times that tolerance away, and more."""
    model, _ = model_of(data, "gpt-cpu", 0)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    model.double()
    tokens, batch = TokenFile(data, "train"), 25  # the batch that ends epoch 0 and begins epoch 1

    def split(dp, micro):
        loss, grads, means = 0.0, [torch.zeros_like(p) for p in model.parameters()], []
        shares = [Shares(tokens, GLOBAL_BATCH, SEED, rank, dp)[batch] for rank in range(dp)]
        counted = sum((targets != IGNORE).sum() for _, targets in shares)  # what the step's all-reduce over dp adds
        for inputs, targets in shares:
            for x, y in zip(inputs.chunk(micro), targets.chunk(micro)):
                model.zero_grad()
                summed = token_loss(model(x).double(), y)
                (summed * dp / counted).backward()
                grads = [g + p.grad / dp for g, p in zip(grads, model.parameters())]
                loss += summed.item() / counted.item()
                means.append(summed.item() / (y != IGNORE).sum().item())
        return loss, grads, sum(means) / len(means)

    whole, whole_grads, _ = split(1, 1)
    for dp, micro in itertools.product((1, 2, 4), (1, 2, 4)):
        loss, grads, mean_of_means = split(dp, micro)
        assert loss == pytest.approx(whole, abs=1e-12) and all(torch.allclose(g, w, rtol=0, atol=1e-12)
                                                               for g, w in zip(grads, whole_grads)), (dp, micro)
        if dp * micro > 1:  # 2.5e-5 to 1.5e-4 away at these initial weights, whose tokens' losses differ little
            assert abs(mean_of_means - whole) > 1e-6, (dp, micro, mean_of_means, whole)
    counts = [(y != IGNORE).sum().item() for y in Shares(tokens, GLOBAL_BATCH, SEED, 0, 1)[batch][1].chunk(4)]
    assert len(set(counts)) > 1, f"the micro-batches count different numbers of tokens: {counts}"


# --- --skip -----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def skipped(tmp_path_factory, data, straight):
    """A rewind after a loss spike, as the page shows it: a copy of the uninterrupted run's snapshot folder (steps 12 to
    36), its snapshots after step 24 moved out to spiked/ (as --resume_from's line says), then one process from step
    24's snapshot with --resume_from 24 --skip 26:29, to step 30."""
    folder = tmp_path_factory.mktemp("skip")
    shutil.copytree(straight.cwd / SNAPSHOTS, folder / SNAPSHOTS)
    (folder / "spiked").mkdir()
    for steps in (30, 36):
        shutil.move(step_snapshot(folder / SNAPSHOTS, steps), folder / "spiked")
    return long_run(folder, data, "--resume_from", 24, "--skip", "26:29", total=30, nproc=1, layout=(1, 1))


@pytest.mark.slow
def test_a_rewind_with_skip_leaves_out_exactly_the_batches_it_names(straight, skipped):
    """Rewound to step 24: a line says which batches it skips, and the steps after the snapshot train on global batches
    24, 25, 29, 30, 31 and 32 (the uninterrupted run's steps 25, 26, 30 to 33), exactly; the snapshot keeps the range
    and the step it was rewound to, so that the same command again (a restart) skips the range again and goes on from
    its own last snapshot, not from step 24's; the snapshots moved out are as they were."""
    job, folder = skipped, str(skipped.cwd / SNAPSHOTS)
    assert output.step_resumes(job.output) == {0: (24, 24)}, job.output[-3000:]
    assert "skipping global batches 26 to 28 (--skip 26:29): 3 batches never trained on" in job.output
    reference = trained(straight)
    assert trained(job) == {25 + i: reference[batch + 1] for i, batch in enumerate([24, 25, 29, 30, 31, 32])}
    snapshot = sharded_snapshot(step_snapshot(job.cwd / SNAPSHOTS, 30))
    assert (snapshot["SKIPPED"], snapshot["NEXT_BATCH"], snapshot["REWOUND_TO"]) == ("26:29", 33, 24)
    assert snapshot_to_resume(folder, 24) == step_snapshot(folder, 30)
    assert sorted(path.name for path in (job.cwd / "spiked").iterdir()) == ["step-00000030", "step-00000036"]
    assert_bitwise_equal(sharded_snapshot(job.cwd / "spiked" / "step-00000036")["MODEL_STATE"],
                         sharded_snapshot(step_snapshot(straight.cwd / SNAPSHOTS, 36))["MODEL_STATE"], "weights")


@pytest.mark.slow
def test_a_rewind_to_a_step_not_kept_or_over_later_snapshots_stops_before_the_process_group(monkeypatch, tmp_path, data,
                                                                                          straight):
    """--resume_from on a copy of the uninterrupted run's folder (steps 12 to 36), before the process group forms: step
    6's snapshot, which --keep 5 removed, stops with one line that names the steps kept; step 24's, with the snapshots
    of steps 30 and 36 still there (the rewound run would write over step 30's, and a restart would resume from step
    36's), stops with one line that says how to move them out; nothing is changed."""
    shutil.copytree(straight.cwd / SNAPSHOTS, tmp_path / SNAPSHOTS)
    kept = sorted(path.name for path in (tmp_path / SNAPSHOTS).iterdir())
    monkeypatch.chdir(tmp_path)
    stops = [str(stopped_as_rank_0(monkeypatch, "long_run.py", 1, "--data", data, "--workload", "gpt-cpu", "--pp", 1,
                                   "--tp", 1, "--global_batch", GLOBAL_BATCH, "--microbatches", 2, "--resume_from",
                                   steps)) for steps in (6, 24)]
    assert stops == ["error: --resume_from 6: long_snapshots keeps no snapshot of step 6; it keeps those of steps 12, "
                     "18, 24, 30 and 36 (--keep says how many of the last stay)",
                     "error: --resume_from 24: long_snapshots holds snapshots after step 24 (of steps 30 and 36), "
                     "which the rewound run would write over, or resume from after a restart: move them out first "
                     "(e.g. `mkdir -p spiked && mv long_snapshots/step-00000030 long_snapshots/step-00000036 "
                     "spiked/`), or leave --resume_from out to go on from step 36; nothing was changed"]
    assert sorted(path.name for path in (tmp_path / SNAPSHOTS).iterdir()) == kept


def test_a_skip_range_is_checked_against_the_cursor_and_kept(capsys):
    """batch_range: the batches of a run from its cursor, less what it skips; --skip again after a restart (the range
    in the snapshot) skips it again without a word; a range the run has passed, or never reaches, stops it."""
    assert batch_range(24, 6, (26, 29), "", say=True) == ([24, 25, 29, 30, 31, 32], "26:29")
    assert "skipping global batches 26 to 28" in capsys.readouterr().out
    assert batch_range(26, 4, (26, 29), "26:29", say=True) == ([29, 30, 31, 32], "26:29")
    assert capsys.readouterr().out == ""
    for skip, cursor in (((3, 5), 24), ((30, 31), 24)):
        with pytest.raises(SystemExit, match=r"^error: --skip .* lies outside what this run can skip"):
            batch_range(cursor, 6, skip, "", say=False)


# --- what a person watching sees --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_lines_tensorboard_and_the_plots_say_the_same(tmp_path, straight, killed):
    """Every LOG_EVERY steps a line with the step, the tokens seen, the loss and tokens/s; the event file holds the same
    losses, the held-out ones, tokens/s and the learning rate, at the same steps; the killed run's event file holds
    each step once (what the killed attempt wrote after its snapshot is purged); tools/plot_metrics.py draws the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = output.step_lines(straight.output)
    assert sorted(lines) == list(range(6, 37, 6)) and lines[36]["tokens"] == 35522
    for job in (straight, killed):
        board = EventAccumulator(str(next((job.cwd / "runs" / "long_run").iterdir()).parent))
        board.Reload()
        scalars = {tag: {event.step: event.value for event in board.Scalars(tag)} for tag in board.Tags()["scalars"]}
        assert sorted(scalars) == ["learning_rate", "loss/held_out", "loss/train", "tokens_per_s"]
        assert {step: round(value, 4) for step, value in scalars["loss/train"].items()} == \
            {step: line["loss"] for step, line in lines.items()}
        assert scalars["loss/held_out"] == pytest.approx(dict(output.held_out_losses(straight.output)), abs=5e-5)
        for tag in scalars:  # the killed run resumed at step 12, a step of a held-out loss
            steps = [event.step for event in board.Scalars(tag)]
            assert steps == sorted(set(steps)), f"{tag}: a step twice: {steps}"
    plot_metrics.plot(plot_metrics.read_run(straight.cwd / "runs"), tmp_path / "metrics.png", "long run")
    assert (tmp_path / "metrics.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs: needs root")
def test_a_disk_that_fills_during_a_synchronous_save_stops_each_rank_with_one_line_and_keeps_the_last_snapshot(
        tmp_path, data):
    """Two ranks (pp 2), a snapshot every 2 steps, --keep 1, on a disk with room for one and a half snapshots (2.3 MiB
    each): the save of step 4 runs out of room while step 2's is still there (a disk must hold --keep + 1). Each rank
    stops with the same one line (DCP's synchronous save, outside replacing(), ended in about 100 lines of traceback a
    rank), the folder being written is gone, and step 2's snapshot stays, whole."""
    with small_disk(tmp_path / "disk", free_bytes=3600 * 1024) as disk:
        job = run(torchrun("long_run.py", 6, 2, "--data", data, "--workload", "gpt-cpu", "--global_batch", 4,
                           "--microbatches", 2, "--pp", 2, "--tp", 1, "--log_every", 2, "--eval_every", 100, "--keep",
                           1, "--snapshot_path", disk / SNAPSHOTS, nproc=2), cwd=tmp_path, timeout=300, check=False)
        left = sorted(path.name for path in (disk / SNAPSHOTS).iterdir())
        kept = sharded_snapshot(step_snapshot(disk / SNAPSHOTS, 2))["STEPS_RUN"] if left else None
    assert job.returncode not in (0, None), job.output[-3000:]
    assert_only_own_lines(job)
    assert output.errors(job.output) == [f"error: cannot write {disk}/{SNAPSHOTS}/step-00000004 (no space left on the "
                                         f"disk of {disk}/{SNAPSHOTS}); the last one is kept, as it was"] * 2, \
        job.output[-3000:]
    assert (left, kept) == (["step-00000002"], 2), "the save cut short is removed, the last snapshot kept"


@pytest.mark.slow
def test_the_last_keep_snapshots_stay_and_nothing_else(straight, killed):
    """--keep 5: steps 12 to 36's snapshots, step 6's removed; no temporary of a save left, after a kill either."""
    for job in (straight, killed):
        assert sorted(path.name for path in (job.cwd / SNAPSHOTS).iterdir()) == \
            [f"step-{steps:08d}" for steps in range(12, 37, 6)]


# --- bad input --------------------------------------------------------------------------------------------------------

def test_a_global_batch_the_layout_cannot_split_stops_before_the_process_group(monkeypatch, data):
    """8 ranks of pp 2 x tp 2 leave 2 dp ranks, each of 2 micro-batches: a global batch of 7 sequences cannot split."""
    stop = stopped_as_rank_0(monkeypatch, "long_run.py", 8, "--data", data, "--workload", "gpt-cpu", "--global_batch",
                             7, "--microbatches", 2)
    assert str(stop).startswith("error: --global_batch 7 must split into the 2 dp ranks' shares"), stop


@pytest.mark.parametrize("workers", ["-1", "two"])
def test_loader_processes_are_a_whole_number_of_zero_or_more(monkeypatch, capsys, data, workers):
    """--workers -1 would reach the DataLoader after the process group formed, and end in its traceback there."""
    stop = stopped_as_rank_0(monkeypatch, "long_run.py", 1, "--data", data, "--workers", workers)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.code == 2 and error.startswith("long_run.py: error: argument --workers: "), error
    assert ("must be 0 or more, got -1" if workers == "-1" else "expected a whole number, got 'two'") in error


@pytest.mark.slow
@pytest.mark.parametrize("case", ["another global batch", "another text", "skip passed", "another step"])
def test_bad_input_on_a_resume_stops_with_one_line_before_any_step(tmp_path, tmp_path_factory, data, straight, text,
                                                                    case):
    """The uninterrupted run's snapshot after 24 steps resumed by one process with another --global_batch (the cursor
    counts batches of the snapshot's size), on token files of another text (another vocabulary), with a --skip the run
    has passed; and a snapshot folder of another kind (a seed checkpoint, which names no step): one line, and no step
    trained."""
    folder, args = resumed_from(tmp_path_factory, "bad", straight, 24), []
    if case == "another global batch":
        args = ["--global_batch", 8]
    elif case == "another text":
        other = tmp_path / "other"
        from tools.prepare_data import prepare
        prepare(other, ["Another text, of another vocabulary: 0123456789 " * 30] * 10, "another", 64)
        data = other
    elif case == "skip passed":
        args = ["--skip", "3:5"]
    else:
        shutil.rmtree(folder / SNAPSHOTS)
        shutil.copytree(seed_checkpoint_beside(text), step_snapshot(folder / SNAPSHOTS, 6))
    job = long_run(folder, data, *args, nproc=1, layout=(1, 1), check=False)
    errors = output.errors(job.output)
    assert job.returncode not in (0, None) and errors and len(set(errors)) == 1, job.output[-3000:]
    assert not job.records("batches.jsonl"), "a step was trained"
    expected = {"another global batch": "global batches of 16 sequences, not --global_batch 8's",
                "another text": "it holds another model", "skip passed": "--skip 3:5 lies outside",
                "another step": "not long_run.py's"}[case]
    assert expected in errors[0], errors


def test_token_files_without_sequences_stop_with_one_line_before_anything(monkeypatch, tmp_path, data):
    """A text of one document: tools/prepare_data.py stops with one line and writes nothing (it wrote an empty
    train.bin, said 0 sequences and exited 0; long_run.py then died on it in a 31-line ZeroDivisionError). Token files
    whose train.bin or val.bin holds no sequence or is missing (cut short, made by hand) stop long_run.py with one line
    before its process group forms (an empty val.bin printed `held-out loss nan` and trained on)."""
    (tmp_path / "one.txt").write_text("A text of one document, long enough for several sequences. " * 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["prepare_data.py", "one", "--files", "one.txt", "--workload", "gpt-cpu"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / "tools" / "prepare_data.py"), run_name="__main__")
    assert str(stop.value) == ("error: one.txt leaves train.bin without a sequence: of its 1 document, the first nine "
                               "tenths (0) are trained on and the rest (1) held out, and each file needs one of 2 "
                               "characters or more; give more documents (several --files, or a text cut into "
                               "several): nothing was written")
    assert [path.name for path in tmp_path.iterdir()] == ["one.txt"]
    for split, damage in (("train", "empty"), ("val", "empty"), ("val", "missing")):
        folder = tmp_path / f"{split}-{damage}"
        shutil.copytree(data, folder)
        if damage == "empty":
            (folder / f"{split}.bin").write_bytes(b"")
        else:
            (folder / f"{split}.bin").unlink()
        stop = stopped_as_rank_0(monkeypatch, "long_run.py", 8, "--data", folder, "--workload", "gpt-cpu",
                                 "--global_batch", GLOBAL_BATCH, "--microbatches", 2)
        holds = "holds no sequence" if damage == "empty" else "is missing"
        assert str(stop) == (f"error: {folder}/{split}.bin {holds}: a run needs sequences to train on and held-out "
                             f"ones to measure; prepare --data {folder} again (tools/prepare_data.py, from several "
                             "documents)"), (split, damage)
    assert not (tmp_path / SNAPSHOTS).exists()


@pytest.mark.slow
def test_a_missing_data_folder_is_said_once_before_the_process_group_forms(tmp_path):
    """Four ranks, --data a folder that is not there: one line, from local rank 0, and every rank stops at once,
    before the process group forms (every rank said the line after the group had formed, then gloo's teardown could
    abort: about 100 lines in all)."""
    job = run(torchrun("long_run.py", 4, 2, "--data", "nowhere", "--workload", "gpt-cpu", "--global_batch", 16,
                       "--microbatches", 2, nproc=4), cwd=tmp_path, timeout=300, check=False)
    assert job.returncode not in (0, None), job.output[-3000:]
    assert_only_own_lines(job)
    assert output.errors(job.output) == ["error: --data nowhere holds no token files (FileNotFoundError): write them "
                                         "first, e.g. `python tools/prepare_data.py nowhere`"], job.output[-3000:]
    assert not (tmp_path / SNAPSHOTS).exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_snapshot_of_another_text_with_as_many_characters_is_refused_with_one_line_that_names_both(
        tmp_path, tmp_path_factory, data, straight):
    """Token files of another text whose vocabulary has the very size of the snapshot's (its pages with 8 of their
    characters replaced by 8 others): every weight has the same shape, and DCP loads them. The GPT's identity of its
    text tells the two apart, once DCP no longer writes the snapshot's identity into the model's own (the check then
    compared the snapshot with itself: exit 0, and it trained on). One line naming both texts; no step trained."""
    from tools.prepare_data import help_topics, prepare

    vocab = json.loads((data / "meta.json").read_text())["vocab"]
    replaced = str.maketrans(dict(zip("aeiounst", "αεινουστ")))
    _, pages = help_topics()
    prepare(tmp_path / "other", [page.translate(replaced) for page in pages if len(page) <= 1500],
            "the same pages, 8 characters replaced", 64)
    theirs = json.loads((tmp_path / "other" / "meta.json").read_text())["vocab"]
    assert len(theirs) == len(vocab) and len(set(theirs) - set(vocab)) == 8, "the test needs vocabularies of one size"
    job = long_run(resumed_from(tmp_path_factory, "other_text", straight, 24), tmp_path / "other", nproc=1,
                   layout=(1, 1), check=False)
    assert job.returncode not in (0, None), job.output[-3000:]
    assert re.fullmatch(rf"error: cannot resume from {SNAPSHOTS}/step-00000024 \(ValueError: it holds a GPT of another "
                        r"text \(Python's help pages of at most 1,500 characters, [\d,]+ characters\) than this run's "
                        r"\(the same pages, 8 characters replaced, [\d,]+ characters\): [^\n]+\); it is left in "
                        r"place: move it away to start anew", "\n".join(output.errors(job.output))), job.output[-3000:]
    assert not job.records("batches.jsonl"), "a step was trained"


def test_the_page_quotes_the_code_as_it_is():
    """docs/reference/long-run.md walks through utils/data.py and a few lines of long_run.py: every line of a quoted
    block (a ```python block whose first line names its file) is in that file as it is (its indentation aside). (The
    learner's page, docs/long-run.md, quotes without naming the file: tests/test_links.py holds its excerpts.)"""
    page = (REPO / "docs" / "reference" / "long-run.md").read_text()
    blocks = re.findall(r"```python\n# (\S+\.py)\n(.*?)```", page, re.S)
    assert {path for path, _ in blocks} == {"utils/data.py", "long_run.py"}, blocks
    for path, block in blocks:
        code = {line.strip() for line in (REPO / path).read_text().splitlines()}
        missing = [line for line in block.splitlines() if line.strip() and line.strip() not in code]
        assert not missing, f"docs/reference/long-run.md quotes lines that {path} does not hold: {missing}"


@pytest.mark.gpu
def test_on_gpus_the_long_run_reads_the_same_batches_and_trains_what_the_cpu_run_trains(tmp_path, data, straight):
    """The uninterrupted run on GPUs (8 of them: its mesh; 4 to 7: pp 2 x tp 2, dp 1; fewer: one process), fp32,
    dropout 0, over NCCL, with 2 loader processes a rank and pinned memory: every step trains on the CPU run's rows,
    the initial held-out loss is the CPU run's within 1e-4, and every window's loss within FROM_SCRATCH_LOSS (from the
    start the roundings of other kernels grow as those of another split do: see above)."""
    gpus = torch.cuda.device_count()
    nproc, layout = (8, (2, 2)) if gpus >= 8 else (4, (2, 2)) if gpus >= 4 else (1, (1, 1))
    job = long_run(tmp_path, data, "--workers", 2, nproc=nproc, layout=layout, gpu=True)
    assert trained(job) == trained(straight)
    held_out, reference = dict(output.held_out_losses(job.output)), dict(output.held_out_losses(straight.output))
    print(f"largest difference from the CPU run: the windows' losses "
          f"{max(abs(a - b) for a, b in zip(window_losses(job).values(), window_losses(straight).values())):.2e}, "
          f"the initial held-out loss {abs(held_out[0] - reference[0]):.2e}")
    assert held_out[0] == pytest.approx(reference[0], abs=1e-4)
    assert window_losses(job) == pytest.approx(window_losses(straight), abs=FROM_SCRATCH_LOSS)
    assert f"[rank 0/{nproc} | local 0 | cuda:0]" in job.output, job.output
