"""fault_tolerant.py, step 13: replica groups (torchft) that train as one data-parallel job while all of them are there,
train on when one dies, and take a returning group back with a healthy group's state, not a snapshot's; FSDP inside
each group (HSDP). Every job: a lighthouse on 127.0.0.1 (a service of the job) and one torchrun per group."""
import re

import pytest
import torch

from expect import assert_only_own_lines
from tools.jobs import (free_port, kill_when_training_together, lighthouse, next_heal, output, replica_groups,
                        run, start, torchrun)
from tools.jobs.processes import descendant_pids

SYNTHETIC = 2048  # training samples of the default workload: 32 steps an epoch at 2 x 32 samples a step
TIMEOUT = 20  # --timeout of every job here: the quorum's, the collectives', the connections'


def groups_job(cwd, epochs, save_every=1, *args, nproc=1, min_replicas=1, restarts=0, node_env=None, record=False,
               timeout=TIMEOUT):
    """Start a lighthouse and two replica groups of fault_tolerant.py (nproc ranks each): a running job."""
    port = free_port()
    commands = [lighthouse(port, min_replicas),
                *replica_groups("fault_tolerant.py", epochs, save_every, "--timeout", timeout, *args, port=port,
                                nproc=nproc, launcher_args=[f"--max_restarts={restarts}"])]
    return start(*commands, cwd=cwd, services=1, node_env=node_env, record=record)


def finished(job, timeout=120):
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
    """Two groups of one rank, 2 epochs (64 steps), a lighthouse that waits for both (--min_replicas 2); and fsdp.py
    on 2 ranks, plain data parallelism (FSDP over 2 ranks), on the same data."""
    groups = finished(groups_job(tmp_path_factory.mktemp("groups"), 2, min_replicas=2, record=True))
    plain = run(torchrun("fsdp.py", 2, 1), cwd=tmp_path_factory.mktemp("plain"), timeout=120, record=True)
    return groups, plain


@pytest.mark.slow
def test_two_groups_of_one_rank_train_as_plain_data_parallelism_on_the_same_samples(together):
    groups, plain = together
    steps = output.group_steps(groups.output)
    assert sorted(steps) == [0, 1] and sorted(steps[0]) == sorted(steps[1]) == list(range(64)), groups.output
    for step in range(64):
        assert steps[0][step]["participants"] == steps[1][step]["participants"] == 2, (step, steps[0][step])
        assert steps[0][step]["weights"] == steps[1][step]["weights"], f"the groups differ after step {step}"
    assert steps[0][63]["loss"] < 0.3 * steps[0][0]["loss"], "the loss did not fall"
    # The same samples: each step's two batches (one a group) are the two ranks' batches of plain DP at that step.
    per_process = list(step_batches(groups).values())
    assert len(per_process) == 2 and all(len(batches) == 64 for batches in per_process), groups.output
    plain_epochs = {}
    for record in plain.samples:
        if record["sampler"] == "DistributedSampler":
            plain_epochs.setdefault(record["epoch"], []).append(record["indices"])
    for step in range(64):
        epoch, batch = divmod(step, 32)
        expected = sorted(i for indices in plain_epochs[epoch] for i in indices[batch * 32:(batch + 1) * 32])
        assert sorted(per_process[0][step] + per_process[1][step]) == expected, f"other samples at step {step}"
    # And the same weights, to the bit: the average of two gradients is the same sum in either job.
    ours, theirs = (torch.load(job.cwd / name) for job, name in ((groups, "ft_model_full.pt"), (plain, "model_full.pt")))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert len([line for line in output.own_lines(groups.output) if "full model saved" in line]) == 1, "written once"
    assert_only_own_lines(groups)


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
    trained 30 steps with group 0 (on a busy machine the restart alone can take 10 s). (job, the step of the kill, the
    heal's step)"""
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
    gaps = [later - earlier for (earlier, *_), (later, *_) in zip(survivor, survivor[1:])]
    # Its longest wait: the lighthouse's heartbeat timeout (2 s here) before it takes the killed group for dead.
    assert 1 < max(gaps) < TIMEOUT, f"group 0 stood still {max(gaps):.1f} s"
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
    """Two groups of two ranks: group 1's rank 1 SIGKILLed once both groups trained 60 steps together; torchrun stops
    its rank 0 and starts both again. The new rank 1 must find the new rank 0's Manager (not the address the dead one left in torchrun's
    store), and each rank must heal its own shards from the same rank of group 0. The job (100 epochs) is stopped once
    group 1 has trained 20 steps after its heal."""
    with groups_job(tmp_path, 100, 10, nproc=2, restarts=1) as job:
        kill_when_training_together(job, rank=1, steps=60)
        back = next_heal(job, 1)
        until_step(job, 1, back + 20)
    survivor = {step: weights for _, step, _, weights in step_lines(job, node=1)}
    returned = [(step, weights) for _, step, _, weights in step_lines(job, node=2) if step >= back]
    assert [step for step, _ in returned] == list(range(back, back + len(returned))), returned[:3]
    together = [(step, weights) for step, weights in returned if step in survivor]
    assert len(together) >= 10, "the groups did not train together again"
    assert all(weights == survivor[step] for step, weights in together), "the returned group's shards differ"
    assert_only_own_lines(job)


@pytest.mark.slow
def test_a_group_started_with_other_arguments_stops_with_one_line_and_the_others_go_on(tmp_path):
    """Group 0 trains (long enough to outlive the check); group 1 joins it with another batch size: it receives the
    running group's state, with its arguments, and stops before it trains; group 0 loses at most the step it joined."""
    port = free_port()
    running = replica_groups("fault_tolerant.py", 200, 100, "--timeout", TIMEOUT, port=port)[0]
    other = replica_groups("fault_tolerant.py", 200, 100, "--timeout", TIMEOUT, "--batch_size", 16, port=port)[1]
    with start(lighthouse(port), running, cwd=tmp_path, services=1) as job:
        job.wait_for(r"\[group 0 .*\] step 20 ", timeout=60)
        (tmp_path / "other").mkdir()
        late = run(other, cwd=tmp_path / "other", timeout=60, check=False)
        job.new_lines()  # what group 0 printed up to the late group's end
        after = int(job.wait_for(output.GROUP_STEP, timeout=30)["step"])
        assert int(job.wait_for(output.GROUP_STEP, timeout=30)["step"]) == after + 1, "group 0 did not go on"
        assert job.running()
        redone = output.NOT_COMMITTED.findall(job.output)
    assert late.returncode == 1 and output.errors(late.output) == [
        "error: this group has TOTAL_EPOCHS, --batch_size, --groups, --workload [200, 16, 2, 'synthetic'], the "
        "running groups [200, 32, 2, 'synthetic']: start it with the arguments they had"], late.output
    assert " step " not in late.output, "the group trained"
    assert len(redone) <= 1, f"group 0 did {len(redone)} steps again"
    assert_only_own_lines(late)


@pytest.mark.slow
def test_a_missing_lighthouse_stops_a_group_with_one_line_within_the_timeout(tmp_path):
    command = replica_groups("fault_tolerant.py", 2, 1, "--timeout", 3, port=free_port())[0]
    job = run(command, cwd=tmp_path, timeout=60, check=False)
    assert job.returncode == 1 and job.seconds() < 30, job.output
    assert output.errors(job.output) == [
        f"error: rank 0: nothing answers at http://127.0.0.1:{command[-1].rsplit(':', 1)[1]} within --timeout 3 s: "
        "the lighthouse is not running or cannot be reached (start it first: torchft_lighthouse; --lighthouse gives its "
        "address); the snapshot on disk is kept, and the same command resumes from it"], job.output
    assert_only_own_lines(job)


@pytest.mark.slow
def test_the_lighthouse_killed_ends_every_group_with_one_line_within_the_timeout(tmp_path):
    with groups_job(tmp_path, 1000, 100, timeout=8) as job:
        job.wait_for(r"\[group 1 .*\] step \d+ \|", timeout=60)
        job.kill_node(0)
        killed_at = job.seconds()
        codes = job.wait(60)
    assert codes[1:] == [1, 1] and job.seconds() - killed_at < 2 * 8, (codes, job.seconds() - killed_at)
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
def test_every_group_gone_resumes_from_the_snapshots_on_disk_with_nothing_lost(tmp_path):
    """Both groups killed (their machines gone) once each has saved a snapshot (every 2 epochs; a group that joined
    late saves from its first epoch's end on); started again together (the lighthouse waits for both), the job goes on
    from the newest snapshot: the group with an older one heals. The second job is stopped 20 steps on."""
    with groups_job(tmp_path, 1000, 2) as first:
        for group in (0, 1):
            first.wait_for(rf"\[group {group} .*\] epoch \d+ \| snapshot saved", timeout=60)
        first.kill_node(1)
        first.kill_node(2)
    with groups_job(tmp_path, 1000, 2, min_replicas=2) as again:
        first_step = int(again.wait_for(output.GROUP_STEP, timeout=60)["step"])
        until_step(again, 0, first_step + 20)
        until_step(again, 1, first_step + 20)
    resumed = [int(re.search(r"resuming from epoch (\d+), restart 0", again.node_output(node))[1]) for node in (1, 2)]
    assert min(resumed) >= 2 and first_step == 32 * max(resumed), (resumed, first_step)
    steps = {node: {step: weights for _, step, _, weights in step_lines(again, node)} for node in (1, 2)}
    for node in (1, 2):
        assert sorted(steps[node]) == list(range(first_step, max(steps[node]) + 1)), (resumed, sorted(steps[node])[:3])
    common = set(steps[1]) & set(steps[2])
    assert len(common) >= 20 and all(steps[1][step] == steps[2][step] for step in common), "the groups went apart"
