"""What context_parallel.py (step 9) plugs into the GPT's attention: the keys and values of one sequence exchanged
between the ranks that hold its parts, with torch's collectives and point-to-point ops, so that it runs on CPU
processes (gloo) and GPUs (NCCL) alike. torch's own `context_parallel` registers its ring for CUDA's attention kernels
only; docs/context-parallel.md shows it as the route on GPUs.

    split_sequence(model, group, chunks_by_rank, exchange)      inside it, the model computes a rank's chunks
    ring_attention(q, k, v, group, chunks_by_rank, n_chunks)    K and V passed around the ring, O(T/cp) of them held
    gathered_attention(q, k, v, group, chunks_by_rank, n_chunks) every rank gathers the whole K and V, O(T) held
    require_cp_fits(args, world_size)                           one line when --cp cannot split the job

A rank holds some of the sequence's `n_chunks` chunks of equal length (`chunks`: their indices, in the order its
tokens are laid out; `chunks_by_rank`: every rank's of the group). A query of chunk a sees the keys of chunk b < a
whole, of chunk a up to itself (the causal mask), of chunk b > a none: the ring skips those pairs.
"""
import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.gpt import CausalSelfAttention, size_of, unwrap


def positions_of(chunks, n_chunks, context):
    """The positions, in the whole sequence of `context` tokens, of the tokens of `chunks` (in that order)."""
    n = context // n_chunks
    return torch.cat([torch.arange(chunk * n, (chunk + 1) * n) for chunk in chunks])


@contextlib.contextmanager
def split_sequence(model, group, chunks_by_rank, exchange="ring"):
    """Inside it, `model` (a GPT, or DDP of one) takes this rank's chunks of each sequence instead of whole sequences:
    its embedding gives each token its position in the whole sequence, and every block's attention exchanges keys and
    values with the other ranks of `group` by `exchange` ("ring" or "allgather"). Outside it, the model is whole
    again (evaluation, sampling). Yields the positions of this rank's tokens, to pick its part of a batch."""
    gpt, rank, n_chunks = unwrap(model), dist.get_rank(group), sum(map(len, chunks_by_rank))
    positions = positions_of(chunks_by_rank[rank], n_chunks, gpt.config.context)
    attend = {"ring": ring_attention, "allgather": gathered_attention}[exchange]
    attentions = [module for module in gpt.modules() if isinstance(module, CausalSelfAttention)]
    gpt.embed.positions = positions.to(next(gpt.parameters()).device)
    for attention in attentions:
        attention.attend = lambda q, k, v, dropout_p: attend(q, k, v, group, chunks_by_rank, n_chunks, dropout_p)
    try:
        yield positions
    finally:
        gpt.embed.positions = None
        for attention in attentions:
            attention.attend = None


def gathered_attention(q, k, v, group, chunks_by_rank, n_chunks, dropout_p=0.0):
    """Causal attention of this rank's queries over the whole sequence's keys and values, all-gathered from the group.
    Its backward reduce-scatters: each rank gets the gradients of its own K and V, summed over the ranks' queries."""
    parts = GatherWithGradients.apply(torch.stack([k, v]), group).unbind()  # every rank's (2, B, H, T/cp, D)
    n = q.shape[-2] // len(chunks_by_rank[0])
    pieces = {chunk: part[..., i * n:(i + 1) * n, :] for part, chunks in zip(parts, chunks_by_rank)
              for i, chunk in enumerate(chunks)}
    keys, values = torch.cat([pieces[chunk] for chunk in range(n_chunks)], dim=-2)  # in sequence order
    mine = positions_of(chunks_by_rank[dist.get_rank(group)], n_chunks, n * n_chunks).to(q.device)
    visible = mine[:, None] >= torch.arange(n * n_chunks, device=q.device)[None, :]  # the causal mask, offset
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, dropout_p=dropout_p)


class GatherWithGradients(torch.autograd.Function):
    """Every rank's `tensor`, stacked in the group's rank order; backward reduce-scatters the gradients (sums them over
    the ranks and gives each its own part). torch.distributed.nn.functional's all_gather does the same, deprecated
    in torch 2.14 with no replacement on every release from 2.6 on; the collectives here are on all of them."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        gathered = tensor.new_empty((dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]))
        ALL_GATHER(gathered, tensor.contiguous(), group=group)
        return gathered.view(-1, *tensor.shape)

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty(grad.shape[1:])
        REDUCE_SCATTER(mine, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return mine, None


# torch 2.14 renames all_gather_into_tensor and reduce_scatter_tensor (deprecating the old names, which 2.6 to 2.13
# have only): the same collectives.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def ring_attention(q, k, v, group, chunks_by_rank, n_chunks, dropout_p=0.0):
    """Causal attention of this rank's queries, the keys and values passed around the ring of `group`."""
    seed = int(torch.randint(2 ** 62, (1,))) if dropout_p else 0  # the masks, drawn again in backward
    return RingAttention.apply(q, k, v, group, chunks_by_rank, n_chunks, dropout_p, seed)


class RingAttention(torch.autograd.Function):
    """In cp steps, each rank's block of keys and values visits every rank of the ring; a rank attends with its queries
    to the block it holds while the next block is on its way, and merges the partial results with an online softmax:
    per query its running maximum score m, the sum l of exp(score - m), and the output so far, rescaled by exp(m_old -
    m_new) when a block brings a higher maximum. Computed in float32 whatever the autocast.

    Backward passes the blocks around again, and behind each block the gradients of its keys and values: a partial
    sum that starts at the rank after the block's own, gains each rank's share as it goes, and reaches home after cp -
    1 hops, where the owner adds its own share (cp - 1 sends of the blocks, cp - 1 of their gradients, in float32:
    GRADIENTS_IN_TRANSIT). Every send is posted before the compute it overlaps and waited for after it: a block's
    gradients travel while the next block's are computed, and the last ones, on their way home, while the rank computes
    the rest of its own block, half of which it keeps for then."""

    @staticmethod
    def forward(ctx, q, k, v, group, chunks_by_rank, n_chunks, dropout_p, seed):
        ring = Ring(group, chunks_by_rank, q, dropout_p, seed)
        with torch.autocast(q.device.type, enabled=False):
            q32 = q.float()
            out = torch.zeros_like(q32)
            high = torch.full(q.shape[:-1], -math.inf, device=q.device)  # m, per query
            total = torch.zeros(q.shape[:-1], device=q.device)  # l, per query
            for held, key_values in ring.blocks(torch.stack([k, v])):
                keys, values = key_values.float()
                for a, qs, b, ks in ring.pairs(held):
                    scores = ring.scores(q32[..., qs, :], keys[..., ks, :], a, b)
                    new_high = torch.maximum(high[..., qs], scores.amax(-1))
                    weights = torch.exp(scores - new_high[..., None])
                    rescale = torch.exp(high[..., qs] - new_high)
                    total[..., qs] = total[..., qs] * rescale + weights.sum(-1)
                    out[..., qs, :] = (out[..., qs, :] * rescale[..., None]
                                       + ring.dropped(weights, a, b) @ values[..., ks, :])
                    high[..., qs] = new_high
                # The block just used is let go before the next exchange is posted: two blocks held at once, not three.
                del key_values, keys, values
            out = out / total[..., None]
        ctx.save_for_backward(q, k, v, out, high + torch.log(total))  # the log-sum-exp of each query's scores
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        with torch.autocast(q.device.type, enabled=False):
            q32, grad_out = q.float(), grad_out.float()
            grad_q = torch.zeros_like(q32)
            delta = (grad_out * out).sum(-1)  # per query: sum over keys of p * dP, which softmax's backward needs

            def add_gradients(grads, keys, values, pairs):
                """The gradients of the scores of `pairs` (this rank's query chunks with chunks of one block): added
                to grad_q, and to `grads`, the block's dK and dV stacked."""
                keys, values = keys.float(), values.float()
                for a, qs, b, ks in pairs:
                    scores = ring.scores(q32[..., qs, :], keys[..., ks, :], a, b)
                    probabilities = torch.exp(scores - lse[..., qs, None])
                    grads[1][..., ks, :] += ring.dropped(probabilities, a, b).transpose(-2, -1) @ grad_out[..., qs, :]
                    grad_p = ring.dropped(grad_out[..., qs, :] @ values[..., ks, :].transpose(-2, -1), a, b)
                    grad_scores = probabilities * (grad_p - delta[..., qs, None]) * ring.scale
                    grad_q[..., qs, :] += grad_scores @ keys[..., ks, :]
                    grads[0][..., ks, :] += grad_scores.transpose(-2, -1) @ q32[..., qs, :]

            # The one compute that needs nothing from the other ranks is this rank's own block: its first half runs
            # while the first block arrives, the rest while the last gradients travel home.
            own_pairs = list(ring.pairs(ring.rank))
            half = len(own_pairs) // 2
            own_grads = torch.zeros((2, *k.shape), device=k.device)
            arriving = ring.post(torch.stack([k, v])) if ring.size > 1 else None
            add_gradients(own_grads, k, v, own_pairs[:half])
            # The gradients this rank sent last on their way, and those of the block it holds next on their way in.
            partial = None
            for step in range(1, ring.size):
                held, key_values = (ring.rank - step) % ring.size, arriving.wait()
                arriving = ring.post(key_values) if step < ring.size - 1 else None
                grads = torch.zeros((2, *k.shape), device=k.device)
                add_gradients(grads, *key_values, ring.pairs(held))
                del key_values
                # The shares of the ranks the block visited before this one: they arrived during the compute above.
                if partial is not None:
                    grads += partial.wait()
                # To the next rank, which holds this block next; at the last step, the block's owner.
                partial = ring.post(grads.to(GRADIENTS_IN_TRANSIT))
                del grads
            add_gradients(own_grads, k, v, own_pairs[half:])
            if partial is not None:
                own_grads += partial.wait()
        return grad_q.to(q.dtype), own_grads[0].to(k.dtype), own_grads[1].to(v.dtype), None, None, None, None, None


# The ring's backward sends the partial sums of the gradients of keys and values in float32, whatever the inputs'
# dtype: in bfloat16 each of the cp - 1 hops would round the sum again, where one process rounds the gradient once
# (docs/context-parallel.md quotes the measured loss, benchmarks/context_parallel.py measures it).
GRADIENTS_IN_TRANSIT = torch.float32


class Transfer:
    """`tensor` on its way to the next rank of the ring while a tensor of its shape and dtype arrives from the previous
    one. The tensor sent is held until wait(): its buffer must outlive the send."""

    def __init__(self, ring, tensor):
        self.sent, self.received = tensor.contiguous(), torch.empty_like(tensor)
        self.requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, self.sent, ring.next, ring.group),
                                                dist.P2POp(dist.irecv, self.received, ring.previous, ring.group)])

    def wait(self):
        """The tensor received, once both ops are done; the tensor sent is let go."""
        for request in self.requests:
            request.wait()
        received, self.sent, self.received, self.requests = self.received, None, None, []
        return received


class Ring:
    """One RingAttention call's ring: who sends to whom, which chunk pairs a rank computes, the causal mask and the
    dropout masks of each pair (drawn from `seed`, so that backward draws the same ones)."""

    def __init__(self, group, chunks_by_rank, q, dropout_p, seed):
        self.group, self.chunks_by_rank, self.dropout_p, self.seed = group, chunks_by_rank, dropout_p, seed
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.n = q.shape[-2] // len(chunks_by_rank[self.rank])  # tokens per chunk
        self.scale = 1.0 / math.sqrt(q.shape[-1])

    def post(self, tensor):
        """A Transfer: `tensor` sent to the next rank, the previous rank's received, both posted now."""
        return Transfer(self, tensor)

    def blocks(self, key_values):
        """(the rank whose block it is, its stacked keys and values) for the cp blocks, this rank's own first. The next
        block is on its way while the caller computes with this one: the send overlaps the compute."""
        held = self.rank
        for step in range(self.size):
            arriving = self.post(key_values) if step < self.size - 1 else None
            yield held, key_values
            # The block sent is let go once its send is done (the caller let go of it already).
            key_values, held = arriving.wait() if arriving else None, (held - 1) % self.size

    def pairs(self, held):
        """(query chunk, its slice, key chunk, its slice) for every pair of a query chunk of this rank and a key chunk
        of the block held that the causal mask leaves something of: chunk b's keys are all hidden from chunk a < b."""
        for i, a in enumerate(self.chunks_by_rank[self.rank]):
            for j, b in enumerate(self.chunks_by_rank[held]):
                if b <= a:
                    yield a, slice(i * self.n, (i + 1) * self.n), b, slice(j * self.n, (j + 1) * self.n)

    def scores(self, q, k, a, b):
        """q k^T / sqrt(D) of query chunk a and key chunk b; on the diagonal (a == b), the causal mask's -inf above."""
        scores = q @ k.transpose(-2, -1) * self.scale
        if a == b:
            hidden = torch.ones(self.n, self.n, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(hidden, -math.inf)
        return scores

    def dropped(self, weights, a, b):
        """`weights` of the pair (a, b) with dropout: the same mask in forward and backward, drawn from the seed."""
        if not self.dropout_p:
            return weights
        generator = torch.Generator(weights.device).manual_seed(self.seed + a * 4096 + b)
        kept = torch.rand(weights.shape, generator=generator, device=weights.device) >= self.dropout_p
        return weights * kept / (1 - self.dropout_p)


def require_cp_fits(args, world_size):
    """Stop with one line, before any process group forms, when context_parallel.py's --cp cannot split the job: the
    processes must form whole cp groups, and the context must cut into 2 x cp chunks of equal length."""
    context = args.context or size_of(args.workload).context
    if world_size % args.cp:
        raise SystemExit(f"error: --cp {args.cp} must divide the number of processes ({world_size}): they form groups "
                         f"of {args.cp} that share each sequence")
    if context % (2 * args.cp):
        raise SystemExit(f"error: the context ({context} tokens) must cut into 2 x --cp = {2 * args.cp} chunks of "
                         f"equal length: give a --context that {2 * args.cp} divides")
