"""Exercise 7, DDP by hand: each verdict of exercises/07_ddp_by_hand/check.py on records made up here (a step's
all-reduces, waits, backward and optimizer step, as the recorder writes them), the reference the weights are compared
with, and (slow) the start file and seeded mistakes of the solution run for real, each reaching its own verdict."""
import re

import pytest
import torch

from exercises.check import exercise_checker
from mistakes import CHECKING, exercise_problems, seeded, written
from harness.jobs import REPO

ddp_by_hand = exercise_checker(7)  # exercises/07_ddp_by_hand/check.py
bucket_sizes, communication_problems, global_batches, steps_of, weights_problems = (
    ddp_by_hand.bucket_sizes, ddp_by_hand.communication_problems, ddp_by_hand.global_batches, ddp_by_hand.steps_of,
    ddp_by_hand.weights_problems)

pytestmark = CHECKING  # the slow tests run checks

SOLUTION = "exercises/07_ddp_by_hand/solution.py"
# A made-up model: 5 gradients whose buckets hold 100, 200 and 50 bytes (350 in all); in model.parameters() order they
# would make buckets of 120, 200 and 30.
EXPECTED = dict(buckets=[100, 200, 50], gradient_bytes=350, parameters=5, in_order=[120, 200, 30], first="0.weight")


def a_step(rank=0, step=0, buckets=(100, 200, 50), in_backward=(True, True, False), asynchronous=True, waited=True,
           waited_late=False, pid=None, late=False, written=False, waited_at_once=False, held=(), again=()):
    """The records of one optimizer step of one rank: backward from t to t + 10 ms, accumulating a gradient at t + 1,
    3, 5, 7 and 9 ms; an all-reduce per bucket (those `in_backward` started during it, at t + 0, 2, 4... ms, or all
    at t + 9.5 ms when `late`; the others after it), each waited on after backward (or never, or after the step
    began, or at once: `waited_at_once`), its buffer `written` before its wait or not; then the step at t + 20 ms,
    with the buffers of earlier steps' all-reduces (`held`: (seq, step) of each) still alive, and waits again on the
    all-reduces of sequence numbers `again`."""
    t, pid = 1000.0 + step, pid or 100 + rank
    rows, sequence = [], 1000 * step
    for index, (size, during) in enumerate(zip(buckets, in_backward)):
        began = t + (0.0095 + 0.0001 * index if late else 0.002 * index) if during else t + 0.011 + 0.001 * index
        rows.append(dict(pid=pid, rank=rank, restart=0, event="call", seq=sequence + index, op="all_reduce",
                         began=began, ended=began + 0.0001, asynchronous=asynchronous, bytes=[size],
                         in_backward=during, step=step, caller=None))
        if asynchronous and waited and waited_at_once and during:
            rows.append(dict(pid=pid, rank=rank, restart=0, event="wait", seq=sequence + index, began=began + 0.0002,
                             ended=began + 0.0005, step=step, written=False, again=False))
    rows.append(dict(pid=pid, rank=rank, restart=0, event="backward", began=t, ended=t + 0.010, step=step,
                     ready=[[t + 0.001 + 0.002 * k, 70] for k in range(5)]))
    if asynchronous and waited:
        for index in range(len(buckets)):
            began = t + (0.025 if waited_late else 0.015) + 0.001 * index
            rows.append(dict(pid=pid, rank=rank, restart=0, event="wait", seq=sequence + index, began=began,
                             ended=began + 0.0005, step=step, written=written, again=False))
    for seq in again:
        rows.append(dict(pid=pid, rank=rank, restart=0, event="wait", seq=seq, began=t + 0.018, ended=t + 0.0181,
                         step=step, written=False, again=True))
    rows.append(dict(pid=pid, rank=rank, restart=0, event="step", step=step, began=t + 0.020, params=350, grads=350,
                     held=[dict(seq=seq, step=when, op="all_reduce", caller=None, bytes=100) for seq, when in held]))
    return sorted(rows, key=lambda row: row.get("began", 0))


def two_ranks(**options):
    return [row for step in range(3) for rank in range(2) for row in a_step(rank, step, **options)]


def test_a_correct_runs_records_get_no_verdict():
    assert communication_problems(two_ranks(), EXPECTED) == []


def test_the_losss_all_reduce_before_the_next_backward_is_not_a_gradients():
    loss = dict(pid=100, rank=0, restart=0, event="call", seq=999, op="all_reduce", began=1000.5, ended=1000.6,
                asynchronous=False, bytes=[8], in_backward=False, step=1, caller=None)
    records = sorted(two_ranks() + [loss], key=lambda row: row.get("began", 0))
    assert [len(calls) for _, _, _, calls, _ in steps_of(records)] == [3] * 6
    assert communication_problems(records, EXPECTED) == []


def test_no_all_reduce_means_each_rank_trained_alone():
    # rank 1's records first, as when its process writes first: the verdict names rank 0 all the same
    [problem] = communication_problems(two_ranks(buckets=())[::-1], EXPECTED)
    assert problem.startswith("rank 0 all-reduced no gradient in its step 0: it stepped with the gradients of its own "
                              "batch only"), problem


def test_more_bytes_than_the_gradients_is_a_bucket_sent_twice():
    [problem] = communication_problems(two_ranks(buckets=(100, 200, 250), in_backward=(True, True, False)), EXPECTED)
    assert problem.startswith("rank 0 all-reduced 550 bytes in step 0, but the model's gradients are 350 bytes: some "
                              "were sent more than once"), problem


def test_fewer_bytes_than_the_gradients_is_a_last_bucket_never_sent():
    [problem] = communication_problems(two_ranks(buckets=(100, 200), in_backward=(True, True)), EXPECTED)
    assert problem.startswith("rank 0 all-reduced 300 bytes in step 0, but the model's gradients are 350 bytes: 50 "
                              "bytes of gradients were never averaged. After backward, finish() must send"), problem


def test_one_all_reduce_per_parameter_ignores_the_bucket_size():
    [problem] = communication_problems(two_ranks(buckets=(50, 50, 100, 100, 50), in_backward=(True,) * 5), EXPECTED)
    assert problem.startswith("rank 0 made one all-reduce per parameter (5) in step 0, whatever --bucket_mb says: "
                              "--bucket_mb 0.1 packs the 5 gradients, in the order they arrive, into 3 buckets (100, "
                              "200 and 50 bytes)"), problem


def test_one_bucket_for_everything_ignores_the_bucket_size():
    [problem] = communication_problems(two_ranks(buckets=(350,), in_backward=(True,)), EXPECTED)
    assert problem.startswith("rank 0 made one all-reduce for all the gradients in step 0, whatever "
                              "--bucket_mb says"), problem


def test_another_number_of_all_reduces_says_how_the_buckets_fill():
    [problem] = communication_problems(two_ranks(buckets=(100, 50, 50, 150), in_backward=(True, True, True, False)),
                                       EXPECTED)
    assert problem == ("rank 0's all-reduces of step 0 carried 100, 50, 50 and 150 bytes, in the order sent, but "
                       "--bucket_mb 0.1 packs the 5 gradients, in the order they arrive, into 3 buckets (100, 200 and "
                       "50 bytes), one all-reduce each"), problem


def test_all_reduces_after_backward_overlap_nothing():
    [problem] = communication_problems(two_ranks(in_backward=(False, False, False)), EXPECTED)
    assert re.fullmatch(r"rank 0's first all-reduce of step 0 began 2\.0 ms after backward had accumulated its last "
                        r"gradient: no all-reduce was in flight while backward computed gradients, so nothing "
                        r"overlapped the backward\. .*register_post_accumulate_grad_hook.*", problem), problem


def test_all_reduces_started_from_the_last_hook_inside_backward_overlap_nothing_either():
    """Called from a hook, asynchronously, before backward returned, but once every gradient was there: in flight
    while backward computed nothing."""
    [problem] = communication_problems(two_ranks(late=True, in_backward=(True, True, True)), EXPECTED)
    assert problem.startswith("rank 0's first all-reduce of step 0 began 0.5 ms after backward had accumulated its "
                              "last gradient: no all-reduce was in flight while backward computed gradients"), problem


def test_an_all_reduce_waited_on_inside_backward_blocks_it():
    [problem] = communication_problems(two_ranks(waited_at_once=True), EXPECTED)
    assert problem.startswith("rank 0's all-reduce in step 0 was waited on during backward, before backward had "
                              "accumulated another gradient: backward stops until it is done"), problem


def test_buckets_filled_in_parameter_order_are_told_from_the_arrival_order():
    [problem] = communication_problems(two_ranks(buckets=(30, 200, 120)), EXPECTED)
    assert problem.startswith("rank 0's all-reduces of step 0 carried 30, 200 and 120 bytes, in the order sent: "
                              "buckets filled in model.parameters() order (0.weight first), where backward hands the "
                              "gradients over from the last layer to the first. The bucket with the first layer's "
                              "gradients (120 bytes) can leave only once backward has computed its last gradient"), \
        problem
    [problem] = communication_problems(two_ranks(buckets=(200, 100, 50)), EXPECTED)
    assert problem == ("rank 0's all-reduces of step 0 carried 200, 100 and 50 bytes, in the order sent, but "
                       "--bucket_mb 0.1 packs the 5 gradients, in the order they arrive, into 3 buckets (100, 200 and "
                       "50 bytes), one all-reduce each"), problem


def test_a_buffer_written_before_its_wait_is_named_whatever_the_weights():
    [problem] = communication_problems(two_ranks(written=True), EXPECTED)
    assert problem.startswith("rank 0 wrote into the buffer of its all-reduce of 100 bytes in step 0 before waiting "
                              "for it: while an all-reduce is in flight, gloo reads the buffer"), problem
    assert weights_problems(weights(3.0), REFERENCE, structural=True, raced=True) == []


def test_buffers_of_earlier_steps_still_held_mean_a_list_never_emptied():
    records = [row for step in range(2) for rank in range(2)
               for row in a_step(rank, step, held=[(0, 0), (1, 0)] if step else (), again=(0, 1) if step else ())]
    [problem] = communication_problems(records, EXPECTED)
    assert problem.startswith("rank 0 still held, as its step 1 began, the buffers of 2 all-reduces of earlier steps "
                              "(200 bytes; the first of step 0) and waited again on 2 of them: the list of all-reduces "
                              "in flight is never emptied"), problem


def test_a_wait_again_after_the_step_does_not_hide_the_first_wait():
    records = two_ranks() + [dict(pid=100, rank=0, restart=0, event="wait", seq=0, began=1005.0, ended=1005.1,
                                  step=5, written=False, again=True)]
    assert communication_problems(records, EXPECTED) == []


def test_a_synchronous_all_reduce_in_a_hook_blocks_backward():
    [problem] = communication_problems(two_ranks(asynchronous=False), EXPECTED)
    assert problem.startswith("rank 0's all-reduce in step 0 runs during backward but synchronously: backward stops "
                              "until it is done"), problem


@pytest.mark.parametrize("options, when", [(dict(waited=False), "never waited on"),
                                           (dict(waited_late=True), "waited on only after optimizer.step() began")])
def test_an_all_reduce_not_waited_on_before_the_step(options, when):
    [problem] = communication_problems(two_ranks(**options), EXPECTED)
    assert problem.startswith(f"rank 0's asynchronous all-reduce of 100 bytes in step 0 was {when}: until "
                              "work.wait() returns"), problem


def test_buckets_fill_in_arrival_order_and_leave_once_full():
    sizes = [40, 5120, 512, 131072, 1024, 262144, 1024, 65536]  # the exercise's MLP, last layer first
    assert bucket_sizes(sizes, 0) == sizes
    assert bucket_sizes(sizes, 0.1) == [136744, 263168, 66560]
    assert bucket_sizes(sizes, 25) == [sum(sizes)]


def test_each_step_of_the_reference_is_both_ranks_batches_every_sample_once_an_epoch():
    batches = global_batches(640, epochs=2, batch_size=16, seed=0)
    assert len(batches) == 40 and {len(batch) for batch in batches} == {32}
    for epoch in (batches[:20], batches[20:]):
        assert sorted(index for batch in epoch for index in batch) == list(range(640))
    assert batches[:20] != batches[20:]  # set_epoch: a new shuffle


def weights(value):
    return {"0.weight": torch.full((2, 2), value), "0.bias": torch.full((2,), value)}


REFERENCE = dict(EXPECTED, weights={1.0: weights(1.0), 2.0: weights(2.0), 0.5: weights(0.5), 0.4: weights(0.4),
                                    2 / 3: weights(0.6)})


def test_the_right_weights_get_no_verdict():
    assert weights_problems(weights(1.0 + 1e-6), REFERENCE) == []


def test_weights_of_a_sum_name_the_wrong_divisor_even_beside_other_verdicts():
    for structural in (False, True):
        [problem] = weights_problems(weights(2.0), REFERENCE, structural)
        assert problem.startswith("rank 0's final weights are those of gradients 2 times the average: the script "
                                  "divides the summed gradients by nothing (1)"), problem
    [problem] = weights_problems(weights(0.4), REFERENCE)
    assert "divides the summed gradients by the number of parameters (5)" in problem, problem
    # A wrong divisor's training amplifies float rounding (another thread count in the reference): 2e-3 off the sum's
    # reference and 1.0 off the right one still names the sum.
    [problem] = weights_problems(weights(2.002), REFERENCE)
    assert "divides the summed gradients by nothing (1)" in problem, problem


def test_other_wrong_weights_are_said_to_differ_unless_another_verdict_explains_them():
    [problem] = weights_problems(weights(3.0), REFERENCE)
    assert problem.startswith("rank 0's final weights differ from those torch's DistributedDataParallel trains on "
                              "the same samples by up to 2"), problem
    assert weights_problems(weights(3.0), REFERENCE, structural=True) == []
    [problem] = weights_problems(None, REFERENCE)
    assert problem.startswith("rank 0 saved no weights to hand_ddp.pt"), problem


def test_the_reference_buckets_the_exercises_mlp_as_backward_hands_its_gradients_over():
    module = ddp_by_hand.exercise()
    order = ddp_by_hand.arrival_order(module)
    assert [name for name, _ in order][:2] == ["6.bias", "6.weight"]  # the last layer's first
    assert bucket_sizes([size for _, size in order], ddp_by_hand.BUCKET_MB) == [136744, 263168, 66560]


# --- run for real: the start file and seeded mistakes of the solution --------------------------------------------

def checked(path, tmp_path):
    return exercise_problems(7, path, tmp_path)


@pytest.mark.slow
def test_the_start_file_averages_nothing_and_the_checker_says_so(tmp_path):
    [problem] = checked(REPO / "exercises/07_ddp_by_hand/start.py", tmp_path)
    assert problem.startswith("rank 0 all-reduced no gradient in its step 0"), problem


# Stage 1 kept: no hooks, every bucket sent after backward (the same buckets, the right average).
AFTER_BACKWARD = [(r"parameter\.register_post_accumulate_grad_hook\(self\._gradient_ready\)",
                   "self.all_parameters = getattr(self, 'all_parameters', []) + [parameter]"),
                  (r"        if self\.bucket:\n",
                   "        for parameter in reversed(self.all_parameters):\n"
                   "            self._gradient_ready(parameter)\n        if self.bucket:\n")]
NO_WAIT = (r"\n *work\.wait\(\)", "")
PER_PARAMETER = (r"self\.bucket_bytes = bucket_mb \* 2\*\*20", "self.bucket_bytes = 0")
NOT_DIVIDED = (r"\n *flat /= self\.world_size", "")
# The bucket emptied only after backward, not as it leaves: each later bucket sends the earlier gradients again.
NEVER_EMPTIED = [(r"parameters, self\.bucket = self\.bucket, \[\]", "parameters = list(self.bucket)"),
                 (r"self\.in_flight = \[\]\n\n\ndef main", "self.in_flight, self.bucket = [], []\n\n\ndef main")]


@pytest.mark.slow
@pytest.mark.parametrize("edits, verdicts", [
    (AFTER_BACKWARD, [r"rank \d's first all-reduce of step 0 began [\d.]+ ms after backward had accumulated its "
                      r"last gradient \(line \d+ \(in _send_bucket: `work = dist\.all_reduce\(flat, "
                      r"async_op=True\)`\)\): no all-reduce was in flight while backward computed gradients, so "
                      r"nothing overlapped the backward"]),
    # independent mistakes share a run: one verdict each
    ([NO_WAIT, PER_PARAMETER], [r"rank \d made one all-reduce per parameter \(8\) in step 0, whatever --bucket_mb says",
                                r"rank \d's asynchronous all-reduce of [\d,]+ bytes in step 0 \(line \d+ \(in "
                                r"_send_bucket: `work = dist\.all_reduce\(flat, async_op=True\)`\)\) was never "
                                r"waited on"]),
    ([NOT_DIVIDED, *NEVER_EMPTIED], [r"rank \d all-reduced [\d,]+ bytes in step 0, but the model's gradients are "
                                    r"466,472 bytes: some were sent more than once",
                                    r"rank 0's final weights are those of gradients 2 times the average: the script "
                                    r"divides the summed gradients by nothing \(1\)"]),
], ids=["after backward", "no wait, per parameter", "not divided, bucket never emptied"])
def test_a_seeded_mistake_gets_its_own_verdict(edits, verdicts, tmp_path):
    edits = edits if isinstance(edits, list) else [edits]
    problems = checked(seeded(tmp_path, SOLUTION, *edits), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.match(verdict, problem), (verdict, problems)


# Programs learners wrote from the starting file (tests/independent/): right ones in other styles pass, each wrong one
# gets the verdicts of its mistakes (two independent mistakes share a run).
@pytest.mark.slow
@pytest.mark.parametrize("part, verdicts", [
    ("ddp_by_hand_flat_buffer_futures.py", []),
    ("ddp_by_hand_parameter_order.py", [
        r"rank 0's all-reduces of step 0 carried 5,672, 132,096 and 328,704 bytes, in the order sent: buckets filled "
        r"in model\.parameters\(\) order \(0\.weight first\).* The bucket with the first layer's gradients \(328,704 "
        r"bytes\) can leave only once backward has computed its last gradient, so it overlaps nothing\. --bucket_mb "
        r"0\.1 packs the 8 gradients, in the order they arrive, into 3 buckets \(136,744, 263,168 and 66,560 bytes\)",
        r"rank 0 still held, as its step 1 began, the buffers of 3 all-reduces of earlier steps \(466,472 bytes; the "
        r"first of step 0 \(line \d+ \(in grad_ready: `self\.pending\.append\(\(dist\.all_reduce\(buffer, "
        r"async_op=True\), buffer, group\)\)`\)\)\) and waited again on 3 of them: the list of all-reduces in flight "
        r"is never emptied"]),
    ("ddp_by_hand_late_and_in_flight.py", [
        r"rank 0's first all-reduce of step 0 began [\d.]+ ms after backward had accumulated its last gradient \(line "
        r"\d+ \(in send: `work = dist\.all_reduce\(flat, async_op=True\)`\)\): no all-reduce was in flight while "
        r"backward computed gradients",
        r"rank 0 wrote into the buffer of its all-reduce of 136,744 bytes in step 0 \(line \d+ \(in send: `work = "
        r"dist\.all_reduce\(flat, async_op=True\)`\)\) before waiting for it \(line \d+ \(in finish: "
        r"`work\.wait\(\)`\)\): while an all-reduce is in flight"]),
], ids=["right: a flat buffer, futures", "buckets in parameter order, a list never emptied",
        "sent after backward, divided in flight"])
def test_a_program_written_independently_gets_the_verdicts_of_its_mistakes(part, verdicts, tmp_path):
    problems = checked(written(tmp_path, "exercises/07_ddp_by_hand/start.py", part), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.match(verdict, problem), (verdict, problems)
