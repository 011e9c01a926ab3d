"""Exercise 10, a pipeline schedule by hand: the checker's verdicts on records made up here (no processes), then, slow,
the start file and realistic wrong solutions run for real, each failing with its verdict."""
import re

import pytest
import torch

from exercises.check import exercise_checker
from mistakes import CHECKING, exercise_problems, seeded, written
from harness.jobs import REPO

checker = exercise_checker(10)  # exercises/10_pipeline_by_hand/check.py
(MICROBATCHES, expected_order, gradient_problems, hang_problems, memory_problems, merged, order_problems, passes_of,
 unseen_problems, wait_problems, weight_problems) = (
    checker.MICROBATCHES, checker.expected_order, checker.gradient_problems, checker.hang_problems,
    checker.memory_problems, checker.merged, checker.order_problems, checker.passes_of, checker.unseen_problems,
    checker.wait_problems, checker.weight_problems)

pytestmark = CHECKING  # the slow tests run checks

SOLUTION, START = "exercises/10_pipeline_by_hand/solution.py", "exercises/10_pipeline_by_hand/start.py"
ONE = 1024  # the bytes one micro-batch's forward keeps, in the made-up records

# A learner's script, as far as the verdicts quote it: its lines are named by number, function and code.
LEARNERS_LINES = {
    4: "            dist.irecv(received, src=self.rank - 1).wait()",
    6: "            self.sends.append(dist.isend(output.detach(), dst=self.rank + 1))",
    9: "            dist.irecv(gradient, src=self.rank + 1).wait()",
    11: "            dist.isend(received.grad, dst=self.rank - 1).wait()",
    14: "        stage.forward(microbatch)",
    15: "        stage.backward()",
}
CALLERS = {("irecv", 0): (9, "backward", 15), ("irecv", 1): (4, "forward", 14), ("isend", 0): (6, "forward", 14),
           ("isend", 1): (11, "backward", 15)}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "my_pipeline.py"
    path.write_text("\n".join(LEARNERS_LINES.get(number, "") for number in range(1, 17)) + "\n")
    return path


def ran(orders, steps=1, retain=False):
    """pipeline_by_hand.jsonl of a run whose ranks ran `orders` ({rank: "F0 F1 B0 ..."}) every step: each forward
    keeps ONE bytes, each backward frees its micro-batch's (none with `retain`: the graph kept until the step ends)."""
    rows = []
    for rank, order in orders.items():
        live = 0
        for step in range(steps):
            for name in order.split():
                microbatch = int(name[1:])
                if name[0] == "F":
                    live += ONE
                    rows.append(dict(pid=rank, rank=rank, event="forward", step=step, microbatch=microbatch,
                                     saved=ONE, live=live))
                else:
                    live -= 0 if retain else ONE
                    rows.append(dict(pid=rank, rank=rank, event="backward", step=step, microbatches=[microbatch],
                                     live=live))
            live = 0
            rows.append(dict(pid=rank, rank=rank, event="step", step=step))
    return rows


def p2p(script, rank, op, seq, step=0, waited=True, error=None):
    """The records of one isend or irecv of `rank` from the learner's line for it: the call, and its wait."""
    line, function, caller = CALLERS[(op, rank)]
    stack = [["/elsewhere/run.py", 1, "<module>"], [str(script), caller, "one_f_one_b"], [str(script), line, function]]
    rows = [dict(pid=rank, rank=rank, event="call", step=step, op=op, seq=seq, peer=1 - rank, bytes=512, stack=stack)]
    if waited is not None:
        rows.append(dict(pid=rank, rank=rank, event="waiting", step=step, seq=seq))
    if waited:
        rows.append(dict(pid=rank, rank=rank, event="waited", step=step, seq=seq, error=error))
    return rows


GPIPE = {0: "F0 F1 F2 F3 B0 B1 B2 B3", 1: "F0 F1 F2 F3 B0 B1 B2 B3"}
ONE_F_ONE_B = {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"}


def test_the_schedules_orders_are_gpipes_and_1f1bs():
    assert " ".join(expected_order("gpipe", 0, 4)) == GPIPE[0]
    assert " ".join(expected_order("1f1b", 0, 4)) == ONE_F_ONE_B[0]
    assert " ".join(expected_order("1f1b", 1, 4)) == ONE_F_ONE_B[1]
    assert " ".join(expected_order("1f1b", 0, 1)) == "F0 B0"  # the warm-up is never longer than M
    assert " ".join(expected_order("1f1b", 0, 4, stages=4)) == "F0 F1 F2 F3 B0 B1 B2 B3"


def test_a_correct_runs_records_get_no_verdict(script):
    for schedule, orders in (("gpipe", GPIPE), ("1f1b", ONE_F_ONE_B)):
        records = ran(orders, steps=3) + p2p(script, 0, "isend", 1) + p2p(script, 0, "irecv", 2)
        assert order_problems(records, schedule) == memory_problems(records, schedule) == []
        assert wait_problems(records, script) == hang_problems(records, schedule, script) == []
        assert unseen_problems(records, schedule) == []
    assert passes_of(ran(ONE_F_ONE_B))[0][0] == ONE_F_ONE_B[0].split()


def test_a_1f1b_that_runs_every_forward_first_is_told_where_its_order_leaves_1f1bs_and_what_it_holds():
    records = ran(GPIPE, steps=2)
    [order] = order_problems(records, "1f1b")
    assert order.startswith("with --schedule 1f1b, rank 0 ran the passes of step 0 as F0 F1 F2 F3 B0 B1 B2 B3, but "
                            "1F1B's order for rank 0 of 2 is F0 F1 B0 F2 B1 F3 B2 B3"), order
    assert "They differ first at pass 3, where it ran F2 and 1F1B runs B0: in 1F1B rank r of p first runs" in order
    [memory] = memory_problems(records, "1f1b")
    assert memory.startswith("with --schedule 1f1b rank 0 held the activations of 4 micro-batches at once (4,096 "
                             "bytes; one micro-batch's forward keeps 1,024), and 1F1B holds at most p = 2"), memory
    assert memory_problems(records, "gpipe") == []  # GPipe holds all M: that is what 1F1B improves on


def test_activations_kept_past_their_backward_show_though_the_order_is_1f1bs():
    records = ran(ONE_F_ONE_B, retain=True)
    assert order_problems(records, "1f1b") == []
    [memory] = memory_problems(records, "1f1b")
    assert "held the activations of 4 micro-batches at once" in memory and "retain_graph=True" in memory


def test_a_stage_whose_forwards_the_checker_never_saw_is_named():
    [problem] = unseen_problems(ran({0: GPIPE[0]}), "gpipe")
    assert problem.startswith("with --schedule gpipe, the checker saw no forward of rank 1's stage")


def test_backwards_in_another_order_than_the_forwards_are_named_with_the_first_pass_that_differs():
    [order] = order_problems(ran({0: "F0 F1 F2 F3 B3 B2 B1 B0", 1: GPIPE[1]}), "gpipe")
    assert re.search(r"rank 0 ran the passes of step 0 as F0 F1 F2 F3 B3 B2 B1 B0, but GPipe's order .* They differ "
                     r"first at pass 5, where it ran B3 and GPipe runs B0: GPipe runs every forward, then every "
                     r"backward, in the order of the forwards", order), order
    [short] = order_problems(ran({0: "F0 F1 F2", 1: GPIPE[1]}), "gpipe")
    assert "differ first at pass 4, where it ran no more and GPipe runs F3" in short


def gradients(scale=1.0, wrong_rank=None):
    """(each rank's first-step gradients, one process's): a model of 4 parameters, 2 on each stage."""
    generator = torch.Generator().manual_seed(0)
    expected = [torch.randn(3, 2, generator=generator) for _ in range(4)]
    grads = {0: [t * scale for t in expected[:2]], 1: [t * scale for t in expected[2:]]}
    if wrong_rank is not None:
        grads[wrong_rank] = [t.flip(0) for t in grads[wrong_rank]]
    return grads, expected


def test_gradients_equal_to_one_processs_get_no_verdict():
    grads, expected = gradients()
    assert gradient_problems(grads, expected, ran(ONE_F_ONE_B), "1f1b") == []


def test_a_loss_not_divided_by_m_shows_as_gradients_m_times_one_processs():
    grads, expected = gradients(scale=MICROBATCHES)
    [problem] = gradient_problems(grads, expected, ran(GPIPE), "gpipe")
    assert problem == ("with --schedule gpipe, the first step's gradients are 4.00 times one process's on every "
                       "stage: the micro-batches' losses were not divided by M (4). Divide each micro-batch's loss "
                       "(the mean over its samples) by M once, so that the M micro-batches' gradients add up to the "
                       "gradient of the batch's mean loss, not to M times it")
    grads, expected = gradients(scale=1 / MICROBATCHES)
    [twice] = gradient_problems(grads, expected, ran(GPIPE), "gpipe")
    assert twice.startswith("with --schedule gpipe, the first step's gradients are 0.25 times one process's on every "
                            "stage (1/M, M = 4): each micro-batch's loss was divided by M twice"), twice
    grads, expected = gradients(scale=2.0)
    [other] = gradient_problems(grads, expected, ran(GPIPE), "gpipe")
    assert "gradients of the first step are 2.00 and 2.00 times one process's" in other


def test_a_backward_that_met_another_micro_batchs_gradient_is_named():
    grads, expected = gradients(wrong_rank=0)
    records = ran({0: "F0 F1 B1 F2 B2 F3 B3 B0", 1: ONE_F_ONE_B[1]})
    [problem] = gradient_problems(grads, expected, records, "1f1b")
    assert re.search(r"with --schedule 1f1b, rank 0's gradients of the first step differ from one process's \(rank "
                     r"0's by up to \d+% of the largest\): in step 0 its backward number 1 ran micro-batch 1 with the "
                     r"gradient rank 1 sent for micro-batch 0", problem), problem


def test_weights_that_drift_after_a_right_first_step_are_named():
    expected = {"0.weight": torch.ones(2, 2)}
    assert weight_problems({0: {"0.weight": torch.ones(2, 2)}}, expected, "gpipe") == []
    [problem] = weight_problems({0: {"0.weight": torch.ones(2, 2) * 1.1}}, expected, "gpipe")
    assert problem.startswith("with --schedule gpipe, rank 0's weight 0.weight after 30 steps differs from one "
                              "process's although the first step's gradients were the same")


def test_both_ranks_waiting_to_receive_is_a_deadlock_named_with_their_lines(script):
    # (rank 0's isend of F0 is not waited for yet: finish() waits at the step's end)
    records = (ran({0: "F0", 1: "F0"}) + p2p(script, 0, "isend", 1, waited=None) + p2p(script, 1, "irecv", 1)
               + p2p(script, 0, "irecv", 2, waited=False) + p2p(script, 1, "irecv", 2, waited=False))
    [problem] = hang_problems(records, "1f1b", script)
    assert problem.startswith(
        "with --schedule 1f1b the ranks hung, each waiting for the other: rank 0 waited for an irecv from rank 1 at "
        "line 9 (in backward: `dist.irecv(gradient, src=self.rank + 1).wait()`), called from line 15 (in "
        "one_f_one_b: `stage.backward()`) in step 0, after F0; rank 1 waited for an irecv from rank 0 at line 4 (in "
        "forward: `dist.irecv(received, src=self.rank - 1).wait()`)"), problem
    assert "A deadlock: each rank waits to receive what the other sends only after its own receive returns" in problem
    # A wait that ended only as the --timeout ran out hung as much
    timed_out = [dict(row, error="RuntimeError: Timed out") if row["event"] == "waited" and row["seq"] == 2 else row
                 for row in records]
    assert hang_problems(timed_out, "1f1b", script) == [problem]


def test_sends_waited_for_at_once_that_block_each_other_are_named(script):
    records = p2p(script, 0, "isend", 1, waited=False) + p2p(script, 1, "isend", 1, waited=False)
    [problem] = hang_problems(records, "1f1b", script)
    assert "rank 0 waited for an isend to rank 1 at line 6 (in forward: " in problem
    assert "A deadlock: a send waited for at once blocks until the other rank receives it" in problem


def test_isends_never_waited_for_are_named_with_their_line(script):
    records = p2p(script, 0, "isend", 1, waited=None) + p2p(script, 0, "isend", 2, waited=None)
    [problem] = wait_problems(records, script)
    assert problem.startswith("rank 0 never waited for 2 of its isends, the first an isend to rank 1 at line 6 (in "
                              "forward: `self.sends.append(dist.isend(output.detach(), dst=self.rank + 1))`)"), problem
    # ... and when the other rank then hung, waiting for what was never sent, the dropped sends are the reason
    hung = records + p2p(script, 1, "irecv", 1, waited=False)
    [problem] = hang_problems(hung, "gpipe", script)
    assert "A deadlock: rank 0 never waited for 2 of its isends" in problem


def test_a_verdict_both_schedules_got_is_said_once():
    assert merged(["with --schedule gpipe, A", "with --schedule 1f1b, B", "with --schedule 1f1b, A"]) == [
        "with --schedule gpipe and with --schedule 1f1b, A", "with --schedule 1f1b, B"]


# --- the scripts, run ------------------------------------------------------------------------------------------------

def checked(path, tmp_path):
    return "\n".join(exercise_problems(10, path, tmp_path))


@pytest.mark.slow
def test_the_start_file_stops_at_its_todos(tmp_path):
    problems = checked(REPO / START, tmp_path)
    assert re.search(r"with --schedule gpipe, it exited with code 1, at line \d+ \(in gpipe: .*\n.*"
                     r"NotImplementedError: TODO 4: the GPipe schedule", problems), problems
    assert "NotImplementedError: TODO 5: the 1F1B schedule" in problems, problems


@pytest.mark.slow
def test_a_1f1b_that_is_gpipe_and_a_loss_not_divided_by_m_fail_with_their_verdicts(tmp_path):
    # Two independent mistakes in one run: 1F1B's warm-up runs every forward (GPipe), and the loss is not divided by M.
    mistaken = seeded(tmp_path, SOLUTION,
                      (r"warmup = min\(STAGES - 1 - stage\.rank, microbatches\)", "warmup = microbatches"),
                      (r"\) / self\.microbatches", ")"))
    problems = checked(mistaken, tmp_path)
    assert "with --schedule 1f1b, rank 0 ran the passes of step 0 as F0 F1 F2 F3 B0 B1 B2 B3" in problems, problems
    assert "with --schedule 1f1b rank 0 held the activations of 4 micro-batches at once" in problems, problems
    assert ("with --schedule gpipe and with --schedule 1f1b, the first step's gradients are 4.00 times one "
            "process's on every stage") in problems, problems


@pytest.mark.slow
def test_backwards_of_the_newest_micro_batch_first_fail_with_their_verdicts(tmp_path):
    # A stack, not a queue: GPipe's backwards then run in reverse (both stages alike: the gradients stay right), and
    # 1F1B's first stage meets the gradient of another micro-batch.
    mistaken = seeded(tmp_path, SOLUTION, (r"self\.in_flight\.pop\(0\)", "self.in_flight.pop()"))
    problems = checked(mistaken, tmp_path)
    assert re.search(r"with --schedule gpipe, rank 0 ran the passes of step 0 as F0 F1 F2 F3 B3 B2 B1 B0, .* where "
                     r"it ran B3 and GPipe runs B0", problems), problems
    assert re.search(r"with --schedule 1f1b, rank 0's gradients of the first step differ from one process's .*: in "
                     r"step 0 its backward number 1 ran micro-batch 1 with the gradient rank 1 sent for micro-batch "
                     r"0", problems), problems
    assert "with --schedule gpipe, rank 0's gradients" not in problems, problems


@pytest.mark.slow
def test_a_warm_up_on_the_wrong_end_of_the_pipeline_deadlocks_and_the_checker_says_where(tmp_path):
    # Rank 0 warms up with 0 forwards, rank 1 with 1: each then waits to receive from the other.
    mistaken = seeded(tmp_path, SOLUTION, (r"warmup = min\(STAGES - 1 - stage\.rank, microbatches\)",
                                           "warmup = min(stage.rank, microbatches)"))
    problems = checked(mistaken, tmp_path)
    assert re.search(r"with --schedule 1f1b the ranks hung, each waiting for the other: rank 0 waited for an irecv "
                     r"from rank 1 at line \d+ \(in backward: `dist\.irecv\(gradient, src=self\.rank \+ 1\)\.wait\(\)`"
                     r"\).*; rank 1 waited for an irecv from rank 0 at line \d+ \(in forward: .*A deadlock: each rank "
                     r"waits to receive", problems), problems
    assert "--schedule gpipe" not in problems, problems


# Programs learners wrote from the starting file (tests/independent/): a right one in another style passes (its loss
# divided by M inside loss_fn, its schedules lists of actions); a loss divided by M twice gets its verdict.
@pytest.mark.slow
@pytest.mark.parametrize("part, verdict", [
    ("pipeline_by_hand_actions.py", ""),
    ("pipeline_by_hand_divided_twice.py", "with --schedule gpipe and with --schedule 1f1b, the first step's gradients "
     "are 0.25 times one process's on every stage (1/M, M = 4): each micro-batch's loss was divided by M twice"),
], ids=["right: loss_fn divides by M, a loop of actions", "divided by M twice"])
def test_a_program_written_independently_gets_the_verdict_of_its_mistake(part, verdict, tmp_path):
    problems = checked(written(tmp_path, "exercises/10_pipeline_by_hand/start.py", part), tmp_path)
    assert problems.startswith(verdict) and "\n" not in problems, problems
    assert bool(problems) == bool(verdict), problems
