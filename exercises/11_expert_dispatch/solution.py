"""Exercise 11 - the experts' dispatch, solved: the two all-to-alls of a mixture-of-experts layer, by hand.

A mixture-of-experts layer holds E experts (small MLPs) and a router that picks top_k of them for each token. With
expert parallelism each of the 2 ranks holds E/2 experts (rank 0 experts 0 and 1, rank 1 experts 2 and 3), so a
token whose expert lives on the other rank travels there and its result comes back:

    1. sort the tokens' assignments by expert, and count how many each expert gets;
    2. all-to-all the counts: each rank learns how many rows the other will send it, per expert;
    3. all-to-all the tokens, with those counts as the split sizes (uneven: the router decides the loads);
    4. run the local experts on what arrived, and send the results back the same way, reversed;
    5. put the results back in the tokens' order and add them up, weighted by the router's probabilities.

Autograd goes through both all-to-alls (AllToAll): its backward sends the gradients the way back. The script runs a
few rounds of forward and backward on tokens made to load the experts unevenly and saves, for each rank and round,
what went in and what came out (outputs, gradients) in --out.

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 exercises/11_expert_dispatch/solution.py --out dispatch
    python exercises/check.py 11 exercises/11_expert_dispatch/solution.py
    diff exercises/11_expert_dispatch/start.py exercises/11_expert_dispatch/solution.py   # the exercise
"""
import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from utils import configure_cpu_threads, exit_without_teardown, positive_int, require_torchrun

EXPERTS, HIDDEN, TOKENS = 4, 8, 12  # experts in the layer, features of a token, tokens per rank and round
# Each round: the top_k of its routing, and the expert each rank's tokens lean towards (None: no lean), so the loads
# are uneven in known ways: in round 1 rank 0 sends all its tokens to rank 1's experts and rank 1 none to rank 0's
# (whose experts get no token at all); in round 2 every token's first choice is one of rank 0's experts.
ROUNDS = [dict(top_k=1, lean=(None, None)), dict(top_k=1, lean=(2, 3)), dict(top_k=2, lean=(0, 1)),
          dict(top_k=2, lean=(None, None))]


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with uneven splits, which autograd can go through: rows [sum(send[:r]),
    sum(send[:r + 1])) of `rows` go to rank r, and receive[r] rows come from rank r, in rank order."""

    @staticmethod
    def forward(ctx, rows, receive, send):
        ctx.receive, ctx.send = receive, send
        # The receiving tensor is as long as the rows every rank sends here: the counts exchanged say how many.
        arrived = rows.new_empty(sum(receive), *rows.shape[1:])
        dist.all_to_all_single(arrived, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send)
        return arrived

    @staticmethod
    def backward(ctx, grad):
        # The gradient of each row that arrived belongs to the rank that sent it: the same all-to-all, reversed.
        return AllToAll.apply(grad, ctx.send, ctx.receive), None, None


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ExpertParallelMoE(nn.Module):
    """A mixture-of-experts layer whose experts are split over the ranks: every rank builds the whole layer from the
    same seed, then keeps its own E / world_size experts (named by their number in the whole layer)."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert() for e in range(EXPERTS)})
        self.per_rank = EXPERTS // world_size
        self.mine = range(rank * self.per_rank, (rank + 1) * self.per_rank)
        for number in list(self.experts):
            if int(number) not in self.mine:
                del self.experts[number]
        self.world_size = world_size

    def forward(self, tokens, top_k):
        # The router in every rank's copy: each token's top_k experts and their weights (not renormalised).
        probs = F.softmax(self.router(tokens), dim=-1)
        gates, chosen = probs.topk(top_k, dim=-1)
        return self.dispatch(tokens, gates, chosen)

    def dispatch(self, tokens, gates, chosen):
        """The layer's output for `tokens` (N, HIDDEN): each token's chosen experts (N, top_k) run on it wherever they
        live, their results added up, weighted by `gates` (N, top_k)."""
        top_k = chosen.shape[1]
        # The N x top_k assignments sorted by expert, stably (in token order within an expert): the rows for rank r
        # are then one piece, since rank r's experts are numbered one after the other.
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS)
        routed = tokens[order // top_k]
        # Each rank tells the other how many rows it sends to each of its experts (an all-to-all of one number per
        # expert): the loads are the router's, and differ from round to round and from rank to rank.
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts)
        send = counts.view(self.world_size, -1).sum(1).tolist()
        receive = incoming.view(self.world_size, -1).sum(1).tolist()
        arrived = AllToAll.apply(routed, receive, send)
        # What arrived is grouped by sender, then by expert: grouped by expert, each local expert takes one piece.
        per_expert = incoming.view(self.world_size, -1)
        expert_of_row = torch.arange(self.per_rank).repeat(self.world_size).repeat_interleave(incoming)
        by_expert = expert_of_row.argsort(stable=True)
        pieces = arrived[by_expert].split(per_expert.sum(0).tolist())
        computed = torch.cat([expert(piece) for expert, piece in zip(self.experts.values(), pieces)])
        # Back in the order the rows arrived, then home: the reversed all-to-all returns them in the order they left.
        results = AllToAll.apply(computed[by_expert.argsort()], send, receive)
        # Home, in expert order: each result is added to its token's row, weighted by the router's probability.
        weighted = results * gates.flatten()[order, None]
        return torch.zeros_like(tokens).index_add(0, order // top_k, weighted)


def make_tokens(round_number, rank, router):
    """This rank's tokens of a round (the same on every run): random, plus a push along the router's row of the
    expert the round leans to, which makes the router pick that expert for most of them."""
    generator = torch.Generator().manual_seed(1000 * round_number + rank)
    tokens = torch.randn(TOKENS, HIDDEN, generator=generator)
    lean = ROUNDS[round_number]["lean"][rank]
    if lean is not None:
        tokens += 3 * router.weight[lean].detach() / router.weight[lean].detach().norm()
    # What the loss weighs each output with: its gradient then tells every token and every weight apart.
    probe = torch.randn(TOKENS, HIDDEN, generator=generator)
    return tokens.requires_grad_(), probe


def main(args):
    if EXPERTS % int(os.environ["WORLD_SIZE"]):
        raise SystemExit(f"error: {os.environ['WORLD_SIZE']} processes cannot hold {EXPERTS} experts evenly: start "
                         "2 (--nproc_per_node=2)")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    configure_cpu_threads(world_size)
    tag = f"[rank {rank}/{world_size} | cpu]"
    torch.manual_seed(0)  # the same whole layer on every rank, before each keeps its experts
    layer = ExpertParallelMoE(rank, world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    for round_number, setting in enumerate(ROUNDS):
        layer.zero_grad(set_to_none=True)
        tokens, probe = make_tokens(round_number, rank, layer.router)
        # What goes in is saved first: the checker can recompute a round that fails.
        weights = {name: p.detach() for name, p in layer.named_parameters()}
        torch.save(dict(top_k=setting["top_k"], tokens=tokens.detach(), probe=probe, weights=weights),
                   args.out / f"round{round_number}_rank{rank}_in.pt")
        output = layer(tokens, setting["top_k"])
        loss = (output * probe).sum()
        loss.backward()
        grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in layer.named_parameters()}
        torch.save(dict(output=output.detach(), tokens_grad=tokens.grad, grads=grads),
                   args.out / f"round{round_number}_rank{rank}_out.pt")
        print(f"{tag} round {round_number} | top_k {setting['top_k']} | loss {loss.item():.4f}")
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("dispatch"), help="Folder for each round's outputs")
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    require_torchrun("torchrun --standalone --nproc_per_node=2")
    main(parser.parse_args())
