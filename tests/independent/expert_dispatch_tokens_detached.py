"""Exercise 11, wrong: the rows sent to the experts are made from detached tokens (so that the buffer sent is not part
of the graph, the learner thought): the experts' results then carry no gradient back to the tokens, though both
all-to-alls are autograd Functions and the gradients do travel back to the rank that sent each row."""


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, receive, send):
        ctx.receive, ctx.send = receive, send
        output = torch.empty((sum(receive), rows.shape[1]), dtype=rows.dtype)
        dist.all_to_all_single(output, rows, receive, send)
        return output

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad.contiguous(), ctx.send, ctx.receive), None, None


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
        k = chosen.shape[1]
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS)
        # the tokens to send, one row per assignment, out of the graph
        outgoing = tokens.detach()[order // k].contiguous()
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts)
        send = counts.reshape(self.world_size, self.per_rank).sum(1).tolist()
        receive = counts_in.reshape(self.world_size, self.per_rank).sum(1).tolist()
        rows = AllToAll.apply(outgoing, receive, send)
        local_expert = torch.arange(self.per_rank).repeat(self.world_size).repeat_interleave(counts_in)
        regroup = torch.argsort(local_expert, stable=True)
        sizes = counts_in.reshape(self.world_size, self.per_rank).sum(0).tolist()
        done = torch.cat([expert(part) for expert, part in zip(self.experts.values(), rows[regroup].split(sizes))])
        undone = torch.empty_like(done)
        undone[regroup] = done
        back = AllToAll.apply(undone, send, receive)
        out = torch.zeros_like(tokens)
        return out.index_add(0, order // k, back * gates.flatten()[order].unsqueeze(1))
