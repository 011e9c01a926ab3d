"""The workshop checker's verdicts, on records made up here (no processes): each mistake the exercises are about is
named in the learner's terms, with their line, and a correct run's records get no verdict. Starting files differ from
their steps only where a TODO says. (tests/test_exercise_runs.py runs the scripts: that the recorder and these
verdicts meet.)"""
import difflib
import re
import types

import pytest

from exercises import check as checker
from exercises.check import EXERCISES, SOLUTIONS, exercise_checker
from exercises.judging import (barrier_problems, ddp_problems, divergence_problems, exit_problems, loss_problems,
                               order_problems, process_problems, saved_state_problems, shard_problems,
                               teardown_problems, writer_problems)
from harness.jobs import PYTHON, REPO, run
from utils import make_workload
from utils.gpt import help_pages

STEPS = SOLUTIONS  # the step each exercise leads to, as the checker names it when all checks pass
# The checkers of the exercises whose own verdicts are tried here (each exercise's check.py, in its folder)
survive_a_kill, grad_accum, two_d, context_parallel = (exercise_checker(number) for number in (2, 4, 5, 6))
KILLED_EPOCH = survive_a_kill.KILLED_EPOCH  # exercise 2 kills rank 1 as it begins this epoch
STARTS = {number: f"exercises/{folder}/start.py" for number, folder in EXERCISES.items()}
HIDDEN_BUGS = {12}  # exercises whose starting file hides what to change
DATASET_SIZE = len(make_workload().train_set)  # the workload exercises 1-3 train on


@pytest.mark.parametrize("number", sorted(STEPS))
def test_a_starting_file_is_its_solution_but_for_the_lines_its_todos_name(number):
    """A starting file is the step it leads to with the exercise's lines taken out: every other line is the step's,
    so the diff the hints suggest (`diff start.py solution.py`) shows the exercise and nothing else; each change is
    marked by a TODO of the starting file (or, in the hang clinic, whose bugs are to be found, by the solution's
    `Fixed (case ...)`)."""
    start, solution = (REPO / STARTS[number]).read_text().splitlines(), (REPO / STEPS[number]).read_text().splitlines()
    docstring_end = next(index for index, line in enumerate(start) if index and line.endswith('"""'))
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, start, solution, autojunk=False).get_opcodes():
        if tag == "equal" or i2 <= docstring_end + 1:
            continue
        changed = start[max(0, i1 - 1):i1 + 1] if tag == "insert" else start[i1:i2]  # an insertion: where it goes
        # The hang clinic's starting file does not point at its bugs (finding them is the exercise): its solution
        # says each fix instead.
        changed += [line for line in solution[j1:j2] if number in HIDDEN_BUGS and "Fixed (case" in line]
        assert any("TODO" in line or "Fixed (case" in line for line in changed), (
            f"{STARTS[number]}:{i1 + 1}: differs from {STEPS[number]} where no TODO says so:\n"
            + "\n".join([*(f"-{line}" for line in start[i1:i2]), *(f"+{line}" for line in solution[j1:j2])]))


@pytest.mark.slow  # a process of its own, stopped at its limit
def test_a_run_stopped_at_its_time_limit_is_said_to_have_run_that_long(tmp_path):
    job = run([PYTHON, "-c", "import time; time.sleep(30)"], cwd=tmp_path, timeout=0.5, check=False)
    [problem] = exit_problems(job)
    assert problem.startswith("it did not finish within 0.5 s and was stopped"), problem


def test_checker_refuses_a_missing_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["check.py", "1", "no_such_script.py"])
    with pytest.raises(SystemExit) as stop:
        checker.main()
    assert str(stop.value) == "error: no_such_script.py is not a file"


# --- exercises 1-3: data parallelism, on made-up records of 2 ranks ------------------------------------------------

# A learner's script, as far as the verdicts quote it: its lines are named by number, function and code.
LEARNERS_LINES = {
    3: "        loss = self.loss_fn(self.model.module(source), targets)",
    6: "            torch.save(snapshot, tmp)  # written whole, then renamed",
    9: "                    self._save_snapshot(epoch)",
    12: "    return DataLoader(dataset, batch_size=batch_size, shuffle=True, sampler=DistributedSampler(dataset))",
}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "my_script.py"
    path.write_text("\n".join(LEARNERS_LINES.get(number, "") for number in range(1, 14)) + "\n")
    return path


def shuffled(epoch):
    """The sampler's order of the dataset in `epoch` (any permutation that changes with the epoch)."""
    step = 2 * epoch + 3  # odd, hence coprime with the even dataset size
    return [(index * step + epoch) % DATASET_SIZE for index in range(DATASET_SIZE)]


def passes(epochs=3, ranks=2, restart=0, first_epoch=0, indices=None, sampler="DistributedSampler", **fields):
    """samples.jsonl of a correct DDP run (a row per rank and epoch), or of one attempt after a restart; `indices`
    (rank, epoch) -> its samples replaces the sampler's split, `fields` are set on every row."""
    rows = []
    for number, epoch in enumerate(range(first_epoch, epochs)):
        for rank in range(ranks):
            rows.append(dict(pid=100 * restart + rank, rank=rank, restart=restart, number=number, epoch=epoch,
                             sampler=sampler, ddp=True, mesh=None, bypass=None, loss=1.0 / (epoch + 1),
                             indices=indices(rank, epoch) if indices else shuffled(epoch)[rank::ranks],
                             params=f"after {epoch}", optimizer=f"state after {epoch}",
                             params_before=f"after {epoch - 1}", optimizer_before=f"state after {epoch - 1}",
                             **fields))
    return rows


def save(script, rank, began, ended, path="snapshot.pt"):
    """saves.jsonl's row of a save from the learner's line 6, called from line 9."""
    return dict(pid=rank, rank=rank, restart=0, path=path, began=began, ended=ended,
                stack=[["/elsewhere/launcher.py", 40, "main"], [str(script), 9, "train"],
                       [str(script), 6, "_save_snapshot"]])


def test_a_correct_runs_records_get_no_verdict(script):
    samples = passes()
    assert process_problems(samples) == ddp_problems(samples) == divergence_problems(samples, script) == []
    assert shard_problems(samples) == order_problems(samples) == []
    assert writer_problems([save(script, 0, 1.0, 1.5)], script) == []
    assert teardown_problems([dict(rank=rank, restart=0, open=False) for rank in (0, 1)]) == []


def test_one_process_or_ranks_that_never_joined_the_group_are_named():
    one = [dict(row, rank=None, pid=1) for row in passes(ranks=1)]
    assert process_problems(one)[0].startswith("only one process trained: start 2 processes (mp.spawn(main, ")
    assert process_problems([])[0].startswith("it never trained")
    assert process_problems(passes(ranks=3))[0].startswith("the processes that trained had ranks [0, 1, 2], expected")


def test_a_model_called_past_ddp_shows_as_parameters_that_differ_and_the_line_that_did_it(script):
    samples = passes()
    for row in samples:  # each rank trained its own model from epoch 1 on, by calling the model inside DDP
        if row["epoch"] >= 1:
            row["params"] += f" on rank {row['rank']}"
            row["bypass"] = [["/elsewhere/launcher.py", 40, "main"], [str(script), 3, "_run_batch"]]
    assert divergence_problems(samples, script) == [
        "after epoch 1 the ranks' parameters differed (ranks 0 and 1 hold 2 different models): their gradients were "
        "not averaged, so each rank trained a model of its own. At line 3 (in _run_batch: `loss = self.loss_fn("
        "self.model.module(source), targets)`) it calls the model inside DDP directly (self.model.module), which "
        "skips DDP's gradient all-reduce: call the DDP-wrapped model, self.model(source)"]
    unwrapped = [dict(row, ddp=row["rank"] == 0) for row in passes()]
    assert ddp_problems(unwrapped)[0].startswith("rank 1 trained a model not wrapped in DistributedDataParallel")


def test_a_printed_loss_that_is_rank_0s_own_is_told_from_the_mean(script):
    samples = passes()
    for row in samples:
        row["loss"] = (2.0 if row["rank"] == 0 else 1.0) / (row["epoch"] + 1)  # the mean: 1.5 / (epoch + 1)

    def printed(*losses):
        return "".join(f"[rank 0/2 | cpu] epoch {epoch} | steps 32 | loss {loss:.4f} | 9,000 samples/s\n"
                       for epoch, loss in enumerate(losses))

    assert loss_problems(printed(1.5, 0.75, 0.5), 3, samples) == []
    assert loss_problems(printed(2.0, 1.0, 2 / 3), 3, samples) == [
        "epoch 0's printed loss 2.0000 is rank 0's own loss (2.0000), not the mean over the ranks (1.5000): before "
        "rank 0 prints, sum the [loss sum, samples] totals of every rank with dist.all_reduce(totals) (on every "
        "rank), then divide"]
    stuck = [dict(row, epoch=0) for row in samples]  # set_epoch never called: the sampler's epoch stays 0
    assert loss_problems(printed(2.0, 1.0, 2 / 3), 3, stuck)[0].startswith(
        "epoch 0's printed loss 2.0000 is rank 0's own loss (2.0000), not the mean over the ranks (1.5000)")
    assert loss_problems(printed(1.7, 0.75, 0.5), 3, samples)[0].startswith(
        "epoch 0's printed loss 1.7000 is neither the mean nor any one rank's loss")
    assert loss_problems(printed(1.5, 0.75), 3, samples)[0].startswith("no line reported epoch 2")
    assert loss_problems(printed(1.5, 1.4, 1.0), 3, samples)[0].startswith("the model did not learn")


@pytest.mark.parametrize("name, nested", [("checkpoint.pt", False), ("snapshot.pt", True)])
def test_the_ddp_wrappers_state_dict_saved_is_named_with_the_save_that_wrote_it(name, nested, script):
    model_state = make_workload().model.state_dict()
    wrapper_state = {f"module.{key}": tensor for key, tensor in model_state.items()}

    def saved(state):  # a checkpoint is the state_dict, a snapshot holds it with the epochs run
        return dict(MODEL_STATE=state, EPOCHS_RUN=2) if nested else state

    saves = [save(script, 0, 1.0, 1.5, path=name)]
    assert saved_state_problems(name, saved(model_state), saves, script) == []
    assert saved_state_problems(name, saved(wrapper_state), saves, script) == [
        f"{name} holds the DDP wrapper's state_dict (every key starts with 'module.'), which a plain model cannot "
        "load: save self.model.module.state_dict(), the model inside DDP in what the save at line 6 (in "
        "_save_snapshot: `torch.save(snapshot, tmp)`) writes"]
    assert saved_state_problems(name, dict(EPOCHS_RUN=2), saves, script) == [f"{name} holds no model state_dict"]


def test_a_process_group_left_open_at_the_last_attempts_exit_is_named():
    exits = [dict(rank=rank, restart=0, open=True) for rank in (0, 1)]  # the killed attempt's exits do not count
    assert teardown_problems(exits + [dict(rank=rank, restart=1, open=False) for rank in (0, 1)]) == []
    assert teardown_problems(exits)[0].startswith(
        "ranks 0 and 1 exited with their process group still open: call dist.destroy_process_group() at the end of "
        "main, on every rank")
    assert teardown_problems(exits[1:])[0].startswith("rank 1 exited with its process group still open")


def test_shuffle_true_beside_a_distributed_sampler_is_named_at_the_learners_line(script):
    """The DataLoader refuses the pair with a ValueError on every rank; the verdict says why, and where."""
    traceback = (f'Traceback (most recent call last):\n  File "{script}", line 12, in prepare_dataloader\n'
                 "ValueError: sampler option is mutually exclusive with shuffle\n")
    crashed = types.SimpleNamespace(timed_out=False, codes=[1], output=f"[rank0]: {traceback}[rank1]: {traceback}")
    assert exit_problems(crashed, script) == [
        "the DataLoader was given shuffle=True and a DistributedSampler (line 12 (in prepare_dataloader: `return "
        "DataLoader(dataset, batch_size=batch_size, shuffle=True, sampler=DistributedSampler(dataset))`)): the "
        "sampler does the shuffling (a new order every epoch, from set_epoch, the same on every rank), so the "
        "DataLoader must not: pass shuffle=False"]


def test_a_rank_that_begins_an_epoch_while_the_snapshot_is_written_means_a_missing_barrier(script):
    def begins(pass_began, save_began=10.0):
        return [dict(what="save", pid=0, rank=0, restart=0, began=save_began),
                dict(what="pass", pid=1, rank=1, restart=0, epoch=2, began=pass_began)]

    saves = [save(script, 0, 10.0, 10.5)]
    assert barrier_problems(begins(10.6), saves, script) == []  # it waited for the save
    assert barrier_problems(begins(10.1), saves, script) == [
        "rank 1 began epoch 2 while rank 0 was still writing the snapshot (this check makes every save 0.5 s slower, "
        "as a slow disk would): a kill then loses the epoch before too. After the save, every rank must wait until "
        "it is on disk: dist.barrier(), on every rank, after the `if ... == 0:` save (line 9 (in train: "
        "`self._save_snapshot(epoch)`))"]
    # a save the kill cut short never ended: a pass begun after it began ran beside it
    assert barrier_problems(begins(10.6), [], script)[0].startswith("rank 1 began epoch 2 while rank 0 was still")


@pytest.mark.parametrize("lost", ["optimizer", "params"])
def test_a_resumed_epoch_that_begins_from_other_state_than_the_killed_one_ended_with_is_named(lost):
    """The optimizer's state not saved, or saved and not loaded: the restarted job resumes with a fresh Adam."""
    samples = passes(epochs=KILLED_EPOCH) + passes(epochs=4, restart=1, first_epoch=KILLED_EPOCH)
    assert survive_a_kill.resume_problems(samples) == []
    for row in samples:
        if row["restart"] == 1 and row["epoch"] == KILLED_EPOCH:
            row[f"{lost}_before"] = "fresh"
    fix = ("save self.optimizer.state_dict() in the snapshot (_save_snapshot) and load it back with "
           "self.optimizer.load_state_dict(...) (_load_snapshot)" if lost == "optimizer" else
           "save self.model.module.state_dict() in the snapshot and load it back before wrapping in DDP")
    what = ("its optimizer's state differed from the one" if lost == "optimizer" else
            "its parameters differed from those")
    [problem] = survive_a_kill.resume_problems(samples)
    assert problem.startswith(f"rank 0 resumed epoch 2 after the restart, but {what} it had at the end of epoch 1, "
                              "so the resumed run is not the run that was interrupted: " + fix), problem


def test_saves_on_every_rank_or_on_each_nodes_local_rank_0_name_the_global_rank_as_the_one_writer(script):
    saves = [save(script, 0, 1.0, 1.5), save(script, 1, 1.0, 1.5)]
    around = ("around the save at line 6 (in _save_snapshot: `torch.save(snapshot, tmp)`), called from line 9 (in "
              "train: `self._save_snapshot(epoch)`)")
    assert writer_problems(saves, script) == [
        f"ranks 0 and 1 all wrote snapshot.pt: the replicas are identical, so one writer is enough: only rank 0 "
        f"writes (`if self.rank == 0:` {around})"]
    assert writer_problems(saves, script, multinode=True) == [
        "ranks 0 and 1 all wrote snapshot.pt: only global rank 0 writes (RANK, or dist.get_rank()): LOCAL_RANK is 0 "
        f"on every node, so `if local_rank == 0:` makes one writer per node; test the global rank {around}"]
    assert writer_problems(saves[1:], script)[0].startswith("rank 1 wrote snapshot.pt, not rank 0")
    assert writer_problems([], script)[0].startswith("nothing was saved")


def test_a_job_restarted_after_the_kill_resumes_at_the_killed_epoch_or_is_told_where_it_went_wrong():
    """Killed as it began epoch 2 of 4: the restart must train epochs 2 and 3 (1 and 3 when the last snapshot may not
    have been on disk, without a barrier)."""
    def restarted_at(first_epoch, epochs=4):
        return passes(epochs=KILLED_EPOCH) + passes(epochs=epochs, restart=1, first_epoch=first_epoch)

    assert survive_a_kill.restart_problems(restarted_at(KILLED_EPOCH), 4) == []
    assert survive_a_kill.restart_problems(restarted_at(0), 4)[0].startswith(
        "after the kill in epoch 2 the restarted job started over from epoch 0: epochs 0-1 were lost. Save a snapshot")
    assert survive_a_kill.restart_problems(restarted_at(1), 4) == [
        "the restarted job repeated epoch 1, which finished and was saved before the kill: store the number of "
        "epochs *run* (epoch + 1) and start there"]
    assert survive_a_kill.restart_problems(restarted_at(1), 4, no_barrier=True) == []
    assert survive_a_kill.restart_problems(restarted_at(3), 4) == [
        "the restarted job skipped epoch 2, which the kill interrupted: resume at the first epoch that did not finish"]
    assert survive_a_kill.restart_problems(restarted_at(KILLED_EPOCH, epochs=3), 4) == [
        "the restarted job stopped after epoch 2, not 3"]
    assert survive_a_kill.restart_problems(passes(epochs=KILLED_EPOCH), 4) == ["no rank trained after the restart"]


def test_ranks_that_share_their_samples_or_leave_some_out_are_told_to_use_a_distributed_sampler():
    everything = passes(sampler="RandomSampler", indices=lambda rank, epoch: shuffled(epoch))  # no sampler's split
    assert shard_problems(everything) == [
        f"ranks 0 and 1 trained on the same samples: {DATASET_SIZE} of the {DATASET_SIZE} samples rank 0 saw in epoch "
        f"0 were also rank 1's. The DataLoader uses a RandomSampler: give it sampler=DistributedSampler(dataset) (and "
        "shuffle=False), so each rank gets its own 1/world_size of the data"]
    quarters = passes(indices=lambda rank, epoch: shuffled(epoch)[rank::4])  # each rank dealt 1/4: half never seen
    assert shard_problems(quarters)[0].startswith(f"no rank trained on {DATASET_SIZE // 2} of the {DATASET_SIZE} "
                                                  "samples in epoch 0: together the ranks must cover the whole dataset")


def test_the_same_order_in_two_epochs_means_a_missing_set_epoch():
    samples = passes(indices=lambda rank, epoch: shuffled(0)[rank::2])
    for row in samples:
        row["epoch"] = 0  # the sampler's epoch, never set
    assert order_problems(samples) == [
        "rank 0 trained on the same samples in the same order in epochs 0 and 1 (its DistributedSampler's epoch "
        "stayed 0): call self.train_data.sampler.set_epoch(epoch) at the start of every epoch, so each epoch gets a "
        "new shuffle (the same one on every rank)"]
    # a restarted job repeats the order of the epoch it resumes: that is right
    assert order_problems(passes(epochs=2) + passes(epochs=3, restart=1, first_epoch=1)) == []


# --- exercise 4: gradient accumulation, on made-up optimizer steps of rank 0 ----------------------------------------

PEAK_LR, NORM = 6e-3, 2.0


def optimizer_steps(steps_per_epoch=4, rounds=1, gradient=1.0, lr_per_micro_batch=False):
    """steps.jsonl's rows of rank 0 for ACCUM_EPOCHS epochs: the all-reduce rounds of each step, its first round's
    gradient norm (`gradient` times the reference's), and its learning rate from the schedule, stepped once per
    optimizer step (or once per micro-batch)."""
    from utils.loop import WarmupCosine

    total = grad_accum.ACCUM_EPOCHS * steps_per_epoch
    factor = WarmupCosine(total)
    return [dict(rank=0, step=number, rounds=rounds, grad_norms=[gradient * NORM] * rounds,
                 lr=PEAK_LR * factor(min(total - 1, 2 * number if lr_per_micro_batch else number)))
            for number in range(total)]


def test_accumulation_verdicts_name_each_mistake_and_a_right_run_gets_none():
    reference = (NORM, PEAK_LR, 4)
    assert grad_accum.accumulation_problems(optimizer_steps(), reference) == []
    assert grad_accum.accumulation_problems(optimizer_steps(steps_per_epoch=8), reference) == [
        "rank 0 took 16 optimizer steps in 2 epochs, expected 8: with --grad_accum 2, step the optimizer once per 2 "
        "micro-batches (when `last` is True), not after every micro-batch"]
    assert grad_accum.accumulation_problems([], reference)[0].startswith("no optimizer step was taken")
    assert grad_accum.accumulation_problems(optimizer_steps(rounds=2), reference) == [
        "DDP all-reduced the gradients 2 time(s) per optimizer step, once per micro-batch: with --grad_accum 2 that "
        "is 2x the communication. Run all but the last micro-batch inside `with self.model.no_sync():`, the forward "
        "too (DDP decides in forward whether backward syncs)"]
    assert grad_accum.accumulation_problems(optimizer_steps(gradient=2.0), reference) == [
        "the gradient of an optimizer step is 2.00x the mean over its micro-batches: the K=2 micro-batches' "
        "gradients add up, so divide each micro-batch's loss by K (by `micro_batches`) before backward"]
    assert grad_accum.accumulation_problems(optimizer_steps(gradient=0.5), reference)[0].startswith(
        "the gradient of the first optimizer step is 0.50x the mean over its 2 micro-batches on 2 ranks, expected 1x")
    [schedule] = grad_accum.accumulation_problems(optimizer_steps(lr_per_micro_batch=True), reference)
    assert schedule.startswith("optimizer step 1 used learning rate 0.00573, expected 0.006: the warm-up + cosine "
                               "schedule counts optimizer steps, so call scheduler.step() once per optimizer step"), \
        schedule
    # the communication and the schedule are judged apart: a script can get both wrong
    both = grad_accum.accumulation_problems(optimizer_steps(rounds=2, lr_per_micro_batch=True), reference)
    assert [problem.split(" ", 2)[:2] for problem in both] == [["DDP", "all-reduced"], ["optimizer", "step"]], both


def test_the_checker_expects_the_optimizer_steps_gpt_py_takes_when_the_data_does_not_split_evenly(tmp_path):
    """4,700 characters: 66 training blocks, 33 per rank, so 9 micro-batches of at most 4 (the last holds 1) and, with
    K=2, 5 optimizer steps an epoch, the last on one micro-batch: gpt.py rounds up at each division (the sampler pads,
    the DataLoader keeps its last short batch, the Trainer's steps per epoch), and so must the checker."""
    text = tmp_path / "text.txt"
    text.write_text(help_pages()[:4700])
    assert len(make_workload("gpt-cpu", text=str(text)).train_set) == 66
    reference = grad_accum.accumulation_reference(text)
    assert reference[2] == 5
    reference = (NORM, PEAK_LR, reference[2])
    assert grad_accum.accumulation_problems(optimizer_steps(steps_per_epoch=5), reference) == []
    assert grad_accum.accumulation_problems(optimizer_steps(steps_per_epoch=4), reference)[0].startswith(
        "rank 0 took 8 optimizer steps in 2 epochs, expected 10")


# --- exercise 5: 2D parallelism ---------------------------------------------------------------------------------------

def test_the_2d_verdicts_name_overlapping_dp_groups_a_missing_mesh_and_a_wrong_loss():
    """The judge of exercise 5 on records made up here (no processes): 4 ranks, dp 2 x tp 2, 8 samples."""
    def rows(indices_by_rank, loss=1.0, mesh=True):
        return [dict(rank=rank, restart=0, number=0, epoch=0, loss=loss, indices=indices,
                     mesh=dict(dp=rank // 2, tp=rank % 2) if mesh else None)
                for rank, indices in enumerate(indices_by_rank)]

    reference = ({0: 1.0}, 8)
    halves = [[0, 2, 4, 6], [0, 2, 4, 6], [1, 3, 5, 7], [1, 3, 5, 7]]
    assert two_d.two_d_problems(rows(halves), reference) == []
    everything = [list(range(8))] * 4  # no sampler split at all
    assert two_d.two_d_problems(rows(everything), reference)[0].startswith(
        "the dp groups 0 and 1 trained on the same samples in epoch 0 (8 of 8): each dp rank must get its own 1/2")
    assert two_d.two_d_problems(rows(halves, mesh=False), reference)[0].startswith("no rank made a named device mesh")
    assert two_d.two_d_problems(rows(halves, loss=1.5), reference) == [
        "epoch 0's loss, averaged over the ranks, is 1.5000, but one process training on the same samples computes "
        "1.0000: the ranks do not compute what the model computes (the tensor-parallel plan, or the way the data "
        "reaches the ranks)"]


# --- exercise 6: context parallelism ----------------------------------------------------------------------------------

def test_the_context_verdicts_name_a_cut_that_overlaps_a_wrong_loss_an_uneven_load_and_no_ring():
    """The judge of exercise 6 on records made up here (no processes): 2 ranks, one cp group, a context of 8."""
    def rows(positions_by_rank, scores_by_rank, loss=1.0, split=True):
        return [dict(rank=rank, restart=0, number=0, epoch=0, loss=loss,
                     context=dict(positions=positions, scores=scores) if split else None)
                for rank, (positions, scores) in enumerate(zip(positions_by_rank, scores_by_rank))]

    def problems(*args, **options):
        return context_parallel.context_problems(rows(*args, **options), {0: 1.0}, context=8)

    balanced = [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert problems(balanced, [20, 20]) == []
    assert problems(balanced, [20, 20], split=False)[0].startswith("no rank trained on a part of each sequence")
    assert problems([[0, 1, 2, 3], [2, 3, 4, 5]], [20, 20]) == [
        "in epoch 0 the ranks' chunks do not cut the sequence of 8 tokens into parts: positions 2 to 3 are held by "
        "more than one rank. Every chunk of the 2 x cp must be held by exactly one rank of the cp group"]
    assert problems([[0, 1], [2, 3]], [20, 20])[0].endswith("positions 4 to 7 by none. Every chunk of the 2 x cp "
                                                            "must be held by exactly one rank of the cp group")
    assert problems(balanced, [20, 20], loss=1.5)[0].startswith(
        "epoch 0's loss, averaged over the ranks, is 1.5000, but one process training on whole sequences computes "
        "1.0000")
    assert problems([[0, 1, 2, 3], [4, 5, 6, 7]], [16, 32]) == [
        "rank 1 computed 2.00 times the attention scores rank 0 did in epoch 0 (32 against 16 per head and sequence, "
        "forward and backward), and every rank waits for the slowest at each step: under the causal mask a query sees "
        "the keys before it, so the rank holding the end of the sequence does the most. Give each rank an early chunk "
        "and a late one: of 2 x cp chunks, rank r holds chunks r and 2cp-1-r"]
    assert problems(balanced, [0, 0])[0].startswith("rank 0's attention computed nothing by the ring in epoch 0")


def test_every_utils_function_a_hint_or_page_names_exists():
    """A hint that sends the learner to `utils.something()` sends them to a function the project has."""
    import utils

    pages = [*REPO.glob("exercises/*/hints.md"), *REPO.glob("docs/*.md"), *REPO.glob("docs/reference/*.md")]
    named = {(page.relative_to(REPO).as_posix(), name) for page in pages
             for name in re.findall(r"(?<![\w.])utils\.([a-z_]+)\(", page.read_text())}
    assert len(named) >= 5, named
    missing = sorted((page, name) for page, name in named if not hasattr(utils, name))
    assert not missing, missing
