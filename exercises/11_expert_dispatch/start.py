"""Exercise 11 - the experts' dispatch: the two all-to-alls of a mixture-of-experts layer, by hand.

A mixture-of-experts layer holds E experts (small MLPs) and a router that picks top_k of them for each token. With
expert parallelism each of the 2 ranks holds E/2 experts (rank 0 experts 0 and 1, rank 1 experts 2 and 3), so a
token whose expert lives on the other rank must travel there and its result must come back:

    1. sort the tokens' assignments by expert, and count how many each expert gets;
    2. all-to-all the counts: each rank learns how many rows the other will send it, per expert;
    3. all-to-all the tokens, with those counts as the split sizes (uneven: the router decides the loads);
    4. run the local experts on what arrived, and send the results back the same way, reversed;
    5. put the results back in the tokens' order and add them up, weighted by the router's probabilities.

Autograd must see through both all-to-alls: backward sends the gradients the way back. Work on a copy and follow the
TODOs (in AllToAll and in ExpertParallelMoE.dispatch); check it with
    python exercises/check.py 11 my_dispatch.py
which runs `torchrun --standalone --nproc_per_node=2 my_dispatch.py --out DIR` on CPU processes (as it is, the
script stops at the first TODO). The script runs a few rounds of forward and backward on tokens made to load the
experts unevenly (one rank sending all its tokens to the other's experts, an expert with no token at all) and saves
what went in and what came out; the checker compares the outputs and gradients with the whole layer computed in one
process, and counts the rows each all-to-all sent.
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
        # TODO 1: make room for the rows that come here (receive[r] from rank r), all_to_all_single them with the
        # TODO 1: split sizes, and keep on ctx what backward needs
        raise NotImplementedError("TODO 1: AllToAll.forward: send send[r] rows to rank r, receive receive[r] from it")

    @staticmethod
    def backward(ctx, grad):
        # TODO 2: the gradient of each row that arrived belongs to the rank that sent it (one gradient per input of
        # TODO 2: forward: the rows', then None for receive and send)
        raise NotImplementedError("TODO 2: AllToAll.backward: send each row's gradient back where the row came from")


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
        # TODO 3: sort the N x top_k assignments by expert (chosen.flatten()), stably, and count each expert's rows:
        # TODO 3: the rows for rank r are then one piece (rank r's experts are numbered one after the other)
        # TODO 4: all-to-all the counts, so each rank knows how many rows come to each of its experts; from them, the
        # TODO 4: rows this rank sends to each rank (send) and receives from each (receive)
        # TODO 5: send the rows (AllToAll); what arrives is grouped by sender, then by expert: regroup it by expert
        # TODO 5: for the local experts (self.experts, in order), then send the results back in the order they came
        # TODO 6: home, each result goes to its token's row, weighted by its gate (gates, in the order of `chosen`)
        raise NotImplementedError("TODO 3-6: ExpertParallelMoE.dispatch: the tokens to their experts and back")


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
