"""The mixture-of-experts GPT's MLP, and what expert_parallel.py (step 10) plugs into it: each rank holds some of
every layer's experts, and the tokens travel to the ranks of their experts and back by two all-to-alls per layer.

    MoE(config)                             a block's MLP as `experts` MLPs and a router that picks top_k per token
    split_experts(model, ep_group, batch)   keep this rank's experts of every layer; the rest are reached by all-to-all
    balance_loss(model)                     the load-balancing auxiliary loss of the last forward, summed over layers
    routing_stats(model)                    tokens per expert, aux loss, bytes moved, tokens dropped since the last call
    require_ep_fits(ep, top_k, experts, world_size)  one line when --ep or --top_k cannot split the job
    within_capacity(chosen, E, capacity)    the assignments experts keep under a capacity: first choices first

No token is dropped unless a capacity is set (capacity_factor > 0), and then only in training: every expert takes at
most ceil(capacity_factor x tokens x top_k / experts) of the assignments of each rank's tokens, every token's first
choice before any token's second, as GShard does; the others pass the layer by the residual connection alone.
Evaluation and sampling drop nothing, so the held-out loss is the same on any layout. Without a capacity, a layer
computes the same on any placement of its experts, and expert parallelism computes what one process does.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from utils.mlp import MLP


class Experts(nn.ModuleDict):
    """The experts a rank holds, keyed by their number in the whole layer ("0", "1"...: the names in a snapshot are
    the whole model's, whatever the placement). Takes the tokens grouped by expert, in the order of its keys, and
    `counts`, how many each expert gets; runs every expert, also one that gets none (DDP expects every gradient)."""

    def forward(self, tokens, counts):
        pieces = tokens.split(counts)
        return torch.cat([expert(piece) for expert, piece in zip(self.values(), pieces)])


class MoE(nn.Module):
    """A block's MLP as `config.experts` MLPs of the same shape, and a linear router: each token goes to the top_k
    experts of its router's softmax, and their outputs are added up, weighted by those probabilities (not
    renormalised: so with top_k 1 too the router learns from the loss, as in Switch Transformers)."""

    def __init__(self, config):
        super().__init__()
        self.router = nn.Linear(config.n_embd, config.experts, bias=False)
        self.experts = Experts({str(e): MLP(config) for e in range(config.experts)})
        self.n_experts, self.top_k, self.capacity_factor = config.experts, config.top_k, config.capacity_factor
        self.group = None  # the ep group that holds the layer's experts; None: all of them here
        self.batch_group = None  # the ranks whose tokens make the batch (the load and the aux loss are the batch's)
        self.aux_loss = None  # the load-balancing loss of the last training forward
        self.stats = dict(tokens=[], aux=[], bytes=0, dropped=0, assignments=0)  # since the last routing_stats()

    def forward(self, x):
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)
        # The router in its weights' precision (fp32 under bf16 autocast: bf16 would tie the scores of close experts).
        with torch.autocast(x.device.type, enabled=False):
            probs = F.softmax(self.router(tokens.to(self.router.weight.dtype)), dim=-1)  # (N, E)
        gates, chosen = probs.topk(self.top_k, dim=-1)  # (N, k): each token's experts and their weights
        # The N x k assignments sorted by expert (stably: within an expert, in token order).
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        if self.training:  # the load the router asked for, before any drop: what the aux loss evens out
            self._record(probs, counts)
        # A capacity bounds the work of training only: evaluation and sampling drop nothing, so what they compute
        # does not depend on how many tokens each rank holds. Each expert keeps `capacity` assignments, the first
        # choices first (within_capacity); the others are dropped.
        capacity = self.capacity(len(tokens)) if self.training else None
        if capacity is not None:
            kept = within_capacity(chosen, self.n_experts, capacity).flatten()
            self.stats["dropped"] += len(order) - int(kept.sum())
            order, counts = order[kept[order]], counts.clamp(max=capacity)
        routed = tokens[order // self.top_k]
        # The tokens travel in the precision the experts compute in: in bf16, half the bytes of fp32.
        if torch.is_autocast_enabled(x.device.type):
            routed = routed.to(torch.get_autocast_dtype(x.device.type))
        outputs = self._dispatch(routed, counts)
        weighted = outputs * gates.flatten()[order, None]
        return weighted.new_zeros(B * T, C).index_add_(0, order // self.top_k, weighted).view(B, T, C)

    def capacity(self, tokens):
        """The most assignments an expert takes in a training forward from a rank's `tokens` tokens:
        ceil(capacity_factor x tokens x top_k / experts). None when there is no capacity, or when it bounds nothing:
        an expert gets at most one assignment from each token, so a capacity of `tokens` or more drops none (and a
        factor so large that the product overflows to infinity bounds nothing either)."""
        share = self.capacity_factor * tokens * self.top_k / self.n_experts
        return None if self.capacity_factor == 0 or share >= tokens else math.ceil(share)

    def _dispatch(self, routed, counts):
        """The experts' outputs for `routed`, the tokens sorted by expert (`counts` per expert), in the same order."""
        if self.group is None:
            return self.experts(routed, counts.tolist())
        ep = dist.get_world_size(self.group)
        # Every rank tells every other how many tokens it sends to each of its experts: (ep, E / ep) each way.
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)
        send, receive = counts.view(ep, -1).sum(1).tolist(), incoming.view(ep, -1).sum(1).tolist()
        arrived = AllToAll.apply(routed, receive, send, self.group)  # grouped by sender, then by expert
        per_expert = incoming.view(ep, -1)
        expert_of_row = torch.arange(per_expert.shape[1], device=routed.device).repeat(ep)
        by_expert = expert_of_row.repeat_interleave(incoming).argsort(stable=True)  # regrouped by expert
        computed = self.experts(arrived[by_expert], per_expert.sum(0).tolist())
        outputs = computed.new_empty(computed.shape).index_copy_(0, by_expert, computed)  # back in arrival order
        me = dist.get_rank(self.group)
        self.stats["bytes"] += (sum(send) - send[me] + sum(receive) - receive[me]) * routed.shape[1] * routed.itemsize
        return AllToAll.apply(outputs, send, receive, self.group)  # home, in the order they left

    def _record(self, probs, counts):
        """The aux loss and the load of this training forward. Switch Transformers' loss, E x sum_e f_e P_e: f_e, the
        share of the batch's assignments that expert e got; P_e, its mean router probability. Smallest (1) when both
        are uniform. f_e counts the whole batch (summed over `batch_group`, no gradient); P_e this rank's tokens: the
        mean over the ranks of their losses is then the batch's, the loss one process computes on the whole batch."""
        load = counts.detach().clone()
        if self.batch_group is not None:
            dist.all_reduce(load, group=self.batch_group)
        self.aux_loss = self.n_experts * (load / load.sum().clamp(min=1) * probs.mean(0)).sum()
        self.stats["tokens"].append(load)
        self.stats["aux"].append(self.aux_loss.detach())
        self.stats["assignments"] += len(probs) * self.top_k


def within_capacity(chosen, n_experts, capacity):
    """Which assignments the experts keep when each takes at most `capacity`: `chosen` (tokens, k) holds each token's
    experts in the order of its choice, the result (tokens, k) is True for those kept. GShard's priority: an expert
    queues the first choices of all tokens, then their second choices, and so on; within one rank of choice, in token
    order. So a token's first choice is dropped only when its expert is full of other tokens' first choices, never for
    an earlier token's second choice."""
    n_tokens, top_k = chosen.shape
    # The queue, before it is sorted by expert: every token's first choice, then every token's second choice...
    queued = chosen.t().flatten()
    counts = torch.bincount(queued, minlength=n_experts)
    by_expert = queued.argsort(stable=True)
    # An assignment's place in its expert's queue: its position among the assignments sorted by expert, less those of
    # the experts before.
    starts = (counts.cumsum(0) - counts).repeat_interleave(counts)
    place = torch.empty_like(queued)
    place[by_expert] = torch.arange(len(queued), device=chosen.device) - starts
    return (place < capacity).view(top_k, n_tokens).t()


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits: rows [sum(send[:r]), sum(send[:r+1])) of x go to rank r of the group,
    and receive[r] rows come from it. Its backward sends the gradients the way back."""

    @staticmethod
    def forward(ctx, x, receive, send, group):
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.send, ctx.receive, ctx.group), None, None, None


def moe_layers(model):
    """The MoE layers of a model (a GPT, DDP of one, or a layer alone)."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def split_experts(model, ep_group, batch_group=None):
    """Keep, in every MoE layer, the experts of this rank of `ep_group` (rank r of ep: experts r E/ep to (r+1) E/ep
    - 1), delete the others, and send each layer's tokens to their experts' ranks from now on. `batch_group`: the
    ranks whose tokens make one batch (all of them: None is the default group), for the load and the aux loss."""
    rank, ep = dist.get_rank(ep_group), dist.get_world_size(ep_group)
    layers = moe_layers(model)
    for layer in layers:
        mine = range(rank * layer.n_experts // ep, (rank + 1) * layer.n_experts // ep)
        for number in list(layer.experts):
            if int(number) not in mine:
                del layer.experts[number]
        layer.group, layer.batch_group = ep_group, batch_group or dist.group.WORLD
    return layers


def balance_loss(model):
    """The load-balancing loss of the model's last training forward, summed over its MoE layers."""
    return sum(layer.aux_loss for layer in moe_layers(model))


def routing_stats(model):
    """What the routers did since the last call, and reset: `expert_tokens`, for every training forward, every layer's
    tokens per expert in the whole batch, as the routers chose them (before a capacity drops any); `aux_loss`, the mean
    over forwards of the summed layers' aux loss; `all_to_all_bytes`, the bytes this rank sent to other ranks in the
    forwards' two all-to-alls, the tokens out and the outputs back (it received as many; backward moves as many
    again); `dropped`, the share of assignments over capacity."""
    layers = moe_layers(model)
    if not layers or not layers[0].stats["tokens"]:
        return {}
    tokens = torch.stack([torch.stack(layer.stats["tokens"]) for layer in layers], dim=1)  # (forwards, layers, E)
    aux = torch.stack([torch.stack(layer.stats["aux"]) for layer in layers]).sum(0).mean()
    stats = dict(expert_tokens=tokens.tolist(), aux_loss=aux.item(),
                 all_to_all_bytes=sum(layer.stats["bytes"] for layer in layers),
                 dropped=sum(layer.stats["dropped"] for layer in layers) / sum(layer.stats["assignments"]
                                                                              for layer in layers))
    for layer in layers:
        layer.stats = dict(tokens=[], aux=[], bytes=0, dropped=0, assignments=0)
    return stats


def describe(stats, steps):
    """One line of routing_stats(): the busiest expert's share against an even one, the aux loss, the bytes a step."""
    tokens = torch.tensor(stats["expert_tokens"], dtype=torch.float64)
    imbalance = (tokens.amax(-1) / tokens.mean(-1).clamp(min=1e-9)).mean().item()
    line = (f"busiest expert {imbalance:.2f}x even | aux loss {stats['aux_loss']:.4f} | all-to-all "
            f"{stats['all_to_all_bytes'] / steps / 2**20:.2f} MiB/step")
    return line + (f" | dropped {stats['dropped']:.1%}" if stats["dropped"] else "")


def require_ep_fits(ep, top_k, experts, world_size):
    """Stop with one line, before any process group forms, when expert_parallel.py's --ep or --top_k cannot split the
    job of `experts` experts a layer: the processes must form whole ep groups, each rank must hold as many experts as
    the others, and a token cannot go to more experts than there are."""
    if world_size % ep or experts % ep:
        raise SystemExit(f"error: --ep {ep} must divide the number of processes ({world_size}) and of experts "
                         f"({experts}): the processes form groups of {ep}, each holding {experts}/{ep} of "
                         "every layer's experts")
    if top_k > experts:
        raise SystemExit(f"error: --top_k {top_k} is more than the {experts} experts a token can go to")


def whole_grad_norm(model, ep_group):
    """The norm of the whole model's gradient, on every rank of `ep_group`, whose ranks hold different experts: the
    squares of the experts' gradients added up over the group, those of the rest (the same on every rank) once."""
    experts = [p.grad for name, p in model.named_parameters() if ".experts." in name and p.grad is not None]
    rest = [p.grad for name, p in model.named_parameters() if ".experts." not in name and p.grad is not None]
    squares = torch.nn.utils.get_total_norm(experts) ** 2 if experts else torch.zeros(())
    dist.all_reduce(squares, group=ep_group)
    return (squares + torch.nn.utils.get_total_norm(rest) ** 2).sqrt()
