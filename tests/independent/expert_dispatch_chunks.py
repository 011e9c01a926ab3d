"""Exercise 11, right, in another style than the solution's: an autograd Function whose backward calls
all_to_all_single itself, the assignments kept as (expert, token, gate) triples sorted together, and what arrives cut
into (sender, expert) chunks that each local expert gathers, runs, and puts back where they came."""


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
        experts = chosen.reshape(-1)
        token_of = torch.arange(len(tokens)).repeat_interleave(top_k)
        weight = gates.reshape(-1)
        by_expert = torch.sort(experts, stable=True).indices
        experts, token_of, weight = experts[by_expert], token_of[by_expert], weight[by_expert]
        mine = torch.stack([(experts == e).sum() for e in range(EXPERTS)])
        theirs = torch.zeros_like(mine)
        dist.all_to_all_single(theirs, mine)
        send = [int(n) for n in mine.view(self.world_size, self.per_rank).sum(dim=1)]
        receive = [int(n) for n in theirs.view(self.world_size, self.per_rank).sum(dim=1)]
        inbound = AllToAll.apply(tokens[token_of], receive, send)
        # what arrived: rank 0's rows for my first expert, for my second..., then rank 1's
        chunks, start = [], 0
        for sender in range(self.world_size):
            for local in range(self.per_rank):
                count = int(theirs[sender * self.per_rank + local])
                chunks.append((local, start, count))
                start += count
        outcome = [None] * len(chunks)
        for local, expert in enumerate(self.experts.values()):
            picked = [index for index, chunk in enumerate(chunks) if chunk[0] == local]
            ran = expert(torch.cat([inbound[chunks[i][1]:chunks[i][1] + chunks[i][2]] for i in picked]))
            for i, part in zip(picked, ran.split([chunks[i][2] for i in picked])):
                outcome[i] = part
        returned = AllToAll.apply(torch.cat(outcome), send, receive)
        return torch.zeros_like(tokens).index_add(0, token_of, returned * weight[:, None])
