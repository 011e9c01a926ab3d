"""Exercise 11, wrong: each result is weighed by its gate taken out as a number (gates.tolist()), so the weights are
right but the router gets no gradient from the results, and the tokens none through the gates. Both all-to-alls are
autograd Functions; the rows and their gradients travel as they should."""


class AllToAll(torch.autograd.Function):
    """all_to_all_single through autograd: forward sends send[r] rows to rank r and gets receive[r] from it; backward
    sends each row's gradient back the other way."""

    @staticmethod
    def forward(ctx, rows, receive, send):
        ctx.save_for_backward(torch.tensor(send), torch.tensor(receive))
        out = torch.empty(sum(receive), rows.shape[1], dtype=rows.dtype)
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=list(receive),
                               input_split_sizes=list(send))
        return out

    @staticmethod
    def backward(ctx, grad):
        send, receive = ctx.saved_tensors
        back = torch.empty(int(send.sum()), grad.shape[1], dtype=grad.dtype)
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=send.tolist(),
                               input_split_sizes=receive.tolist())
        return back, None, None


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
        top_k = chosen.shape[1]
        assignments = chosen.flatten()
        order = assignments.argsort(stable=True)
        counts = torch.bincount(assignments, minlength=EXPERTS)
        incoming = torch.zeros_like(counts)
        dist.all_to_all_single(incoming, counts)
        send = counts.view(self.world_size, -1).sum(1).tolist()
        receive = incoming.view(self.world_size, -1).sum(1).tolist()
        arrived = AllToAll.apply(tokens[order // top_k], receive, send)
        expert_of_row = torch.arange(self.per_rank).repeat(self.world_size).repeat_interleave(incoming)
        grouped = expert_of_row.argsort(stable=True)
        sizes = incoming.view(self.world_size, -1).sum(0).tolist()
        parts = arrived[grouped].split(sizes)
        outputs = torch.cat([expert(part) for expert, part in zip(self.experts.values(), parts)])
        results = AllToAll.apply(outputs[grouped.argsort()], send, receive)
        # the weight of each result, in the sorted order
        scale = torch.tensor(gates.flatten().tolist())[order]
        return torch.zeros_like(tokens).index_add(0, order // top_k, results * scale[:, None])
