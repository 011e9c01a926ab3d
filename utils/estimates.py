"""What a layout should cost on real GPUs, on paper: each GPU's peaks (with where they are published), the model FLOPs a
device does in a step done right, the time of a step from compute and bandwidth, and the MFU that time predicts.
plan_at_scale.py (step 14) puts in what it counted; docs/reference/plan-at-scale.md derives every formula.

    GPUS["h100"]                                   its memory, dense bf16 peak, NVLink's and the network's bandwidth
    device_flops(config, sequences, tp, pp, cp)    the model FLOPs of one device in a step (6N + attention, / tp pp cp)
    step_time(...)                                 {compute, bubble, tp, dp, pp, exposed, step}: seconds a step
    mfu(flops, seconds, peak)                      model FLOPs utilisation

The MFU done right, against three mistakes seen in the wild: the tokens are the DEVICE's (a dp rank's tokens are
computed by its tp x pp x cp devices together: dividing by the dp ranks alone overstates the MFU tp x pp x cp-fold);
the FLOPs are 6 N a token plus attention's 12 L H Q T (6 N alone understates it at a long context); and
recomputation (activation checkpointing) costs time but is not model FLOPs (counting it overstates the MFU by a third).
"""
import dataclasses

from utils.gpt import flops_per_token
from utils.loop import PEAK_BF16_FLOPS


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str  # as torch.cuda.get_device_name() gives it
    memory: int  # bytes of HBM
    flops: float  # dense bf16 FLOP/s (the datasheet's "BF16 Tensor Core", half the figure "with sparsity")
    nvlink: float  # bytes/s one GPU sends to the others of its node over NVLink, one direction
    network: float  # bytes/s one GPU sends to other nodes, one direction (its own InfiniBand NIC)
    per_node: int = 8  # GPUs a node links by NVLink


# H100 SXM5 and H200 SXM, as NVIDIA publishes them: the H100 datasheet (nvidia.com/en-us/data-center/h100: 80 GB,
# BF16 Tensor Core 1,979 TFLOPS with sparsity, NVLink 900 GB/s) and the H200's (nvidia.com/en-us/data-center/h200:
# 141 GB, the same 1,979 TFLOPS, NVLink 900 GB/s). NVLink's 900 GB/s count both directions: 450 GB/s each way. Their
# DGX systems (the DGX H100/H200 user guide) give each GPU its own ConnectX-7 port of 400 Gb/s InfiniBand NDR: 50 GB/s
# each way between nodes. The memory is what the driver reports (nvidia-smi: 81,559 MiB for the "80 GB", 143,771 MiB
# for the "141 GB"), of which the CUDA context and NCCL take some (tools/memory_plan.MARGIN keeps 15% free).
GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", 81559 * 2**20, PEAK_BF16_FLOPS["NVIDIA H100 80GB HBM3"], 450e9, 50e9),
    "h200": Gpu("NVIDIA H200", 143771 * 2**20, PEAK_BF16_FLOPS["NVIDIA H200"], 450e9, 50e9),
}


def device_flops(config, sequences, tp=1, pp=1, cp=1):
    """The model FLOPs one device does in a step: its dp rank's `sequences` (of config.context tokens each) times
    flops_per_token (6 N + 12 L H Q T, forward and backward), shared by the tp x pp x cp devices that compute that dp
    rank's work together. Recomputation is not counted: it is the hardware's work, not the model's."""
    return sequences * config.context * flops_per_token(config) / (tp * pp * cp)


def recomputed_flops(config, sequences, tp=1, pp=1, cp=1):
    """The FLOPs activation checkpointing adds to a device's step: each block's forward again in backward (a third of
    its 6 N + 12 L H Q T); the embedding and the head are not recomputed."""
    C, L, T = config.n_embd, config.n_layer, config.context
    head = 6 * (2 * C + C * config.vocab_size)
    blocks = flops_per_token(config) - head
    return sequences * T * blocks / 3 / (tp * pp * cp)


def step_time(flops, gpu, tp_bytes=0.0, dp_bytes=0.0, pp_bytes=0.0, tp_link="nvlink", dp_link="network",
              pp_link="network", pp=1, microbatches=1, stages_per_rank=2, recomputed=0.0):
    """{compute, bubble, tp, dp, pp, exposed, step}: seconds a step takes on `gpu` (a Gpu), on paper.

    compute: the device's FLOPs (model FLOPs `flops` plus `recomputed`) at the GPU's peak; a lower bound, no kernel
    reaches it. bubble: what a pipeline of pp ranks idles, (pp - 1) / (stages_per_rank x microbatches) of the compute
    for an interleaved 1F1B (one_mesh.py: 2 stages a rank). tp, dp, pp: each dimension's bytes a step (one rank's
    share of each ring, what it sends) over its link's bandwidth (`*_link`: "nvlink" inside a node, "network" across
    nodes). Tensor parallelism's collectives and the pipeline's sends wait on the compute and it on them: they add up.
    FSDP's all-gathers and reduce-scatters overlap the compute (they are prefetched and run beside it): only what
    outlasts the compute adds. exposed: the communication that adds; step: compute + bubble + exposed."""
    compute = (flops + recomputed) / gpu.flops
    bubble = compute * (pp - 1) / (stages_per_rank * microbatches) if pp > 1 else 0.0
    tp_s, dp_s, pp_s = (sent / getattr(gpu, link) for sent, link in
                        ((tp_bytes, tp_link), (dp_bytes, dp_link), (pp_bytes, pp_link)))
    exposed = tp_s + pp_s + max(0.0, dp_s - compute)
    return dict(compute=compute, bubble=bubble, tp=tp_s, dp=dp_s, pp=pp_s, exposed=exposed,
                step=compute + bubble + exposed)


def mfu(flops, seconds, peak):
    """Model FLOPs utilisation of one device: the model FLOPs it does in a step over what its peak does in the step's
    time. The same for the whole job when every device does its share."""
    return flops / (seconds * peak)


# ---------------------------------------------------------------------------------------------- what each layout holds

def weights(config):
    """{blocks, edges, experts, total}: the GPT's weights (utils/gpt.GPT): its blocks' (the experts' apart, for a
    mixture of experts), its embedding's and head's (edges), and all of them."""
    C, V, T, L = config.n_embd, config.vocab_size, config.context, config.n_layer
    mlp = (4 * C * C + 4 * C) + (4 * C * C + C)
    experts = L * config.experts * mlp if config.experts else 0
    block = 4 * (C * C + C) + 4 * C + (C * config.experts if config.experts else mlp)  # attention, 2 norms, MLP/router
    edges = V * C + T * C + 2 * C + C * V  # the two embeddings, the final norm, the head
    return dict(blocks=L * block, edges=edges, experts=experts, total=L * block + edges + experts)


def textbook(step, config, world, tp=1, pp=1, ep=1, sequences=1, precision="bf16"):
    """{state, sent}: what each rank of a layout holds (its weights, gradients and AdamW's two moments: 16 bytes a
    weight, in fp32) and sends a step (a dict by group), by the formulas of docs/reference/plan-at-scale.md. Psi is a
    count of weights; d the compute dtype's bytes; b T the tokens of a dp rank's step (`sequences` of the context).
    The formulas leave out what is small: FSDP's padding, the norms and biases tensor parallelism copies, the few
    numbers the gradient clipping sends. step: "gpt" (DDP), "fsdp", "tensor_parallel" (2D), "expert_parallel"."""
    d = 2 if precision == "bf16" else 4
    psi, bT, C, L = weights(config), sequences * config.context, config.n_embd, config.n_layer
    ring = lambda n: (n - 1) / n  # noqa: E731 - a ring's share of a buffer that each rank sends
    if step == "gpt":  # every rank all of it; the gradients all-reduced in fp32
        return dict(state=16 * psi["total"], sent=dict(dp=2 * ring(world) * 4 * psi["total"]))
    if step == "fsdp":  # 1/n of it; the weights all-gathered before each forward and each backward, in d; the gradients
        return dict(state=16 * psi["total"] / world,  # reduce-scattered in fp32
                    sent=dict(dp=ring(world) * psi["total"] * (2 * d + 4)))
    if step == "tensor_parallel":  # the blocks split tp-fold, FSDP over dp of the rest; 4 all-reduces a block
        dp, held = world // tp, psi["blocks"] / tp + psi["edges"]
        return dict(state=16 * held / dp, sent=dict(dp=ring(dp) * held * (2 * d + 4),
                                                    tp=4 * L * 2 * ring(tp) * bT * C * d))
    if step == "expert_parallel":  # 1/ep of the experts, DDP of them over dp, DDP of the rest over all; 4 all-to-alls
        dp, held = world // ep, psi["experts"] / ep  # a layer: the tokens out and back, forward and backward
        return dict(state=16 * (psi["blocks"] + psi["edges"] + held),
                    sent=dict(all=2 * ring(world) * 4 * (psi["blocks"] + psi["edges"]), dp=2 * ring(dp) * 4 * held,
                              ep=4 * L * ring(ep) * bT * config.top_k * C * d))
    raise ValueError(f"no textbook formula for {step}")
