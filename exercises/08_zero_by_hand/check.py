"""Exercise 8's checker: ZeRO by hand. The learner's script runs twice under torchrun (2 CPU ranks, gloo), with
--stage 1 and with --stage 2, both jobs at once; the recorder notes every collective each rank called (its bytes),
each optimizer step (the bytes of the parameters and gradients it updates, and of its state), and this folder's
recorder.py (a plugin of the recorder) the gradients each rank holds as it steps and a digest of its model. What a
correct script does:

- its weights after STEPS steps are those of torch.optim.AdamW in one process on the whole global batch (the mean of
  the ranks' mean losses), computed here from the repository's solution.py (its model, data and hyperparameters);
- at its first step, the gradients the ranks step with are the average of theirs: over the ranks' shards, the
  squared norm of the one-process gradient (a sum, not divided by the world size, is world_size^2 times it);
- every rank holds the same model as each step begins (the all-gather gave it every shard);
- the optimizer state a rank holds (AdamW's two moments of the tensors it steps) is 1/N of the whole AdamW's: 2 x Psi
  x 4 bytes / N, where Psi is the parameter count, rounded up to a shard of the padded flat vector;
- with --stage 2, the gradients a rank holds as it steps, wherever they are held (the .grad of the model's parameters
  and of what the optimizer steps, the gradients backward made, the tensors given to a reduce-scatter or an
  all-reduce since, while anything still references them) are its shard's only: Psi x 4 bytes / N;
- each rank moves 2 Psi (N-1)/N elements a step, as ring algorithms move them: a reduce-scatter of the gradients
  (Psi (N-1)/N) and an all-gather of the parameters (as much), the same as plain data parallelism's all-reduce.
  All-reducing the gradients (2 Psi (N-1)/N) before the all-gather moves 3 Psi (N-1)/N: half as much again.
"""
import math
import re
from pathlib import Path

import torch

from exercises.judging import (COLLECTIVE_TIMEOUT_S, JOB_LIMIT_S, WORLD_SIZE, exit_problems, line_of, listed,
                               script_module)
from harness.jobs import REPO, shown, start, torchrun

SOLUTION = REPO / "exercises/08_zero_by_hand/solution.py"
RECORDER = Path(__file__).with_name("recorder.py")  # what this exercise needs recorded beyond the recorder's own
STEPS = 40
STAGES = (1, 2)
WEIGHTS = "weights.pt"
WEIGHT_TOLERANCE = 1e-5  # the ranks' averages are sums of other floats in another order than one process's
GRADIENT_TOLERANCE = 1e-3  # relative, on the first step's squared gradient norm
TRAFFIC_TOLERANCE = 0.05  # relative: a loss averaged for the log, now and then, is a few bytes more
# How many elements a collective of a tensor of n elements sends from each rank, as ring algorithms move them
# (the factor of n (N-1)/N): an all-reduce is a reduce-scatter and then an all-gather.
RING_FACTOR = {"all_reduce": 2, "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "reduce_scatter": 1,
               "all_gather_into_tensor": 1, "all_gather_single": 1, "all_gather": 1, "broadcast": 1}


def solution_module():
    return script_module(SOLUTION, "zero_by_hand_solution")


def reference(steps=STEPS):
    """What AdamW computes in one process on the whole global batch, from the solution's model, data and
    hyperparameters: {"names", "sizes", "numel", "trained" (the flat parameters after 0, 1, ... `steps` steps),
    "grad_square" (the first step's squared gradient norm)}."""
    solution = solution_module()
    model = solution.make_model()
    names, params = zip(*model.named_parameters())
    trained = [torch.cat([p.detach().reshape(-1).double() for p in params])]
    optimizer = torch.optim.AdamW(model.parameters(), lr=solution.LEARNING_RATE, weight_decay=solution.WEIGHT_DECAY)
    grad_square = None
    for inputs, targets in solution.global_batches(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        if grad_square is None:
            grad_square = sum(float(p.grad.double().pow(2).sum()) for p in params)
        optimizer.step()
        trained.append(torch.cat([p.detach().reshape(-1).double() for p in params]))
    return dict(names=list(names), sizes=[p.numel() for p in params], numel=trained[0].numel(), trained=trained,
                grad_square=grad_square)


def shard_of(numel, world_size=WORLD_SIZE):
    """Elements of one shard of the flat vector padded to divide by the world size."""
    return math.ceil(numel / world_size)


def spans(indices):
    """Consecutive runs of sorted indices: [(first, last), ...]."""
    runs = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return [tuple(run) for run in runs]


def named(first, last, expected):
    """`parameters 170 to 338 of the flat 339 (in 0.bias, 2.weight and 2.bias)`, the flat vector's elements."""
    offsets, touched = 0, []
    for name, size in zip(expected["names"], expected["sizes"]):
        if offsets <= last and first < offsets + size:
            touched.append(name)
        offsets += size
    what = f"parameter {first}" if first == last else f"parameters {first} to {last}"
    return f"{what} of the flat {expected['numel']} (in {listed(touched)})"


def owners(indices, numel, world_size=WORLD_SIZE):
    """The ranks whose shards (of the padded flat vector) hold these indices."""
    return sorted({index // shard_of(numel, world_size) for index in indices})


def averaging_problems(steps, plugin_rows, expected, stage):
    """At the first step, the squared norm of the gradients the ranks step with, against the average's. A rank whose
    optimizer steps the whole model is compared on its own; the ranks that step shards, summed over them."""
    whole = 4 * expected["numel"]
    params_bytes = {row["rank"]: row["params"] for row in steps if row["event"] == "step" and row["step"] == 0}
    squares = {row["rank"]: row["stepped_grad_square"] for row in plugin_rows if row["step"] == 0}
    if not squares or not expected["grad_square"]:
        return []
    full = [rank for rank in squares if params_bytes.get(rank, 0) >= whole]
    measured = squares[full[0]] if full else sum(squares.values())
    ratio = measured / expected["grad_square"]
    if abs(ratio - 1) <= GRADIENT_TOLERANCE:
        return []
    if abs(ratio - WORLD_SIZE ** 2) <= WORLD_SIZE ** 2 * GRADIENT_TOLERANCE:
        return [f"with --stage {stage}, the gradient the ranks stepped with at the first step is the sum of the "
                f"ranks' gradients, not their average: its squared norm is {ratio:.2f} times the average's "
                f"({WORLD_SIZE}^2). A reduce-scatter (or an all-reduce) sums; divide the shard's gradient by the "
                "world size, so each rank steps on the gradient of the mean loss over the global batch (with "
                "AdamW a sum only looks harmless: epsilon and the weight decay are not scaled with it)"]
    return [f"with --stage {stage}, the gradient the ranks stepped with at the first step has {ratio:.3f} times the "
            "squared norm of the average of the ranks' gradients (over the ranks' shards): each rank must step its "
            "shard with that shard of the gradient summed over the ranks (a reduce-scatter), divided by the world "
            "size"]


def weights_problems(weights, plugin_rows, expected, stage):
    """Rank 0's parameters as each step began (the plugin's `flat`) and its saved weights after the last, against one
    process's AdamW after as many steps; and the ranks' models step by step (equal on every rank). At the first step
    that went wrong: which part of the flat vector, and whose shard it is."""
    if weights is None:
        return [f"with --stage {stage}, rank 0 saved no {WEIGHTS}: the script saves the model's state_dict there "
                "after the last step; keep that"]
    final = torch.cat([tensor.detach().reshape(-1).double() for tensor in weights.values()])
    if final.numel() != expected["numel"]:
        return [f"with --stage {stage}, rank 0's {WEIGHTS} holds {final.numel()} parameters, the model "
                f"{expected['numel']}: save model.state_dict()"]
    trained = expected["trained"]
    series = {row["step"]: torch.tensor(row["flat"], dtype=torch.float64) for row in plugin_rows
              if row["rank"] == 0 and row.get("flat") is not None and len(row["flat"]) == expected["numel"]}
    series[len(trained) - 1] = final
    off = {step: (flat - trained[step]).abs() > WEIGHT_TOLERANCE for step, flat in sorted(series.items())
           if step < len(trained)}
    first = next((step for step, wrong in off.items() if wrong.any()), None)
    by_step = {}
    for row in plugin_rows:
        by_step.setdefault(row["step"], {})[row["rank"]] = row["params"]
    diverged = next((step for step, digests in sorted(by_step.items()) if len(set(digests.values())) > 1), None)
    if first is None and diverged is None:
        return []
    indices, unchanged, where, whose = [], [], "", ""
    if first is not None:
        indices = off[first].nonzero().flatten().tolist()
        moved = trained[first] != trained[max(first - 1, 0)]
        stayed = (series[first] - trained[max(first - 1, 0)]).abs() <= WEIGHT_TOLERANCE
        unchanged = (off[first] & moved & stayed).nonzero().flatten().tolist()
        where, whose = place(indices, expected), shards(indices, expected)
    if diverged is not None:
        told = (f" On rank 0, step {first} left {place(unchanged, expected)} unchanged: {shards(unchanged, expected)}"
                ", updated on its owner only." if unchanged else
                f" On rank 0, {where} ({whose}) differs from AdamW's in one process after step {first}."
                if indices else "")
        return [f"with --stage {stage}, the ranks held different models after step {diverged} (their parameters "
                f"differ as the next step begins): each rank updated its own shard only.{told} After its step, "
                "every rank needs every updated shard: all-gather the shards (all_gather_into_tensor, or "
                "all_gather_single) into one flat vector, and copy all of it, but the padding, into the model's "
                "parameters"]
    if unchanged and len(unchanged) == len(indices):
        return [f"with --stage {stage}, step {first} left {place(unchanged, expected)} unchanged, where AdamW in "
                "one process moved them: no rank's shard held them. The shards together must cover the whole flat "
                f"vector: shard_size = ceil({expected['numel']} / world_size), the vector padded with zeros to "
                "shard_size x world_size"]
    largest = float((series[first] - trained[first]).abs().max())
    return [f"with --stage {stage}, after step {first} rank 0's weights differ from AdamW's in one process on the "
            f"whole global batch (by up to {largest:.2g}) at {where}: {whose}, as the all-gather lays the shards "
            "out (rank r's at r x shard_size). Each rank must step the slice of the flat vector it gets back in the "
            "all-gather: start = rank x shard_size, from the padded vector's shard_size"]


def place(indices, expected):
    """Where in the flat vector: its runs, the first three named."""
    runs = spans(indices)
    more = f", and {len(runs) - 3} more runs" if len(runs) > 3 else ""
    return ", ".join(named(first, last, expected) for first, last in runs[:3]) + more


def shards(indices, expected):
    ranks = owners(indices, expected["numel"])
    return f"rank {ranks[0]}'s shard" if len(ranks) == 1 else f"in the shards of ranks {listed(ranks)}"


def who(ranks):
    """`rank 1`, or `ranks 0 and 1 each`: the subject of a sentence about what each rank held."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {listed(ranks)} each"


def stepping(ranks):
    return "as it stepped" if len(ranks) == 1 else "as they stepped"



def state_problems(steps, expected, stage):
    """The bytes of the optimizer state each rank holds (AdamW's moments of the tensors it steps): 1/N of the whole
    AdamW's, the shard padded."""
    whole = 2 * 4 * expected["numel"]
    share = 2 * 4 * shard_of(expected["numel"])
    held = {}
    for row in steps:
        if row["event"] == "stepped":
            held[row["rank"]] = max(held.get(row["rank"], 0), row["state"])
    if not held:
        return [f"with --stage {stage}, no optimizer ever stepped: build a torch.optim.AdamW over this rank's shard "
                "and call its step()"]
    over = sorted(rank for rank, state in held.items() if state > share)
    if not over:
        return []
    state = held[over[0]]
    what = ("the whole model's: every rank keeps a full AdamW, as plain data parallelism does" if state >= whole
            else "more than its shard's: the ranks' shards overlap")
    return [f"with --stage {stage}, {who(over)} held {state:,} bytes of optimizer state {stepping(over)} "
            f"({what}; the whole AdamW's are 2 moments x {expected['numel']} parameters x 4 bytes = {whole:,}). "
            f"ZeRO keeps 1/{WORLD_SIZE} on each rank: at most {share:,} bytes (2 x {shard_of(expected['numel'])} "
            f"x 4, a shard of the padded flat vector). Make this rank's shard 1/{WORLD_SIZE} of the flat vector, "
            f"shard_size = ceil({expected['numel']} / world_size) elements from rank x shard_size, and build the "
            "AdamW over that shard only, not over the whole model's parameters"]


def holder(row, script=None):
    """What holds `row["bytes"]` of gradients (a row of the plugin's `holders`), in the learner's terms."""
    if row["what"] == "grad":
        return f"{row['bytes']:,} in a .grad"
    if row["what"] == "backward":
        return (f"{row['bytes']:,} in a gradient backward made, set to None on its parameter but still held (a list, "
                "a variable)")
    caller = row.get("caller")
    where = (line_of(script, caller[1], caller[2]) if script and caller and Path(caller[0]) == Path(script)
             else "a line of a library")
    return f"{row['bytes']:,} given to {row['op']} at {where}, still held (a variable, an attribute)"


def gradient_problems(plugin_rows, expected, stage=2, script=None):
    """With --stage 2, the gradients a rank holds as it steps, wherever they are held: its shard's only."""
    share = 4 * shard_of(expected["numel"])
    held, worst = {}, {}
    for row in plugin_rows:
        if row["held_grads"] > held.get(row["rank"], -1):
            held[row["rank"]], worst[row["rank"]] = row["held_grads"], row
    over = sorted(rank for rank, grads in held.items() if grads > share)
    if not over:
        return []
    holders = worst[over[0]].get("holders") or []
    # The three largest holders are named; the rest are added up, so that the parts add up to the whole.
    named = [holder(row, script) for row in holders[:3]]
    if len(holders) > 3:
        named.append(f"{sum(row['bytes'] for row in holders[3:]):,} in {len(holders) - 3} more")
    what = f": {'; '.join(named)}" if named else ""
    return [f"with --stage {stage}, {who(over)} held {held[over[0]]:,} bytes of gradients {stepping(over)} (the "
            "memory of every tensor that holds a gradient, wherever it is held; a slice keeps its whole tensor "
            f"alive{what}). ZeRO-2 keeps its shard's only: {share:,} bytes ({shard_of(expected['numel'])} x 4). Once "
            "the reduce-scatter has given the rank its shard's gradient, a tensor of its own (divided in place), free "
            "the rest before the step: p.grad = None for every parameter of the model"]


def traffic(call):
    """The bytes a call sends from each rank, as ring algorithms move them (RING_FACTOR), before the (N-1)/N."""
    sizes = call.get("bytes") or [0]
    if call["op"] == "barrier":
        return 0
    if call["op"] == "all_gather" and len(sizes) > 1:  # a list of outputs, then the input
        return sum(sizes[:-1])
    if call["op"] == "reduce_scatter" and len(sizes) > 1:  # the output, then a list of inputs
        return sum(sizes[1:])
    return RING_FACTOR.get(call["op"], 1) * max(sizes)


def communication_problems(collectives, expected, script, stage):
    """The bytes each rank moved a step, on average over the run, against 2 Psi (N-1)/N of the padded vector."""
    calls = [row for row in collectives if row["event"] == "call"]
    steps = len({row["step"] for row in collectives if row["event"] == "stepped" and row["rank"] == 0})
    if not calls or not steps:
        return []
    factor = (WORLD_SIZE - 1) / WORLD_SIZE
    ranks = sorted({row["rank"] for row in calls}, key=str)
    moved = {rank: sum(traffic(row) for row in calls if row["rank"] == rank) * factor / steps for rank in ranks}
    busiest = max(moved, key=moved.get)
    psi = 4 * shard_of(expected["numel"]) * WORLD_SIZE
    allowed = 2 * psi * factor
    if moved[busiest] <= allowed * (1 + TRAFFIC_TOLERANCE):
        return []
    kinds = {}
    for row in (row for row in calls if row["rank"] == busiest):
        where = (line_of(script, row["caller"][1], row["caller"][2])
                 if row.get("caller") and Path(row["caller"][0]) == Path(script) else "in a library")
        kind = kinds.setdefault((row["op"], where), [0, 0])
        kind[0] += 1
        kind[1] += traffic(row) * factor
    largest = [item for item in sorted(kinds.items(), key=lambda item: -item[1][1])
               if item[1][1] / steps >= 0.01 * psi][:3]
    what = "; ".join(f"{op} at {where}: {count} calls, {total / steps:,.0f} bytes a step"
                     for (op, where), (count, total) in largest)
    return [f"with --stage {stage}, rank {busiest} moved {moved[busiest]:,.0f} bytes a step ({moved[busiest] / psi:.2f}"
            f" Psi, Psi = {psi:,} bytes of the padded flat vector, counted as ring algorithms move them: an "
            "all-reduce of n bytes sends 2n(N-1)/N from each rank, a reduce-scatter or an all-gather n(N-1)/N). ZeRO "
            f"needs 2 Psi (N-1)/N = {allowed:,.0f}: a reduce-scatter of the gradients and an all-gather of the "
            f"parameters, no more than plain data parallelism's all-reduce. Here: {what}. An all-reduce of the "
            "whole gradient hands every rank every averaged gradient, but a rank steps its own shard only: "
            "reduce-scatter the flat gradient instead (reduce_scatter_tensor, or reduce_scatter_single)"]


# What a flat vector that does not cut into equal shards raises: gloo's size check in a reduce-scatter or an
# all-gather (`Check failed: outputShape[0] * worldSize == inputShape[0] (340 vs. 339)`), or the copy back into the
# parameters of a gathered vector too short.
UNEQUAL_SHARDS = r"Check failed: .*worldSize|split_with_sizes expects split_sizes to sum exactly to"


def crash_problems(job, script, expected):
    """A crash in the learner's terms; the one a flat vector that does not cut into equal shards gives, named."""
    problems = exit_problems(job, script)
    if problems and not job.timed_out and re.search(UNEQUAL_SHARDS, job.output):
        numel, shard = expected["numel"], shard_of(expected["numel"])
        problems = [f"the flat vector of {numel} parameters does not cut into {WORLD_SIZE} equal shards "
                    f"({numel} = {WORLD_SIZE} x {numel // WORLD_SIZE} + {numel % WORLD_SIZE}), and the collectives "
                    f"need equal ones: pad it with zeros to {WORLD_SIZE} x {shard} = {WORLD_SIZE * shard} "
                    f"(shard_size = ceil({numel} / world_size)), and leave the padding out when copying the "
                    "all-gathered vector back into the parameters. " + problems[0][0].upper() + problems[0][1:]]
    return problems


def stage_problems(job, workdir, script, expected, stage):
    if not job.ok:
        return [f"with --stage {stage}, {problem}" for problem in crash_problems(job, script, expected)]
    collectives = job.records("collectives.jsonl")
    plugin_rows = job.records("zero_by_hand.jsonl")
    steps = [row for row in collectives if row["event"] in ("step", "stepped")]
    saved = Path(workdir) / WEIGHTS
    weights = torch.load(saved, map_location="cpu", weights_only=True) if saved.exists() else None
    averaging = averaging_problems(steps, plugin_rows, expected, stage)
    # A sum where an average belongs trains other weights too: that verdict says why, the weights' would not.
    problems = averaging or weights_problems(weights, plugin_rows, expected, stage)
    problems += state_problems(steps, expected, stage)
    if stage == 2:
        problems += gradient_problems(plugin_rows, expected, stage, script)
    return problems + communication_problems(collectives, expected, script, stage)


def merged(by_stage):
    """The verdicts of every stage, one sentence for a verdict both stages got alike."""
    problems = []
    for stage, found in by_stage.items():
        for problem in found:
            alike = [other for other in by_stage if other != stage
                     and problem.replace(f"--stage {stage}", f"--stage {other}") in by_stage[other]]
            if alike and min(alike) < stage:
                continue
            problems.append(problem.replace(f"with --stage {stage}", "with --stage 1 and with --stage 2")
                            if alike else problem)
    return problems


def check(script, workdir, say):
    jobs = {}
    for stage in STAGES:
        folder = Path(workdir) / f"stage{stage}"
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [*torchrun(script, nproc=WORLD_SIZE), "--stage", stage, "--steps", STEPS, "--timeout",
               COLLECTIVE_TIMEOUT_S]
        say(f"running: {shown(cmd)}   (every collective and optimizer step recorded, and the gradients each rank "
            "holds as it steps)")
        jobs[stage] = (folder, start(cmd, cwd=folder, logs=folder / "records", record_collectives=True,
                                     env={"JOB_RECORD_PLUGINS": RECORDER}))
    try:
        # Computed while the jobs run: this process waits for them anyway.
        say(f"computing the reference: AdamW in one process on the whole global batch, {STEPS} steps")
        expected = reference()
        for folder, job in jobs.values():
            job.wait(timeout=JOB_LIMIT_S)
    finally:
        for folder, job in jobs.values():
            job.stop()
    by_stage = {stage: stage_problems(job, folder, script, expected, stage) for stage, (folder, job) in jobs.items()}
    return list(dict.fromkeys(merged(by_stage)))
