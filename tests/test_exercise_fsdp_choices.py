"""Exercise 9, FSDP's choices: each verdict of exercises/09_fsdp_choices/check.py on records made up here (the units,
peaks and fully_shard calls its recorder.py writes), the reference the training is compared with,
and (slow) the start file and seeded mistakes of the solution run for real, each reaching its own verdict."""
import re

import pytest

from exercises.check import exercise_checker
from mistakes import CHECKING, exercise_problems, seeded, written
from harness.jobs import REPO

fsdp_choices = exercise_checker(9)  # exercises/09_fsdp_choices/check.py
(global_batches, granularity_problems, model_facts, order_problems, peak_problems, plain_problems, records_problems,
 reference, result_problems, step_losses) = (
    fsdp_choices.global_batches, fsdp_choices.granularity_problems, fsdp_choices.model_facts,
    fsdp_choices.order_problems, fsdp_choices.peak_problems, fsdp_choices.plain_problems, fsdp_choices.records_problems,
    fsdp_choices.reference, fsdp_choices.result_problems, fsdp_choices.step_losses)

pytestmark = CHECKING  # the slow tests run checks

SOLUTION = "exercises/09_fsdp_choices/solution.py"
# A made-up model: the root's own parameters 10 bytes, 4 blocks of 100: the bound is 10 + 2 * 100.
FACTS = dict(blocks=4, block=100, root_own=10, whole=410, bound=210, gathers=9, root_names=["embed", "head", "norm"])
ROOT_PARAMS = ["embed.weight", "norm.weight", "head.weight"]


def block_params(block, *modules):
    return [f"blocks.{block}.{module}.weight" for module in modules or ("norm", "up", "down")]


def a_unit(module, params, size, gathers=2, resharded=True):
    return dict(module=module, params=params, bytes=size, gathers=gathers, resharded_in_forward=resharded)


def right_units():
    """The solution's units: each block (gathered in forward and again in backward), then the root (once)."""
    return [a_unit("", ROOT_PARAMS, 10, gathers=1, resharded=False),
            *(a_unit(f"blocks.{block}", block_params(block), 100) for block in range(4))]


def steps(units=None, forward=110, backward=210, plain=0, total=410, at_peak=("", "blocks.3", "blocks.2")):
    """Three steps of two ranks, as the plugin writes them."""
    units = right_units() if units is None else units
    return [dict(pid=100 + rank, rank=rank, restart=0, event="step", step=step, units=units,
                 peaks=dict(forward=forward, backward=backward),
                 at_peak=dict(forward=list(at_peak[:2]), backward=list(at_peak)), plain=plain, total=total)
            for step in range(3) for rank in range(2)]


def judged(records):
    return plain_problems(records, FACTS) + peak_problems(records, FACTS) + granularity_problems(records, FACTS)


def test_the_bound_is_the_roots_own_parameters_and_two_blocks():
    module = fsdp_choices.exercise()
    model = module.build_model(20)
    facts = model_facts(model)
    own = sum(param.nbytes for name, param in model.named_parameters() if not name.startswith("blocks."))
    block = sum(param.nbytes for param in model.blocks[0].parameters())
    assert (facts["root_own"], facts["block"], facts["blocks"]) == (own, block, len(model.blocks))
    assert facts["bound"] == own + 2 * block < facts["whole"]
    assert facts["root_names"] == ["embed", "head", "norm"]


def test_a_correct_runs_records_get_no_verdict():
    assert judged(steps()) == []


def test_the_root_as_the_only_unit_holds_every_block_at_once():
    units = [a_unit("", ROOT_PARAMS + [name for block in range(4) for name in block_params(block)], 410, gathers=1,
                    resharded=False)]
    [problem] = judged(steps(units, forward=410, backward=410, at_peak=("",)))
    assert problem.startswith("rank 0 held parameters whole at once: 0.4 KiB in forward and 0.4 KiB in backward, "
                              "over the bound of 0.2 KiB (the root's own parameters, 0.0 KiB, and two blocks of "
                              "0.1 KiB"), problem
    assert "the root is one unit that holds the parameters of blocks 0, 1, 2 and 3" in problem, problem
    assert problem.endswith("fully_shard(block, mesh=mesh) for each block, before fully_shard(model, mesh=mesh)")


def test_blocks_that_stay_whole_after_their_forward_are_named_with_reshard_after_forward():
    units = [{**unit, "gathers": 1, "resharded_in_forward": unit["module"] == ""} for unit in right_units()]
    [problem] = judged(steps(units, forward=410, backward=410))
    assert re.search(r"\): `blocks\.0`, `blocks\.1`, `blocks\.2` and `blocks\.3` stayed whole from their forward "
                     r"until their backward \(reshard_after_forward=False\)", problem), problem


def test_only_a_phase_over_the_bound_is_named():
    [problem] = judged(steps(forward=110, backward=310, at_peak=("", "blocks.3", "blocks.2", "blocks.1")))
    assert problem.startswith("rank 0 held parameters whole at once: 0.3 KiB in backward, over"), problem
    assert problem.endswith("the units whole then: the root, blocks.3, blocks.2 and blocks.1"), problem


def test_a_block_left_in_the_roots_unit_is_named_not_the_root():
    units = [a_unit("", ROOT_PARAMS + block_params(3), 110, gathers=1, resharded=False),
             *(a_unit(f"blocks.{block}", block_params(block), 100) for block in range(3))]
    [problem] = judged(steps(units, forward=310, backward=310, at_peak=("", "blocks.0", "blocks.1")))
    assert problem.startswith("rank 0 held parameters whole at once: 0.3 KiB in forward and 0.3 KiB in backward, over "
                              "the bound of 0.2 KiB"), problem
    assert problem.endswith("`blocks.3` is not a unit of its own: its parameters (0.1 KiB) went into the root's unit, "
                            "which holds them whole whenever it is whole (the root's, from its forward until its "
                            "backward), beside the blocks gathered one by one. Call "
                            "fully_shard(model.blocks[3], mesh=mesh) too: every block, before the root"), problem


def test_blocks_that_are_roots_of_their_own_keep_their_parameters_until_backward():
    units = [a_unit("", block_params(0), 100, gathers=1, resharded=False) for _ in range(4)]
    problems = judged(steps(units, forward=400, backward=400, plain=10))
    assert problems[0].startswith("0.0 KiB of the parameters the optimizer steps are not sharded (the root's own: "
                                  "embed, head, norm): no unit holds them"), problems
    assert problems[1].endswith("4 units are roots of their own (the model around them was not sharded), and FSDP "
                                "keeps a root's parameters whole from its forward until its backward: shard the "
                                "model too, after the blocks"), problems


def test_an_optimizer_of_the_parameters_before_sharding_steps_no_shard():
    [problem] = plain_problems(steps(plain=410), FACTS)
    assert problem.startswith("the optimizer steps none of FSDP's sharded parameters"), problem
    [problem] = plain_problems(steps(plain=7), FACTS)
    assert "(parameters outside every unit)" in problem, problem


def test_units_finer_than_a_block_count_their_all_gathers():
    units = [a_unit("", ROOT_PARAMS + [f"blocks.{block}.norm.weight" for block in range(4)], 10, gathers=1,
                    resharded=False),
             *(a_unit(f"blocks.{block}.{linear}", block_params(block, linear), 50)
               for block in range(4) for linear in ("up", "down"))]
    [problem] = judged(steps(units, forward=60, backward=110))
    assert problem.startswith("the units are finer than the blocks: block 0 is split into 3 units (the root, "
                              "`blocks.0.up` and `blocks.0.down`), and rank 0 gathered 17 units a step where one "
                              "unit per block gathers 9"), problem


def test_a_block_sharded_after_the_root_that_took_its_parameters():
    script = REPO / SOLUTION
    line = next(number for number, text in enumerate(script.read_text().splitlines(), 1)
                if "fully_shard(block" in text)
    calls = [dict(pid=100, rank=0, restart=0, event="shard", module="ResidualMLP", params=30, sharded_already=0,
                  reshard_after_forward=None, caller=[str(script), line + 3, "shard"]),
             dict(pid=100, rank=0, restart=0, event="shard", module="Block", params=6, sharded_already=6,
                  reshard_after_forward=None, caller=[str(script), line, "shard"])]
    [problem] = order_problems(calls, script)
    assert problem.startswith(f"fully_shard(Block) at line {line} (in shard: `fully_shard(block, mesh=mesh, "
                              "reshard_after_forward=True)`) came after fully_shard of a module that holds it: all 6 "
                              "of its parameters were sharded already"), problem
    # the root made last finds its blocks' parameters sharded, and takes the rest: right
    assert order_problems([{**calls[0], "sharded_already": 24}], script) == []


def test_a_script_that_never_shards_is_told_to_and_a_torch_without_the_internals_says_so():
    [problem] = records_problems(steps(units=[], plain=410), samples(), weights=None)
    assert problem.startswith("it never called fully_shard"), problem
    why = "torch 2.5's FSDPParamGroup has no unshard"
    unsupported = [dict(pid=100, rank=0, restart=0, event="unsupported", why=why)]
    [problem] = records_problems(unsupported, samples(), weights=None)
    assert problem == ("this torch cannot be checked: torch 2.5's FSDPParamGroup has no unshard (the checker reads "
                       "FSDP2's parameter groups)")


def samples(losses=((1.0, 0.5), (3.0, 1.5))):
    """One pass of each rank: 2 steps of 2 samples."""
    return [dict(pid=100 + rank, rank=rank, restart=0, number=0, indices=[4 * rank + i for i in range(4)],
                 losses=list(each)) for rank, each in enumerate(losses)]


def test_each_step_of_the_reference_is_both_ranks_batches_and_its_loss_their_mean():
    assert global_batches(samples()) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert step_losses(samples()) == [2.0, 1.0]


def test_the_reference_trains_and_the_learners_run_is_judged_against_it():
    batches = [list(range(step * 64, step * 64 + 64)) for step in range(4)]
    losses, weights = reference(batches)
    assert losses[-1] < losses[0]
    assert result_problems(losses, weights, losses, weights) == []
    [problem] = result_problems([losses[0], losses[1] + 0.01, *losses[2:]], weights, losses, weights)
    assert problem.startswith(f"the training differs from DDP's: at step 1 the ranks' mean loss was "
                              f"{losses[1] + 0.01:.6f}, where one process (as DDP) computes {losses[1]:.6f}"), problem
    moved = {name: tensor + (0.01 if name == "head.bias" else 0) for name, tensor in weights.items()}
    [problem] = result_problems(losses, moved, losses, weights)
    assert problem.startswith("the final weights differ from DDP's: `head.bias` is 1.00e-02 off"), problem
    [problem] = result_problems(losses[:3], weights, losses, weights)
    assert problem == "it took 3 steps where the data gives 4"


# --- run for real: the start file and seeded mistakes of the solution --------------------------------------------

def checked(path, tmp_path):
    return exercise_problems(9, path, tmp_path)


@pytest.mark.slow
def test_the_start_file_gathers_the_whole_model_and_the_checker_says_so(tmp_path):
    [problem] = checked(REPO / "exercises/09_fsdp_choices/start.py", tmp_path)
    assert re.match(r"rank 0 held parameters whole at once: ([\d.]+) KiB in forward and \1 KiB in backward, over "
                    r"the bound of [\d.]+ KiB \(.*the whole model is \1 KiB\): the root is one unit that holds the "
                    r"parameters of blocks 0, 1, 2 and 3", problem), problem


# The learner's mistakes, as edits of the solution: the root sharded before the blocks (its unit takes every
# parameter); the blocks sharded but not the root; a unit per nn.Linear; the blocks kept whole after their forward;
# the optimizer made before fully_shard replaced the parameters.
BLOCKS = r"    for block in model\.blocks:\n        fully_shard\(block, mesh=mesh, reshard_after_forward=True\)\n"
ROOT = r"    fully_shard\(model, mesh=mesh\)\n"
ROOT_FIRST = (BLOCKS + r"(?:    #.*\n)*" + ROOT, "    fully_shard(model, mesh=mesh)\n"
              "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n")
NO_ROOT = (ROOT, "")
KEPT_WHOLE = (r"reshard_after_forward=True\)", "reshard_after_forward=False)")
EVERY_LINEAR = (r"fully_shard\(block, mesh=mesh, reshard_after_forward=True\)",
                "for linear in (block.up, block.down):\n            fully_shard(linear, mesh=mesh)")
SHARD_CALL = '    shard(model, init_device_mesh("cpu", (world_size,)))\n'
OPTIMIZER_FIRST = (re.escape(SHARD_CALL) + r"    optimizer = make_optimizer.*\n",
                   "    optimizer = make_optimizer(model)\n" + SHARD_CALL)
DIFFERS = r"the training differs from DDP's: at step 1 the ranks' mean loss was [\d.]+, where one process"


@pytest.mark.slow
@pytest.mark.parametrize("edits, verdicts", [
    ([ROOT_FIRST], [r"fully_shard\(Block\) at line \d+ \(in shard: `fully_shard\(block, mesh=mesh\)`\) came after "
                    r"fully_shard of a module that holds it"]),
    ([NO_ROOT], [r"6\.0 KiB of the parameters the optimizer steps are not sharded \(the root's own: embed, head, "
                 r"norm\)", DIFFERS]),
    ([EVERY_LINEAR], [r"the units are finer than the blocks: block 0 is split into 3 units \(the root, "
                      r"`blocks\.0\.up` and `blocks\.0\.down`\), and rank 0 gathered 17 units a step where one unit "
                      r"per block gathers 9"]),
    # independent mistakes share a run: one verdict each
    ([KEPT_WHOLE, OPTIMIZER_FIRST], [r"the optimizer steps none of FSDP's sharded parameters",
                                     r"rank 0 held parameters whole at once: .*: `blocks\.0`, `blocks\.1`, `blocks\.2` "
                                     r"and `blocks\.3` stayed whole from their forward until their backward "
                                     r"\(reshard_after_forward=False\)", DIFFERS]),
], ids=["root first", "no root", "every linear", "kept whole, optimizer first"])
def test_a_seeded_mistake_gets_its_own_verdict(edits, verdicts, tmp_path):
    problems = checked(seeded(tmp_path, SOLUTION, *edits), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.match(verdict, problem), (verdict, problems)


# Programs learners wrote from the starting file (tests/independent/): blocks found by their type pass; the last block
# left in the root's unit is named as such, not as a root kept whole. Its backward holds the root's unit (blocks.3 in
# it), the block computing and the next, gathered ahead: over the bound on every run. Its forward holds the root's
# unit and the block computing, the bound itself: one run measured it over, another not, so the verdict may name
# forward or not.
@pytest.mark.slow
@pytest.mark.parametrize("part, verdicts", [
    ("fsdp_choices_by_type.py", []),
    ("fsdp_choices_last_block_in_root.py", [
        r"rank \d held parameters whole at once: ([\d.]+ KiB in forward and )?[\d.]+ KiB in backward, over the "
        r"bound .*: `blocks\.3` is not a unit of its own: its parameters \([\d.]+ KiB\) went into the root's unit"]),
], ids=["right: blocks by type", "the last block in the root's unit"])
def test_a_program_written_independently_gets_the_verdicts_of_its_mistakes(part, verdicts, tmp_path):
    problems = checked(written(tmp_path, "exercises/09_fsdp_choices/start.py", part), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.match(verdict, problem), (verdict, problems)
