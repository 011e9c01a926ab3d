"""The workshop checker run for real (each check a job of 3 to 8 processes): the repository's own steps pass every
exercise, each starting file fails with the message its exercise is about, and a seeded mistake per kind of evidence
(a spawned job's saves, losses and exits; a job killed and restarted by torchrun; two nodes; optimizer steps)
reaches its verdict through what the recorder wrote. tests/test_exercises.py proves each verdict on records made up
in the test."""
import re

import pytest

from exercises.check import EXERCISES, SOLUTIONS
from mistakes import exercise_problems, seeded
from harness.jobs import PYTHON, REPO, run, script

pytestmark = pytest.mark.slow  # every test here starts a job of processes

STEPS = SOLUTIONS  # the step each exercise leads to, as the checker names it when all checks pass
STARTS = {number: f"exercises/{folder}/start.py" for number, folder in EXERCISES.items()}


def checked(number, path, tmp_path):
    return "\n".join(exercise_problems(number, path, tmp_path))


@pytest.mark.parametrize("number", sorted(STEPS))
def test_the_repositorys_step_passes_its_exercise(number, tmp_path):
    assert checked(number, script(STEPS[number]), tmp_path) == ""


def test_starting_file_1_runs_in_one_process_and_the_checker_says_so(tmp_path):
    job = run([PYTHON, REPO / "exercises/check.py", 1, REPO / STARTS[1]], cwd=tmp_path, check=False)
    assert job.returncode == 1, job.output
    assert "✗ only one process trained: start 2 processes (mp.spawn(" in job.output
    assert "1 problem(s). Hints: exercises/01_ddp/hints.md" in job.output


def test_starting_file_2_starts_over_after_the_kill(tmp_path):
    problems = checked(2, REPO / STARTS[2], tmp_path)
    assert "the restarted job started over from epoch 0: epochs 0-1 were lost" in problems


def test_starting_file_3_trains_out_of_step_when_nodes_have_their_own_disks(tmp_path):
    problems = checked(3, REPO / STARTS[3], tmp_path)
    assert re.search(r"the nodes trained out of step: rank 0 began at epoch 3; rank 1 began at epoch 0", problems)


def test_starting_file_4_steps_after_every_micro_batch_and_the_checker_says_so(tmp_path):
    problems = checked(4, REPO / STARTS[4], tmp_path)
    assert problems == ("rank 0 took 16 optimizer steps in 2 epochs, expected 8: with --grad_accum 2, step the "
                        "optimizer once per 2 micro-batches (when `last` is True), not after every micro-batch"), \
        problems


def test_starting_file_5_splits_the_data_over_every_rank_and_the_checker_says_so(tmp_path):
    problems = checked(5, REPO / STARTS[5], tmp_path)
    assert re.fullmatch(r"ranks 0 and 1 form a tp group \(dp 0: they compute one model together, each with 1/2 of "
                        r"every block's heads\) but trained on different samples in epoch 0, .* each rank trained on "
                        r"its own 1/4 of the data \(16 of 64 samples\), as a DistributedSampler over all 4 ranks "
                        r"\(the global rank\) deals it\. Give the sampler the dp group's size and rank: .*",
                        problems), problems


def test_starting_file_6_gives_the_last_rank_twice_the_attention_and_the_checker_says_so(tmp_path):
    problems = checked(6, REPO / STARTS[6], tmp_path)
    assert problems.startswith("rank 1 computed 2.00 times the attention scores rank 0 did in epoch 0 ("), problems
    assert "rank r holds chunks r and 2cp-1-r" in problems and "\n" not in problems, problems


# Seeded mistakes: (exercise, edits to its solution, one pattern per verdict the checker must print, and no other).
# One run per kind of evidence the recorder gives the verdicts: what a spawned job's ranks trained on, computed, saved
# (from which line, in which file) and left open; a job torchrun restarts after a kill (when each rank began an epoch
# and what a save was doing then; the state a restarted rank begins from); two nodes; each optimizer step (its
# all-reduce rounds and learning rate). Mistakes whose effects are independent share one run: each run costs 3 to 8
# processes that import torch.
BYPASS = (r"loss = self\.loss_fn\(self\.model\(source\)", "loss = self.loss_fn(self.model.module(source)")
NO_ALL_REDUCE = (r"\n *dist\.all_reduce\(totals\).*", "")
NO_DESTROY = (r"\n *dist\.destroy_process_group\(\)", "")
NO_SET_EPOCH = (r"\n *self\.train_data\.sampler\.set_epoch\(epoch\).*", "")
NO_BARRIER = (r"\n *dist\.barrier\(\).*", "")
NO_OPTIMIZER_SAVED = (r"OPTIMIZER_STATE=self\.optimizer\.state_dict\(\),", "")
NO_OPTIMIZER_LOADED = (r"\n *self\.optimizer\.load_state_dict\(snapshot\[\"OPTIMIZER_STATE\"\]\)", "")
NO_SYNC = (r"contextlib\.nullcontext\(\) if last else self\.model\.no_sync\(\)", "contextlib.nullcontext()")
SCHEDULER_PER_OPTIMIZER_STEP = (r"\n *if self\.scaler\.get_scale\(\) >= scale:.*\n *self\.scheduler\.step\(\).*", "")
SCHEDULER_PER_MICRO_BATCH = (r"(\.backward\(\).*)", r"\1\n            self.scheduler.step()")
MISTAKES = {
    "ddp-bypassed, loss of rank 0 alone, no set_epoch, the wrapper saved, the group left open": (1, [
        BYPASS, NO_ALL_REDUCE, NO_DESTROY, NO_SET_EPOCH,
        (r"torch\.save\(self\.model\.module\.state_dict\(\)", "torch.save(self.model.state_dict()")], [
        r"^after epoch 0 the ranks' parameters differed .*: their gradients were not averaged.* At line \d+ \(in "
        r"_run_batch: `loss = self\.loss_fn\(self\.model\.module\(source\), targets\)`\) it calls the model inside "
        r"DDP directly .*: call the DDP-wrapped model, self\.model\(source\)$",
        r"^rank 0 trained on the same samples in the same order in epochs 0 and 1 \(its DistributedSampler's epoch "
        r"stayed 0\): call self\.train_data\.sampler\.set_epoch\(epoch\)",
        r"^epoch \d+'s printed loss [\d.]+ is rank 0's own loss \([\d.]+\), not the mean over the ranks \([\d.]+\): "
        r".*dist\.all_reduce\(totals\)",
        r"^checkpoint\.pt holds the DDP wrapper's state_dict .*: save self\.model\.module\.state_dict\(\), the model "
        r"inside DDP in what the save at line \d+ \(in _save_checkpoint: `torch\.save\(self\.model\.state_dict\(\)",
        r"^ranks 0 and 1 exited with their process group still open: call dist\.destroy_process_group\(\)"]),
    "no optimizer in the snapshot, no barrier after the save": (2, [
        NO_OPTIMIZER_SAVED, NO_OPTIMIZER_LOADED, NO_BARRIER], [
        r"^rank 1 began epoch \d while rank 0 was still writing the snapshot .*: dist\.barrier\(\), on every rank, "
        r"after the `if \.\.\. == 0:` save( \(line \d+ \(in train: `self\._save_snapshot\(epoch\)`\)\))?$",
        r"^rank \d resumed epoch \d after the restart, but its optimizer's state differed from the one it had at the "
        r"end of epoch \d, .*: save self\.optimizer\.state_dict\(\) in the snapshot"]),
    "no no_sync, the scheduler stepped per micro-batch": (4, [
        NO_SYNC, SCHEDULER_PER_OPTIMIZER_STEP, SCHEDULER_PER_MICRO_BATCH], [
        r"^DDP all-reduced the gradients 2 time\(s\) per optimizer step, once per micro-batch: with --grad_accum 2 "
        r"that is 2x the communication\.",
        r"^optimizer step \d+ used learning rate \S+, expected \S+: the warm-up \+ cosine schedule counts optimizer "
        r"steps, so call scheduler\.step\(\) once per optimizer step \(after the last micro-batch\), not once per "
        r"micro-batch$"]),
    "LOCAL_RANK 0 as the writer": (3, [
        (r"(# One writer in the whole job, not one per node\.\n *)if self\.global_rank == 0:",
         r"\1if self.local_rank == 0:")], [
        r"^ranks 0 and 1 all wrote snapshot\.pt: only global rank 0 writes .*LOCAL_RANK is 0 on every node, .* "
        r"called from line \d+ \(in train: `self\._save_snapshot\(epoch\)`\)$"]),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_a_seeded_mistake_gets_the_verdict_that_names_it_and_nothing_else(name, tmp_path, monkeypatch, capsys):
    """`python exercises/check.py N mistaken.py` (main(), in this process) exits non-zero with one verdict per
    mistake, in the learner's terms and naming their line, and none of what gloo and torchrun print around a crash."""
    from exercises import check as checker

    number, edits, verdicts = MISTAKES[name]
    mistaken = seeded(tmp_path, STEPS[number], *edits)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["check.py", str(number), str(mistaken)])
    with pytest.raises(SystemExit) as stop:
        checker.main()
    printed = capsys.readouterr().out
    problems = [line.strip()[2:] for line in printed.splitlines() if line.strip().startswith("✗ ")]
    hints = f"exercises/{checker.EXERCISES[number]}/hints.md"
    assert stop.value.code == f"{len(verdicts)} problem(s). Hints: {hints}", printed  # a message: exit status 1
    for verdict in verdicts:
        assert any(re.search(verdict, problem) for problem in problems), f"no verdict matches {verdict!r}:\n{printed}"
    assert not re.search(r"GLHF|Connection reset|\[rank\d\]:|Traceback|Error:", printed), printed
