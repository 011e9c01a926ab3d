"""What the steps that train the GPT (gpt.py and the steps built on it) share around their loop and none of them
teaches: the learning-rate schedule's factor, a sample of what the model writes, the random-number state a snapshot
saves, the model-FLOPs utilisation of a GPU, the GPT's options, and the checks of options that cannot run here.

    WarmupCosine(total_steps)                   the learning-rate factor per optimizer step, for LambdaLR
    generate(model, prompt, new_tokens, seed)   a short sample, decoded to text: what the model has learned
    rng_state(), set_rng_state(states, rank)    this process's random state (dropout), saved and put back
    every_rank_rng_state()                      every rank's rng_state(), gathered for a snapshot
    mfu(model, tokens_per_s, device)            model-FLOPs utilisation of a GPU (None on a CPU)
    compiler_missing()                          why torch.compile cannot build kernels here (None: it can)
    add_gpt_arguments(parser)                   --text, --dropout and --peak_tflops
    check_options(args)                         one line and exit when an option cannot run here
"""
import argparse
import math
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.collectives import gathered_bytes
from utils.gpt import DROPOUT_VARIABLE, decode, encode, flops_per_token, load_text, size_of, text_needed, unwrap
from utils.arguments import positive_number, probability
from utils.guards import require_dense_gpt


class WarmupCosine:
    """The learning-rate factor at each optimizer step, for torch.optim.lr_scheduler.LambdaLR: a linear warm-up over
    the first `warmup_fraction` of the steps (Adam's moment estimates are noisy at first: big steps then can throw
    the weights far off), then a cosine from 1 down to `floor` at the last step.

    An object rather than a function, so that LambdaLR's state_dict holds it: a snapshot keeps how far along the
    schedule training is. resume() fits what is left of the schedule to the steps a resumed run has left.
    """

    def __init__(self, total_steps, warmup_fraction=0.05, floor=0.1):
        self.total_steps, self.floor = total_steps, floor
        self.warmup = max(1, int(warmup_fraction * total_steps))
        # Where the schedule is at optimizer step `start`, and how far it moves per step from there: (0, 0.0, 1.0)
        # until a resume changes them.
        self.start, self.position, self.pace = 0, 0.0, 1.0

    def __call__(self, step):
        """The factor at optimizer step `step` (LambdaLR's count of the steps taken so far)."""
        at = self.position + (step - self.start) * self.pace
        if at < self.warmup:
            return (at + 1) / self.warmup
        progress = min(1.0, (at - self.warmup) / max(1, self.total_steps - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def resume(self, step, steps_left):
        """Go on from where the schedule is at `step`, spreading what is left of it over the `steps_left` optimizer
        steps this run will take. A run resumed as it was started changes nothing (bit for bit); one with more epochs,
        another world size, batch size or accumulation neither jumps nor ends early: the learning rate goes on from
        its last value and reaches the floor at the run's last step (a finished schedule stays at the floor)."""
        at = self.position + (step - self.start) * self.pace
        left = self.total_steps - at
        pace = left / steps_left if left > 0 and steps_left > 0 else 0.0
        if pace != self.pace:  # else the same steps lie ahead: nothing to change, not even the bookkeeping
            self.start, self.position, self.pace = step, at, pace


# ---------------------------------------------------------------------------------------------------- looking at it

@torch.no_grad()
def generate(model, prompt=None, new_tokens=200, seed=0, temperature=1.0, top_k=None):
    """The prompt followed by `new_tokens` characters sampled from the model, as text. The default prompt is a
    newline (the start of a line), or the first character of the vocabulary if the text has no newline.

    A generator of its own, seeded: the same model, prompt and seed give the same sample, and the global random
    state (dropout, shuffling) is left untouched, so sampling mid-training does not change the training run.
    Under FSDP every rank must call it (each forward all-gathers the weights); under DDP rank 0 alone may.
    """
    model = unwrap(model)  # eager and unwrapped: a compiled model would recompile for every new length
    config, vocab = model.config, model.vocab
    prompt = ("\n" if "\n" in vocab else vocab[0]) if prompt is None else prompt
    if not prompt:
        raise ValueError("generate() needs a prompt of at least one character, e.g. a newline")
    device = next(model.parameters()).device
    ids = encode(prompt, vocab).to(device).unsqueeze(0)  # (1, len(prompt))
    generator = torch.Generator(device).manual_seed(seed)
    was_training = model.training
    model.eval()  # no dropout while sampling
    for _ in range(new_tokens):
        logits = model(ids[:, -config.context:])[:, -1, :].float() / temperature  # scores for the next character
        if top_k is not None:  # only the k likeliest characters may be drawn
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, next_id], dim=1)
    model.train(was_training)
    return decode(ids[0], vocab)


# Dense bf16 peak of common GPUs, FLOP/s, by their full name as torch.cuda.get_device_name() gives it, matched
# exactly: a substring would give an L40 the L4's figure and an H100 NVL the SXM's. The figures are the "BF16 Tensor
# Core" lines of NVIDIA's datasheets without sparsity (half the figure marked "with sparsity"): the H100 and H200
# datasheets (SXM, PCIe, NVL), the A100 datasheet (the same figure for its SXM4 and PCIe cards), the L4, L40, L40S
# and A10 datasheets, and for the GeForce cards the Ampere GA102 and Ada Lovelace architecture whitepapers (with FP32
# accumulate). The A10G (AWS's card) has no datasheet of NVIDIA's, so it is left out, as is every other name:
# $TUTORIAL_PEAK_TFLOPS gives any GPU's peak (e.g. 989 for an H100 SXM).
PEAK_BF16_FLOPS = {
    "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12,
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L4": 121e12, "NVIDIA L40": 181e12, "NVIDIA L40S": 362e12, "NVIDIA A10": 125e12,
    "NVIDIA GeForce RTX 4090": 165e12, "NVIDIA GeForce RTX 3090": 71e12,
}
PEAK_VARIABLE = "TUTORIAL_PEAK_TFLOPS"


def peak_flops(device, peak_tflops=None):
    """The GPU's peak dense bf16 FLOP/s: `peak_tflops` x 1e12 if given, else $TUTORIAL_PEAK_TFLOPS's, else the
    table's; None when unknown or a CPU."""
    peak_tflops = peak_tflops or os.environ.get(PEAK_VARIABLE)
    if peak_tflops:
        return float(peak_tflops) * 1e12
    if torch.device(device).type != "cuda":
        return None
    return PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(device))


def mfu(model, tokens_per_s, device, peak_tflops=None):
    """Model-FLOPs utilisation: the model FLOPs that the whole job's `tokens_per_s` need, over the peak of its
    devices (peak_flops() of this one, times the world size); None on a CPU or an unknown GPU. The peak is the bf16
    one whatever the precision, as nanoGPT and PaLM count it."""
    peak = peak_flops(device, peak_tflops)
    devices = dist.get_world_size() if dist.is_initialized() else 1
    return None if peak is None else flops_per_token(unwrap(model)) * tokens_per_s / (peak * devices)


def compiler_missing():
    """None if torch.compile can build kernels here, else what is missing. Inductor compiles C++ for the CPU (the
    compiler in $CXX, by default g++, clang++ on macOS); on GPUs Triton builds its launchers with a C compiler."""
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx} is not on PATH (set CXX to one)"
    if torch.cuda.is_available() and not any(map(shutil.which, [os.environ.get("CC", "cc"), "gcc", "clang"])):
        return "no C compiler for Triton: cc, gcc and clang are not on PATH (set CC to one)"
    return None


def add_gpt_arguments(parser, text=True):
    """The GPT steps' options that are not part of their lesson: the text the GPT learns (unless `text` is False: a
    step that reads token files), its dropout, the GPU's peak for the MFU."""
    if text:
        parser.add_argument("--text", help="A UTF-8 text file to learn (default: Python's help pages)")
    parser.add_argument("--dropout", type=probability, help="Instead of the model's dropout (0: exact comparisons)")
    parser.add_argument("--peak_tflops", type=positive_number, help="The GPU's peak bf16 TFLOP/s, for the MFU")


def check_options(args):
    """Stop with one line, before the process group forms, when an option of a GPT step cannot run here or a variable
    that stands in for an option holds no usable value: fp16 without CUDA, a --grad_clip that is not above 0 (it
    would freeze the model, or train it backwards), --compile without a compiler, $TUTORIAL_GPT_DROPOUT or
    $TUTORIAL_PEAK_TFLOPS that is not a number in its range; the mixture-of-experts GPT in a step that does not add its
    load-balancing loss (all but expert_parallel.py, which has --aux_weight); a --text (or the help pages) that is no
    UTF-8 text or too short for the context (a step's --context, else the size's). The text is read here once more,
    before the process group forms: a step that stopped after it would leave gloo's threads to Python's teardown."""
    require_dense_gpt(args)
    if hasattr(args, "text"):
        load_text(args.text, text_needed(getattr(args, "context", None) or size_of(args.workload).context))
    if args.precision == "fp16" and not torch.cuda.is_available():
        raise SystemExit("error: --precision fp16 needs a CUDA GPU (its gradient scaler is for GPUs); on a CPU use "
                         "--precision bf16")
    if not args.grad_clip > 0:
        raise SystemExit(f"error: --grad_clip is the largest gradient norm a step may have: more than 0, got "
                         f"{args.grad_clip} (inf turns clipping off)")
    missing = compiler_missing() if getattr(args, "compile", False) else None  # a step without --compile too
    if missing:
        raise SystemExit(f"error: --compile needs a compiler to build its kernels, and there is {missing}; "
                         "leave --compile out to train without it")
    for variable, option, kind in ((DROPOUT_VARIABLE, "--dropout", probability), (PEAK_VARIABLE, "--peak_tflops",
                                                                                  positive_number)):
        try:
            kind(os.environ.get(variable) or "0.5")
        except argparse.ArgumentTypeError as error:
            raise SystemExit(f"error: ${variable} (what {option} is when not given) {error}; set it right or "
                             "unset it") from None


# ---------------------------------------------------------------------------------------------------- random state

def rng_state():
    """This process's random-number state: (CPU generator's, the current GPU's or None). Dropout draws from the CPU
    generator on a CPU and from the GPU's on a GPU; a snapshot that holds every rank's resumes the same masks."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def every_rank_rng_state():
    """rng_state() of every rank, in rank order, gathered as bytes (utils.collectives: no pickle crosses the wire):
    the list a snapshot saves. A collective: call it on every rank."""
    cpu, cuda = rng_state()
    cpus = gathered_bytes(cpu.numpy().tobytes())
    cudas = gathered_bytes(b"" if cuda is None else cuda.numpy().tobytes())
    return [(torch.frombuffer(bytearray(cpu), dtype=torch.uint8),
             torch.frombuffer(bytearray(cuda), dtype=torch.uint8) if cuda else None) for cpu, cuda in zip(cpus, cudas)]


def set_rng_state(states, rank):
    """Put back rank `rank`'s state from `states`, the list of every rank's rng_state() a snapshot saved.

    A job resumed on as many ranks as it was saved on draws the same dropout masks as if it had never stopped. A rank
    the snapshot holds no state for (the job resumed on more ranks) keeps the state it has, which the step seeded by
    its rank as at a fresh start; a GPU state is put back only where there is a GPU. Generator states are CPU byte
    tensors, wherever torch.load's map_location put them (a snapshot loaded onto a GPU has them there)."""
    if rank >= len(states):
        return
    cpu, cuda = states[rank]
    torch.set_rng_state(cpu.cpu())
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda.cpu())
