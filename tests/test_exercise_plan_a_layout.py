"""Exercise 13, plan a layout: the checker's verdicts. Those that stop before the planner runs (a number missing, tp
across nodes, a layout one_mesh.py refuses) on learners' files written here; the memory and speed verdicts on plans
made up here, each side of its line; the starting file through the planner for real (its last pipeline rank over the
85% line). The solution passing through the planner is tests/test_exercise_runs.py's."""
import warnings

import pytest

from exercises.check import exercise_checker
from mistakes import exercise_problems
from harness.jobs import REPO

plan_a_layout = exercise_checker(13)  # exercises/13_plan_a_layout/check.py

GiB = 2**30


def learner_file(tmp_path, pp=2, tp=2, microbatches=8, checkpoint="False", extra=""):
    path = tmp_path / "my_layout.py"
    path.write_text(f"PP = {pp}\nTP = {tp}\nMICROBATCHES = {microbatches}\nCHECKPOINT_ACTIVATIONS = {checkpoint}\n"
                    f"{extra}")
    return path


@pytest.mark.parametrize("values, verdict", [
    (dict(pp="None"), "PP must be a positive whole number, got None: set it at the top of the file"),
    (dict(tp="True"), "TP must be a positive whole number, got True: set it at the top of the file"),
    (dict(microbatches=0), "MICROBATCHES must be a positive whole number, got 0: set it at the top of the file"),
    (dict(checkpoint="1"), "CHECKPOINT_ACTIVATIONS must be True or False, got 1: set it at the top of the file"),
])
def test_a_number_missing_or_of_the_wrong_kind_is_named(tmp_path, values, verdict):
    assert exercise_problems(13, learner_file(tmp_path, **values), tmp_path) == [verdict]


def test_tensor_parallelism_across_nodes_and_a_layout_one_mesh_refuses_are_named_before_any_planning(tmp_path):
    for folder in "abc":
        (tmp_path / folder).mkdir()
    [across] = exercise_problems(13, learner_file(tmp_path, pp=1, tp=16, microbatches=1), tmp_path / "a")
    assert across.startswith("TP = 16 spans 2 nodes of 8 GPUs: tensor parallelism's all-gathers"), across
    [grid] = exercise_problems(13, learner_file(tmp_path, pp=3, tp=1, microbatches=3), tmp_path / "b")
    assert grid == ("--world 16 is not a whole number of pp x tp x ep = 3 grids: one_mesh.py would stop on it"), grid
    [rounds] = exercise_problems(13, learner_file(tmp_path, pp=2, tp=2, microbatches=1), tmp_path / "c")
    assert rounds == "--microbatches 1 must be a multiple of --pp 2 (rounds of pp): one_mesh.py would stop on it"


def estimate(step, bubble=0.0, exposed=0.0, compute=1.0, mfu=0.5):
    return dict(step=step, bubble=bubble, exposed=exposed, compute=compute, mfu=mfu, flops=compute * 989e12,
                links={"dp": "network", "tp": "nvlink"}, sent={"dp": 2 * GiB, "tp": 10 * GiB})


def rank(number, peak, step=1.0, **figures):
    return dict(rank=number, where=f"pp {number}", peak=peak, params=GiB, grads=GiB, optim=2 * GiB,
                activations=10 * GiB, estimate=estimate(step, **figures))


def test_a_rank_over_85_percent_of_the_gpu_is_named_with_what_fills_it_and_one_under_is_not():
    line = plan_a_layout.USABLE
    over = dict(plans=[rank(0, line - 1), rank(14, line + GiB)], args=dict(microbatches=8))
    [verdict] = plan_a_layout.fit_problems(over)
    assert verdict.startswith(f"rank 14 (pp 14) peaks at {(line + GiB) / GiB:.1f} GiB (torch's MemTracker"), verdict
    assert "weights' shards, their gradients and AdamW's state are 4.0 GiB" in verdict
    # The step's 10 GiB of activations over its 8 micro-batches: what one holds, not all at once.
    assert "autograd keeps 1.2 GiB for backward a micro-batch (of the 8 a step" in verdict
    assert "Recompute each block (CHECKPOINT_ACTIVATIONS)" in verdict
    assert plan_a_layout.fit_problems(dict(plans=[rank(0, line), rank(14, line - GiB)],
                                           args=dict(microbatches=8))) == []


def test_a_step_below_90_percent_of_the_best_mfu_is_named_with_what_it_loses_most_to():
    best = dict(mfu=0.8)
    slow = dict(plans=[rank(0, GiB, step=1.8, bubble=0.44, exposed=0.36, compute=1.0, mfu=0.5)])
    [verdict] = plan_a_layout.speed_problems(slow, best)
    assert verdict.startswith("a step takes 1.80 s at best (MFU 50%), and the best layout that fits reaches 80%"), \
        verdict
    assert "Most of what it loses is the pipeline's bubble (0.44 s a step" in verdict
    exposed = dict(plans=[rank(0, GiB, step=1.8, bubble=0.1, exposed=0.7, compute=1.0, mfu=0.5)])
    assert "the communication the compute does not hide (0.70 s" in plan_a_layout.speed_problems(exposed, best)[0]
    assert plan_a_layout.speed_problems(dict(plans=[rank(0, GiB, mfu=0.73)]), best) == []  # over 90% of 0.8


@pytest.mark.slow  # the memory plan of every layout of 16 GPUs: 7 s of CPU
def test_the_best_layout_is_the_repositorys_arithmetic_and_fits_with_tp_in_a_node():
    best = plan_a_layout.best_layout()
    assert best["layout"]["tp"] <= 8 and best["layout"]["pp"] * best["layout"]["dp"] * best["layout"]["tp"] == 16
    assert best["total"] <= plan_a_layout.USABLE


@pytest.mark.slow
def test_the_starting_file_peaks_over_the_line_on_its_last_pipeline_rank(tmp_path):
    """pp 8 x dp 2 x tp 1, no recomputation: the planner traces ranks 0 and 14, and rank 14 (the head, the logits of
    every micro-batch) passes 85% of an H100. The planner says nothing else: FSDP's warning about views under the
    collectives' counting, which the learner can do nothing about, is silenced where the planner traces."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        problems = exercise_problems(13, REPO / "exercises/13_plan_a_layout/start.py", tmp_path)
    assert len(problems) == 1 and problems[0].startswith("rank 14 (pp 7, dp 0, tp 0) peaks at "), problems
    assert [str(warning.message) for warning in warned] == []
