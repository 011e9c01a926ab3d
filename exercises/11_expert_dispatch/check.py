"""Exercise 11's checker: the experts' dispatch, judged by what the ranks computed and what they sent.

The script runs a few rounds of forward and backward of a mixture-of-experts layer split over 2 ranks, on tokens
made to load the experts unevenly, and saves for each rank and round what went in (tokens, weights:
round<i>_rank<r>_in.pt) and, once the round is done, what came out (output, gradients: round<i>_rank<r>_out.pt). The
checker makes each round's inputs as the exercise does, from the repository's solution.py (its seeded layer, its
make_tokens, its rounds), checks that the script's are those, and computes the whole layer in this process (every
expert here, each token's top_k experts run on it directly); it compares each rank's output, the gradient of its
tokens, every expert's weight gradients (held by one rank) and the router's (the ranks' sum). A gradient that is the
whole layer's with one of its two paths cut (the tokens' rows detached on their way to the experts, or the gates
detached from the router) is named as such. From expert_dispatch.jsonl (written by this folder's recorder.py: every
all_to_all_single as it was asked for, before it ran) it reads each round's all-to-alls: the split sizes must add up
to the rows of their tensors, the rows each rank sent to the other must be the assignments its tokens routed to that
rank's experts, the rows it made room for must be what the other sent, and backward must send rows too (the
gradients going back). A crash that none of this explains is said as the script's own error.
"""
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from exercises.judging import COLLECTIVE_TIMEOUT_S, JOB_LIMIT_S, WORLD_SIZE, exit_problems, lines_in, script_module
from harness.jobs import REPO, run, shown, torchrun

SOLUTION = REPO / "exercises/11_expert_dispatch/solution.py"
RECORDER = Path(__file__).with_name("recorder.py")  # what this exercise needs recorded beyond the recorder's own
ROUND_FILE = "round{round}_rank{rank}_{part}.pt"  # part "in": tokens and weights; "out": outputs, gradients
# Float32 sums in another order than the whole layer's: each value is off by about 1e-7 of the largest of the terms it
# adds up (the row's largest value stands for them), a wrong dispatch by a whole term.
RTOL, ATOL = 1e-4, 1e-5
FIX_BACKWARD = ("the gradient of each row that went to another rank must come back to the rank and the token it came "
                "from: make each all-to-all an autograd Function (AllToAll) whose backward is the same all-to-all "
                "with send and receive swapped")


def load_rounds(folder):
    """([[rank 0's saved dict, rank 1's...] for each round every rank began], the rounds every rank finished): what
    went in (tokens, weights) and, for a finished round, what came out (outputs, gradients)."""
    def saved(number, rank, part):
        path = folder / ROUND_FILE.format(round=number, rank=rank, part=part)
        return torch.load(path, weights_only=True) if path.exists() else None

    rounds, finished = [], 0
    while all(saved(len(rounds), rank, "in") for rank in range(WORLD_SIZE)):
        number = len(rounds)
        outputs = [saved(number, rank, "out") for rank in range(WORLD_SIZE)]
        rounds.append([dict(saved(number, rank, "in"), **(outputs[rank] or {})) for rank in range(WORLD_SIZE)])
        finished += finished == number and all(outputs)
    return rounds, finished


def exercise_rounds(module=None):
    """Each round's inputs as the exercise makes them, from the repository's solution.py: [[{"top_k", "tokens",
    "probe", "weights"} of rank 0, of rank 1] for each round], what every correct script saves as it begins a round."""
    module = module or script_module(SOLUTION, "expert_dispatch_solution")
    layers = []
    for rank in range(WORLD_SIZE):
        torch.manual_seed(0)  # as the script seeds every rank's whole layer, before each keeps its experts
        layers.append(module.ExpertParallelMoE(rank, WORLD_SIZE))
    rounds = []
    for number, setting in enumerate(module.ROUNDS):
        rounds.append([])
        for rank, layer in enumerate(layers):
            tokens, probe = module.make_tokens(number, rank, layer.router)
            rounds[-1].append(dict(top_k=setting["top_k"], tokens=tokens.detach(), probe=probe,
                                   weights={name: p.detach() for name, p in layer.named_parameters()}))
    return rounds


def whole_layer(saved, cut=None):
    """What the whole layer computes in one process for one round (`saved`: each rank's inputs): every rank's output
    and gradient of its tokens, the gradient of every weight (of the sum of the ranks' losses), and `routes`:
    routes[r][p], the assignments of rank r's tokens to the experts rank p holds. `cut`: "tokens", the gradients
    when the rows sent to the experts are detached from the tokens; "gates", when the gates are detached from the
    router (each cuts one of the two paths from the loss to the tokens)."""
    holder = {name: rank for rank, own in enumerate(saved) for name in own["weights"] if name.startswith("experts.")}
    weights = {name: saved[rank]["weights"][name].clone().requires_grad_() for name, rank in holder.items()}
    weights["router.weight"] = saved[0]["weights"]["router.weight"].clone().requires_grad_()
    experts = sorted({int(name.split(".")[1]) for name in holder})
    expert_rank = {number: holder[f"experts.{number}.up.weight"] for number in experts}
    top_k, loss, tokens, outputs, routes = saved[0]["top_k"], 0, [], [], []
    for own in saved:
        x = own["tokens"].clone().requires_grad_()
        gates, chosen = F.softmax(F.linear(x, weights["router.weight"]), dim=-1).topk(top_k, dim=-1)
        rows = x.detach() if cut == "tokens" else x
        gates = gates.detach() if cut == "gates" else gates
        # Every expert on every token, (tokens, experts, hidden): each token then takes its chosen experts' rows.
        every = torch.stack([F.linear(F.gelu(F.linear(rows, weights[f"experts.{e}.up.weight"],
                                                      weights[f"experts.{e}.up.bias"])),
                                      weights[f"experts.{e}.down.weight"], weights[f"experts.{e}.down.bias"])
                             for e in experts], dim=1)
        picked = every.gather(1, chosen[..., None].expand(-1, -1, every.shape[-1]))
        output = (picked * gates[..., None]).sum(1)
        loss = loss + (output * own["probe"]).sum()
        tokens.append(x)
        outputs.append(output.detach())
        ranks_chosen = torch.tensor([expert_rank[e] for e in experts])[chosen.flatten()]
        routes.append(torch.bincount(ranks_chosen, minlength=len(saved)).tolist())
    loss.backward()
    return dict(inputs=saved, outputs=outputs,
                tokens_grads=[x.grad if x.grad is not None else torch.zeros_like(x) for x in tokens],
                routes=routes, holder=holder,
                grads={name: weight.grad if weight.grad is not None else torch.zeros_like(weight)
                       for name, weight in weights.items()})


def tolerance(b):
    """How far from `b` (a value of the whole layer's) a right result may be: RTOL of each value, and ATOL of the
    largest value of its row (of the tensor, for a vector), at least ATOL."""
    scale = b.abs().amax(dim=-1, keepdim=True).clamp(min=1) if b.dim() else b.abs().clamp(min=1)
    return RTOL * b.abs() + ATOL * scale


def close(a, b):
    return a.shape == b.shape and bool(((a - b).abs() <= tolerance(b)).all())


def input_problems(rounds, expected):
    """The inputs the script saved for each round it began against the exercise's (`expected`: exercise_rounds())."""
    for number, (saved, made) in enumerate(zip(rounds, expected)):
        for rank, (own, right) in enumerate(zip(saved, made)):
            wrong = [key for key in ("top_k", "tokens", "probe") if not (
                own.get(key) == right[key] if key == "top_k" else
                isinstance(own.get(key), torch.Tensor) and close(own[key], right[key]))]
            names = sorted(set(own.get("weights") or {}) ^ set(right["weights"]))
            wrong += [f"weights ({', '.join(names)})"] if names else [
                f"weight {name}" for name in right["weights"]
                if not close(own["weights"][name], right["weights"][name])]
            if wrong:
                return [f"in round {number} rank {rank} saved other inputs than the exercise's "
                        f"({', '.join(wrong[:3])}): the checker compares the layer's results with the whole layer's "
                        "on the exercise's own tokens and weights; keep the script's torch.manual_seed(0) before the "
                        "layer, make_tokens and ROUNDS"]
    return []


def rows_differ(a, b):
    """How many rows of `a` differ from `b`'s, and the largest difference."""
    if a.shape != b.shape:
        return len(b), float("inf")
    wrong = ((a - b).abs() > tolerance(b)).any(dim=1)
    return int(wrong.sum()), float((a - b).abs().max())


def permutation(a, b):
    """Where each row of `a` is in `b`, when `a` holds `b`'s rows in another order; else None."""
    if a.shape != b.shape:
        return None
    places = []
    for row in a:
        found = [j for j in range(len(b)) if close(row, b[j])]
        if not found:
            return None
        places.append(found[0])
    return places if sorted(places) == list(range(len(b))) and places != list(range(len(b))) else None


def value_problems(rounds, references, skip_grads=False):
    """Each finished round's outputs, then its gradients, against the whole layer's (`references`: whole_layer of
    each round): the first difference found, the outputs of every round before any gradient (a wrong output makes the
    gradients wrong too). skip_grads: the gradients' verdict is already said (no rows in backward)."""
    for number, (saved, reference) in enumerate(zip(rounds, references)):
        top_k = saved[0]["top_k"]
        where = f"in round {number} (top_k {top_k})"
        for rank, own in enumerate(saved):
            expected = reference["outputs"][rank]
            if close(own["output"], expected):
                continue
            moved = permutation(own["output"], expected) if top_k == 1 else None
            if moved:
                token = next(i for i, j in enumerate(moved) if i != j)
                return [f"{where} rank {rank}'s output holds the right results in the wrong rows (token {token}'s "
                        f"row holds token {moved[token]}'s result): the results came home in the order the rows "
                        "left, sorted by expert; put each back in its token's row (index_add with the sort's order "
                        "// top_k), weighted by its gate"]
            wrong, most = rows_differ(own["output"], expected)
            return [f"{where} rank {rank}'s output differs from the whole layer's for {wrong} of its {len(expected)} "
                    f"tokens (by up to {most:.3g}): every token must get the results of its own experts, from the rank "
                    "that holds them. Check that the rank holding the experts sends the results back in the order "
                    "the rows arrived (it ran them grouped by expert), and that each token's results are weighted "
                    "by its gates"]
    if skip_grads:
        return []
    for number, (saved, reference) in enumerate(zip(rounds, references)):
        where = f"in round {number} (top_k {saved[0]['top_k']})"
        for rank, own in enumerate(saved):
            expected = reference["tokens_grads"][rank]
            if own["tokens_grad"] is None or not close(own["tokens_grad"], expected):
                return [cut_problem(where, saved, reference) or (
                    f"{where} the gradient of rank {rank}'s tokens differs from the whole layer's for "
                    f"{len(expected) if own['tokens_grad'] is None else rows_differ(own['tokens_grad'], expected)[0]}"
                    f" of its {len(expected)} tokens, though the outputs are right: {FIX_BACKWARD}")]
        wrong = expert_problem(where, saved, reference)
        if wrong:
            return [wrong]
        router = sum(own["grads"]["router.weight"] for own in saved)
        if not close(router, reference["grads"]["router.weight"]):
            return [f"{where} the router's gradient, summed over the ranks, differs from the whole layer's: each "
                    "token's results must be weighted by the gates the router gave it (probs.topk), so that the "
                    "router learns from them"]
    return []


def expert_problem(where, saved, reference):
    """The first expert weight whose gradient (on the rank that holds it) is not the whole layer's, said."""
    for name, holder in sorted(reference["holder"].items()):
        if not close(saved[holder]["grads"][name], reference["grads"][name]):
            expert = name.split(".")[1]
            return (f"{where} the gradient of expert {expert}'s {name.split('.', 2)[2]} (held by rank {holder}) "
                    "differs from the whole layer's, though the outputs are right: an expert's gradient sums "
                    f"the gradients of the rows every rank sent it: {FIX_BACKWARD}")
    return None


def cut_problem(where, saved, reference):
    """Gradients of the tokens that are the whole layer's with one path from the loss to them cut (the tokens' rows
    detached on their way to the experts, or the gates detached from the router), said; None otherwise."""
    router = sum(own["grads"]["router.weight"] for own in saved)
    for cut in ("tokens", "gates"):
        variant = whole_layer(reference["inputs"], cut)
        if not all(close(own["tokens_grad"], variant["tokens_grads"][rank]) for rank, own in enumerate(saved)):
            continue
        if not close(router, variant["grads"]["router.weight"]) or expert_problem(where, saved, reference):
            continue
        if cut == "tokens":
            return (f"{where} the tokens' gradients are only what reaches them through the router (the gates): the "
                    "results of the experts carry no gradient back to the tokens, although the all-to-alls sent the "
                    "gradients back (the experts' weights' gradients are the whole layer's). The rows sent to the "
                    "experts were cut from the tokens (tokens.detach(), .data, or a tensor made anew from their "
                    "values): take them from the tokens themselves, tokens[order // top_k], so that autograd "
                    "follows them")
        return (f"{where} the router's gradient, summed over the ranks, is {float(router.abs().max()):.2g} at most "
                "(the whole layer's reaches "
                f"{float(reference['grads']['router.weight'].abs().max()):.2g}), and the tokens' gradients lack "
                "what comes through the gates: the gates that weigh each result were cut from the router "
                "(gates.detach(), .item(), .tolist(), or computed under no_grad), so the router never learns from "
                "the results. Weigh the results with the gates topk returned, tensors of the graph")
    return None


def calls_of(dispatches, rank, number, in_backward=False):
    """The all_to_all_single calls rank `rank` asked for in round `number`'s forward (or its backward), in order."""
    return [call for call in dispatches if call["rank"] == rank and call["round"] == number and not call["restart"]
            and call["in_backward"] == in_backward]


def carries_rows(call):
    """Rows of features (tokens, results, their gradients), not numbers such as the counts."""
    return call["dtype"].startswith(("float", "bfloat")) and call["dims"] >= 2


def rows_to(call, peer):
    """The rows a recorded all_to_all_single sent to rank `peer` (without split sizes: an even share)."""
    splits = call["input_split_sizes"]
    return splits[peer] if splits else call["rows_in"] // WORLD_SIZE


def where_called(call, script):
    """ at the learner's line that asked for the call (and the line that called it there), or nothing."""
    lines = lines_in(call.get("stack"), script) if script is not None else []
    return f" at {', called from '.join(lines)}" if lines else ""


def traffic_problems(dispatches, routes, finished, script=None):
    """Each round's all-to-alls on each rank (`dispatches`: expert_dispatch.jsonl's calls; `routes`: whole_layer's
    routes of each round begun; `finished`: the rounds every rank saved): the rows sent to each other rank are the
    assignments routed to its experts, the rows a rank makes room for are what the other sends, and backward sends
    rows back."""
    def tokens_call(rank, number):
        return next((call for call in calls_of(dispatches, rank, number) if carries_rows(call)), None)

    for call in dispatches:
        given = {name: call[f"{name}_split_sizes"] for name in ("input", "output")}
        rows = dict(input=call["rows_in"], output=call["rows_out"])
        wrong = [name for name in given if given[name] is not None and sum(given[name]) != rows[name]]
        if wrong:
            sizes = " and ".join(f"{name}_split_sizes {given[name]} ({sum(given[name])} rows) for an {name} of "
                                 f"{rows[name]} rows" for name in wrong)
            swapped = (given["input"] is not None and given["output"] is not None
                       and sum(given["input"]) == rows["output"] and sum(given["output"]) == rows["input"])
            backward = (" (in backward, which sends the gradients the way back: the forward's split sizes, send and "
                        "receive swapped)" if call["in_backward"] else "")
            return [f"in round {call['round']} rank {call['rank']} called all_to_all_single"
                    f"{where_called(call, script)} with {sizes}{': the two are swapped' if swapped else ''}. "
                    "output_split_sizes are the rows it receives from each rank (what the counts exchanged say), "
                    f"adding up to the output's rows; input_split_sizes the rows it sends to each, adding up to the "
                    f"input's{backward}"]
    for number, route in enumerate(routes):
        for rank in range(WORLD_SIZE):
            call = tokens_call(rank, number)
            if call is None:
                if number < finished:
                    return [f"in round {number} no all_to_all_single carried rank {rank}'s tokens: the tokens go to "
                            "the ranks of their experts by all_to_all_single, the counts exchanged first"]
                continue
            for peer in (peer for peer in range(WORLD_SIZE) if peer != rank):
                rows, expected = rows_to(call, peer), route[rank][peer]
                if rows != expected:
                    more = "more" if rows > expected else "fewer"
                    return [f"in round {number} rank {rank} sent {rows * call['row_bytes']:,} bytes of tokens to rank "
                            f"{peer} ({rows} rows of {call['row_bytes']} bytes{where_called(call, script)}), but its "
                            f"tokens chose rank {peer}'s experts {expected} times ({expected * call['row_bytes']:,} "
                            f"bytes): {more} bytes than the dispatch needs. Send each rank only the rows its experts "
                            "take, one per assignment, sorted by expert: input_split_sizes are this rank's counts "
                            "summed over each rank's experts"]
            received = call["output_split_sizes"] or [call["rows_out"] // WORLD_SIZE] * WORLD_SIZE
            for peer in range(WORLD_SIZE):
                other = tokens_call(peer, number)
                sent = rows_to(other, rank) if other else route[peer][rank]
                if received[peer] != sent:
                    earlier = calls_of(dispatches, rank, number)
                    told = any(not carries_rows(row) for row in earlier[:earlier.index(call)])
                    fix = ("the counts it received say how many rows come from each rank: sum them over this "
                           "rank's experts for output_split_sizes" if told else
                           "nothing told it how many: no counts were exchanged before the tokens. First exchange "
                           "the counts per expert (all_to_all_single of `counts` into `incoming`), then make room "
                           "for what they say: output_split_sizes = incoming summed over this rank's experts")
                    return [f"in round {number} rank {rank} made room for {received[peer]} rows from rank {peer} "
                            f"(output_split_sizes {received}{where_called(call, script)}), but rank {peer} sent "
                            f"{sent}: the loads are uneven, so a rank cannot assume it receives what it sends; {fix}"]
    for number in range(finished):
        for rank in range(WORLD_SIZE):
            forward = [call for call in calls_of(dispatches, rank, number) if carries_rows(call)]
            backward = [call for call in calls_of(dispatches, rank, number, in_backward=True) if carries_rows(call)]
            if forward and not backward:
                return [f"in round {number} no rows travelled during rank {rank}'s backward, though {len(forward)} "
                        "all-to-all(s) carried rows in its forward: autograd does not see through "
                        f"dist.all_to_all_single, so {FIX_BACKWARD}"]
    return []


# Crashes the dispatch's mistakes cause, by what torch and gloo raise: (pattern, what to say).
CRASHES = [
    (r"Function (\w+?)(?:Backward)? returned an invalid gradient at index 0 - got \[(\d+), \d+\] but expected "
     r"shape compatible with \[(\d+), \d+\]",
     "{0}.backward returned a gradient of {1} rows for an input of {2} rows: the gradient of the rows that arrived "
     "here belongs to the ranks that sent them: backward is the same all-to-all with send and receive swapped"),
    (r"Received data size doesn't match expected size",
     "a rank received more rows than its output_split_sizes made room for (gloo aborted): a rank learns how many rows "
     "each rank sends it from the counts exchanged before the tokens (all_to_all_single of the counts per expert)"),
]


def crash_problems(job, script):
    output = job.output
    if not job.timed_out and any(code != 0 for code in job.codes):
        for pattern, verdict in CRASHES:
            match = re.search(pattern, output)
            if match:
                return [verdict.format(*match.groups())]
    return exit_problems(job, script)


def check(script, workdir, say):
    """Run the script under torchrun (2 ranks), then judge the rounds it saved and its all-to-alls."""
    out = workdir / "dispatch"
    cmd = [*torchrun(script, nproc=WORLD_SIZE), "--out", out, "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}   (2 ranks, 2 experts each; rounds of uneven loads, top_k 1 and 2)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, timeout=JOB_LIMIT_S, check=False,
              env={"JOB_RECORD_PLUGINS": RECORDER})
    rounds, finished = load_rounds(out)
    expected = exercise_rounds()[:len(rounds)]
    wrong = input_problems(rounds, expected)
    if wrong:
        return wrong
    references = [whole_layer(inputs) for inputs in expected]
    say(f"comparing {finished} round(s) with the whole layer computed in one process")
    routes = [reference["routes"] for reference in references]
    problems = traffic_problems(job.records("expert_dispatch.jsonl"), routes, finished, script)
    skip_grads = any("during rank" in problem for problem in problems)
    problems += value_problems(rounds[:finished], references, skip_grads)
    return problems or crash_problems(job, script)
