"""fault_tolerant.py, step 13: replica groups (torchft) that train as one data-parallel job while all of them are there,
train on when one dies, and take a returning group back with a healthy group's state, not a snapshot's; FSDP inside
each group (HSDP). Every job: a lighthouse on 127.0.0.1 (a service of the job) and one torchrun per group."""
import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

from expect import PEER_GONE, assert_only_own_lines
from harness import stepdiff
from harness.jobs import (PYTHON, REPO, environment, free_port, kill_when_training_together, lighthouse, next_heal,
                        output, replica_groups, run, start, torchrun)
from harness.jobs.processes import descendant_pids, listening
from tools.netns import namespaces_unavailable, network_namespaces
from utils.replicas import CheckpointOverHTTP

SYNTHETIC = 2048  # training samples of the default workload: 32 steps an epoch at 2 x 32 samples a step
TIMEOUT = 20  # --timeout of every job here: the quorum's, the collectives', the connections'
STOPPED_S = 5  # how long a rank is stopped (SIGSTOP) to play a machine that hangs: less than --timeout


def groups_job(cwd, epochs, save_every=1, *args, nproc=1, min_replicas=1, restarts=0, node_env=None, record=False,
               timeout=TIMEOUT, logs=None):
    """Start a lighthouse and two replica groups of fault_tolerant.py (nproc ranks each): a running job (its logs in
    `logs`, else in `cwd`)."""
    port = free_port()
    commands = [lighthouse(port, min_replicas),
                *replica_groups("fault_tolerant.py", epochs, save_every, "--timeout", timeout, *args, port=port,
                                nproc=nproc, launcher_args=[f"--max_restarts={restarts}"])]
    return start(*commands, cwd=cwd, services=1, node_env=node_env, record=record, logs=logs)


def finished(job, timeout=240):
    """Wait for a job to end (its lighthouse stopped with it, also when the wait fails): it must have ended well."""
    with job:
        job.wait(timeout)
    assert job.ok, f"{job.describe()}; its output ends:\n{job.output[-4000:]}"
    return job


def until_step(job, group, step, timeout=120):
    """Follow the job until `group` prints a step line for `step` or later."""
    seen = -1
    while seen < step:
        match = job.wait_for(output.GROUP_STEP, timeout=timeout)
        seen = int(match["step"]) if match["group"] == str(group) else seen
    job.new_lines()


def all_trained_together(job, groups, step, timeout=180):
    """Follow the job until each of its `groups` groups has printed a line of its own for `step` or later with all
    of them as participants. One group's such line is not enough: a group that started late (a busy machine) heals
    to the job's step as it joins, and its first line, for that very step, may come after the others'."""
    together, deadline = set(), time.monotonic() + timeout
    while len(together) < groups:
        try:
            match = job.wait_for(output.GROUP_STEP, timeout=deadline - time.monotonic())
        except AssertionError as error:
            missing = sorted(set(map(str, range(groups))) - together)
            raise AssertionError(f"group(s) {', '.join(missing)} printed no step from {step} on with all {groups} "
                                 f"groups within {timeout} s: {error}") from None
        if int(match["step"]) >= step and match["participants"] == str(groups):
            together.add(match["group"])
    job.new_lines()


def step_lines(job, node):
    """[(second the line was read, step, participants, weights)] of one group (node 1: group 0, node 2: group 1)."""
    return [(seconds, int(match["step"]), int(match["participants"]), match["weights"])
            for seconds, where, line in job.timeline if where == node
            for match in [output.GROUP_STEP.search(line)] if match]


def step_batches(job):
    """{pid: [indices of each step]}: the batches each process of a fault_tolerant.py job trained on, in order."""
    batches = {}
    for record in job.samples:
        if record["sampler"] == "list":  # a step's own loader; evaluation passes go through another sampler
            batches.setdefault(record["pid"], []).append(record["indices"])
    return batches


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    """Two groups of one rank, 2 epochs of 22 steps at --batch_size 48 (each rank's share of an epoch, 1,024 samples,
    is 21 batches of 48 and one of 16), a lighthouse that waits for both (--min_replicas 2), started as the step's page
    starts it; and fsdp.py on 2 ranks, plain data parallelism (FSDP over 2 ranks), on the same data."""
    groups = finished(groups_job(tmp_path_factory.mktemp("groups"), 2, 1, "--batch_size", BATCH, min_replicas=2,
                                 record=True))
    plain = run(torchrun("fsdp.py", 2, 1, "--batch_size", BATCH), cwd=tmp_path_factory.mktemp("plain"), timeout=120,
                record=True)
    return groups, plain


BATCH = 48  # 1,024 samples a rank and epoch are not a multiple of it: the last batch of each epoch has 16


@pytest.mark.slow
def test_two_groups_of_one_rank_train_as_plain_data_parallelism_on_the_same_samples(together):
    groups, plain = together
    steps_per_epoch = -(-SYNTHETIC // 2 // BATCH)  # 22: the short batch is trained, as step 5 trains it
    total = 2 * steps_per_epoch
    steps = output.group_steps(groups.output)
    assert sorted(steps) == [0, 1] and sorted(steps[0]) == sorted(steps[1]) == list(range(total)), groups.output
    for step in range(total):
        assert steps[0][step]["participants"] == steps[1][step]["participants"] == 2, (step, steps[0][step])
        assert steps[0][step]["weights"] == steps[1][step]["weights"], f"the groups differ after step {step}"
    assert steps[0][total - 1]["loss"] < 0.3 * steps[0][0]["loss"], "the loss did not fall"
    # The same samples, every one of them: each step's two batches (one a group) are the two ranks' batches of plain
    # DP at that step, the short last batch of each epoch too.
    per_process = list(step_batches(groups).values())
    assert len(per_process) == 2 and all(len(batches) == total for batches in per_process), groups.output
    plain_epochs = {}
    for record in plain.samples:
        if record["sampler"] == "DistributedSampler":
            plain_epochs.setdefault(record["epoch"], []).append(record["indices"])
    for step in range(total):
        epoch, batch = divmod(step, steps_per_epoch)
        expected = sorted(i for indices in plain_epochs[epoch] for i in indices[batch * BATCH:(batch + 1) * BATCH])
        assert sorted(per_process[0][step] + per_process[1][step]) == expected, f"other samples at step {step}"
    assert sum(len(batch) for batch in per_process[0]) == 2 * SYNTHETIC // 2, "an epoch left samples out"
    # And the same weights, to the bit: the average of two gradients is the same sum in either job.
    ours, theirs = (torch.load(job.cwd / name) for job, name in ((groups, "ft_model_full.pt"), (plain, "model_full.pt")))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert len([line for line in output.own_lines(groups.output) if "full model saved" in line]) == 1, "written once"
    assert_only_own_lines(groups)


@pytest.mark.slow
def test_the_lighthouse_started_as_the_page_shows_prints_nothing(together):
    """At torchft's default level the lighthouse logs 4-5 lines a step (thousands in a run of the README): started
    with RUST_LOG=warn, as the step's page, the README and the step's docstring start it, it prints none."""
    groups, _ = together
    assert groups.node_output(0) == "", groups.node_output(0)[:2000]


@pytest.mark.slow
def test_hsdp_two_groups_of_two_ranks_equal_fsdp_on_four_ranks_without_torchft(tmp_path):
    """FSDP inside each group, torchft's all-reduce across them: the sharded model of 4 ranks, the same samples (the
    sampler's rank of group g's rank r is r + 2g, fsdp.py's rank), 32 steps; equal up to the order of the sums."""
    groups = finished(groups_job(tmp_path / "groups", 2, nproc=2, min_replicas=2))
    plain = run(torchrun("fsdp.py", 2, 1, nproc=4), cwd=tmp_path, timeout=120)
    steps = output.group_steps(groups.output)
    assert sorted(steps[0]) == sorted(steps[1]) == list(range(32)), groups.output
    assert all(steps[0][step]["weights"] == steps[1][step]["weights"] for step in range(32)), "the groups differ"
    ours, theirs = torch.load(tmp_path / "groups" / "ft_model_full.pt"), torch.load(tmp_path / "model_full.pt")
    farthest = max((ours[name] - theirs[name]).abs().max().item() for name in ours)
    assert farthest < 1e-6, f"HSDP under torchft is {farthest} from FSDP on 4 ranks"
    assert output.held_out(groups.output)["loss"] == pytest.approx(output.held_out(plain.output)["loss"], abs=1e-4)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Two groups of one rank, a snapshot every 2 epochs (64 steps), a lighthouse that lets one group go on alone;
    group 1's worker SIGKILLed once it has saved a snapshot and both have trained 100 steps together, and its torchrun
    starts it again (--max_restarts=1). The job has more epochs than it needs: it is stopped once group 1, back, has
    trained 30 steps with group 0 (on a busy machine the restart alone can take 10 s); then both groups are killed at
    once, their whole process trees (their machines gone), leaving their snapshots in the job's folder (job.cwd).
    (job, the step of the kill, the heal's step)"""
    with groups_job(tmp_path_factory.mktemp("killed"), 1000, 2, restarts=1) as job:
        job.wait_for(r"\[group 1 .*\] epoch \d+ \| snapshot saved", timeout=120)  # something of its own to load
        killed = kill_when_training_together(job, steps=100)
        back = next_heal(job, 1)
        until_step(job, 1, back + 30)
    return job, killed, back


@pytest.mark.slow
def test_the_other_group_never_stops_when_one_is_killed(killed):
    job, killed_at, back = killed
    survivor = step_lines(job, node=1)
    numbers = [step for _, step, _, _ in survivor]
    assert numbers == list(range(numbers[0], numbers[-1] + 1)), "group 0's step counter went back or skipped a step"
    assert numbers[-1] >= back + 20, "group 0 stopped"
    alone = [step for _, step, participants, _ in survivor if participants == 1 and killed_at < step < back]
    assert alone, "group 0 never trained alone after the kill"
    around_kill = [later - earlier for (earlier, step, *_), (later, *_) in zip(survivor, survivor[1:])
                   if killed_at - 1 <= step < back]
    # Its longest wait: the lighthouse's heartbeat timeout (2 s here) before it takes the killed group for dead.
    assert 1 < max(around_kill) < TIMEOUT, f"group 0 stood still {max(around_kill):.1f} s"
    assert_only_own_lines(job)


@pytest.mark.slow
def test_the_killed_group_comes_back_with_the_healthy_groups_weights_from_its_first_step(killed):
    job, _, back = killed
    text = job.node_output(2)
    assert re.search(r"resuming from epoch \d+, restart 1", text), "its own snapshot on disk was older: it loads it"
    assert re.search(rf"healed at step {back} from a healthy group, not from disk", text)
    survivor = {step: weights for _, step, _, weights in step_lines(job, node=1)}
    returned = [(step, weights) for _, step, _, weights in step_lines(job, node=2) if step >= back]
    assert returned[0][0] == back and [step for step, _ in returned] == list(range(back, back + len(returned)))
    together = [(step, weights) for step, weights in returned if step in survivor]
    assert len(together) >= 30, "the groups did not train together again"
    assert all(weights == survivor[step] for step, weights in together), "the returned group's weights differ"


@pytest.mark.slow
def test_an_hsdp_group_that_loses_one_rank_comes_back_whole_with_the_others_shards(tmp_path):
    """Two groups of two ranks. Group 1's rank 1 stopped (SIGSTOP) for STOPPED_S seconds once both groups trained 30
    steps together: its rank 0 still heartbeats, so group 1 is neither in a step nor out of the quorum, and group 0
    waits for as long as it hangs (up to --timeout), not the heartbeat timeout. Then group 1's rank 1 SIGKILLed once
    both groups trained 60 steps together; torchrun stops its rank 0 and starts both again. The new rank 1 must find
    the new rank 0's Manager (not the address the dead one left in torchrun's store), and each rank must heal its own
    shards from the same rank of group 0. The job (100 epochs) is stopped once group 1 has trained 20 steps after its
    heal."""
    with groups_job(tmp_path, 100, 10, nproc=2, restarts=1) as job:
        all_trained_together(job, groups=2, step=30)  # group 1's step 30 alone: group 0 may not have joined yet
        stopped = job.kill_worker(rank=1, node=2, nproc=2, sig=signal.SIGSTOP)
        stopped_at = job.seconds()
        while job.seconds() < stopped_at + STOPPED_S:
            job.new_lines()  # each line dated as it comes
            time.sleep(0.01)
        os.kill(stopped, signal.SIGCONT)
        kill_when_training_together(job, rank=1, steps=60)
        back = next_heal(job, 1)
        until_step(job, 1, back + 20)
    survivor = {step: weights for _, step, _, weights in step_lines(job, node=1)}
    returned = [(step, weights) for _, step, _, weights in step_lines(job, node=2) if step >= back]
    assert [step for step, _ in returned] == list(range(back, back + len(returned))), returned[:3]
    together = [(step, weights) for step, weights in returned if step in survivor]
    assert len(together) >= 10, "the groups did not train together again"
    assert all(weights == survivor[step] for step, weights in together), "the returned group's shards differ"
    lines = step_lines(job, node=1)
    spanning = [later - earlier for (earlier, *_), (later, *_) in zip(lines, lines[1:])
                if earlier <= stopped_at + 0.5 and later >= stopped_at]
    assert spanning and 0.8 * STOPPED_S < max(spanning) < TIMEOUT, f"group 0 waited {spanning} s for the hung rank"
    assert_only_own_lines(job)



@pytest.mark.slow
def test_a_group_started_with_other_arguments_stops_with_one_line_and_the_others_go_on(tmp_path):
    """Group 0 trains (long enough to outlive the check); group 1 joins it with another batch size: it receives the
    running group's state, with its arguments, and stops before it trains; group 0 loses at most the step it joined.
    Its torchrun starts it again (--max_restarts=1), as no restart can fix it: refused again, without a second line,
    and it never trains (a restarted group may not lead: it could have trained another job alone once group 0 ends)."""
    port = free_port()
    running = replica_groups("fault_tolerant.py", 200, 100, "--timeout", TIMEOUT, port=port)[0]
    other = replica_groups("fault_tolerant.py", 200, 100, "--timeout", TIMEOUT, "--batch_size", 16, port=port,
                           launcher_args=["--max_restarts=1"])[1]
    with start(lighthouse(port), running, cwd=tmp_path, services=1) as job:
        job.wait_for(r"\[group 0 .*\] step 20 ", timeout=180)
        (tmp_path / "other").mkdir()
        late = run(other, cwd=tmp_path / "other", timeout=240, check=False)
        job.new_lines()  # what group 0 printed up to the late group's end
        after = int(job.wait_for(output.GROUP_STEP, timeout=30)["step"])
        assert int(job.wait_for(output.GROUP_STEP, timeout=30)["step"]) == after + 1, "group 0 did not go on"
        assert job.running()
        redone = output.NOT_COMMITTED.findall(job.output)
    assert late.returncode == 1 and output.errors(late.output) == [
        "error: this group has TOTAL_EPOCHS, --batch_size, --groups, --workload [200, 16, 2, 'synthetic'], the "
        "running groups [200, 32, 2, 'synthetic']: start it with the arguments they had"], late.output
    assert " step " not in late.output, "the group trained"
    assert late.output.count("failed (exitcode: 1)") == 2, "its torchrun did not start it again"
    assert len(redone) <= 2, f"group 0 did {len(redone)} steps again"
    assert_only_own_lines(late)


@pytest.mark.slow
def test_what_no_restart_fixes_is_said_once_and_a_group_alone_neither_leads_nor_replaces_a_result(tmp_path):
    """Groups of two ranks under torchrun --max_restarts=1, as the README runs them, in one job of groups that do not
    meet: (a) a group whose lighthouse is not there says so in one line an attempt, within --timeout (rank 1 used to
    give up first, in the barrier, with "a collective gave up ... a rank is stuck"); (b) `--group 2 --groups 2` is said
    once, by rank 0 of the first attempt; (c) a group of a job of two that trained alone, is killed, and comes back to
    find no other group (the others finished, on another disk, or are gone) does not train the job alone: it waits
    --timeout for a group that holds the job's steps, then stops with one line; (d) a group started by hand, alone at
    a lighthouse of its own, trains a job of its own (22 steps) beside a result that more batches trained: it keeps
    that result."""
    port, own_port, nobody = free_port(), free_port(), free_port()
    nodes = dict(
        missing=replica_groups("fault_tolerant.py", 2, 1, "--timeout", 3, port=nobody, nproc=2,
                               launcher_args=["--max_restarts=1"])[0],
        out_of_range=torchrun("fault_tolerant.py", 2, 1, "--group", 2, "--groups", 2, "--lighthouse",
                              f"http://127.0.0.1:{port}", nproc=2, launcher_args=["--max_restarts=1"]),
        alone=replica_groups("fault_tolerant.py", 1000, 1000, "--timeout", 15, port=port, nproc=2,
                             launcher_args=["--max_restarts=1"])[0],
        lone=replica_groups("fault_tolerant.py", 1, 1, "--timeout", 15, port=own_port, groups=3)[2])
    folders = [tmp_path / name for name in ("lighthouse", "own_lighthouse", *nodes)]
    for folder in folders:
        folder.mkdir()
    result = b"the result of a job of 20 steps and 1,000 batches (50 groups)"  # not finished for a job of 22 steps
    (tmp_path / "lone" / "ft_model_full.pt").write_bytes(result)
    (tmp_path / "lone" / "ft_model_full.json").write_text('{"steps": 20, "batches": 1000}')
    with start(lighthouse(port), lighthouse(own_port), *nodes.values(), cwd=folders, services=2) as job:
        node = {name: index for index, name in enumerate(nodes, start=2)}
        job.wait_for(r"\[group 0 .*\] step 10 ", timeout=180)
        job.kill_worker(rank=1, node=node["alone"], nproc=2)
        codes = job.wait(180)
    assert codes[2:] == [1, 1, 1, 0], (codes, job.output[-3000:])
    nothing = (f"error: rank 0: nothing answers at http://127.0.0.1:{nobody} within --timeout 3 s: the lighthouse is "
               "not running or cannot be reached (start it first: torchft_lighthouse; --lighthouse gives its address); "
               "the snapshot on disk is kept, and the same command resumes from it")
    assert output.errors(job.node_output(node["missing"])) == [nothing, nothing], job.node_output(node["missing"])
    said = job.node_output(node["out_of_range"])
    assert said.count("fault_tolerant.py: error: --group 2 is not one of the --groups 2 (0 to 1)") == 1, said
    assert said.count("usage: fault_tolerant.py") == 1, said
    back = job.node_output(node["alone"])
    assert "step 0: no group of this quorum holds the job's steps" in back, back
    assert [line for line in output.errors(back) if not PEER_GONE.match(line)] == [
        "error: group 0: no group that holds the job's steps came within --timeout 15 s: they have finished, hang, or "
        "are gone, and this group trained nothing; to go on from the snapshots without them, start every group "
        "again"], back
    restarted = back[back.index("no group of this quorum"):]
    assert not output.GROUP_STEP.search(restarted), "the group came back and trained the job alone"
    lone = job.node_output(node["lone"])
    assert re.search(r"^\[group 2 .*\] ft_model_full\.pt is kept: it holds a result of 1000 batches of the groups, "
                     r"this group's of 22$", lone, re.M), lone[-2000:]
    assert (tmp_path / "lone" / "ft_model_full.pt").read_bytes() == result, "a group alone wrote over a larger result"
    assert_only_own_lines(job)


@pytest.mark.slow
def test_the_lighthouse_killed_ends_every_group_with_one_line_within_the_timeout(tmp_path):
    """The lighthouse killed once both groups trained a step together: each group's one line comes within twice
    --timeout of the kill (a quorum asked for just before it gives up --timeout later; 8.0-8.3 s at load 15-22). The
    worker ends with its line; torchrun then ends in its own time, bounded by the wait: 12 s later at load 20 (a
    torchrun whose one worker exits at once takes 9 s to end at load 18), which a bound of twice --timeout on the
    whole cut short. (Killed once group 1 alone had trained, it found group 0 still starting: group 0 reached for the
    lighthouse after the kill, and said so 12.8 s after it, at load 15.)"""
    with groups_job(tmp_path, 1000, 100, timeout=8) as job:
        all_trained_together(job, groups=2, step=0)
        job.kill_node(0)
        killed_at = job.seconds()
        codes = job.wait(60)
    said = [seconds - killed_at for seconds, node, line in job.timeline if node in (1, 2) and output.ERROR.match(line)]
    assert codes[1:] == [1, 1], f"exit codes {codes}: a group did not end by itself within 60 s of the kill"
    assert len(said) == 2 and max(said) < 2 * 8, f"the groups' lines came {said} s after the kill"
    # A quorum asked for before the kill times out; one asked for after it finds nothing to connect to.
    gone = re.compile(r"error: rank 0: (?:no quorum within --timeout 8 s: the lighthouse is gone or cannot be reached; "
                      r"the snapshot on disk is kept, and the same commands resume from it once it runs|nothing answers "
                      r"at http://127\.0\.0\.1:\d+ within --timeout 8 s: the lighthouse is not running or cannot be "
                      r"reached .*)$")
    for node in (1, 2):
        [line] = output.errors(job.node_output(node))
        assert gone.match(line), job.node_output(node)
    assert not any(descendant_pids(proc.pid) for proc in job.procs), "a process was left"
    assert_only_own_lines(job)


@pytest.mark.slow
def test_every_group_gone_resumes_from_the_snapshots_on_disk_with_nothing_lost(killed, tmp_path):
    """Both groups of the `killed` job killed at once (their machines gone), each with a snapshot of its own (every 2
    epochs: 64 steps; both trained 130 steps or more, group 1 restarted on the way), started again together (the
    lighthouse waits for both): the job goes on from the newest snapshot, and the group with an older one heals. The
    second job is stopped 20 steps on."""
    first, *_ = killed
    for group in (0, 1):
        assert re.search(rf"\[group {group} .*\] epoch \d+ \| snapshot saved", first.output), f"no snapshot of {group}"
    with groups_job(first.cwd, 1000, 2, min_replicas=2, logs=tmp_path) as again:
        first_step = int(again.wait_for(output.GROUP_STEP, timeout=180)["step"])
        until_step(again, 0, first_step + 20)
        until_step(again, 1, first_step + 20)
    resumed = [int(re.search(r"resuming from epoch (\d+), restart 0", again.node_output(node))[1]) for node in (1, 2)]
    assert min(resumed) >= 2 and first_step == 32 * max(resumed), (resumed, first_step)
    steps = {node: {step: weights for _, step, _, weights in step_lines(again, node)} for node in (1, 2)}
    for node in (1, 2):
        assert sorted(steps[node]) == list(range(first_step, max(steps[node]) + 1)), (resumed, sorted(steps[node])[:3])
    common = set(steps[1]) & set(steps[2])
    assert len(common) >= 20 and all(steps[1][step] == steps[2][step] for step in common), "the groups went apart"


def status(port):
    """The lighthouse's status page (torchft's, open to anyone who reaches its port), as text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as page:
        return page.read().decode()


@pytest.mark.slow
def test_groups_back_without_the_jobs_steps_wait_for_it_and_a_group_back_after_the_end_leaves_the_result(tmp_path):
    """Three groups of one rank (--max_restarts=2), no snapshot yet. (1) Groups 1 and 2 SIGKILLed at once, and group 0
    hangs (SIGSTOP) meanwhile. Their torchruns start the two again, and they form a quorum of their own (more than half
    of the groups that heartbeat): from step 0, without the job's steps, they must not train, since torchft heals every
    group toward the highest step and they would overwrite group 0's steps once ahead. They say so and wait; group 0,
    resumed, joins them and they heal from it. (2) Group 1 SIGKILLed again while its torchrun is stopped, so that it
    comes back after groups 0 and 2 have finished: it finds the job's result beside the snapshots, stops with one line
    (exit 0), and the result stays as it was. --timeout 90: group 0 hangs while the two restart (up to a minute on a
    busy machine) and must not give up its quorum meanwhile. The groups are held at their Managers until all three
    are there (on a busy machine their starts are 5-12 s apart, the job's 66 steps take 20 s, and a group that joins
    late heals to the job's step), and the kills wait for a step each of them trained with the other two."""
    port = free_port()
    commands = replica_groups("fault_tolerant.py", 3, 1000, "--timeout", 90, port=port, groups=3,
                              launcher_args=["--max_restarts=2"])
    with start(lighthouse(port), *commands, cwd=tmp_path, services=1, hold=True) as job:
        job.release(processes=3)
        all_trained_together(job, groups=3, step=20)
        job.kill_worker(rank=0, node=2)
        job.kill_worker(rank=0, node=3)
        hung = job.kill_worker(rank=0, node=1, sig=signal.SIGSTOP)
        returned = set()
        while len(returned) < 2:  # the two back: each says it waits (or, were they to lead, trains a step before 20)
            match = job.wait_for(r"\[group ([12]) .*\] step (\d+)(?:: no group of this quorum| \|)", timeout=180)
            returned |= {match[1]} if "no group" in match[0] or int(match[2]) < 20 else set()
        os.kill(hung, signal.SIGCONT)
        job.note("SIGCONT to group 0")
        healed = {}
        while len(healed) < 2:
            match = job.wait_for(output.HEALED, timeout=120)
            healed[match["group"]] = int(match["step"])
        until_step(job, 1, max(healed.values()) + 5)
        os.kill(job.procs[2].pid, signal.SIGSTOP)  # group 1's torchrun: it restarts the group only once resumed
        job.kill_worker(rank=0, node=2, restart=1)
        deadline = time.monotonic() + 240
        while job.procs[1].poll() is None or job.procs[3].poll() is None:
            assert time.monotonic() < deadline, f"groups 0 and 2 did not finish the job within 240 s: {job.poll()}"
            job.new_lines()
            time.sleep(0.1)
        result = (tmp_path / "ft_model_full.pt").read_bytes()
        os.kill(job.procs[2].pid, signal.SIGCONT)
        codes = job.wait(180)
    for node in (2, 3):
        # Its attempts, split where torchrun reports the worker SIGKILLed: the steps it trained, and those back.
        attempts = job.node_output(node).split("failed (exitcode: -9)")
        assert len(attempts) > 1, f"group {node - 1}'s torchrun never reported its worker killed: {attempts[0][-2000:]}"
        before, back = attempts[:2]
        reached = [int(match["step"]) for match in output.GROUP_STEP.finditer(before)]
        assert reached, f"group {node - 1} printed no step before its kill, though the test waited for one: {before}"
        trained = [int(match["step"]) for match in output.GROUP_STEP.finditer(back)]
        assert trained, f"group {node - 1} came back and never trained a step: {back[-2000:]}"
        assert min(trained) > max(reached), f"group {node - 1} came back and trained without the job's steps"
        assert "no group of this quorum holds the job's steps" in back, back[-2000:]
    assert min(healed.values()) >= 20, healed
    assert codes[1:] == [0, 0, 0], (codes, job.output[-3000:])
    late = job.node_output(2)
    assert re.search(r"\[group 1 .*\] the job has finished: ft_model_full\.pt holds its result \(step 66 of 66\), so "
                     r"this group has nothing to train", late), late[-2000:]
    assert (tmp_path / "ft_model_full.pt").read_bytes() == result, "the late group wrote over the job's result"
    assert len(re.findall(r"full model saved", job.output)) == 1
    assert_only_own_lines(job)


PROBE = """import socket, sys
for port in sys.argv[2:]:
    try:
        socket.create_connection((sys.argv[1], int(port)), timeout=3).close()
        print(port)
    except OSError:
        pass
"""


def reachable_from_another_host(ports):
    """The ports of this machine that a process in another network namespace (another host on a bridge to this one)
    can connect to; None where namespaces cannot be made here."""
    if namespaces_unavailable():
        return None
    with network_namespaces(1, tag="s") as (bridge_ip, [stranger]):
        probed = subprocess.run(stranger.cmd(PYTHON, "-c", PROBE, bridge_ip, *sorted(ports)), capture_output=True,
                                text=True, timeout=120)
    return {int(port) for port in probed.stdout.split()}


def workers(job, node):
    """The pids of the workers node `node`'s torchrun runs now."""
    return descendant_pids(job.procs[node].pid)


def ask_for_torchft_checkpoints(ports, steps, answers):
    """A plain HTTP client: torchft's checkpoint URL (/checkpoint/STEP/full) of each of `steps` at each port, each
    request in a thread of its own (torchft's server holds a request until it serves that step); each answer's (port,
    step, HTTP status, bytes read) goes to `answers`. The threads, started."""
    def ask(port, step):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/checkpoint/{step}/full", timeout=150) as reply:
                answers.append((port, step, reply.status, len(reply.read())))
        except urllib.error.HTTPError as error:
            answers.append((port, step, error.code, 0))
        except (OSError, ValueError, http.client.HTTPException):
            answers.append((port, step, None, 0))
    threads = [threading.Thread(target=ask, args=(port, step), daemon=True) for port in ports for step in steps]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.slow
def test_strangers_at_the_ports_of_step_13_read_nothing_and_run_no_code(tmp_path):
    """Strangers played against a job of two groups of one rank; the lighthouse waits for both (--min_replicas 2), so
    that group 0, alone, waits in its quorum and the step group 1 heals at is known. (1) From another network
    namespace (another host), nothing the job's workers or its lighthouse listen on answers: the step's servers listen
    on the interface toward the lighthouse (127.0.0.1 here), where torchft's listen on every interface. (2) A plain HTTP
    client asks each port of group 0's worker for torchft's checkpoint URL of the steps around the heal, before group 1
    comes back to heal: it reads nothing (torchft's HTTPTransport hands the model and the optimizer state to any
    client during a heal). (3) A fake replica (tests/fake_replica.py) joins at a step far ahead, so both groups heal
    from it, and answers every request with a planted pickle: both refuse it in one line, and its code never runs.
    --timeout 90: group 0 waits for group 1's restart in its quorum."""
    port = free_port()
    groups = [replica_groups("fault_tolerant.py", 1000, 1000, "--timeout", 90, port=port,
                             launcher_args=[f"--max_restarts={restarts}"])[group]
              for group, restarts in ((0, 0), (1, 1))]
    marker, go = tmp_path / "the planted code ran", tmp_path / "stranger, join"
    with open(tmp_path / "stranger.log", "w") as log:
        stranger = subprocess.Popen([PYTHON, str(REPO / "tests" / "fake_replica.py"), f"http://127.0.0.1:{port}",
                                     str(marker), str(go), "60"], env=environment(), stdout=log, stderr=log)
    try:
        with start(lighthouse(port, min_replicas=2), *groups, cwd=tmp_path, services=1) as job:
            kill_when_training_together(job, steps=10, timeout=180)  # group 1's worker
            pids = [job.procs[0].pid, *workers(job, 1), *workers(job, 2)]  # the lighthouse's, and the workers'
            ports = {port for pid in pids for _, port in listening(pid)}
            # (1) group 1's restart takes seconds: time to probe from outside while group 0 waits
            reached = reachable_from_another_host(ports)
            time.sleep(2)  # group 0 has done the step it was in, and waits for a quorum
            job.new_lines()
            heal_step = 1 + max(step for _, step, _, _ in step_lines(job, node=1))
            answers = []
            asking = ask_for_torchft_checkpoints({port for pid in workers(job, 1) for _, port in listening(pid)},
                                                 range(heal_step - 1, heal_step + 2), answers)
            assert next_heal(job, 1, timeout=180) in range(heal_step - 1, heal_step + 2)
            for thread in asking:
                thread.join(timeout=150)
            until_step(job, 1, heal_step + 5)
            go.touch()  # (3)
            codes = job.wait(120)
    finally:
        stranger.kill()
        stranger.wait()
    if reached is not None:
        assert not reached, f"ports {sorted(reached)} answer another host"
    assert not [answer for answer in answers if answer[2] == 200], f"a plain client read a checkpoint: {answers}"
    assert not marker.exists(), "the stranger's pickle ran in a group"
    assert codes[1:] == [1, 1], codes
    refused = re.compile(r"error: rank 0: the state served at http://127\.0\.0\.1:\d+/0{32}/1000000 for step 1000000 "
                         r"is not this job's \(.*\): refused, nothing was loaded\. .*")
    for node in (1, 2):
        assert refused.fullmatch(output.errors(job.node_output(node))[-1]), job.node_output(node)[-2000:]
    assert_only_own_lines(job)


# --- the checkpoint transport, alone: what a healing rank reads, and what it refuses --------------------------------

def template():
    """A state of the shape torchft sends (ours under user/default, its step count under torchft), small."""
    return {"user": {"default": {"MODEL": {"weight": torch.zeros(2, 3), "bias": torch.zeros(3, dtype=torch.bfloat16)},
                                 "OPTIMIZER": {"param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "foreach": None}]},
                                 "ARGS": [4, 32, 2, "synthetic"]}},
            "torchft": {"step": 7, "batches_committed": 12}}


class Refused(Exception):
    pass


@pytest.fixture
def receiving(monkeypatch):
    """A receiving transport whose refusals raise Refused (in a job they end the rank), and a server that answers every
    request with bytes of the test's choosing: (transport, serve(data) -> the URL a group would give)."""
    import http.server

    from utils import replicas

    def refuse(line):
        raise Refused(line)
    monkeypatch.setattr(replicas, "_stop", refuse)
    served = {}

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(served["data"])

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    transport = replicas.CheckpointOverHTTP("127.0.0.1", timedelta(seconds=10), expected=template)

    def serve(data):
        served["data"] = data
        return f"http://127.0.0.1:{server.server_address[1]}/{'0' * 32}/"
    yield transport, serve
    server.shutdown()
    transport.shutdown()


def header_and_bytes(state, step=7, changes=None):
    """What a healthy rank of the step would send for `state`, its header's leaves changed as `changes` says
    ({index: {key: value}})."""
    import json
    import struct

    from utils import replicas
    leaves, data = [], b""
    for path, leaf in replicas._leaves(state):
        if isinstance(leaf, torch.Tensor):
            flat = leaf.reshape(-1).contiguous()
            leaves.append(dict(path=list(path), dtype=str(leaf.dtype).removeprefix("torch."), shape=[flat.numel()],
                               bytes=flat.numel() * leaf.element_size()))
            data += flat.view(torch.uint8).numpy().tobytes()
        else:
            leaves.append(dict(path=list(path), value=leaf))
    for index, change in (changes or {}).items():
        leaves[index].update(change)
    header = json.dumps(dict(step=step, leaves=leaves)).encode()
    return struct.pack("<Q", len(header)) + header + data


def test_a_healing_rank_reads_the_state_of_the_steps_transport_as_sent(receiving):
    transport, serve = receiving
    sent = template()
    sent["user"]["default"]["MODEL"]["weight"] = torch.arange(6.0).reshape(2, 3)
    sent["user"]["default"]["MODEL"]["bias"] = torch.tensor([1.5, -2, 3], dtype=torch.bfloat16)
    sender = CheckpointOverHTTP("127.0.0.1", timedelta(seconds=10), expected=template)
    try:
        sender.send_checkpoint([1], 7, sent, timedelta(seconds=10))
        got = transport.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=10))
        # a plain client, at torchft's URL or without the token, reads nothing
        for path in ("/checkpoint/7/full", "/7", f"/{'0' * 32}/7"):
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(sender.metadata().split("/", 3)[0] + "//" +
                                       sender.metadata().split("/")[2] + path, timeout=10)
    finally:
        sender.shutdown()
    assert torch.equal(got["user"]["default"]["MODEL"]["weight"], sent["user"]["default"]["MODEL"]["weight"])
    assert torch.equal(got["user"]["default"]["MODEL"]["bias"], sent["user"]["default"]["MODEL"]["bias"])
    assert got["user"]["default"]["OPTIMIZER"] == sent["user"]["default"]["OPTIMIZER"]  # the tuple a tuple again
    assert got["user"]["default"]["ARGS"] == [4, 32, 2, "synthetic"] and got["torchft"] == sent["torchft"]


class Planted:
    """Unpickled, it writes the file its path names: the proof that the bytes of a stranger ran as code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_healing_rank_refuses_what_it_did_not_expect_before_it_loads_anything(receiving, tmp_path):
    """A stranger's answers, each refused with the cause named, none unpickled: torch.save's bytes of a planted
    object; a header of another step; a tensor of another shape (its bytes never read); a value of another type; a
    place the receiving state does not have; bytes that end early; and an address not of the step's kind."""
    import io
    transport, serve = receiving
    planted = io.BytesIO()
    torch.save({"user": {"default": Planted(str(tmp_path / "ran"))}}, planted)
    shorter = template()
    shorter["user"]["default"]["MODEL"]["weight"] = torch.zeros(2, 2)
    strangers = {
        "header of": planted.getvalue(),
        "no header of this step": header_and_bytes(template(), step=8),
        "where {'path': ['user', 'default', 'MODEL', 'weight'], 'dtype': 'float32', 'shape': [6]": header_and_bytes(
            shorter),
        "where a int is expected": header_and_bytes(template(), changes={7: {"value": "32"}}),
        "where ['user', 'default', 'MODEL', 'bias'] is expected": header_and_bytes(
            template(), changes={1: {"path": ["user", "default", "MODEL", "shift"]}}),
        "its bytes end early": header_and_bytes(template())[:-4],
    }
    for cause, data in strangers.items():
        with pytest.raises(Refused, match=re.escape(cause)):
            transport.recv_checkpoint(0, serve(data), 7, timedelta(seconds=10))
    with pytest.raises(Refused, match="as its checkpoint's address"):
        transport.recv_checkpoint(0, f"http://127.0.0.1:1/checkpoint/", 7, timedelta(seconds=10))
    assert not (tmp_path / "ran").exists()


def test_the_pages_say_what_reaching_torchfts_ports_means_and_start_the_lighthouse_quiet_on_one_address():
    """Issue 47's words, where the commands are; and every lighthouse shown is started with RUST_LOG=warn (it logs
    4-5 lines a step else) and bound to one address, not every interface."""
    page = stepdiff.BLOCK.sub("", (REPO / "docs" / "fault-tolerance-at-scale.md").read_text())  # less its diff
    assert ("Whoever reaches the lighthouse or any group's ports can kill groups, read the model, and run code as the "
            "user who\nstarted the groups.") in page
    for words in ("more than half of the groups that heartbeat", "The vote is within each group, not across the groups",
                  "the checkpoint server that every rank runs", "every group's `MASTER_ADDR`"):
        assert words in page, words
    shown = [command for text in (page, (REPO / "README.md").read_text(), (REPO / "fault_tolerant.py").read_text())
             for command in re.findall(r"([^\s`]*\s*torchft_lighthouse --[^`\n]*)", text)]
    assert len(shown) >= 3, shown
    for command in shown:
        assert command.startswith("RUST_LOG=warn torchft_lighthouse --") and "--bind " in command, command
        assert not re.search(r"--bind (?:0\.0\.0\.0|\[::\])", command), command


def test_the_exports_record_is_read_only_as_steps_and_batches(tmp_path):
    """What a group reads beside ft_model_full.pt to decide whether the job has finished, and whether its own result
    may replace the one there: none, a record of whole steps and batches, or one line that says to move it away (a
    record of anything else would have made a group skip training, or keep or replace a result, on a guess)."""
    from utils.replicas import result_record
    full = tmp_path / "ft_model_full.pt"
    assert result_record(full) is None
    record = tmp_path / "ft_model_full.json"
    record.write_text('{"steps": 66, "batches": 132}')
    assert result_record(full) == {"steps": 66, "batches": 132}
    for wrong in ("[66, 132]", '{"steps": "66", "batches": 132}', '{"steps": 66}', '{"steps": 66, "batches": 1.5}',
                  "66 steps"):
        record.write_text(wrong)
        with pytest.raises(SystemExit, match=rf"^error: cannot read {re.escape(str(record))} \(.*\): move it away, "
                                             rf"with {re.escape(str(full))}$"):
            result_record(full)
