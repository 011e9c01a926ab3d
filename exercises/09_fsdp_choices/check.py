"""Exercise 9's checker: FSDP's choices. The learner's script runs under torchrun (2 CPU ranks, gloo) and trains the
exercise's residual MLP (4 blocks) for 32 steps with FSDP2; this folder's recorder.py (a plugin of the recorder)
notes each call of fully_shard, and for every step each FSDP unit (its parameters, how often it was gathered whole,
whether it gave its whole parameters back at the end of its forward) and the most bytes of parameters a rank held
whole at once, in forward and in backward. What a correct shard(model, mesh) gives:

- every parameter sharded: no parameter the optimizer steps is a plain tensor (a plain one's gradient is averaged
  by nobody, and each rank's copy drifts on its own);
- the blocks sharded before the root that holds them (the root first takes every parameter, and then a block's
  fully_shard finds its parameters sharded already);
- at most the root's own parameters and two blocks whole at once, in forward and in backward: the block computing
  and the next one, gathered ahead. One unit for the whole model gathers it all; blocks that keep their parameters
  whole after their forward (reshard_after_forward=False) hold every block at once when forward ends;
- units no finer than a block: every unit is one all-gather in forward and another in backward, and one per block
  (9 all-gathers a step here) meets the bound;
- and the same training as DDP: the ranks train on the samples the exercise's DistributedSampler deals them, and the
  mean of the ranks' losses at each step, and the final weights rank 0 saved, are what one process computes on those
  samples (both ranks' batches together), with the repository's model and optimizer, within float rounding.
"""
import math
import re
from pathlib import Path

import torch

from exercises.judging import (COLLECTIVE_TIMEOUT_S, JOB_LIMIT_S, WORLD_SIZE, exit_problems, line_of, listed,
                               script_module)
from harness.jobs import REPO, run, shown, torchrun

SOLUTION = REPO / "exercises" / "09_fsdp_choices" / "solution.py"
RECORDER = Path(__file__).with_name("recorder.py")  # what this exercise needs recorded beyond the recorder's own
SAVED = "fsdp_weights.pt"  # the script's default --weights, in its working folder
LOSS_TOLERANCE = 1e-4  # a reduce-scatter's and one process's sums round apart by ~1e-7; a wrong gradient is far off
WEIGHT_TOLERANCE = 1e-4
BATCH_SIZE = 32  # samples per rank and step: 2,048 samples on 2 ranks make 32 steps


def exercise():
    """The exercise's own model, data and optimizer (the repository's solution.py as a module): what the learner's
    copy trains too."""
    return script_module(SOLUTION, "fsdp_choices_solution")


def model_facts(model):
    """What the bound is made of: the bytes of each block's parameters, and of the root's own (those of no block)."""
    blocks = [sum(param.nbytes for param in block.parameters()) for block in model.blocks]
    whole = sum(param.nbytes for param in model.parameters())
    root_own = whole - sum(blocks)
    return dict(blocks=len(blocks), block=max(blocks), root_own=root_own, whole=whole,
                bound=root_own + 2 * max(blocks), gathers=2 * len(blocks) + 1,
                sizes={name: param.nbytes for name, param in model.named_parameters()},
                root_names=sorted({name.split(".")[0] for name, _ in model.named_parameters()} - {"blocks"}))


def kib(size):
    return f"{size / 1024:,.1f} KiB"


def where(row, script):
    caller = row.get("caller")
    return line_of(script, caller[1], caller[2]) if caller and script and caller[0] == str(script) else "its call"


def order_problems(shards, script=None):
    """A fully_shard given a module whose parameters an earlier fully_shard (of a module around it) took already: it
    makes a unit of nothing. (The root's own call finds its blocks' parameters sharded, and takes the rest.)"""
    late = [row for row in shards if row["rank"] == 0 and row["params"] and row["sharded_already"] == row["params"]]
    if not late:
        return []
    row = late[0]
    return [f"fully_shard({row['module']}) at {where(row, script)} came after fully_shard of a module that holds it: "
            f"all {row['params']} of its parameters were sharded already, into the outer unit (a unit takes every "
            "parameter inside it that no unit made before took). Shard the blocks first, then the root: "
            "fully_shard(block, ...) for each block, and fully_shard(model, ...) last"]


def block_of(name):
    match = re.match(r"blocks\.(\d+)\.", name or "")
    return int(match[1]) if match else None


def unit_name(unit):
    return f"`{unit['module']}`" if unit["module"] else "the root"


def peak_problems(steps, facts):
    """The most bytes held whole at once in forward and in backward (the worst rank and step of each) against the
    bound; and why, from the units: one unit holding several blocks, blocks that stayed whole after their forward,
    several roots."""
    over = {}
    for phase in ("forward", "backward"):
        rows = sorted((row for row in steps if row["peaks"].get(phase) is not None),
                      key=lambda row: (row["rank"], row["step"]))
        worst = max(rows, key=lambda row: row["peaks"][phase], default=None)
        if worst is not None and worst["peaks"][phase] > facts["bound"]:
            over[phase] = worst
    if not over:
        return []
    phase, worst = max(over.items(), key=lambda item: item[1]["peaks"][item[0]])
    units = worst["units"]
    spanning = [unit for unit in units if len({block_of(name) for name in unit["params"]} - {None}) > 1]
    # A block whose parameters went into a unit that holds more than the block (the root's, say): that unit holds them
    # whole with its own. (A block that is a root of its own is a unit of only its parameters, named "".)
    strays = [(unit, block) for unit in units for block in sorted({block_of(name) for name in unit["params"]} - {None})
              if any(block_of(name) is None for name in unit["params"])
              or unit["module"] not in ("", f"blocks.{block}")]
    kept = [unit for unit in units if unit["module"] and unit["resharded_in_forward"] is False]
    roots = [unit for unit in units if not unit["module"]]
    if strays and not spanning:
        unit, block = strays[0]
        size = sum(facts.get("sizes", {}).get(name, facts["block"] / 3) for name in unit["params"]
                   if block_of(name) == block)
        why = (f"`blocks.{block}` is not a unit of its own: its parameters ({kib(size)}) went into "
               f"{unit_name(unit)}'s unit, which holds them whole whenever it is whole"
               + (" (the root's, from its forward until its backward)" if not unit["module"] else "")
               + f", beside the blocks gathered one by one. Call fully_shard(model.blocks[{block}], mesh=mesh) too: "
               "every block, before the root")
    elif spanning:
        unit = spanning[0]
        blocks = sorted({block_of(name) for name in unit["params"]} - {None})
        why = (f"{unit_name(unit)} is one unit that holds the parameters of blocks {listed(blocks)} "
               f"({kib(unit['bytes'])}): gathering it gathers them all at once. Make each block a unit of its own: "
               "fully_shard(block, mesh=mesh) for each block, before fully_shard(model, mesh=mesh)")
    elif kept:
        why = (f"{listed(unit_name(unit) for unit in kept)} stayed whole from their forward until their backward "
               "(reshard_after_forward=False), so when forward ends a rank holds them all: pass "
               "reshard_after_forward=True to each block's fully_shard (their backward gathers them again)")
    elif len(roots) > 1:
        why = (f"{len(roots)} units are roots of their own (the model around them was not sharded), and FSDP keeps a "
               "root's parameters whole from its forward until its backward: shard the model too, after the blocks")
    else:
        why = f"the units whole then: {listed(name or 'the root' for name in worst['at_peak'][phase])}"
    held = " and ".join(f"{kib(row['peaks'][name])} in {name}" for name, row in over.items())
    return [f"rank {worst['rank']} held parameters whole at once: {held}, over the bound of {kib(facts['bound'])} "
            f"(the root's own parameters, {kib(facts['root_own'])}, and two blocks of {kib(facts['block'])}: the one "
            f"computing and the next, gathered ahead; the whole model is {kib(facts['whole'])}): {why}"]


def granularity_problems(steps, facts):
    """Units finer than a block: more all-gathers a step than one unit per block needs."""
    row = next((row for row in steps if row["rank"] == 0 and row["step"] == 1), None)
    if row is None:
        return []
    split = {}
    for unit in row["units"]:
        for block in {block_of(name) for name in unit["params"]} - {None}:
            split.setdefault(block, []).append(unit)
    split = {block: units for block, units in split.items() if len(units) > 1}
    if not split:
        return []
    block, units = min(split.items())
    gathers = sum(unit["gathers"] for unit in row["units"])
    return [f"the units are finer than the blocks: block {block} is split into {len(units)} units "
            f"({listed(unit_name(unit) for unit in units)}), and rank 0 gathered {gathers} units a step where one "
            f"unit per block gathers {facts['gathers']} (each block in forward and again in backward, the root "
            "once). Every all-gather pays a fixed start-up cost however few its bytes, and a unit smaller than a "
            "block leaves less computation to hide the next unit's all-gather behind; one unit per block already "
            "meets the memory bound. Shard each block as one unit"]


def plain_problems(steps, facts):
    """Parameters the optimizer steps that FSDP did not shard."""
    row = next((row for row in steps if row["rank"] == 0), None)
    if row is None or not row["plain"]:
        return []
    if row["plain"] == row["total"]:
        return ["the optimizer steps none of FSDP's sharded parameters: it holds the model's parameters from before "
                "fully_shard, which replaced each one with a sharded parameter (a DTensor). Make the optimizer after "
                "shard(model, mesh)"]
    whose = (f"the root's own: {', '.join(facts['root_names'])}" if row["plain"] == facts["root_own"] else
             "parameters outside every unit")
    return [f"{kib(row['plain'])} of the parameters the optimizer steps are not sharded ({whose}): no unit holds "
            "them, so their gradients are averaged over the ranks by nobody and each rank's copy trains on its own "
            "half of the data. Shard the root too, after the blocks: fully_shard(model, mesh=mesh)"]


def exercise_batches(module=None, batch_size=BATCH_SIZE):
    """Each step's global batch as the exercise deals it (the repository's data and DistributedSampler over the
    ranks, batches of `batch_size` per rank): rank 0's samples, then rank 1's."""
    from torch.utils.data.distributed import DistributedSampler

    module = module or exercise()
    train_set, _ = module.teacher_data(module.SEED)
    shares = [list(DistributedSampler(train_set, num_replicas=WORLD_SIZE, rank=rank)) for rank in range(WORLD_SIZE)]
    steps = math.ceil(len(shares[0]) / batch_size)
    return [[index for share in shares for index in share[step * batch_size:(step + 1) * batch_size]]
            for step in range(steps)]


def data_problems(batches, expected):
    """The samples the ranks trained on (`batches`, recorded) against those the exercise's sampler deals."""
    for step, (got, want) in enumerate(zip(batches, expected)):
        if got != want:
            return [f"at step {step} the ranks trained on other samples than the exercise's DistributedSampler deals "
                    f"them ({len(set(got) - set(want))} of {len(want)} others): keep the script's DataLoader, "
                    f"DistributedSampler(train_set) and --batch_size"]
    return []


def global_batches(samples):
    """Each step's global batch, from what each rank trained on: rank 0's samples, then rank 1's."""
    passes = sorted((row for row in samples if row["restart"] == 0), key=lambda row: (row["number"], row["rank"]))
    batches = []
    for number in sorted({row["number"] for row in passes}):
        ranks = [row for row in passes if row["number"] == number]
        steps = len(ranks[0]["losses"])
        size = len(ranks[0]["indices"]) // max(steps, 1)
        for step in range(steps):
            batches.append([index for row in ranks for index in row["indices"][step * size:(step + 1) * size]])
    return batches


def reference(batches, module=None):
    """(the loss of each step, the final weights) one process computes, stepping on the mean loss of each global
    batch: what DDP (and FSDP) compute."""
    module = module or exercise()
    train_set, _ = module.teacher_data(module.SEED)
    inputs, targets = train_set.tensors
    model = module.build_model(inputs.shape[1])
    optimizer = module.make_optimizer(model)
    loss_fn = torch.nn.MSELoss()
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def step_losses(samples):
    """The mean over the ranks of each step's loss (equal batches: the loss of the step's global batch)."""
    passes = sorted((row for row in samples if row["restart"] == 0), key=lambda row: (row["number"], row["rank"]))
    losses = []
    for number in sorted({row["number"] for row in passes}):
        ranks = [row["losses"] for row in passes if row["number"] == number]
        losses += [sum(each) / len(each) for each in zip(*ranks)]
    return losses


def result_problems(losses, weights, expected_losses, expected_weights):
    """The learner's training against one process's on the same samples: the losses step by step, the weights."""
    if len(losses) != len(expected_losses):
        return [f"it took {len(losses)} steps where the data gives {len(expected_losses)}"]
    for step, (loss, expected) in enumerate(zip(losses, expected_losses)):
        if abs(loss - expected) > LOSS_TOLERANCE:
            return [f"the training differs from DDP's: at step {step} the ranks' mean loss was {loss:.6f}, where "
                    f"one process (as DDP) computes {expected:.6f} on the same samples"]
    if weights is None:
        return [f"rank 0 saved no weights to {SAVED}: keep the script's save of the whole weights"]
    if set(weights) != set(expected_weights):
        return [f"{SAVED} holds the parameters {', '.join(sorted(set(weights) - set(expected_weights))) or 'of a '}"
                f"where the model has {', '.join(sorted(set(expected_weights) - set(weights))) or 'others'}"]
    name, difference = max(((name, (weights[name].float() - expected_weights[name]).abs().max().item())
                            for name in expected_weights), key=lambda item: item[1])
    if difference > WEIGHT_TOLERANCE:
        return [f"the final weights differ from DDP's: `{name}` is {difference:.2e} off what one process (as DDP) "
                "trains on the same samples"]
    return []


def check(script, workdir, say):
    """Run the learner's script under torchrun with this folder's recorder.py; judge its units, its peaks of
    parameters held whole, and its training against one process's."""
    cmd = [*torchrun(script, nproc=WORLD_SIZE), "--batch_size", BATCH_SIZE, "--timeout", str(COLLECTIVE_TIMEOUT_S)]
    say(f"running: {shown(cmd)}")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, env={"JOB_RECORD_PLUGINS": RECORDER},
              timeout=JOB_LIMIT_S, check=False)
    rows = job.records("fsdp_choices.jsonl")
    shards = [row for row in rows if row.get("event") == "shard"]
    order = order_problems(shards, script)
    if not job.ok:
        return order or exit_problems(job, script)
    saved = workdir / SAVED
    weights = torch.load(saved, map_location="cpu", weights_only=True) if saved.is_file() else None
    return records_problems(rows, job.samples, weights, script)


def records_problems(rows, samples, weights, script=None, module=None):
    """What a job that ended well recorded (the plugin's rows, the passes over the data, the weights rank 0 saved),
    judged: the units and their order, the peaks, the parameters left plain, and the training against one process."""
    unsupported = [row["why"] for row in rows if row.get("event") == "unsupported"]
    if unsupported:
        return [f"this torch cannot be checked: {unsupported[0]} (the checker reads FSDP2's parameter groups)"]
    shards = [row for row in rows if row.get("event") == "shard"]
    steps = [row for row in rows if row.get("event") == "step"]
    if not shards and not any(row["units"] for row in steps):
        return ["it never called fully_shard: shard(model, mesh) must make the model's modules FSDP units"]
    module = module or exercise()
    train_set, _ = module.teacher_data(module.SEED)
    facts = model_facts(module.build_model(train_set.tensors[0].shape[1]))
    problems = (order_problems(shards, script) + plain_problems(steps, facts) + peak_problems(steps, facts)
                + granularity_problems(steps, facts))
    batches = exercise_batches(module)
    wrong = data_problems(global_batches(samples), batches)
    if wrong:
        return problems + wrong
    expected_losses, expected_weights = reference(batches, module)
    return problems + result_problems(step_losses(samples), weights, expected_losses, expected_weights)
