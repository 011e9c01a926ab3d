"""What the routers of a mixture-of-experts job chose, token by token, against one process: the first forward where a
token goes to other experts than in one process, and how near a tie its router's scores were there.

    reference = reference_with_routes(text, batch_size=32, epochs=2, top_k=1, workload="gpt-moe-cpu", aux_weight=0.01)
    steps = job_steps(job.samples, world_size=2, top_k=1)   # each step's loss and routes, as one process's batch
    flip = first_flip(reference, steps, top_k=1)            # None, or where, and how near a tie

A router's choice is a discrete function of continuous scores: the top_k of E probabilities. A job on several ranks
adds its gradients up in another order than one process, so after the first optimizer step its weights differ from
one process's in the last bits, and so do the router's probabilities. A token whose two best experts score within
that rounding of each other (a near-tie) can then go to the other expert: its output changes by a whole expert's
term, not by a rounding error, and from that step on the two runs train two slightly different models. The job's
samples.jsonl (harness/jobs' recorder, record=True) holds each rank's `losses` (every backward's) and `routes` (every
training forward's chosen experts); the reference is harness.one_process.train_gpt, watched as it trains.
"""
import torch

from harness import one_process
from utils.moe import MoE


def reference_with_routes(text, batch_size, epochs, **options):
    """harness.one_process.train_gpt(text, batch_size, epochs, context=64, **options), and what it did at every step:
    `step_losses`, the loss each backward() was called on (the task's plus the weighted aux loss), and `probs`, every
    training forward's router probabilities, (tokens of the batch, E) a layer, forward by forward (step by step, layer
    by layer)."""
    probs, step_losses = [], []
    record, backward = MoE._record, torch.Tensor.backward

    def noting_record(layer, layer_probs, counts):
        probs.append(layer_probs.detach().clone())
        return record(layer, layer_probs, counts)

    def noting_backward(tensor, *args, **kwargs):
        step_losses.append(tensor.item())
        return backward(tensor, *args, **kwargs)

    MoE._record, torch.Tensor.backward = noting_record, noting_backward
    try:
        result = one_process.train_gpt(text, batch_size, epochs, context=64, **options)
    finally:
        MoE._record, torch.Tensor.backward = record, backward
    return dict(result, probs=probs, step_losses=step_losses)


def decode(route, top_k, context):
    """One rank's recorded route of one forward (the hex of a byte per assignment) as (sequences, context, top_k)."""
    return torch.frombuffer(bytearray.fromhex(route), dtype=torch.uint8).long().view(-1, context, top_k)


def job_steps(samples, world_size, top_k, context=64):
    """A job's recorded passes (job.samples: one row per rank and epoch, no restart) as one process would have seen
    them: `losses`, each optimizer step's loss, the mean over the ranks (each rank's loss is the mean over its own
    sequences, and the ranks hold as many each); `routes`, every forward's chosen experts, (sequences of the whole
    batch, context, top_k), the sequences in one process's order. DistributedSampler deals the shuffled samples round
    robin, so sequence j of rank r's batch is sequence j x world_size + r of one process's batch of world_size times
    as many."""
    rows = {(row["epoch"], row["rank"]): row for row in samples}
    epochs = sorted({epoch for epoch, _ in rows})
    losses, routes = [], []
    for epoch in epochs:
        ranks = [rows[(epoch, rank)] for rank in range(world_size)]
        losses += [sum(step) / world_size for step in zip(*(row["losses"] for row in ranks))]
        for forward in zip(*(row["routes"] or [] for row in ranks)):
            parts = [decode(route, top_k, context) for route in forward]
            whole = torch.empty(sum(len(part) for part in parts), context, top_k, dtype=torch.long)
            for rank, part in enumerate(parts):
                whole[rank::world_size] = part
            routes.append(whole)
    return dict(losses=losses, routes=routes)


def margins(probs, top_k):
    """Each token's margin: its k-th best expert's probability less the (k+1)-th's, how far its route is from a tie."""
    best = probs.topk(top_k + 1, dim=-1).values
    return best[..., top_k - 1] - best[..., top_k]


def first_flip(reference, steps, top_k, context=64):
    """The first forward whose routes differ from one process's (a token sent to another set of experts), or None:
    dict(forward (its number: step x layers + layer), step, layer, tokens (how many flipped), margins (one process's
    margin of each flipped token), median_margin (over the forward's tokens), rank (how many of the forward's tokens
    have a smaller margin than the largest flipped one))."""
    layers = len(reference["probs"]) // len(reference["step_losses"])
    for forward, (probs, chosen) in enumerate(zip(reference["probs"], steps["routes"])):
        probs = probs.view(-1, context, probs.shape[-1])
        # Where the ranks cannot hold as many sequences each, DistributedSampler repeats the epoch's first ones at
        # the end of its last batch: the job's batch has those more, after one process's.
        chosen = chosen[:len(probs)]
        expected = probs.topk(top_k, dim=-1).indices.sort(-1).values
        flipped = (expected != chosen.sort(-1).values).any(-1)
        if flipped.any():
            margin = margins(probs, top_k)
            largest = margin[flipped].max()
            return dict(forward=forward, step=forward // layers, layer=forward % layers, tokens=int(flipped.sum()),
                        margins=margin[flipped].tolist(), median_margin=margin.median().item(),
                        rank=int((margin < largest).sum()))
    return None
