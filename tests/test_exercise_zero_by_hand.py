"""Exercise 8 (ZeRO by hand): each verdict of its checker on records made up here (no processes), then the checker run
for real on the starting file and on the solution with a learner's mistake seeded in. (The solution passing is
tests/test_exercise_runs.py's.)"""
import re
import types

import pytest
import torch

from exercises.check import exercise_checker
from mistakes import CHECKING, exercise_problems, seeded, written
from harness.jobs import REPO

checker = exercise_checker(8)  # exercises/08_zero_by_hand/check.py
(averaging_problems, communication_problems, crash_problems, gradient_problems, merged, state_problems,
 weights_problems) = (
    checker.averaging_problems, checker.communication_problems, checker.crash_problems, checker.gradient_problems,
    checker.merged, checker.state_problems, checker.weights_problems)

pytestmark = CHECKING  # the slow tests run checks

STEPS = 40
SOLUTION = "exercises/08_zero_by_hand/solution.py"
NUMEL, SHARD = 339, 170  # the exercise's model: 339 parameters, two shards of 170 (one zero of padding)


@pytest.fixture(scope="module")
def expected():
    """One process's AdamW on the whole global batch (no process started: the solution's model and data)."""
    return checker.reference(STEPS)


@pytest.fixture
def script(tmp_path):
    """A learner's script, as far as the verdicts quote it (line 5: the all-reduce, line 9: the all-gather)."""
    path = tmp_path / "my_zero.py"
    lines = {5: "        dist.all_reduce(flat_grad)", 9: "        ALL_GATHER(gathered, self.shard.detach())"}
    path.write_text("\n".join(lines.get(number, "") for number in range(1, 12)) + "\n")
    return path


def optimizer_rows(params=4 * SHARD, grads=4 * SHARD, state=8 * SHARD, steps=STEPS):
    """collectives.jsonl's "step" and "stepped" events of both ranks, each stepping tensors of `params` bytes."""
    rows = []
    for step in range(steps):
        for rank in (0, 1):
            rows.append(dict(rank=rank, event="step", step=step, params=params, grads=grads))
            rows.append(dict(rank=rank, event="stepped", step=step, state=state))
    return rows


def plugin_rows(expected, flat_of=None, digest_of=None, held=4 * SHARD, squares=None):
    """zero_by_hand.jsonl of both ranks: rank 0's parameters as each step begins (one process's, unless
    `flat_of(step)` says otherwise), the digests (equal unless `digest_of(rank, step)`), the gradient bytes held."""
    squares = squares or (expected["grad_square"] / 2, expected["grad_square"] / 2)
    rows = []
    for step in range(STEPS):
        flat = flat_of(step) if flat_of else expected["trained"][step]
        for rank in (0, 1):
            rows.append(dict(rank=rank, step=step, held_grads=held, stepped_grad_square=squares[rank],
                             params=digest_of(rank, step) if digest_of else f"after {step}",
                             flat=flat.tolist() if rank == 0 else None))
    return rows


def final(flat, expected):
    """The saved state_dict of a model whose flat parameters are `flat`."""
    weights, offset = {}, 0
    for name, size in zip(expected["names"], expected["sizes"]):
        weights[name] = flat[offset:offset + size].float()
        offset += size
    return weights


def calls(*kinds, steps=STEPS):
    """collectives.jsonl's calls of rank 0 and 1: each kind (op, bytes, line of the script) once a step."""
    rows = []
    for step in range(steps):
        for rank in (0, 1):
            for op, size, line in kinds:
                rows.append(dict(rank=rank, event="call", op=op, bytes=[size] if op == "all_reduce" else
                                 [size // 2, size] if op.startswith("reduce") else [size, size // 2], step=step,
                                 caller=[line[0], line[1], "step"]))
            rows.append(dict(rank=rank, event="stepped", step=step, state=8 * SHARD))
    return rows


def test_a_correct_runs_records_get_no_verdict(expected, script):
    trained = expected["trained"]
    assert weights_problems(final(trained[-1], expected), plugin_rows(expected), expected, 1) == []
    assert averaging_problems(optimizer_rows(), plugin_rows(expected), expected, 1) == []
    assert state_problems(optimizer_rows(), expected, 1) == []
    assert gradient_problems(plugin_rows(expected), expected) == []
    padded = 4 * 2 * SHARD
    assert communication_problems(calls(("reduce_scatter_single", padded, (str(script), 5)),
                                        ("all_gather_single", padded, (str(script), 9))), expected, script, 1) == []


def test_a_whole_adamw_on_every_rank_is_named_by_its_bytes(expected):
    [problem] = state_problems(optimizer_rows(params=4 * NUMEL, state=8 * NUMEL), expected, 1)
    assert problem.startswith("with --stage 1, ranks 0 and 1 each held 2,712 bytes of optimizer state as they "
                              "stepped (the whole model's: every rank keeps a full AdamW"), problem
    assert "at most 1,360 bytes (2 x 170 x 4, a shard of the padded flat vector)" in problem
    overlapping = optimizer_rows(state=8 * (SHARD + 10))
    assert "more than its shard's: the ranks' shards overlap" in state_problems(overlapping, expected, 1)[0]
    assert state_problems([], expected, 2)[0].startswith("with --stage 2, no optimizer ever stepped")


def test_zero_2_that_keeps_the_models_gradients_is_named_by_their_bytes(expected):
    [problem] = gradient_problems(plugin_rows(expected, held=4 * (NUMEL + SHARD)), expected)
    assert problem.startswith("with --stage 2, ranks 0 and 1 each held 2,036 bytes of gradients as they stepped"), \
        problem
    assert problem.endswith("free the rest before the step: p.grad = None for every parameter of the model")


def test_gradients_held_off_every_grad_are_named_by_what_holds_them(expected, script):
    """A flat gradient kept in an attribute or a variable, given to the reduce-scatter at line 5: no .grad holds it,
    but it is held as the step begins."""
    rows = plugin_rows(expected, held=4 * (2 * SHARD + SHARD))
    for row in rows:
        row["holders"] = [dict(bytes=8 * SHARD, what="collective", op="reduce_scatter_tensor",
                               caller=[str(script), 5, "step"]), dict(bytes=4 * SHARD, what="grad")]
    [problem] = gradient_problems(rows, expected, script=script)
    assert problem.startswith("with --stage 2, ranks 0 and 1 each held 2,040 bytes of gradients as they stepped (the "
                              "memory of every tensor that holds a gradient, wherever it is held; a slice keeps its "
                              "whole tensor alive: 1,360 given to reduce_scatter_tensor at line 5 (in step: "
                              "`dist.all_reduce(flat_grad)`), still held (a variable, an attribute); 680 in a .grad). "
                              "ZeRO-2 keeps its shard's only: 680 bytes (170 x 4)"), problem


def test_a_sum_of_the_ranks_gradients_is_told_from_their_average(expected):
    summed = plugin_rows(expected, squares=(2 * expected["grad_square"], 2 * expected["grad_square"]))
    [problem] = averaging_problems(optimizer_rows(), summed, expected, 2)
    assert problem.startswith("with --stage 2, the gradient the ranks stepped with at the first step is the sum of "
                              "the ranks' gradients, not their average: its squared norm is 4.00 times"), problem
    # A rank that steps the whole model (no shard) is compared on its own: the average, on every rank, is right.
    whole = plugin_rows(expected, squares=(expected["grad_square"], expected["grad_square"]))
    assert averaging_problems(optimizer_rows(params=4 * NUMEL), whole, expected, 1) == []
    local = plugin_rows(expected, squares=(expected["grad_square"], 0.5 * expected["grad_square"]))
    assert "1.500 times the squared norm of the average" in averaging_problems(optimizer_rows(), local, expected, 1)[0]


def test_a_missing_all_gather_shows_as_ranks_that_differ_and_the_shard_that_never_reached_rank_0(expected):
    trained = expected["trained"]

    def rank_0s(step):  # its own shard trained, rank 1's left as it began
        return trained[step][:SHARD].tolist() + trained[0][SHARD:].tolist()

    rows = plugin_rows(expected, flat_of=lambda step: torch.tensor(rank_0s(step), dtype=torch.float64),
                       digest_of=lambda rank, step: f"rank {rank} after {step}" if step else "start")
    [problem] = weights_problems(final(torch.tensor(rank_0s(STEPS)), expected), rows, expected, 1)
    assert problem.startswith(
        "with --stage 1, the ranks held different models after step 1 (their parameters differ as the next step "
        "begins): each rank updated its own shard only. On rank 0, step 1 left parameters 170 to 338 of the flat 339 "
        "(in 0.weight, 0.bias, 2.weight and 2.bias) unchanged: rank 1's shard, updated on its owner only."), problem


def test_a_parameter_no_shard_holds_and_a_shard_laid_out_one_off_are_named_by_their_place(expected):
    trained = expected["trained"]

    def last_kept(step):
        return torch.cat([trained[step][:-1], trained[0][-1:]])

    [problem] = weights_problems(final(last_kept(STEPS), expected), plugin_rows(expected, flat_of=last_kept),
                                 expected, 2)
    assert problem.startswith("with --stage 2, step 1 left parameter 338 of the flat 339 (in 2.bias) unchanged, "
                              "where AdamW in one process moved them: no rank's shard held them"), problem

    def shifted(step):  # rank 1's shard, one element late from step 1 on
        return trained[step] if step == 0 else torch.cat([trained[step][:SHARD], trained[step][SHARD - 1:-1]])

    [problem] = weights_problems(final(shifted(STEPS), expected), plugin_rows(expected, flat_of=shifted), expected, 1)
    assert re.match(r"with --stage 1, after step 1 rank 0's weights differ from AdamW's in one process on the whole "
                    r"global batch \(by up to [0-9.e-]+\) at parameters 170 to 338 of the flat 339 \(in 0\.weight, "
                    r"0\.bias, 2\.weight and 2\.bias\): rank 1's shard", problem), problem
    assert weights_problems(None, [], expected, 1)[0].startswith("with --stage 1, rank 0 saved no weights.pt")


def test_an_all_reduce_before_the_all_gather_is_counted_as_half_as_much_traffic_again(expected, script):
    padded = 4 * 2 * SHARD
    [problem] = communication_problems(calls(("all_reduce", padded, (str(script), 5)),
                                             ("all_gather_single", padded, (str(script), 9))), expected, script, 2)
    assert problem.startswith("with --stage 2, rank 0 moved 2,040 bytes a step (1.50 Psi, Psi = 1,360 bytes"), problem
    assert ("Here: all_reduce at line 5 (in step: `dist.all_reduce(flat_grad)`): 40 calls, 1,360 bytes a step; "
            "all_gather_single at line 9 (in step: `ALL_GATHER(gathered, self.shard.detach())`): 40 calls, 680 bytes "
            "a step.") in problem
    assert problem.endswith("reduce-scatter the flat gradient instead (reduce_scatter_tensor, or "
                            "reduce_scatter_single)")


def test_a_flat_vector_that_does_not_cut_into_equal_shards_is_named_when_it_crashes(expected, script):
    job = types.SimpleNamespace(timed_out=False, codes=[1, 1], output=(
        f'Traceback (most recent call last):\n  File "{script}", line 9, in step\nRuntimeError: split_with_sizes '
        "expects split_sizes to sum exactly to 338 (input tensor's size at dimension 0), but got split_sizes=[240, "
        "24, 72, 3]\n"))
    [problem] = crash_problems(job, script, expected)
    assert problem.startswith("the flat vector of 339 parameters does not cut into 2 equal shards (339 = 2 x 169 + "
                              "1), and the collectives need equal ones: pad it with zeros to 2 x 170 = 340"), problem
    assert "It exited with code 1, at line 9 (in step: `ALL_GATHER(gathered, self.shard.detach())`)" in problem
    job.output = ('[rank0]: RuntimeError: [rank0]:[F1126 09:25:36.667463069 ProcessGroupGloo.cpp:1583] Check failed: '
                  'outputShape[0] * worldSize == inputShape[0] (340 vs. 339).\n')
    assert crash_problems(job, script, expected)[0].startswith("the flat vector of 339 parameters does not cut")
    job.output = "RuntimeError: something else\n"
    assert crash_problems(job, script, expected)[0].startswith("it exited with code 1")


def test_a_verdict_both_stages_got_is_said_once():
    both = merged({1: ["with --stage 1, A", "with --stage 1, B"], 2: ["with --stage 2, A", "with --stage 2, C"]})
    assert both == ["with --stage 1 and with --stage 2, A", "with --stage 1, B", "with --stage 2, C"]


# --- the checker run for real: the starting file, and seeded mistakes of the solution ---------------------------

NO_ALL_GATHER = (r"gathered = torch\.empty\(self\.padded_numel\)\n"
                 r"        ALL_GATHER\(gathered, self\.shard\.detach\(\)\)",
                 "gathered = self.padded(torch.cat([p.detach().reshape(-1) for p in self.params]))\n"
                 "        gathered[self.start:self.start + self.shard_size] = self.shard.detach()")
ALL_REDUCE_SUMMED = (r"shard_grad = torch\.empty\(self\.shard_size\)\n        REDUCE_SCATTER\(shard_grad, flat_grad\)\n"
                     r"        shard_grad /= self\.world_size\n        self\.shard\.grad = shard_grad",
                     "dist.all_reduce(flat_grad)\n        self.shard.grad = flat_grad[self.start:self.start + "
                     "self.shard_size]")
START_OFF_BY_ONE = (r"self\.start = self\.rank \* self\.shard_size",
                    "self.start = self.rank * (self.numel // self.world_size)")
GRADIENTS_KEPT = (r"\n            for p in self\.params:\n                p\.grad = None", "")
NOT_PADDED = (r"self\.shard_size = \(self\.numel \+ self\.world_size - 1\) // self\.world_size",
              "self.shard_size = self.numel // self.world_size")


def checked(path, tmp_path, stages=(1, 2)):
    original = checker.STAGES
    checker.STAGES = stages
    try:
        return exercise_problems(8, path, tmp_path)
    finally:
        checker.STAGES = original


@pytest.mark.slow
def test_the_starting_file_trains_right_but_keeps_a_whole_adamw_and_every_gradient(tmp_path):
    state, gradients = checked(REPO / "exercises/08_zero_by_hand/start.py", tmp_path)
    assert state.startswith("with --stage 1 and with --stage 2, ranks 0 and 1 each held 2,712 bytes of optimizer "
                            "state as they stepped (the whole model's"), state
    # Three copies of the model's 339 gradients (1,356 bytes): the parameters' .grad, the flat vector all_reduce
    # filled, still a variable at the step, and the shard's .grad, a slice of it divided into a tensor of its own.
    assert gradients.startswith("with --stage 2, ranks 0 and 1 each held 4,068 bytes of gradients"), gradients
    assert "given to all_reduce at line" in gradients and "dist.all_reduce(flat_grad)" in gradients, gradients


# The wrong solutions run --stage 2 only: its run is judged on all that --stage 1's is, and on the gradients besides.

@pytest.mark.slow
def test_a_solution_without_its_all_gather_trains_ranks_apart(tmp_path):
    [problem] = checked(seeded(tmp_path, SOLUTION, NO_ALL_GATHER), tmp_path, stages=(2,))
    assert re.match(r"with --stage 2, the ranks held different models after step 1 .* On rank 0, step 1 left "
                    r"parameters 170 to 338 of the flat 339 .* unchanged: rank 1's shard", problem), problem


@pytest.mark.slow
def test_an_all_reduced_and_summed_gradient_is_counted_and_named(tmp_path):
    summed, gradients, traffic = checked(seeded(tmp_path, SOLUTION, ALL_REDUCE_SUMMED), tmp_path, stages=(2,))
    assert "is the sum of the ranks' gradients, not their average" in summed, summed
    assert re.match(r"with --stage 2, rank \d moved 2,04\d bytes a step \(1\.50 Psi.* Here: all_reduce at line \d+ "
                    r"\(in step: `dist\.all_reduce\(flat_grad\)`\)", traffic), traffic
    # the optimizer's gradient, a slice of the whole flat one, keeps all of it alive
    assert gradients.startswith("with --stage 2, ranks 0 and 1 each held 1,360 bytes of gradients"), gradients


@pytest.mark.slow
def test_a_shard_one_off_and_gradients_kept_are_named(tmp_path):
    weights, gradients = checked(seeded(tmp_path, SOLUTION, START_OFF_BY_ONE, GRADIENTS_KEPT), tmp_path, stages=(2,))
    assert re.match(r"with --stage 2, after step 1 rank 0's weights differ .* at parameters 170 to 338 of the flat "
                    r"339 .*: rank 1's shard", weights), weights
    assert gradients.startswith("with --stage 2, ranks 0 and 1 each held 2,036 bytes of gradients"), gradients


@pytest.mark.slow
def test_a_flat_vector_not_padded_is_named_when_it_crashes(tmp_path):
    [problem] = checked(seeded(tmp_path, SOLUTION, NOT_PADDED), tmp_path, stages=(2,))
    assert problem.startswith("with --stage 2, the flat vector of 339 parameters does not cut into 2 equal shards"), \
        problem
    assert "split_with_sizes expects split_sizes to sum exactly to 338" in problem


# Programs learners wrote from the starting file (tests/independent/): a right one with the list forms of the
# collectives passes; the gradient all-reduced into a buffer the optimizer keeps is traffic of 3 Psi and, in ZeRO-2,
# gradient memory held at the step.
@pytest.mark.slow
@pytest.mark.parametrize("part, verdicts", [
    ("zero_by_hand_chunks.py", []),
    ("zero_by_hand_all_reduced_buffer.py", [
        r"with --stage 1 and with --stage 2, rank \d moved 2,04\d bytes a step \(1\.50 Psi.* Here: all_reduce at line "
        r"\d+ \(in step: `dist\.all_reduce\(self\.flat_grad\)`\)",
        r"with --stage 2, ranks 0 and 1 each held 2,040 bytes of gradients as they stepped \(.*: 1,360 given to "
        r"all_reduce at line \d+ \(in step: `dist\.all_reduce\(self\.flat_grad\)`\), still held"]),
], ids=["right: list forms, chunks", "all-reduced into a buffer kept"])
def test_a_program_written_independently_gets_the_verdicts_of_its_mistakes(part, verdicts, tmp_path):
    problems = checked(written(tmp_path, "exercises/08_zero_by_hand/start.py", part), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.match(verdict, problem), (verdict, problems)
