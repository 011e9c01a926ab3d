"""Exercise 4's checker: gradient accumulation with no_sync, on the GPT of step 6. The learner's script runs under
torchrun (2 ranks, --grad_accum 2, dropout 0) on a short text with every optimizer step recorded, and is judged against
one process: the number of optimizer steps, the all-reduce rounds each took, the size of the first one's gradient and
the learning rate each used.
"""
import torch

from exercises.judging import COLLECTIVE_TIMEOUT_S, WORLD_SIZE, exit_problems, listed
from harness.jobs import run, shown, torchrun
from utils import make_workload

ACCUM_K, ACCUM_BATCH, ACCUM_EPOCHS = 2, 4, 2  # micro-batches per step, micro-batch per rank, epochs
ACCUM_TEXT_CHARS = 4600  # a short excerpt of the help pages: 64 training blocks, so 4 optimizer steps an epoch


def accumulation_reference(text):
    """What a correct run's first optimizer step and schedule look like, computed here in one process without DDP
    (dropout 0): the norm of the mean gradient over the step's 2 x K x b samples (the first 2Kb of the sampler's
    epoch-0 order: rank r trains on positions r, r+2, ...), the peak learning rate and the optimizer steps of an
    epoch."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    workload = make_workload("gpt-cpu", text=str(text), dropout=0)
    per_step = WORLD_SIZE * ACCUM_K * ACCUM_BATCH
    sampler = DistributedSampler(workload.train_set, num_replicas=1, rank=0)
    source, targets = next(iter(DataLoader(workload.train_set, batch_size=per_step, sampler=sampler)))
    workload.loss_fn(workload.model(source), targets).backward()
    norm = torch.cat([p.grad.flatten() for p in workload.model.parameters()]).double().norm().item()
    # Each rank's micro-batches in an epoch, as the step's DataLoader deals them (the sampler pads the data to a
    # multiple of the ranks, the last micro-batch may be short); the last optimizer step takes what is left of them.
    micro_batches = len(DataLoader(workload.train_set, batch_size=ACCUM_BATCH,
                                   sampler=DistributedSampler(workload.train_set, num_replicas=WORLD_SIZE, rank=0)))
    steps_per_epoch = -(-micro_batches // ACCUM_K)
    return norm, workload.optimizer.param_groups[0]["lr"], steps_per_epoch


def accumulation_problems(steps, reference):
    """What the recorded optimizer steps of rank 0 say about the accumulation: their number, the all-reduce rounds
    each took, the size of the first one's gradient, and the learning rate each used. With the right number of steps,
    the communication (or, when that is right, the gradient's size) and the schedule are judged apart: a script can
    get both wrong."""
    from utils.loop import WarmupCosine

    norm, peak_lr, steps_per_epoch = reference
    expected_steps, K = ACCUM_EPOCHS * steps_per_epoch, ACCUM_K
    if not steps:
        return ["no optimizer step was taken (or the model was not wrapped in DDP)"]
    if len(steps) != expected_steps:
        return [f"rank 0 took {len(steps)} optimizer steps in {ACCUM_EPOCHS} epochs, expected {expected_steps}: "
                f"with --grad_accum {K}, step the optimizer once per {K} micro-batches (when `last` is True), "
                "not after every micro-batch"]
    problems = []
    rounds = sorted({step["rounds"] for step in steps})
    ratio = steps[0]["grad_norms"][0] / norm
    # With a round per micro-batch, the first round's gradient is not the step's: its size says nothing then.
    if rounds != [1]:
        problems.append(f"DDP all-reduced the gradients {listed(rounds)} time(s) per optimizer step, once per "
                        f"micro-batch: with --grad_accum {K} that is {K}x the communication. Run all but the last "
                        "micro-batch inside `with self.model.no_sync():`, the forward too (DDP decides in forward "
                        "whether backward syncs)")
    elif abs(ratio - K) < 0.01 * K:
        problems.append(f"the gradient of an optimizer step is {ratio:.2f}x the mean over its micro-batches: the K={K} "
                        "micro-batches' gradients add up, so divide each micro-batch's loss by K (by `micro_batches`) "
                        "before backward")
    elif abs(ratio - 1) > 0.01:
        problems.append(f"the gradient of the first optimizer step is {ratio:.2f}x the mean over its {K} "
                        f"micro-batches on {WORLD_SIZE} ranks, expected 1x: each step must average exactly those "
                        "samples")
    factor = WarmupCosine(expected_steps)
    for number, step in enumerate(steps):
        expected = peak_lr * factor(number)
        if abs(step["lr"] - expected) > 1e-6 * peak_lr:
            problems.append(f"optimizer step {number} used learning rate {step['lr']:.3g}, expected {expected:.3g}: "
                            "the warm-up + cosine schedule counts optimizer steps, so call scheduler.step() once per "
                            "optimizer step (after the last micro-batch), not once per micro-batch")
            break
    return problems


def check(script, workdir, say):
    """Exercise 4: 2 ranks, --grad_accum 2, dropout 0, on a short text; every optimizer step recorded (its learning
    rate, and the gradient all-reduces DDP ran for it)."""
    from utils.gpt import help_pages

    text = workdir / "text.txt"
    text.write_text(help_pages()[:ACCUM_TEXT_CHARS])
    cmd = [*torchrun(script, ACCUM_EPOCHS, ACCUM_EPOCHS, nproc=WORLD_SIZE), "--workload", "gpt-cpu", "--batch_size",
           ACCUM_BATCH, "--grad_accum", ACCUM_K, "--timeout", COLLECTIVE_TIMEOUT_S, "--text", text, "--dropout", 0]
    say(f"running: {shown(cmd)}   ({ACCUM_TEXT_CHARS:,} characters of Python's help pages)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record_steps=True, timeout=120, check=False)
    problems = exit_problems(job)
    if problems:
        return problems
    return accumulation_problems([step for step in job.steps if step["rank"] == 0], accumulation_reference(text))
