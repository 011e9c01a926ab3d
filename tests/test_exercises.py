"""The workshop checker keeps its promise: the repository's own steps pass every exercise, each starting file fails
with the message its exercise is about, and seeded mistakes are named in the learner's terms."""
import difflib
import re

import pytest

from exercises.check import EXERCISES, SOLUTIONS, accumulation_reference, check, exit_problems
from tools.jobs import PYTHON, REPO, run, script
from utils import make_workload
from utils.gpt import help_pages

STEPS = SOLUTIONS  # the step each exercise leads to, as the checker names it when all checks pass
STARTS = {number: f"exercises/{folder}/start.py" for number, folder in EXERCISES.items()}


@pytest.mark.parametrize("number", sorted(STEPS))
def test_a_starting_file_is_its_solution_but_for_the_lines_its_todos_name(number):
    """A starting file is the step it leads to with the exercise's lines taken out: every other line is the step's,
    so the diff the hints suggest (`diff start.py solution.py`) shows the exercise and nothing else."""
    start, solution = (REPO / STARTS[number]).read_text().splitlines(), (REPO / STEPS[number]).read_text().splitlines()
    docstring_end = next(index for index, line in enumerate(start) if index and line.endswith('"""'))
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, start, solution, autojunk=False).get_opcodes():
        if tag == "equal" or i2 <= docstring_end + 1:
            continue
        changed = start[max(0, i1 - 1):i1 + 1] if tag == "insert" else start[i1:i2]  # an insertion: where it goes
        assert any("TODO" in line for line in changed), (
            f"{STARTS[number]}:{i1 + 1}: differs from {STEPS[number]} where no TODO says so:\n"
            + "\n".join([*(f"-{line}" for line in start[i1:i2]), *(f"+{line}" for line in solution[j1:j2])]))


def seeded(tmp_path, step, *edits):
    """A copy of a step script with mistakes put in: each edit is (text, replacement), and each text must occur."""
    text = (REPO / step).read_text()
    for old, new in edits:
        assert re.search(old, text), f"{step} no longer contains {old!r}: update this seeded mistake"
        text = re.sub(old, new, text)
    path = tmp_path / f"mistaken_{step}"
    path.write_text(text)
    return path


def checked(number, path, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    return "\n".join(check(number, path, workdir))


@pytest.mark.slow
@pytest.mark.parametrize("number", sorted(STEPS))
def test_the_repositorys_step_passes_its_exercise(number, tmp_path):
    assert checked(number, script(STEPS[number]), tmp_path) == ""


@pytest.mark.slow
def test_starting_file_1_runs_in_one_process_and_the_checker_says_so(tmp_path):
    job = run([PYTHON, REPO / "exercises/check.py", 1, REPO / STARTS[1]], cwd=tmp_path, check=False)
    assert job.returncode == 1, job.output
    assert "✗ only one process trained: start 2 processes (mp.spawn(" in job.output
    assert "1 problem(s). Hints: exercises/1_ddp/hints.md" in job.output


@pytest.mark.slow
def test_starting_file_2_starts_over_after_the_kill(tmp_path):
    problems = checked(2, REPO / STARTS[2], tmp_path)
    assert "the restarted job started over from epoch 0: epochs 0-1 were lost" in problems


@pytest.mark.slow
def test_starting_file_3_trains_out_of_step_when_nodes_have_their_own_disks(tmp_path):
    problems = checked(3, REPO / STARTS[3], tmp_path)
    assert re.search(r"the nodes trained out of step: rank 0 began at epoch 3; rank 1 began at epoch 0", problems)


@pytest.mark.slow
def test_a_run_stopped_at_its_time_limit_is_said_to_have_run_that_long(tmp_path):
    job = run([PYTHON, "-c", "import time; time.sleep(30)"], cwd=tmp_path, timeout=0.5, check=False)
    [problem] = exit_problems(job)
    assert problem.startswith("it did not finish within 0.5 s and was stopped"), problem


def test_the_checker_expects_the_optimizer_steps_gpt_py_takes_when_the_data_does_not_split_evenly(tmp_path):
    """4,700 characters: 66 training blocks, 33 per rank, so 9 micro-batches of at most 4 (the last holds 1) and, with
    K=2, 5 optimizer steps an epoch, the last on one micro-batch: gpt.py rounds up at each division (the sampler pads,
    the DataLoader keeps its last short batch, the Trainer's steps per epoch), and so must the checker."""
    text = tmp_path / "text.txt"
    text.write_text(help_pages()[:4700])
    assert len(make_workload("gpt-cpu", text=str(text)).train_set) == 66
    assert accumulation_reference(text)[2] == 5


def test_checker_refuses_a_missing_script(tmp_path, monkeypatch):
    from exercises import check as checker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["check.py", "1", "no_such_script.py"])
    with pytest.raises(SystemExit) as stop:
        checker.main()
    assert str(stop.value) == "error: no_such_script.py is not a file"


@pytest.mark.slow
def test_a_dataloader_without_distributed_sampler_shows_as_overlapping_ranks(tmp_path):
    mistaken = seeded(tmp_path, "multigpu.py",
                      (r"shuffle=False,\s*sampler=DistributedSampler\(dataset\)\)", "shuffle=True)"),
                      (r"\n *self\.train_data\.sampler\.set_epoch\(epoch\).*", ""))
    problems = checked(1, mistaken, tmp_path)
    assert re.search(r"ranks 0 and 1 trained on the same samples: \d+ of the \d+ samples rank 0 saw in epoch 0 "
                     r"were also rank 1's. The DataLoader uses a RandomSampler: give it "
                     r"sampler=DistributedSampler\(dataset\)", problems), problems


@pytest.mark.slow
def test_a_missing_set_epoch_and_saving_on_every_rank_are_both_named(tmp_path):
    mistaken = seeded(tmp_path, "multigpu.py",
                      (r"\n *self\.train_data\.sampler\.set_epoch\(epoch\).*", ""),
                      (r"if self\.rank == 0:  # the replicas are identical.*\n *", ""))
    problems = checked(1, mistaken, tmp_path)
    assert ("rank 0 trained on the same samples in the same order in epochs 0 and 1 (its DistributedSampler's "
            "epoch stayed 0): call self.train_data.sampler.set_epoch(epoch)") in problems, problems
    assert "ranks 0 and 1 all wrote checkpoint.pt: the replicas are identical, so one writer is enough" in problems


@pytest.mark.slow
def test_a_snapshot_that_stores_the_finished_epoch_repeats_it_after_the_kill(tmp_path):
    mistaken = seeded(tmp_path, "multigpu_torchrun.py", (r"EPOCHS_RUN=epoch \+ 1\)", "EPOCHS_RUN=epoch)"))
    problems = checked(2, mistaken, tmp_path)
    assert problems == ("the restarted job repeated epoch 1, which finished and was saved before the kill: store "
                        "the number of epochs *run* (epoch + 1) and start there"), problems


# --- exercise 4: gradient accumulation (each a 2-process run of ~8 optimizer steps on a short text) -------------------

@pytest.mark.slow
def test_starting_file_4_steps_after_every_micro_batch_and_the_checker_says_so(tmp_path):
    problems = checked(4, REPO / STARTS[4], tmp_path)
    assert problems == ("rank 0 took 16 optimizer steps in 2 epochs, expected 8: with --grad_accum 2, step the "
                        "optimizer once per 2 micro-batches (when `last` is True), not after every micro-batch"), \
        problems


@pytest.mark.slow
def test_accumulating_without_no_sync_shows_as_one_all_reduce_per_micro_batch(tmp_path):
    mistaken = seeded(tmp_path, "gpt.py", (r"contextlib\.nullcontext\(\) if last else self\.model\.no_sync\(\)",
                                           "contextlib.nullcontext()"))
    problems = checked(4, mistaken, tmp_path)
    assert problems.startswith("DDP all-reduced the gradients 2 time(s) per optimizer step, once per micro-batch: "
                               "with --grad_accum 2 that is 2x the communication."), problems


@pytest.mark.slow
def test_a_loss_not_divided_by_k_shows_as_a_gradient_k_times_too_large(tmp_path):
    mistaken = seeded(tmp_path, "gpt.py", (r"scale\(loss / micro_batches\)", "scale(loss)"))
    problems = checked(4, mistaken, tmp_path)
    assert problems.startswith("the gradient of an optimizer step is 2.00x the mean over its micro-batches"), problems


@pytest.mark.slow
def test_a_scheduler_stepped_per_micro_batch_shows_in_the_learning_rates(tmp_path):
    stepped_per_optimizer_step = r"\n *if self\.scaler\.get_scale\(\) >= scale:.*\n *self\.scheduler\.step\(\).*"
    mistaken = seeded(tmp_path, "gpt.py", (stepped_per_optimizer_step, ""),
                      (r"(\.backward\(\).*)", r"\1\n            self.scheduler.step()"))
    problems = checked(4, mistaken, tmp_path)
    assert re.fullmatch(r"optimizer step \d+ used learning rate \S+, expected \S+: the warm-up \+ cosine schedule "
                        r"counts optimizer steps, so call scheduler.step\(\) once per optimizer step \(after the "
                        r"last micro-batch\), not once per micro-batch", problems), problems


# --- exercise 5: 2D parallelism (a 4-process run, dp 2 x tp 2, of 16 optimizer steps on a short text) ----------------

@pytest.mark.slow
def test_starting_file_5_splits_the_data_over_every_rank_and_the_checker_says_so(tmp_path):
    problems = checked(5, REPO / STARTS[5], tmp_path)
    assert re.fullmatch(r"ranks 0 and 1 form a tp group \(dp 0: they compute one model together, each with 1/2 of "
                        r"every block's heads\) but trained on different samples in epoch 0, .* each rank trained on "
                        r"its own 1/4 of the data \(16 of 64 samples\), as a DistributedSampler over all 4 ranks "
                        r"\(the global rank\) deals it\. Give the sampler the dp group's size and rank: .*",
                        problems), problems


def test_the_2d_verdicts_name_overlapping_dp_groups_a_missing_mesh_and_a_wrong_loss():
    """The judge of exercise 5 on records made up here (no processes): 4 ranks, dp 2 x tp 2, 8 samples."""
    from exercises.check import two_d_problems

    def rows(indices_by_rank, loss=1.0, mesh=True):
        return [dict(rank=rank, restart=0, number=0, epoch=0, loss=loss, indices=indices,
                     mesh=dict(dp=rank // 2, tp=rank % 2) if mesh else None)
                for rank, indices in enumerate(indices_by_rank)]

    reference = ({0: 1.0}, 8)
    halves = [[0, 2, 4, 6], [0, 2, 4, 6], [1, 3, 5, 7], [1, 3, 5, 7]]
    assert two_d_problems(rows(halves), reference) == []
    everything = [list(range(8))] * 4  # no sampler split at all
    assert two_d_problems(rows(everything), reference)[0].startswith(
        "the dp groups 0 and 1 trained on the same samples in epoch 0 (8 of 8): each dp rank must get its own 1/2")
    assert two_d_problems(rows(halves, mesh=False), reference)[0].startswith("no rank made a named device mesh")
    assert two_d_problems(rows(halves, loss=1.5), reference) == [
        "epoch 0's loss, averaged over the ranks, is 1.5000, but one process training on the same samples computes "
        "1.0000: the ranks do not compute what the model computes (the tensor-parallel plan, or the way the data "
        "reaches the ranks)"]


# Seeded mistakes: (exercise, edits to its solution, one pattern per verdict the checker must print, and no other).
# The checker judges what the run did (every rank's parameters after each epoch, the losses each rank computed, what
# was saved, when, by which line, the state a resumed run starts from), so mistakes whose effects are independent
# share one run: each run costs 3 to 7 processes that import torch.
BYPASS = (r"loss = self\.loss_fn\(self\.model\(source\)", "loss = self.loss_fn(self.model.module(source)")
NO_ALL_REDUCE = (r"\n *dist\.all_reduce\(totals\).*", "")
NO_DESTROY = (r"\n *dist\.destroy_process_group\(\)", "")
NO_BARRIER = (r"\n *dist\.barrier\(\).*", "")
NO_OPTIMIZER_SAVED = (r"OPTIMIZER_STATE=self\.optimizer\.state_dict\(\),", "")
NO_OPTIMIZER_LOADED = (r"\n *self\.optimizer\.load_state_dict\(snapshot\[\"OPTIMIZER_STATE\"\]\)", "")
EVERY_RANK_SAVES = (r"if self\.rank == 0:  # the replicas are identical.*\n *", "")
MISTAKES = {
    "ddp-bypassed, loss of rank 0 alone, the wrapper saved, the group left open": (1, [
        BYPASS, NO_ALL_REDUCE, NO_DESTROY,
        (r"torch\.save\(self\.model\.module\.state_dict\(\)", "torch.save(self.model.state_dict()")], [
        r"^after epoch 0 the ranks' parameters differed .*: their gradients were not averaged.* At line \d+ \(in "
        r"_run_batch: `loss = self\.loss_fn\(self\.model\.module\(source\), targets\)`\) it calls the model inside "
        r"DDP directly .*: call the DDP-wrapped model, self\.model\(source\)$",
        r"^epoch \d+'s printed loss [\d.]+ is rank 0's own loss \([\d.]+\), not the mean over the ranks \([\d.]+\): "
        r".*dist\.all_reduce\(totals\)",
        r"^checkpoint\.pt holds the DDP wrapper's state_dict .*: save self\.model\.module\.state_dict\(\), the model "
        r"inside DDP in what the save at line \d+ \(in _save_checkpoint: `torch\.save\(self\.model\.state_dict\(\)",
        r"^ranks 0 and 1 exited with their process group still open: call dist\.destroy_process_group\(\)"]),
    "shuffle=True with a DistributedSampler": (1, [(r"shuffle=False,", "shuffle=True,")], [
        r"^the DataLoader was given shuffle=True and a DistributedSampler \(line \d+ \(in prepare_dataloader: "
        r"`return DataLoader\(.*\)\): the sampler does the shuffling .* pass shuffle=False$"]),
    "no optimizer in the snapshot, no barrier after the save": (2, [
        NO_OPTIMIZER_SAVED, NO_OPTIMIZER_LOADED, NO_BARRIER], [
        r"^rank 1 began epoch \d while rank 0 was still writing the snapshot .*: dist\.barrier\(\), on every rank, "
        r"after the `if \.\.\. == 0:` save( \(line \d+ \(in train: `self\._save_snapshot\(epoch\)`\)\))?$",
        r"^rank \d resumed epoch \d after the restart, but its optimizer's state differed from the one it had at the "
        r"end of epoch \d, .*: save self\.optimizer\.state_dict\(\) in the snapshot"]),
    "the optimizer saved but not loaded, every rank saves": (2, [NO_OPTIMIZER_LOADED, EVERY_RANK_SAVES], [
        r"^ranks 0 and 1 all wrote snapshot\.pt: .*only rank 0 writes \(`if self\.rank == 0:` around the save at line "
        r"\d+ \(in _save_snapshot: `torch\.save\(snapshot, tmp\)`\), called from line \d+ \(in train: "
        r"`self\._save_snapshot\(epoch\)`\)\)$",
        r"^rank \d resumed epoch 2 after the restart, but its optimizer's state differed"]),
    "the DDP wrapper's state in the snapshot": (2, [
        (r"MODEL_STATE=self\.model\.module\.state_dict\(\)", "MODEL_STATE=self.model.state_dict()")], [
        r"^snapshot\.pt holds the DDP wrapper's state_dict \(every key starts with 'module\.'\), which a plain model "
        r"cannot load: save self\.model\.module\.state_dict\(\)"]),
    "LOCAL_RANK 0 as the writer": (3, [
        (r"if self\.global_rank == 0:  # one writer", "if self.local_rank == 0:  # one writer")], [
        r"^ranks 0 and 1 all wrote snapshot\.pt: only global rank 0 writes .*LOCAL_RANK is 0 on every node, .* "
        r"called from line \d+ \(in train: `self\._save_snapshot\(epoch\)`\)$"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MISTAKES))
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
