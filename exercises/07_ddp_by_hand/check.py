"""Exercise 7's checker: DDP by hand. The learner's script runs under torchrun (2 CPU ranks, gloo) with
--bucket_mb BUCKET_MB for EPOCHS epochs; the recorder notes every all-reduce each rank started (its bytes, whether
it was asynchronous, whether a gradient hook called it during backward), when backward accumulated each gradient, when
each all-reduce was waited on (its Work's wait, or its future's) and whether its buffer was written before that, each
optimizer step with the buffers of all-reduces still alive then (the last two with this folder's recorder.py, a
plugin of the recorder). What a correct script does, step by step and rank by rank:

- it all-reduces every gradient once: the bytes of the step's all-reduces are the model's gradients' bytes;
- its buckets are those --bucket_mb makes of the gradients in the order backward hands them over (the last layer's
  first): a bucket sent once it holds --bucket_mb MiB, the partly filled last one after backward; the bytes of each
  all-reduce, in the order sent, are those buckets';
- every bucket but the last is in flight while backward still computes gradients (measured: gradients accumulated
  after its all-reduce began and before it was waited on), so communication overlaps the computation;
- each asynchronous all-reduce is waited on before the optimizer step reads the gradients, and its buffer is not
  written before that wait (the recorder runs it on a copy and compares);
- no buffer of an earlier step's all-reduces is still held at a step;
- and rank 0's final weights are what torch's DistributedDataParallel trains on the same samples: one process
  stepping on the gradient of the mean loss over both ranks' batches together (computed here, in this process, from
  the repository's model, data and optimizer).
A gradient averaged by the wrong count trains other weights: the checker trains the reference again with the
gradient that count gives (summed and not divided, divided twice, by the number of parameters, of buckets) and
names the one the learner's weights match.
"""
from pathlib import Path

import torch

from exercises.judging import (COLLECTIVE_TIMEOUT_S, JOB_LIMIT_S, WORLD_SIZE, exit_problems, line_of, listed,
                               script_module)
from harness.jobs import REPO, run, shown, torchrun

SOLUTION = REPO / "exercises" / "07_ddp_by_hand" / "solution.py"
RECORDER = Path(__file__).with_name("recorder.py")  # what this exercise needs recorded beyond the recorder's own
BUCKET_MB = 0.1  # buckets of 0.1 MiB: the MLP's 8 gradients (466 KB) make 3 of them
EPOCHS, BATCH_SIZE = 2, 16  # 40 optimizer steps of 16 samples per rank
SAVED = "hand_ddp.pt"
WEIGHT_TOLERANCE = 1e-4  # float rounding of two sums over 40 steps stays far below; a factor in the gradient does not
DIVISOR_MARGIN = 0.1  # a wrong divisor is named when its reference is 10x nearer than the right one (0.002 vs 0.30)


def exercise():
    """The exercise's own model, data and optimizer (the repository's solution.py as a module): what the learner's
    copy trains too."""
    return script_module(SOLUTION, "ddp_by_hand_solution")


def arrival_order(module):
    """[(parameter name, gradient bytes)] in the order backward hands the gradients over (the order their
    post-accumulate-grad hooks run)."""
    model = module.make_model()
    order = []
    for name, parameter in model.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda p, name=name: order.append((name, p.grad.nbytes)))
    inputs, targets = module.make_dataset()[:BATCH_SIZE]
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    return order


def bucket_sizes(gradient_bytes, bucket_mb):
    """The bytes of each bucket when gradients of these sizes, in this order, fill buckets of bucket_mb MiB: one
    leaves as soon as it holds that much; the last, partly filled, after backward (bucket_mb 0: one per gradient)."""
    buckets, filling = [], 0
    for size in gradient_bytes:
        filling += size
        if filling >= bucket_mb * 2**20:
            buckets.append(filling)
            filling = 0
    return buckets + [filling] * (filling > 0)


def global_batches(dataset_size, epochs=EPOCHS, batch_size=BATCH_SIZE, seed=None):
    """Each step's sample indices on every rank together: rank 0's batch, then rank 1's, as DistributedSampler deals
    them epoch by epoch (set_epoch) and the DataLoader batches them (drop_last)."""
    from torch.utils.data.distributed import DistributedSampler

    from utils import SEED

    batches = []
    for epoch in range(epochs):
        shares = []
        for rank in range(WORLD_SIZE):
            sampler = DistributedSampler(range(dataset_size), num_replicas=WORLD_SIZE, rank=rank,
                                         seed=SEED if seed is None else seed)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        steps = len(shares[0]) // batch_size
        batches += [[index for share in shares for index in share[step * batch_size:(step + 1) * batch_size]]
                    for step in range(steps)]
    return batches


def reference_weights(module, factor=1.0):
    """The final weights of one process training on both ranks' batches together, the gradient of their mean loss
    multiplied by `factor` before each step: with factor 1, what DistributedDataParallel's ranks compute."""
    dataset = module.make_dataset()
    model = module.make_model()
    optimizer = module.make_optimizer(model)
    inputs, targets = dataset.tensors
    for batch in global_batches(len(dataset)):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(inputs[batch]), targets[batch]).backward()
        for parameter in model.parameters():
            parameter.grad *= factor
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def wrong_divisors(parameters, buckets):
    """{factor the averaged gradient is off by: what the script divided the summed gradients by, in words}: the
    counts a learner divides by instead of the world size."""
    return {WORLD_SIZE / 1: "by nothing (1): all_reduce sums, so the gradients were the sum over the ranks",
            WORLD_SIZE / WORLD_SIZE**2: f"twice by the world size (by {WORLD_SIZE**2})",
            WORLD_SIZE / parameters: f"by the number of parameters ({parameters})",
            WORLD_SIZE / buckets: f"by the number of buckets ({buckets})"}


def reference(module=None):
    """What the verdicts compare with: {"buckets": expected bucket bytes, "gradient_bytes", "parameters",
    "in_order": the buckets of the gradients in model.parameters() order, "first": the name of the first parameter,
    "weights": {1.0: the right final weights}, "module": the exercise's, to train the weights of a wrong divisor with
    (weights_problems does, when the right ones differ)}."""
    module = module or exercise()
    order = arrival_order(module)
    buckets = bucket_sizes([size for _, size in order], BUCKET_MB)
    declared = [(name, p.nbytes) for name, p in module.make_model().named_parameters()]
    return dict(buckets=buckets, gradient_bytes=sum(size for _, size in order), parameters=len(order),
                in_order=bucket_sizes([size for _, size in declared], BUCKET_MB), first=declared[0][0],
                weights={1.0: reference_weights(module)}, module=module)


def line(call, script):
    """The learner's line that made a recorded call, as their editor shows it (None: not a line of theirs)."""
    caller = call.get("caller")
    if script and caller and Path(caller[0]) == Path(script):
        return line_of(script, caller[1], caller[2])
    return None


def where(call, script):
    """The learner's line that made a recorded call, in parentheses after a space (or nothing)."""
    return f" ({line(call, script)})" if line(call, script) else ""


def steps_of(records):
    """[(rank, step number, its backward, its gradient all-reduces, the step's own record)], rank by rank: the
    all-reduces a rank called from its step's backward's start to the optimizer step (the loss's, before the next
    backward, are not the gradients')."""
    steps = []
    for pid in dict.fromkeys(row["pid"] for row in records):
        rows = [row for row in records if row["pid"] == pid]
        for step in (row for row in rows if row["event"] == "step"):
            backward = [row for row in rows if row["event"] == "backward" and row["step"] == step["step"]]
            if not backward:
                continue
            calls = [row for row in rows if row["event"] == "call" and row["op"] == "all_reduce"
                     and row["step"] == step["step"] and row["began"] >= backward[-1]["began"]]
            steps.append((step["rank"], step["step"], backward[-1], calls, step))
    # Rank by rank (whichever process wrote first), so that a verdict names the lowest rank it applies to.
    return sorted(steps, key=lambda found: (found[0] is None, found[0] or 0, found[1]))


def sizes(numbers):
    return listed(f"{number:,}" for number in numbers)


def first_waits(records):
    """{(pid, seq): the first wait of that all-reduce} (a Work waited on again later is noted again)."""
    waits = {}
    for row in records:
        if row["event"] == "wait":
            waits.setdefault((row["pid"], row["seq"]), row)
    return waits


def overlapped(call, backward, wait):
    """How many gradients backward accumulated while `call` was in flight: after it began, before it was waited on."""
    until = wait["began"] if wait else float("inf")
    return sum(1 for at, _ in backward.get("ready") or () if call["began"] < at < until)


def bucket_problem(rank, step, calls, expected):
    """The buckets a step sent (their bytes, in the order sent) against those of the gradients in arrival order."""
    buckets = expected["buckets"]
    sent = [sum(call["bytes"]) for call in calls]
    if sent == buckets:
        return None
    filled = (f"--bucket_mb {BUCKET_MB} packs the {expected['parameters']} gradients, in the order they arrive, into "
              f"{len(buckets)} buckets ({sizes(buckets)} bytes), one all-reduce each")
    if len(calls) == expected["parameters"] and len(buckets) != len(calls):
        return (f"rank {rank} made one all-reduce per parameter ({len(calls)}) in step {step}, whatever --bucket_mb "
                f"says: {filled}. Put each ready gradient in the bucket being filled and send the bucket once it "
                "holds bucket_mb MiB (stage 3)")
    if len(calls) == 1 and len(buckets) > 1:
        return (f"rank {rank} made one all-reduce for all the gradients in step {step}, whatever --bucket_mb says: "
                f"{filled}. Send a bucket as soon as it is full, while backward computes the rest")
    if sorted(sent) == sorted(expected["in_order"]):
        return (f"rank {rank}'s all-reduces of step {step} carried {sizes(sent)} bytes, in the order sent: buckets "
                f"filled in model.parameters() order ({expected['first']} first), where backward hands the gradients "
                "over from the last layer to the first. The bucket with the first layer's gradients "
                f"({expected['in_order'][0]:,} bytes) can leave only once backward has computed its last gradient, so "
                "it overlaps "
                f"nothing. {filled[0].upper()}{filled[1:]}: fill the bucket as the hooks fire, in the order they "
                "fire")
    return (f"rank {rank}'s all-reduces of step {step} carried {sizes(sent)} bytes, in the order sent, but {filled}")


def communication_problems(records, expected, script=None):
    """What the all-reduces of each step did wrong, at most one sentence per kind of mistake (its first step).
    `expected`: reference()'s buckets, gradient_bytes and parameters (and in_order, first)."""
    steps = steps_of(records)
    if not steps:
        return ["no rank took an optimizer step after a backward: the script must train (loss.backward(), then "
                "optimizer.step()) on every rank"]
    problems = {}
    buckets, gradient_bytes = expected["buckets"], expected["gradient_bytes"]
    waits = first_waits(records)
    gradient_calls = {(call["pid"], call["seq"]) for _, _, _, calls, _ in steps for call in calls}
    for rank, step, backward, calls, began in steps:
        if not calls:
            problems.setdefault("none", f"rank {rank} all-reduced no gradient in its step {step}: it stepped with the "
                                "gradients of its own batch only, so the ranks train different models. Average every "
                                "gradient over the ranks before optimizer.step(): dist.all_reduce, then divide by the "
                                "world size (HandDDP.finish, stage 1 of the hints)")
            continue
        calls = sorted(calls, key=lambda call: call["began"])
        sent = sum(sum(call["bytes"]) for call in calls)
        if sent > gradient_bytes:
            places = "".join(f", from {place}" for place in dict.fromkeys(line(call, script) for call in calls)
                             if place)
            problems.setdefault("twice", f"rank {rank} all-reduced {sent:,} bytes in step {step}, but the model's "
                                f"gradients are {gradient_bytes:,} bytes: some were sent more than once{places}. "
                                "Each gradient belongs to one bucket and each bucket is all-reduced once: empty "
                                "self.bucket as _send_bucket takes it, and leave no other all-reduce of the gradients "
                                "(stage 1's) beside the buckets'")
        elif sent < gradient_bytes:
            problems.setdefault("partial", f"rank {rank} all-reduced {sent:,} bytes in step {step}, but the model's "
                                f"gradients are {gradient_bytes:,} bytes: {gradient_bytes - sent:,} bytes of gradients "
                                "were never averaged. After backward, finish() must send the bucket backward left "
                                "partly filled (the first layer's gradients arrive last)")
        else:
            wrong = bucket_problem(rank, step, calls, expected)
            if wrong:
                problems.setdefault("buckets", wrong)
        ready = backward.get("ready") or []
        during = [call for call in calls if call["asynchronous"] and call["in_backward"]]
        in_flight = [call for call in during if overlapped(call, backward, waits.get((call["pid"], call["seq"])))]
        blocking = [call for call in calls if call["in_backward"] and not call["asynchronous"]]
        # An asynchronous all-reduce waited on inside backward, before backward accumulated another gradient, blocks
        # it as a synchronous one does.
        at_once = [call for call in during if call not in in_flight and ready
                   and waits.get((call["pid"], call["seq"]), {}).get("began", float("inf")) < ready[-1][0]]
        if blocking or at_once:
            call = (blocking or at_once)[0]
            how = ("runs during backward but synchronously" if blocking else
                   "was waited on during backward, before backward had accumulated another gradient"
                   + where(waits[(call["pid"], call["seq"])], script))
            problems.setdefault("blocking", f"rank {rank}'s all-reduce in step {step}{where(call, script)} {how}: "
                                "backward stops until it is done, so nothing overlaps. Pass async_op=True and keep "
                                "its Work, to wait on in finish(), after backward")
        elif "buckets" not in problems and len(in_flight) < len(buckets) - 1:
            first = calls[0]
            if not in_flight and ready and first["began"] >= ready[-1][0]:
                when = (f"began {(first['began'] - ready[-1][0]) * 1e3:.1f} ms after backward had accumulated its "
                        "last gradient")
            elif not in_flight:
                when = f"began {(first['began'] - backward['ended']) * 1e3:.1f} ms after its backward ended"
            if not in_flight:
                problems.setdefault("overlap", f"rank {rank}'s first all-reduce of step {step} {when}"
                                    f"{where(first, script)}: no all-reduce was in flight while backward computed "
                                    "gradients, so nothing overlapped the backward. Start each bucket's all-reduce "
                                    "from a hook as soon as its gradients are ready "
                                    "(parameter.register_post_accumulate_grad_hook) with async_op=True (stage 2)")
            else:
                problems.setdefault("overlap", f"only {len(in_flight)} of rank {rank}'s all-reduces of step {step} "
                                    f"({sizes(sum(call['bytes']) for call in in_flight)} bytes) were in flight while "
                                    f"backward computed gradients, where the buckets of --bucket_mb {BUCKET_MB} make "
                                    f"{len(buckets) - 1} ({sizes(buckets[:-1])} bytes): send each bucket from the hook "
                                    "that fills it, asynchronously, and wait for it in finish()")
        for call in (call for call in calls if call["asynchronous"]):
            wait = waits.get((call["pid"], call["seq"]))
            if wait is None or wait["ended"] > began["began"]:
                when = "never waited on" if wait is None else "waited on only after optimizer.step() began"
                problems.setdefault("wait", f"rank {rank}'s asynchronous all-reduce of {sum(call['bytes']):,} bytes "
                                    f"in step {step}{where(call, script)} was {when}: until work.wait() returns, "
                                    "gloo may still be summing the buffer, and the step reads whatever is there. "
                                    "Keep every Work (or its future) and wait on each in finish(), before the step")
                break
            if wait.get("written"):
                problems.setdefault("written", f"rank {rank} wrote into the buffer of its all-reduce of "
                                    f"{sum(call['bytes']):,} bytes in step {step}{where(call, script)} before waiting "
                                    f"for it{where(wait, script)}: while an all-reduce is in flight, gloo reads the "
                                    "buffer and writes the sum into it, at moments of its own, so what the program "
                                    "writes there meanwhile is lost or summed, depending on the timing. Touch the "
                                    "buffer only after wait() returns: divide it there")
                break
        held = [row for row in began.get("held") or () if row["step"] < step
                and (row.get("pid", began["pid"]), row["seq"]) in gradient_calls]
        if held:
            again = [row for row in records if row["event"] == "wait" and row.get("again")
                     and row["pid"] == began["pid"] and row["step"] == step]
            problems.setdefault("held", f"rank {rank} still held, as its step {step} began, the buffers of "
                                f"{len(held)} all-reduces of earlier steps ({sum(row['bytes'] for row in held):,} "
                                f"bytes; the first of step {held[0]['step']}{where(held[0], script)})"
                                + (f" and waited again on {len(again)} of them" if again else "") +
                                ": the list of all-reduces in flight is never emptied, so it grows every step and "
                                "every finish() goes over the earlier steps' buckets again. Empty it once each has "
                                "been waited on and copied back")
    return list(problems.values())


def largest_difference(weights, other):
    return max((weights[name].float() - other[name].float()).abs().max().item() for name in other)


def weights_problems(weights, expected, structural=False, raced=False):
    """Rank 0's final weights against the reference's (expected["weights"][1.0]) and against those of the wrong
    divisors. `structural`: other verdicts already explain a difference; only a wrong divisor is then named. `raced`:
    a buffer was written while its all-reduce was in flight, and that verdict explains whatever the weights are."""
    if weights is None:
        return [f"rank 0 saved no weights to {SAVED}: the script must save model.state_dict() there after training"]
    references = expected["weights"]
    if set(weights) != set(references[1.0]):
        return [f"the weights saved to {SAVED} are not the exercise's MLP's (keys {sorted(weights)[:3]}...): save "
                "the plain model's state_dict()"]
    if largest_difference(weights, references[1.0]) <= WEIGHT_TOLERANCE or raced:
        return []
    named = wrong_divisors(expected["parameters"], len(expected["buckets"]))
    for factor in (factor for factor in named if factor not in references):
        references[factor] = reference_weights(expected["module"], factor)
    distances = {factor: largest_difference(weights, references[factor]) for factor in named}
    nearest = min(distances, key=distances.get)
    # A wrong divisor's run is not reproducible to the last bit: twice the gradient under SGD's momentum amplifies
    # float rounding (the reference's thread count alone moves its weights by 2e-3 in 40 steps). The nearest of
    # the references names it when it is far nearer than the right one.
    if distances[nearest] <= max(WEIGHT_TOLERANCE, DIVISOR_MARGIN * largest_difference(weights, references[1.0])):
        return [f"rank 0's final weights are those of gradients {nearest:g} times the average: the script divides "
                f"the summed gradients {named[nearest]}. The average over the ranks is the sum divided by the world "
                f"size ({WORLD_SIZE}): divide each bucket once, by dist.get_world_size()"]
    if structural:
        return []
    return [f"rank 0's final weights differ from those torch's DistributedDataParallel trains on the same samples by "
            f"up to {largest_difference(weights, references[1.0]):.2g}: the averaged gradients are not the mean of "
            "the ranks' gradients (each bucket's values must go back to the gradients they came from, in order)"]


def check(script, workdir, say):
    cmd = [*torchrun(script, nproc=WORLD_SIZE), "--bucket_mb", BUCKET_MB, "--epochs", EPOCHS, "--batch_size",
           BATCH_SIZE, "--save", SAVED, "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}   (every all-reduce, wait, backward and optimizer step recorded)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record_collectives=True, timeout=JOB_LIMIT_S,
              check=False, env={"JOB_RECORD_PLUGINS": RECORDER})
    if not job.ok:
        return exit_problems(job, script)
    say("computing the reference: one process on both ranks' batches, as DistributedDataParallel trains")
    expected = reference()
    problems = communication_problems(job.records("collectives.jsonl"), expected, script)
    saved = Path(workdir) / SAVED
    weights = torch.load(saved, map_location="cpu") if saved.exists() else None
    raced = any("before waiting for it" in problem for problem in problems)
    return problems + weights_problems(weights, expected, structural=bool(problems), raced=raced)
