"""What the steps that train the GPT (gpt.py and the steps built on it) share around their loop and none of them
teaches: the learning-rate schedule's factor, the random-number state a snapshot saves, the model-FLOPs utilisation
of a GPU, and the checks of options that cannot run on this machine.

    warmup_cosine(total_steps)                  the learning-rate factor per optimizer step, for LambdaLR
    rng_state(), set_rng_state(state)           this process's random state (dropout), saved and put back
    mfu(model, tokens_per_s, device)            model-FLOPs utilisation of a GPU (None on a CPU)
    compiler_missing()                          why torch.compile cannot build kernels here (None: it can)
    check_options(precision, compile)           one line and exit when an option cannot run here
"""
import math
import os
import shutil
import sys

import torch

from utils.gpt import flops_per_token, unwrap


def warmup_cosine(total_steps, warmup_fraction=0.05, floor=0.1):
    """The learning-rate factor at each optimizer step, for torch.optim.lr_scheduler.LambdaLR: a linear warm-up over
    the first `warmup_fraction` of the steps (Adam's moment estimates are noisy at first: big steps then can
    throw the weights far off), then a cosine from 1 down to `floor` at the last step."""
    warmup = max(1, int(warmup_fraction * total_steps))

    def factor(step):  # step: optimizer steps taken so far (LambdaLR's count)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor



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


def peak_flops(device):
    """The GPU's peak dense bf16 FLOP/s ($TUTORIAL_PEAK_TFLOPS, else the table), or None when unknown or a CPU."""
    if os.environ.get(PEAK_VARIABLE):
        return float(os.environ[PEAK_VARIABLE]) * 1e12
    if torch.device(device).type != "cuda":
        return None
    return PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(device))


def mfu(model, tokens_per_s, device):
    """Model-FLOPs utilisation of one device: the model FLOPs its `tokens_per_s` need over its peak; None on a CPU
    or an unknown GPU. The peak is the bf16 one whatever the precision, as nanoGPT and PaLM count it."""
    peak = peak_flops(device)
    return None if peak is None else flops_per_token(unwrap(model)) * tokens_per_s / peak


def compiler_missing():
    """None if torch.compile can build kernels here, else what is missing. Inductor compiles C++ for the CPU (the
    compiler in $CXX, by default g++, clang++ on macOS); on GPUs Triton builds its launchers with a C compiler."""
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx} is not on PATH (set CXX to one)"
    if torch.cuda.is_available() and not any(map(shutil.which, [os.environ.get("CC", "cc"), "gcc", "clang"])):
        return "no C compiler for Triton: cc, gcc and clang are not on PATH (set CC to one)"
    return None


def check_options(precision, compile):
    """Stop with one line when step 6's options cannot run here: fp16 without CUDA, --compile without a compiler."""
    if precision == "fp16" and not torch.cuda.is_available():
        raise SystemExit("error: --precision fp16 needs a CUDA GPU (its gradient scaler is for GPUs); on a CPU use "
                         "--precision bf16")
    missing = compiler_missing() if compile else None
    if missing:
        raise SystemExit(f"error: --compile needs a compiler to build its kernels, and there is {missing}; "
                         "leave --compile out to train without it")


# ---------------------------------------------------------------------------------------------------- random state

def rng_state():
    """This process's random-number state: (CPU generator's, the current GPU's or None). Dropout draws from the CPU
    generator on a CPU and from the GPU's on a GPU; a snapshot that holds both resumes the same masks."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_rng_state(state):
    """Put back a state rng_state() returned. Generator states are CPU byte tensors, wherever torch.load's
    map_location put them (a snapshot loaded onto the GPU has them there)."""
    cpu, cuda = state
    torch.set_rng_state(cpu.cpu())
    if cuda is not None:
        torch.cuda.set_rng_state(cuda.cpu())
