"""Exercise 13's checker: plan a layout. The learner's file names a layout of the 8B GPT on 2 nodes of 8 H100s (PP,
TP, MICROBATCHES, CHECKPOINT_ACTIVATIONS; dp the rest of the 16 GPUs); the checker runs the planner on it, in this
process (plan_at_scale.py, step 14: one_mesh.py's own code on torch's fake process group, the first and the last
pipeline rank traced), and judges what it counted:

- a layout one_mesh.py accepts (whole grids, whole heads, micro-batches in rounds of pp): else the planner's line;
- tensor parallelism inside a node: its collectives run in every block, on the critical path, and between nodes a
  GPU has one 50 GB/s port where NVLink gives it 450;
- every traced rank's peak memory (torch's MemTracker) within 85% of an H100's 80 GB (tools/memory_plan.MARGIN: the
  rest is the CUDA context's, NCCL's and fragmentation's);
- a step within 10% of the best MFU, on paper (utils/estimates.py: compute at the GPU's peak, the pipeline's bubble,
  the communication the compute does not hide): the best is computed from the repository's arithmetic
  (tools/memory_plan.ranked over every layout that fits), never from the learner's file.
"""
import math

from exercises.judging import script_module
from tools import memory_plan
from utils.estimates import GPUS

JOB = dict(size="8b", world=16, batch_size=8, precision="bf16")
GPU = GPUS["h100"]
USABLE = (1 - memory_plan.MARGIN) * GPU.memory  # what a rank may peak at
MFU_SHARE = 0.9  # of the best layout's MFU, at least
GiB = 2**30


def layout_of(script):
    """The learner's four numbers, or the line that says which is missing or not a number of the right kind."""
    module = script_module(script, "plan_a_layout_learner")
    layout = {}
    for name, kind in (("PP", int), ("TP", int), ("MICROBATCHES", int), ("CHECKPOINT_ACTIVATIONS", bool)):
        value = getattr(module, name, None)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            return None, [f"{name} must be {'a positive whole number' if kind is int else 'True or False'}, got "
                          f"{value!r}: set it at the top of the file"]
        layout[name.lower()] = value
    return layout, []


def command(layout):
    """The planner's command line for the layout (what the learner can run too)."""
    argv = ["--world", JOB["world"], "--size", JOB["size"], "--batch_size", JOB["batch_size"], "--precision",
            JOB["precision"], "--pp", layout["pp"], "--tp", layout["tp"], "--microbatches", layout["microbatches"]]
    return [str(part) for part in argv] + (["--checkpoint_activations"] if layout["checkpoint_activations"] else [])


def tp_problems(layout):
    if layout["tp"] <= GPU.per_node:
        return []
    nodes = math.ceil(layout["tp"] / GPU.per_node)
    return [f"TP = {layout['tp']} spans {nodes} nodes of {GPU.per_node} GPUs: tensor parallelism's all-gathers and "
            f"reduce-scatters run in every block, forward and backward, and wait for each other; between nodes a GPU "
            f"has one port of {GPU.network / 1e9:.0f} GB/s where NVLink gives it {GPU.nvlink / 1e9:.0f} GB/s inside "
            f"one. Keep tp within a node (at most {GPU.per_node}); let dp or pp cross the nodes"]


def fit_problems(plan):
    """Every traced rank's peak within USABLE: else the largest, with what fills it."""
    over = [rank for rank in plan["plans"] if rank["peak"] > USABLE]
    if not over:
        return []
    worst = max(over, key=lambda rank: rank["peak"])
    state = worst["params"] + worst["grads"] + worst["optim"]
    # What autograd keeps is counted over the whole step (every micro-batch's); the schedule holds a few micro-batches'
    # at once, freeing each in its backward: the verdict says a micro-batch's, which is what the levers below shrink.
    microbatches = plan["args"]["microbatches"]
    return [f"rank {worst['rank']} ({worst['where']}) peaks at {worst['peak'] / GiB:.1f} GiB (torch's MemTracker, "
            f"one step traced), over the {USABLE / GiB:.1f} GiB that 85% of an H100's {GPU.memory / GiB:.1f} GiB "
            f"leaves: its weights' shards, their gradients and AdamW's state are {state / GiB:.1f} GiB; autograd "
            f"keeps {worst['activations'] / microbatches / GiB:.1f} GiB for backward a micro-batch (of the "
            f"{microbatches} a step, the pipeline holds a few at once); the rest is FSDP's gathered weights and "
            "gradients of its layers, the last stage's logits and the pipeline's buffers. Recompute each block "
            "(CHECKPOINT_ACTIVATIONS), split each block over a node's GPUs (TP), or cut the model into more stages "
            "(PP)"]


def speed_problems(plan, best):
    """The slowest traced rank's step on paper against the best layout's (tools/memory_plan.ranked)."""
    mine = min((rank["estimate"] for rank in plan["plans"]), key=lambda estimate: estimate["mfu"])
    if mine["mfu"] >= MFU_SHARE * best["mfu"]:
        return []
    costs = {"the pipeline's bubble": mine["bubble"], "the communication the compute does not hide": mine["exposed"],
             "the recomputation": mine["compute"] - plan["plans"][0]["estimate"]["flops"] / GPU.flops}
    costly = max(costs, key=costs.get)
    network = sum(sent for label, sent in mine["sent"].items() if mine["links"].get(label) == "network")
    return [f"a step takes {mine['step']:.2f} s at best (MFU {mine['mfu']:.0%}), and the best layout that fits reaches "
            f"{best['mfu']:.0%}: {MFU_SHARE:.0%} of it at least is the goal. Most of what it loses is {costly} "
            f"({costs[costly]:.2f} s a step; compute {mine['compute']:.2f} s, bubble {mine['bubble']:.2f} s, "
            f"communication not hidden {mine['exposed']:.2f} s, {network / GiB:.1f} GiB a step over the network)"]


def best_layout():
    """The best layout that fits, by the repository's arithmetic (tools/memory_plan.ranked): {layout, mfu, ...}."""
    from utils.gpt import SHAPES

    return memory_plan.ranked(SHAPES[JOB["size"]], JOB["world"], GPU, JOB["batch_size"], JOB["batch_size"],
                              JOB["precision"])[0]


def check(script, workdir, say):
    """Plan the learner's layout and judge it."""
    import plan_at_scale

    layout, problems = layout_of(script)
    if problems:
        return problems
    problems = tp_problems(layout)
    if problems:
        return problems
    argv = command(layout)
    say(f"planning: python plan_at_scale.py {' '.join(argv)}   (one_mesh.py's code, a pipeline's first and last rank "
        "traced on the fake process group)")
    try:
        plan = plan_at_scale.plan_job(plan_at_scale.parse(argv), say=lambda line: None)
    except SystemExit as stopped:  # the planner's one line: a layout one_mesh.py does not accept
        return [f"{str(stopped.code).removeprefix('error: ')}: one_mesh.py would stop on it"]
    for rank in plan["plans"]:
        say(f"  rank {rank['rank']}: peak {rank['peak'] / GiB:.1f} GiB, a step {rank['estimate']['step']:.2f} s at "
            f"best, MFU {rank['estimate']['mfu']:.0%}")
    return fit_problems(plan) or speed_problems(plan, best_layout())
