"""Exercise 10's checker: a pipeline schedule by hand. It runs the learner's script twice, `--schedule gpipe` and
`--schedule 1f1b` (two ranks each, at once), recorded by this folder's recorder.py, and judges:
- the gradients: the first optimizer step's, and every stage's weights after the last step, against one process
  training the exercise's whole model (the repository's, with its batches, loss and learning rate, whatever the
  script's own functions became) on the same batches, each micro-batch's loss divided by M;
- the order: each rank's forwards and backwards, micro-batch by micro-batch (which micro-batch a backward ran is
  measured: the activations autograd handed it), against the schedule's;
- the memory: the activations a rank held at once (bytes autograd kept, measured), at most p micro-batches' with 1F1B;
- the waits: a rank that waited for the other forever (a deadlock) is named with its line, and every isend or irecv
  must be waited for.
"""
import time
from pathlib import Path

import torch

from exercises.judging import COLLECTIVE_TIMEOUT_S, JOB_LIMIT_S, exit_problems, lines_in, listed, script_module
from harness.jobs import REPO, shown, start, torchrun

SOLUTION = REPO / "exercises/10_pipeline_by_hand/solution.py"
STAGES = 2  # the script's pipeline: one stage per rank
MICROBATCHES, BATCH_SIZE, STEPS = 4, 16, 30
# Passed as --timeout: a rank stuck in a send or receive fails after this long (a deadlock is stopped sooner, below)
P2P_TIMEOUT_S = COLLECTIVE_TIMEOUT_S
SCHEDULES = ("gpipe", "1f1b")
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}
TOLERANCE = 1e-5  # relative: the stages compute the same operations as one process, in the same order
RECORDER = Path(__file__).with_name("recorder.py")  # what this exercise needs recorded beyond the recorder's own
PLUGIN = "pipeline_by_hand"  # the name of the files it writes
RECORD = f"{PLUGIN}.jsonl"
QUIET_S = 5  # every rank waiting for the other and nothing recorded for this long: a deadlock, stopped there


def expected_order(schedule, rank, microbatches, stages=STAGES):
    """The passes rank `rank` of `stages` runs in one step, as ["F0", "F1", "B0", ...]."""
    forwards, backwards = [f"F{i}" for i in range(microbatches)], [f"B{i}" for i in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(stages - 1 - rank, microbatches)
    steady = [passed for pair in zip(forwards[warmup:], backwards) for passed in pair]
    return forwards[:warmup] + steady + backwards[microbatches - warmup:]


def passes_of(records):
    """{rank: {step: ["F0", "B0", ...]}}: the passes each rank ran, step by step, as the recorder measured them."""
    passes = {}
    for row in records:
        if row["event"] == "forward":
            name = f"F{row['microbatch']}"
        elif row["event"] == "backward":
            name = "B" + "+".join(map(str, row["microbatches"]))
        else:
            continue
        passes.setdefault(row["rank"], {}).setdefault(row["step"], []).append(name)
    return passes


def explained(schedule):
    if schedule == "gpipe":
        return "GPipe runs every forward, then every backward, in the order of the forwards"
    return ("in 1F1B rank r of p first runs p-1-r forwards (the warm-up), then alternates one forward and one "
            "backward, then runs the backwards left")


def capitalized(sentence):
    return sentence[:1].upper() + sentence[1:]


def unseen_problems(records, schedule):
    """Every rank's stage must run forwards the recorder sees: calls of a module with parameters."""
    missing = sorted(set(range(STAGES)) - set(passes_of(records)))
    if not missing:
        return []
    return [f"with --schedule {schedule}, the checker saw no forward of rank {listed(missing)}'s stage: each rank "
            "runs its layers as a module, self.module(received), whose calls the checker watches"]


def order_problems(records, schedule, microbatches=MICROBATCHES):
    """Each rank's passes, step by step, against the schedule's order; the first difference, said."""
    for rank, steps in sorted(passes_of(records).items()):
        expected = expected_order(schedule, rank, microbatches)
        for step, ran in sorted(steps.items()):
            if ran == expected:
                continue
            position = next((index for index, (a, b) in enumerate(zip(ran, expected)) if a != b),
                            min(len(ran), len(expected)))
            what = (f"it ran {ran[position]} and {NAMES[schedule]} runs {expected[position]}"
                    if position < min(len(ran), len(expected)) else
                    f"it ran no more and {NAMES[schedule]} runs {expected[position]}" if position < len(expected)
                    else f"{NAMES[schedule]} has run all of its passes and it ran {ran[position]}")
            return [f"with --schedule {schedule}, rank {rank} ran the passes of step {step} as {' '.join(ran)}, but "
                    f"{NAMES[schedule]}'s order for rank {rank} of {STAGES} is {' '.join(expected)} (F: forward, "
                    f"B: backward, of that micro-batch). They differ first at pass {position + 1}, where {what}: "
                    f"{explained(schedule)}"]
    return []


def held_at_once(records, rank):
    """(the most bytes of activations rank `rank` held at once, the bytes one micro-batch's forward kept) over the
    run; (0, 0) without a forward."""
    mine = [row for row in records if row["rank"] == rank and row["event"] in ("forward", "backward")]
    one = max((row["saved"] for row in mine if row["event"] == "forward"), default=0)
    return max((row["live"] for row in mine), default=0), one


def memory_problems(records, schedule):
    """1F1B holds at most p micro-batches' activations at once on a stage (GPipe: all M)."""
    if schedule != "1f1b":
        return []
    for rank in sorted({row["rank"] for row in records}):
        most, one = held_at_once(records, rank)
        if one and most > STAGES * one:
            return [f"with --schedule 1f1b rank {rank} held the activations of {most / one:.0f} micro-batches at "
                    f"once ({most:,} bytes; one micro-batch's forward keeps {one:,}), and 1F1B holds at most "
                    f"p = {STAGES}: a micro-batch's activations are freed by its backward, so 1F1B runs each "
                    "backward as soon as it can (after p-1-r forwards on rank r). If the order is 1F1B's, "
                    "something keeps the activations after their backward: backward(..., retain_graph=True) keeps "
                    "them as long as the output is referenced"]
    return []


def calls_of(records):
    """{(pid, seq): the "call" row of that point-to-point operation}."""
    return {(row["pid"], row["seq"]): row for row in records if row["event"] == "call"}


def operation(call, script):
    """`a recv from rank 1 at line N (in backward: `...`), called from line M (...)`."""
    what = {"isend": "an isend to", "send": "a send to", "irecv": "an irecv from", "recv": "a recv from"}
    where = lines_in(call["stack"], script)
    return f"{what.get(call['op'], call['op'])} rank {call['peer']}" + (
        f" at {', called from '.join(where)}" if where else "")


def hang_problems(records, schedule, script):
    """The waits that began and never returned (or returned only as the --timeout ran out), each rank's first, with
    what it had run of its step."""
    calls, ended = calls_of(records), {}
    for row in records:
        if row["event"] == "waited":
            ended[(row["pid"], row["seq"])] = row["error"]
    stuck = {}
    for row in records:
        key = (row["pid"], row["seq"]) if row["event"] == "waiting" else None
        if key and (key not in ended or ended[key]):
            stuck.setdefault(row["rank"], (row, calls.get(key)))
    if not stuck:
        return []
    passes = passes_of(records)
    said = []
    for rank, (row, call) in sorted(stuck.items()):
        ran = passes.get(rank, {}).get(row["step"], [])
        said.append(f"rank {rank} waited for {operation(call, script) if call else 'an operation'} in step "
                    f"{row['step']}, after {' '.join(ran) if ran else 'no pass'}")
    ops = {call["op"] for _, call in stuck.values() if call}
    dropped = lost_sends(records, stuck)
    if dropped:
        why = (f"rank {listed(sorted({call['rank'] for call in dropped}))} never waited for {len(dropped)} of its "
               f"isends, the first {operation(dropped[0], script)}: a Work dropped before its send completed can "
               "take the send with it, and the other rank waits for what never comes. Keep each isend's Work and "
               "wait() for it before the optimizer step")
    elif ops and ops <= {"irecv", "recv"} and len(stuck) > 1:
        why = ("each rank waits to receive what the other sends only after its own receive returns: the two ranks' "
               "orders do not match (what one sends next must be what the other receives next)")
    elif ops & {"isend", "send"}:
        why = ("a send waited for at once blocks until the other rank receives it (gloo completes a send only then), "
               "and that rank is itself blocked: post the isend, go on, and wait for its Work later, before the "
               "optimizer step")
    else:
        why = "a rank waits for something the other never sends"
    return [f"with --schedule {schedule} the ranks hung, each waiting for the other: {'; '.join(said)}. A deadlock: "
            f"{why}. {capitalized(explained(schedule))}"]


def lost_sends(records, stuck):
    """The isends never waited for that a stuck receive should have got: the peer sent as many as the stuck rank
    waits for, so they were sent and lost (a Work dropped before its send completed can take the send with it)."""
    calls = calls_of(records)
    waited = {(row["pid"], row["seq"]) for row in records if row["event"] == "waiting"}
    for rank, (row, call) in sorted(stuck.items()):
        if not call or call["op"] not in ("irecv", "recv"):
            continue
        wanted = [key for key, other in calls.items() if other["rank"] == rank and other["op"] in ("irecv", "recv")
                  and other["peer"] == call["peer"] and other["seq"] <= call["seq"]]
        sent = [(key, other) for key, other in calls.items() if other["rank"] == call["peer"]
                and other["op"] in ("isend", "send") and other["peer"] == rank]
        never = [other for key, other in sent if key not in waited]
        if len(sent) >= len(wanted) and never:
            return never
    return []


def wait_problems(records, script):
    """Every isend and irecv must be waited for: a sent tensor may not change before its send completed, a received
    one is not there before its wait, and an error shows only in the wait."""
    waited = {(row["pid"], row["seq"]) for row in records if row["event"] == "waiting"}
    for op in ("isend", "irecv"):
        never = [call for key, call in calls_of(records).items()
                 if call["op"] == op and call.get("asynchronous", True) and key not in waited]
        if never:
            ranks = sorted({call["rank"] for call in never})
            return [f"rank {listed(ranks)} never waited for {len(never)} of its {op}s, the first "
                    f"{operation(never[0], script)}: keep the Work each {op} returns and call its wait() "
                    + ("before the tensor sent is changed or freed, at the latest before the optimizer step (an "
                       "error of the send shows only there)" if op == "isend" else
                       "before reading the tensor: until then it is not there")]
    return []


def exercise():
    """The exercise's own model, batches, loss and learning rate (the repository's solution.py as a module): what the
    learner's copy trains too, whatever the copy's own functions became."""
    return script_module(SOLUTION, "pipeline_by_hand_solution")


def reference(module=None, steps=STEPS, batch_size=BATCH_SIZE, microbatches=MICROBATCHES):
    """One process training the exercise's whole model on the same batches, micro-batch by micro-batch, each loss (the
    mean squared error of its samples) divided by M: {"grads": the first step's gradients in the parameters' order,
    "weights": the state after the last step}."""
    module = module or exercise()
    model = module.whole_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=module.LEARNING_RATE)
    first = None
    for step in range(steps):
        inputs, targets = module.batch(step, batch_size)
        for source, target in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
            (torch.nn.functional.mse_loss(model(source), target) / microbatches).backward()
        if first is None:
            first = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(grads=first, weights={name: value.clone() for name, value in model.state_dict().items()})


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE * float(b.abs().max()))


def gradient_problems(grads, expected, records, schedule, microbatches=MICROBATCHES):
    """The first step's gradients of each rank ({rank: [tensor, ...] in its optimizer's order}) against one process's
    (`expected`, the whole model's, in order: rank 0 holds the first ones, rank 1 the last)."""
    own = {rank: expected[:len(tensors)] if rank == 0 else expected[len(expected) - len(tensors):]
           for rank, tensors in grads.items()}
    wrong = {}
    for rank, tensors in sorted(grads.items()):
        if any(t is None for t in tensors):
            return [f"with --schedule {schedule}, rank {rank}'s parameters had no gradient at the first optimizer "
                    "step: run a backward of every micro-batch through the stage's layers before it"]
        if [t.shape for t in tensors] != [t.shape for t in own[rank]]:
            return [f"with --schedule {schedule}, rank {rank} updated parameters of shapes "
                    f"{[tuple(t.shape) for t in tensors]}, where its half of the whole model has "
                    f"{[tuple(t.shape) for t in own[rank]]}: keep cut(whole_model(), rank)"]
        if not all(close(a, b) for a, b in zip(tensors, own[rank])):
            wrong[rank] = tensors
    if not wrong:
        return []
    flat = {rank: (torch.cat([t.flatten() for t in tensors]), torch.cat([t.flatten() for t in own[rank]]))
            for rank, tensors in wrong.items()}
    scales = {rank: float(got @ want / (want @ want)) for rank, (got, want) in flat.items()}
    if all(torch.allclose(got, scales[rank] * want, rtol=1e-4, atol=1e-6) for rank, (got, want) in flat.items()):
        factors = sorted({round(scale, 2) for scale in scales.values()})
        if factors == [float(microbatches)] and len(wrong) == STAGES:
            return [f"with --schedule {schedule}, the first step's gradients are {microbatches:.2f} times one "
                    f"process's on every stage: the micro-batches' losses were not divided by M ({microbatches}). "
                    "Divide each micro-batch's loss (the mean over its samples) by M once, so that the M "
                    "micro-batches' gradients add up to the gradient of the batch's mean loss, not to M times it"]
        if factors == [round(1 / microbatches, 2)] and len(wrong) == STAGES:
            return [f"with --schedule {schedule}, the first step's gradients are {1 / microbatches:.2f} times one "
                    f"process's on every stage (1/M, M = {microbatches}): each micro-batch's loss was divided by M "
                    "twice (in loss_fn and again where the last stage computes it, say). Divide it once: the M "
                    "micro-batches' gradients then add up to the gradient of the batch's mean loss"]
        return [f"with --schedule {schedule}, rank {listed(sorted(wrong))}'s gradients of the first step are "
                f"{listed([f'{scale:.2f}' for scale in scales.values()])} times one process's: each micro-batch's "
                f"loss is divided by M ({microbatches}), once, and every micro-batch runs one backward"]
    rank = min(wrong)
    got, want = flat[rank]
    off = float((got - want).abs().max() / want.abs().max())
    mismatch = mismatched_gradients(records, rank)
    why = (f"in step 0 its backward number {mismatch[0] + 1} ran micro-batch {mismatch[1]} with the gradient rank "
           f"{rank + 1} sent for micro-batch {mismatch[2]}: each backward needs the gradient of its own micro-batch's "
           "output, and the stage after sends them in the order of its backwards (the oldest micro-batch in "
           "flight first)" if mismatch else
           "every micro-batch runs one forward and one backward per step, each backward with the gradient of its own "
           "micro-batch's output")
    return [f"with --schedule {schedule}, rank {listed(sorted(wrong))}'s gradients of the first step differ from "
            f"one process's (rank {rank}'s by up to {off:.0%} of the largest): {why}"]


def mismatched_gradients(records, rank):
    """(k, the micro-batch rank `rank`'s k-th backward ran, the one whose gradient rank+1 sent k-th) in step 0, or
    None: the stage after sends its input's gradient after each of its backwards, in their order."""
    passes = passes_of(records)
    mine = [name for name in passes.get(rank, {}).get(0, []) if name.startswith("B")]
    theirs = [name for name in passes.get(rank + 1, {}).get(0, []) if name.startswith("B")]
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return index, a[1:], b[1:]
    return None


def weight_problems(saved, expected, schedule, steps=STEPS):
    """Each rank's weights after the last step ({rank: its stage's state_dict}) against one process's, by name."""
    for rank, state in sorted(saved.items()):
        for name, value in state.items():
            if name not in expected or not close(value, expected[name]):
                return [f"with --schedule {schedule}, rank {rank}'s weight {name} after {steps} steps differs from "
                        "one process's although the first step's gradients were the same: a later step computed "
                        "other gradients (each step must start from zero gradients, and use only its own "
                        "micro-batches)"]
    return []


def judged(job, schedule, script, expected):
    """What one run of `schedule` got wrong, from its records and the files it saved."""
    records = job.records(RECORD)
    hung = hang_problems(records, schedule, script) if not job.ok else []
    if hung:
        return hung
    if not job.ok:
        return [f"with --schedule {schedule}, {problem}" for problem in exit_problems(job, script)]
    unseen = unseen_problems(records, schedule)
    if unseen:
        return unseen
    problems = wait_problems(records, script) + order_problems(records, schedule)
    problems += memory_problems(records, schedule)
    grads = {}
    for rank in range(STAGES):
        path = job.logs_dir / f"{PLUGIN}_grads_rank{rank}.pt"
        if not path.exists():
            return problems + [f"with --schedule {schedule}, rank {rank} took no optimizer step"]
        grads[rank] = torch.load(path)
    wrong = gradient_problems(grads, expected["grads"], records, schedule)
    if wrong:
        return problems + wrong
    saved = {}
    for rank in range(STAGES):
        path = job.cwd / f"stage{rank}.pt"
        if not path.exists():
            return problems + [f"with --schedule {schedule}, rank {rank} saved no stage{rank}.pt: each rank saves its "
                               "stage's weights at the end (torch.save(module.state_dict(), f\"stage{rank}.pt\"))"]
        saved[rank] = torch.load(path)
    return problems + weight_problems(saved, expected["weights"], schedule)


def pending(records):
    """The ranks in a wait that has not returned."""
    ended = {(row["pid"], row["seq"]) for row in records if row["event"] == "waited"}
    return {row["rank"] for row in records if row["event"] == "waiting" and (row["pid"], row["seq"]) not in ended}


def until_deadlocked(jobs, say):
    """Wait for the jobs ({schedule: job}) to end, each within JOB_LIMIT_S; a job whose ranks all wait and whose records
    have not grown for QUIET_S is deadlocked: stopped there, not left to its --timeout."""
    deadline, sizes = time.monotonic() + JOB_LIMIT_S, {}
    while any(job.running() for job in jobs.values()) and time.monotonic() < deadline:
        for schedule, job in jobs.items():
            path = job.logs_dir / RECORD
            size = path.stat().st_size if path.exists() else 0
            if sizes.get(schedule, (None,))[0] != size:
                sizes[schedule] = (size, time.monotonic())
            elif (job.running() and time.monotonic() - sizes[schedule][1] > QUIET_S
                  and len(pending(job.records(RECORD))) == STAGES):
                say(f"stopped --schedule {schedule}: every rank has waited for the other for {QUIET_S} s")
                job.stop()
        time.sleep(0.2)
    for job in jobs.values():
        job.wait(max(1.0, deadline - time.monotonic()))


def check(script, workdir, say):
    """Exercise 10: both schedules, two ranks each, run at once; then one process's training in this one."""
    jobs = {}
    try:
        for schedule in SCHEDULES:
            folder = workdir / schedule
            folder.mkdir(parents=True, exist_ok=True)
            cmd = [*torchrun(script, nproc=STAGES), "--schedule", schedule, "--microbatches", MICROBATCHES,
                   "--batch_size", BATCH_SIZE, "--steps", STEPS, "--timeout", P2P_TIMEOUT_S]
            say(f"running: {shown(cmd)}")
            jobs[schedule] = start(cmd, cwd=folder, logs=folder / "records", record=True,
                                   env={"JOB_RECORD_PLUGINS": RECORDER})
        until_deadlocked(jobs, say)
    finally:
        for job in jobs.values():
            job.stop()
    expected = reference() if any(job.ok for job in jobs.values()) else None
    problems = []
    for schedule, job in jobs.items():
        problems += judged(job, schedule, script, expected)
        if job.ok:
            most, one = held_at_once(job.records(RECORD), 0)
            if one:
                say(f"{NAMES[schedule]}: rank 0 held at most {most / one:.0f} micro-batches' activations at once "
                    f"({most:,} bytes)")
    return merged(problems)


def merged(problems):
    """The problems, each once: a verdict that both schedules got is said once, for both."""
    both = "with --schedule gpipe and with --schedule 1f1b"
    said = []
    for problem in problems:
        twin = problem.replace("--schedule gpipe", "--schedule 1f1b")
        if "--schedule gpipe" in problem and twin in problems:
            problem = problem.replace("with --schedule gpipe", both)
        elif "--schedule 1f1b" in problem and problem.replace("--schedule 1f1b", "--schedule gpipe") in problems:
            continue
        said.append(problem)
    return list(dict.fromkeys(said))
