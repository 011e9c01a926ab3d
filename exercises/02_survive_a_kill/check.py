"""Exercise 2's checker: survive a kill. The learner's script runs under torchrun --max_restarts=2 with every save made
slower (a slow disk), and rank 1 is killed (SIGKILL) as it begins an epoch. Besides what every data-parallel run shows
(exercises/judging.py's training_problems), it judges where the restarted job resumed (no epoch lost, none repeated),
that it resumed the very parameters and optimizer state the killed job had, and that no rank began an epoch while the
snapshot was still being written.
"""
from exercises.judging import (COLLECTIVE_TIMEOUT_S, SLOW_SAVE_S, WORLD_SIZE, exit_problems, listed,
                               training_problems)
from harness.jobs import run, shown, torchrun

KILLED_EPOCH = 2  # rank 1 is killed as it begins this epoch


def resume_problems(samples):
    """A run resumed from a snapshot goes on exactly as an uninterrupted one: the first epoch after a restart
    starts from the very parameters and optimizer state the epoch before it ended with."""
    first = {}
    for row in samples:
        first.setdefault(row["pid"], row)
    for row in first.values():
        if not row["restart"] or not row.get("epoch") or "params_before" not in row:
            continue
        before = [earlier for earlier in samples if earlier["rank"] == row["rank"] and earlier["epoch"] ==
                  row["epoch"] - 1 and earlier["restart"] < row["restart"]]
        if not before:
            continue
        before = before[-1]
        what = ("its parameters" if row["params_before"] != before["params"] else
                "its optimizer's state" if row["optimizer_before"] != before["optimizer"] else None)
        if what is None:
            continue
        fix = ("save self.optimizer.state_dict() in the snapshot (_save_snapshot) and load it back with "
               "self.optimizer.load_state_dict(...) (_load_snapshot): Adam's running averages are part of the training"
               if what == "its optimizer's state" else
               "save self.model.module.state_dict() in the snapshot and load it back before wrapping in DDP")
        those = "those" if what == "its parameters" else "the one"
        return [f"rank {row['rank']} resumed epoch {row['epoch']} after the restart, but {what} differed from {those} "
                f"it had at the end of epoch {row['epoch'] - 1}, so the resumed run is not the run that was "
                f"interrupted: {fix}"]
    return []


def restart_problems(samples, epochs, no_barrier=False):
    """Where the job restarted after the kill in epoch KILLED_EPOCH resumed and how far it went (rank 0's passes);
    when at the right epoch, whether it resumed the state that epoch began with (resume_problems)."""
    restarted = [row for row in samples if row["restart"] >= 1 and row["rank"] == 0]
    if not restarted:
        return ["no rank trained after the restart"]
    resumed_at = [row["epoch"] for row in restarted]
    if None in resumed_at:
        return ["the restarted job's sampler has no epoch: use a DistributedSampler and set_epoch"]
    expected = [KILLED_EPOCH - 1, KILLED_EPOCH] if no_barrier else [KILLED_EPOCH]
    first, problems = min(resumed_at), []
    if first == 0:
        problems.append(f"after the kill in epoch {KILLED_EPOCH} the restarted job started over from epoch 0: "
                        f"epochs 0-{KILLED_EPOCH - 1} were lost. Save a snapshot (model, optimizer, epochs run) every "
                        "save_every epochs, and at start load it, if it exists, and go on from there")
    elif first < min(expected):
        problems.append(f"the restarted job repeated epoch {listed(range(first, KILLED_EPOCH))}, which finished and "
                        f"was saved before the kill: store the number of epochs *run* (epoch + 1) and start there")
    elif first > max(expected):
        problems.append(f"the restarted job skipped epoch {listed(range(KILLED_EPOCH, first))}, which the kill "
                        "interrupted: resume at the first epoch that did not finish")
    if max(resumed_at) != epochs - 1:
        problems.append(f"the restarted job stopped after epoch {max(resumed_at)}, not {epochs - 1}")
    # the state is judged only at the right epoch: one resumed at a wrong epoch cannot be the state it began with
    return problems or resume_problems(samples)


def check(script, workdir, say):
    """Exercise 2: under torchrun --max_restarts=2, rank 1 is killed as it begins epoch 2; the job must resume
    at epoch 2 (no epoch lost, none repeated) and finish."""
    epochs = 4
    # two restarts allowed, so one that fails for reasons of its own (a slow start on a busy machine) is retried
    cmd = [*torchrun(script, epochs, 1, nproc=WORLD_SIZE, launcher_args=["--max_restarts=2"]),
           "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}")
    say(f"         and killing rank 1 (SIGKILL) as it begins epoch {KILLED_EPOCH}; every save takes {SLOW_SAVE_S} s "
        "longer (a slow disk)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, kill_at=(0, 1, KILLED_EPOCH),
              slow_save=SLOW_SAVE_S, timeout=120, check=False)
    restarted = [row for row in job.samples if row["restart"] >= 1 and row["rank"] == 0]
    if not job.timed_out and not restarted and not any(row["restart"] == 0 and row["number"] >= KILLED_EPOCH - 1
                                                  for row in job.samples):
        return exit_problems(job, script) or [f"the job ended before epoch {KILLED_EPOCH}, so it was never killed"]
    problems = training_problems(job, workdir, epochs, script, snapshots=True)
    if not job.ok:
        return problems
    # without a barrier, the kill can land before the last snapshot is on disk: resuming an epoch early is then right
    no_barrier = any("barrier()" in problem for problem in problems)
    return problems + restart_problems(job.samples, epochs, no_barrier)
