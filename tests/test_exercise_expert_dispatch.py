"""Exercise 11, the experts' dispatch: each verdict of exercises/11_expert_dispatch/check.py on records and rounds
made up here (the all-to-alls as its recorder.py writes them, each rank's saved outputs and gradients), the whole layer
the outputs are compared with, and (slow) the start file and seeded mistakes of the solution run for real, each
reaching its own verdict."""
import re
import types

import pytest
import torch
import torch.nn.functional as F

from exercises.check import exercise_checker
from mistakes import CHECKING, exercise_problems, seeded, written
from harness.jobs import REPO

checker = exercise_checker(11)  # exercises/11_expert_dispatch/check.py
(ROUND_FILE, crash_problems, exercise_rounds, input_problems, load_rounds, traffic_problems, value_problems,
 whole_layer) = (
    checker.ROUND_FILE, checker.crash_problems, checker.exercise_rounds, checker.input_problems, checker.load_rounds,
    checker.traffic_problems, checker.value_problems, checker.whole_layer)

pytestmark = CHECKING  # the slow tests run checks

SOLUTION = "exercises/11_expert_dispatch/solution.py"
ROUTES = [[4, 8], [6, 6]]  # routes[r][p]: the assignments of rank r's tokens to rank p's experts
HIDDEN, EXPERTS = 8, 4
ROW_BYTES = 4 * HIDDEN


@pytest.fixture
def script(tmp_path):
    """A learner's script, as far as the verdicts quote it: the all-to-all at line 3, called from line 7."""
    path = tmp_path / "my_dispatch.py"
    lines = {3: "        dist.all_to_all_single(arrived, rows, output_split_sizes=receive, input_split_sizes=send)",
             7: "        arrived = AllToAll.apply(routed, receive, send)"}
    path.write_text("\n".join(lines.get(number, "") for number in range(1, 10)) + "\n")
    return path


def a2a(script, rank, number, dtype="float32", send=None, receive=None, rows_in=None, rows_out=None,
        in_backward=False):
    """expert_dispatch.jsonl's row of one all_to_all_single, asked for at line 3 of `script`, called from line 7."""
    row_bytes = 8 if dtype == "int64" else ROW_BYTES
    return dict(pid=100 + rank, rank=rank, restart=0, round=number, in_backward=in_backward, dtype=dtype,
                dims=1 if dtype == "int64" else 2,
                rows_in=sum(send) if rows_in is None else rows_in, rows_out=sum(receive) if rows_out is None
                else rows_out, row_bytes=row_bytes, input_split_sizes=send, output_split_sizes=receive,
                stack=[["/elsewhere/launcher.py", 40, "main"], [str(script), 7, "dispatch"],
                       [str(script), 3, "forward"]])


def a_round(script, number=0, routes=ROUTES, counts=True, backward=True):
    """A correct round's all-to-alls on both ranks: the counts, the tokens out, the results back, and (backward) the
    gradients of both, the way back."""
    rows = []
    for rank in range(2):
        send, receive = routes[rank], [routes[peer][rank] for peer in range(2)]
        if counts:
            rows.append(a2a(script, rank, number, "int64", rows_in=EXPERTS, rows_out=EXPERTS))
        rows += [a2a(script, rank, number, send=send, receive=receive),
                 a2a(script, rank, number, send=receive, receive=send)]
        if backward:
            rows += [a2a(script, rank, number, send=send, receive=receive, in_backward=True),
                     a2a(script, rank, number, send=receive, receive=send, in_backward=True)]
    return rows


def test_a_correct_dispatchs_all_to_alls_get_no_verdict(script):
    rows = a_round(script, 0) + a_round(script, 1, routes=[[0, 12], [0, 12]])
    assert traffic_problems(rows, [ROUTES, [[0, 12], [0, 12]]], finished=2, script=script) == []


def test_split_sizes_that_do_not_add_up_to_the_rows_are_named_swapped_in_forward_or_backward(script):
    swapped = [a2a(script, 0, 0, "int64", rows_in=EXPERTS, rows_out=EXPERTS),
               a2a(script, 0, 0, send=[4, 6], receive=[4, 8], rows_in=12, rows_out=10)]
    assert traffic_problems(swapped, [ROUTES], finished=0, script=script) == [
        "in round 0 rank 0 called all_to_all_single at line 3 (in forward: `dist.all_to_all_single(arrived, rows, "
        "output_split_sizes=receive, input_split_sizes=send)`), called from line 7 (in dispatch: `arrived = "
        "AllToAll.apply(routed, receive, send)`) with input_split_sizes [4, 6] (10 rows) for an input of 12 rows and "
        "output_split_sizes [4, 8] (12 rows) for an output of 10 rows: the two are swapped. output_split_sizes are "
        "the rows it receives from each rank (what the counts exchanged say), adding up to the output's rows; "
        "input_split_sizes the rows it sends to each, adding up to the input's"]
    backward = a_round(script, backward=False) + [a2a(script, 1, 0, send=[8, 6], receive=[6, 6], rows_in=12,
                                                      in_backward=True)]
    [problem] = traffic_problems(backward, [ROUTES], finished=0, script=script)
    assert problem.startswith("in round 0 rank 1 called all_to_all_single at line 3") and problem.endswith(
        "with input_split_sizes [8, 6] (14 rows) for an input of 12 rows. output_split_sizes are the rows it receives "
        "from each rank (what the counts exchanged say), adding up to the output's rows; input_split_sizes the rows "
        "it sends to each, adding up to the input's (in backward, which sends the gradients the way back: the "
        "forward's split sizes, send and receive swapped)"), problem


def test_every_token_sent_to_every_rank_is_more_bytes_than_the_tokens_routed_there(script):
    everywhere = a_round(script, routes=[[12, 12], [12, 12]], counts=False)
    assert traffic_problems(everywhere, [ROUTES], finished=1, script=script) == [
        "in round 0 rank 0 sent 384 bytes of tokens to rank 1 (12 rows of 32 bytes at line 3 (in forward: "
        "`dist.all_to_all_single(arrived, rows, output_split_sizes=receive, input_split_sizes=send)`), called from "
        "line 7 (in dispatch: `arrived = AllToAll.apply(routed, receive, send)`)), but its tokens chose rank 1's "
        "experts 8 times (256 bytes): more bytes than the dispatch needs. Send each rank only the rows its experts "
        "take, one per assignment, sorted by expert: input_split_sizes are this rank's counts summed over each "
        "rank's experts"]
    # no split sizes at all: an even share of the rows to each rank
    even = [a2a(script, rank, 0, rows_in=24, rows_out=24) for rank in range(2)]
    assert traffic_problems(even, [ROUTES], finished=1, script=script)[0].startswith(
        "in round 0 rank 0 sent 384 bytes of tokens to rank 1 (12 rows of 32 bytes")
    fewer = a_round(script, routes=[[4, 7], [6, 6]])
    assert "but its tokens chose rank 1's experts 8 times (256 bytes): fewer bytes" in traffic_problems(
        fewer, [ROUTES], finished=1)[0]


def test_room_made_for_the_rows_sent_here_without_the_counts_is_named_with_the_missing_exchange(script):
    """The even-load guess: each rank makes room for as many rows from each rank as it sends there. Rank 1 crashed in
    the call (gloo aborts a rank that receives more than it made room for): the route says what it sent."""
    guessed = [a2a(script, 0, 0, send=[4, 8], receive=[4, 8])]
    assert traffic_problems(guessed, [ROUTES], finished=0, script=script) == [
        "in round 0 rank 0 made room for 8 rows from rank 1 (output_split_sizes [4, 8] at line 3 (in forward: "
        "`dist.all_to_all_single(arrived, rows, output_split_sizes=receive, input_split_sizes=send)`), called from "
        "line 7 (in dispatch: `arrived = AllToAll.apply(routed, receive, send)`)), but rank 1 sent 6: the loads are "
        "uneven, so a rank cannot assume it receives what it sends; nothing told it how many: no counts were "
        "exchanged before the tokens. First exchange the counts per expert (all_to_all_single of `counts` into "
        "`incoming`), then make room for what they say: output_split_sizes = incoming summed over this rank's "
        "experts"]
    told = [a2a(script, 0, 0, "int64", rows_in=EXPERTS, rows_out=EXPERTS)] + guessed
    assert traffic_problems(told, [ROUTES], finished=0, script=script)[0].endswith(
        "so a rank cannot assume it receives what it sends; the counts it received say how many rows come from each "
        "rank: sum them over this rank's experts for output_split_sizes")


def test_no_rows_in_backward_means_autograd_never_sent_the_gradients_back(script):
    assert traffic_problems(a_round(script, backward=False), [ROUTES], finished=1, script=script) == [
        "in round 0 no rows travelled during rank 0's backward, though 2 all-to-all(s) carried rows in its forward: "
        "autograd does not see through dist.all_to_all_single, so the gradient of each row that went to another rank "
        "must come back to the rank and the token it came from: make each all-to-all an autograd Function (AllToAll) "
        "whose backward is the same all-to-all with send and receive swapped"]
    # a round not finished (a crash in its backward) is not judged by its backward
    assert traffic_problems(a_round(script, backward=False), [ROUTES], finished=0, script=script) == []
    counts_only = [row for row in a_round(script) if row["dtype"] == "int64"]
    assert traffic_problems(counts_only, [ROUTES], finished=1)[0].startswith(
        "in round 0 no all_to_all_single carried rank 0's tokens")


# --- the outputs and gradients, against the whole layer ---------------------------------------------------------------

def made_up_round(top_k, seed=0, tokens=6):
    """What both ranks saved of a round of a made-up layer (rank 0 holds experts 0 and 1, rank 1 experts 2 and 3):
    what went in, and what came out as the whole layer computes it."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    router = draw(EXPERTS, HIDDEN)
    experts = {f"experts.{e}.{name}": draw(*shape) for e in range(EXPERTS) for name, shape in (
        ("up.weight", (2 * HIDDEN, HIDDEN)), ("up.bias", (2 * HIDDEN,)), ("down.weight", (HIDDEN, 2 * HIDDEN)),
        ("down.bias", (HIDDEN,)))}
    saved = [dict(top_k=top_k, tokens=draw(tokens, HIDDEN), probe=draw(tokens, HIDDEN),
                  weights={"router.weight": router, **{name: weight for name, weight in experts.items()
                                                       if int(name.split(".")[1]) // 2 == rank}})
             for rank in range(2)]
    reference = whole_layer(saved)
    for rank, own in enumerate(saved):
        own.update(output=reference["outputs"][rank].clone(), tokens_grad=reference["tokens_grads"][rank].clone(),
                   grads={name: (reference["grads"][name] / 2 if name == "router.weight" else
                                 reference["grads"][name]).clone() for name in own["weights"]})
    return saved, reference


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_whole_layer_runs_each_tokens_chosen_experts_on_it_weighted_by_its_gates(top_k):
    """Token by token in float64, against the checker's float32 layer. Each output value is a sum of products, some as
    large as 20 that cancel to 0.004: float32 rounds each such sum to within about 2^-24 x (the number of terms) x (the
    sum of their magnitudes), so the bound is that, per value, with the magnitudes computed here too."""
    saved, reference = made_up_round(top_k)
    weights = {name: weight.double() for own in saved for name, weight in own["weights"].items()}
    for rank, own in enumerate(saved):
        probs = F.softmax(own["tokens"].double() @ weights["router.weight"].t(), dim=-1)
        for token, x in enumerate(own["tokens"].double()):
            gates, chosen = probs[token].topk(top_k)
            expected, magnitude = 0, 0
            for gate, e in zip(gates, chosen.tolist()):
                up, down = F.linear(x, weights[f"experts.{e}.up.weight"], weights[f"experts.{e}.up.bias"]), \
                    weights[f"experts.{e}.down.weight"]
                hidden = F.gelu(up)
                expected = expected + gate * F.linear(hidden, down, weights[f"experts.{e}.down.bias"])
                upstream = (weights[f"experts.{e}.up.weight"].abs() @ x.abs()
                            + weights[f"experts.{e}.up.bias"].abs())  # bounds the error the hidden values carry
                magnitude = magnitude + gate * (down.abs() @ (hidden.abs() + 1.2 * upstream)
                                                + weights[f"experts.{e}.down.bias"].abs())
            bound = 4 * 2**-24 * (2 * HIDDEN + HIDDEN + 2) * magnitude
            assert ((reference["outputs"][rank][token].double() - expected).abs() <= bound).all(), \
                (reference["outputs"][rank][token], expected, bound)
        assert reference["routes"][rank] == [int((probs.topk(top_k).indices // 2 == peer).sum()) for peer in (0, 1)]
    assert reference["holder"] == {name: int(name.split(".")[1]) // 2 for name in weights if name != "router.weight"}


def test_right_outputs_and_gradients_get_no_verdict():
    rounds, references = zip(*(made_up_round(top_k, seed) for seed, top_k in enumerate([1, 2])))
    assert value_problems(rounds, references) == []


def test_right_results_rounded_another_way_get_no_verdict():
    """The same layer computed in float64, then rounded to float32: what a right dispatch's other summation order
    gives, off the whole layer's by float32's rounding of values as large as the row's largest."""
    rounds, references = [], []
    for seed, top_k in enumerate([1, 2]):
        saved, reference = made_up_round(top_k, seed)
        wider = whole_layer([dict(own, tokens=own["tokens"].double(), probe=own["probe"].double(),
                                  weights={name: w.double() for name, w in own["weights"].items()}) for own in saved])
        for rank, own in enumerate(saved):
            own.update(output=wider["outputs"][rank].float(), tokens_grad=wider["tokens_grads"][rank].float(),
                       grads={name: (wider["grads"][name] / 2 if name == "router.weight" else
                                     wider["grads"][name]).float() for name in own["weights"]})
        assert any(not torch.equal(own["output"], reference["outputs"][rank]) for rank, own in enumerate(saved))
        rounds.append(saved)
        references.append(reference)
    assert value_problems(rounds, references) == []


def test_the_right_results_in_the_wrong_rows_are_told_from_wrong_results():
    saved, reference = made_up_round(top_k=1)
    saved[1]["output"] = saved[1]["output"][[1, 0, 2, 3, 4, 5]]
    assert value_problems([saved], [reference]) == [
        "in round 0 (top_k 1) rank 1's output holds the right results in the wrong rows (token 0's row holds token "
        "1's result): the results came home in the order the rows left, sorted by expert; put each back in its "
        "token's row (index_add with the sort's order // top_k), weighted by its gate"]
    saved[1]["output"] = reference["outputs"][1].clone()
    saved[1]["output"][3] += 0.5
    assert value_problems([saved], [reference]) == [
        "in round 0 (top_k 1) rank 1's output differs from the whole layer's for 1 of its 6 tokens (by up to 0.5): "
        "every token must get the results of its own experts, from the rank that holds them. Check that the rank "
        "holding the experts sends the results back in the order the rows arrived (it ran them grouped by expert), "
        "and that each token's results are weighted by its gates"]


def test_wrong_gradients_behind_right_outputs_name_what_differs():
    saved, reference = made_up_round(top_k=2)
    saved[0]["tokens_grad"] = torch.zeros_like(saved[0]["tokens_grad"])
    assert value_problems([saved], [reference])[0].startswith(
        "in round 0 (top_k 2) the gradient of rank 0's tokens differs from the whole layer's for 6 of its 6 tokens, "
        "though the outputs are right: the gradient of each row that went to another rank must come back")
    assert value_problems([saved], [reference], skip_grads=True) == []  # said already, from the all-to-alls
    saved, reference = made_up_round(top_k=2)
    saved[1]["grads"]["experts.3.down.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)
    assert value_problems([saved], [reference])[0].startswith(
        "in round 0 (top_k 2) the gradient of expert 3's down.weight (held by rank 1) differs from the whole "
        "layer's, though the outputs are right: an expert's gradient sums the gradients of the rows every rank sent")
    saved, reference = made_up_round(top_k=2)
    saved[1]["grads"]["router.weight"] = saved[0]["grads"]["router.weight"] * 0
    assert value_problems([saved], [reference])[0].startswith(
        "in round 0 (top_k 2) the router's gradient, summed over the ranks, differs from the whole layer's")


def saved_as(reference, saved, cut):
    """Each rank's saved round with the gradients of the whole layer with one path `cut`."""
    variant = whole_layer(reference["inputs"], cut)
    for rank, own in enumerate(saved):
        own.update(tokens_grad=variant["tokens_grads"][rank].clone(),
                   grads={name: (variant["grads"][name] / 2 if name == "router.weight" else
                                 variant["grads"][name]).clone() for name in own["weights"]})
    return saved


def test_tokens_cut_from_their_rows_and_gates_cut_from_the_router_are_named_not_the_all_to_alls():
    saved, reference = made_up_round(top_k=2)
    [problem] = value_problems([saved_as(reference, saved, "tokens")], [reference])
    assert problem.startswith("in round 0 (top_k 2) the tokens' gradients are only what reaches them through the "
                              "router (the gates): the results of the experts carry no gradient back to the tokens, "
                              "although the all-to-alls sent the gradients back"), problem
    saved, reference = made_up_round(top_k=2)
    [problem] = value_problems([saved_as(reference, saved, "gates")], [reference])
    assert re.match(r"in round 0 \(top_k 2\) the router's gradient, summed over the ranks, is 0 at most \(the whole "
                    r"layer's reaches [\d.]+\), and the tokens' gradients lack what comes through the gates: the gates "
                    r"that weigh each result were cut from the router", problem), problem
    assert "autograd Function" not in problem


def test_inputs_other_than_the_exercises_are_named_and_the_exercises_are_the_solutions():
    rounds = exercise_rounds()
    assert [own["top_k"] for own, _ in rounds] == [1, 1, 2, 2]
    assert sorted(rounds[0][1]["weights"]) == ["experts.2.down.bias", "experts.2.down.weight", "experts.2.up.bias",
                                               "experts.2.up.weight", "experts.3.down.bias", "experts.3.down.weight",
                                               "experts.3.up.bias", "experts.3.up.weight", "router.weight"]
    assert input_problems(rounds, exercise_rounds()) == []
    changed = [[dict(own) for own in saved] for saved in rounds]
    changed[1][0]["tokens"] = changed[1][0]["tokens"] + 0.1
    assert input_problems(changed, rounds) == [
        "in round 1 rank 0 saved other inputs than the exercise's (tokens): the checker compares the layer's results "
        "with the whole layer's on the exercise's own tokens and weights; keep the script's torch.manual_seed(0) "
        "before the layer, make_tokens and ROUNDS"]


def test_the_rounds_every_rank_finished_are_those_judged_by_their_results(tmp_path):
    saved, _ = made_up_round(top_k=1)
    for rank, own in enumerate(saved):
        torch.save({key: own[key] for key in ("top_k", "tokens", "probe", "weights")},
                   tmp_path / ROUND_FILE.format(round=0, rank=rank, part="in"))
        torch.save({key: own[key] for key in ("output", "tokens_grad", "grads")},
                   tmp_path / ROUND_FILE.format(round=0, rank=rank, part="out"))
        torch.save({key: own[key] for key in ("top_k", "tokens", "probe", "weights")},
                   tmp_path / ROUND_FILE.format(round=1, rank=rank, part="in"))
    torch.save({}, tmp_path / ROUND_FILE.format(round=1, rank=0, part="out"))  # rank 1 never finished round 1
    rounds, finished = load_rounds(tmp_path)
    assert (len(rounds), finished) == (2, 1)
    assert torch.equal(rounds[0][1]["output"], saved[1]["output"]) and "output" not in rounds[1][1]


def test_a_backward_that_returns_the_gradient_unsent_and_a_gloo_abort_are_named(script):
    def crashed(output):
        return types.SimpleNamespace(timed_out=False, codes=[1], output=output)

    assert crash_problems(crashed(
        "[rank0]: RuntimeError: Function AllToAllBackward returned an invalid gradient at index 0 - got [12, 8] but "
        "expected shape compatible with [14, 8]\n"), script) == [
        "AllToAll.backward returned a gradient of 12 rows for an input of 14 rows: the gradient of the rows that "
        "arrived here belongs to the ranks that sent them: backward is the same all-to-all with send and receive "
        "swapped"]
    assert crash_problems(crashed(
        "  what():  [enforce fail at pair.cc:464] op.preamble.length <= op.nbytes. 256 vs 192. Received data size "
        "doesn't match expected size.\n"), script)[0].startswith(
        "a rank received more rows than its output_split_sizes made room for (gloo aborted)")
    [other] = crash_problems(crashed(f'Traceback (most recent call last):\n  File "{script}", line 7, in dispatch\n'
                                     "NotImplementedError: TODO 3-6\n"), script)
    assert other.startswith("it exited with code 1, at line 7 (in dispatch: `arrived = AllToAll.apply("), other


# --- run for real: the start file and seeded mistakes of the solution --------------------------------------------

def checked(path, tmp_path):
    return exercise_problems(11, path, tmp_path)


@pytest.mark.slow
def test_the_start_file_stops_at_its_first_todo_and_the_checker_says_where(tmp_path):
    [problem] = checked(REPO / "exercises/11_expert_dispatch/start.py", tmp_path)
    assert re.match(r"it exited with code 1, at line \d+ \(in dispatch: `raise NotImplementedError\(\"TODO 3-6: "
                    r"ExpertParallelMoE\.dispatch: .*NotImplementedError: TODO 3-6", problem, re.S), problem


# The split sizes given the wrong way round: torch refuses them (the records say why, before the call).
SWAPPED = (r"output_split_sizes=receive, input_split_sizes=send", "output_split_sizes=send, input_split_sizes=receive")
# No counts exchanged: each rank makes room for what it sends (gloo aborts the rank that receives more).
NO_COUNTS = (r"incoming = torch\.empty_like\(counts\)\n *dist\.all_to_all_single\(incoming, counts\)",
             "incoming = counts")
# The results added up home as if they came back in the tokens' order, not sorted by expert.
NOT_UNSORTED = (r"return torch\.zeros_like\(tokens\)\.index_add\(0, order // top_k, weighted\)",
                "return weighted.view(len(tokens), top_k, -1).sum(1)")
# The all-to-alls out of autograd's sight, as a bare dist.all_to_all_single would be: no gradient goes back.
DETACHED = [(r"(arrived = AllToAll\.apply\(routed, receive, send\))", r"\1.detach()"),
            (r"(results = AllToAll\.apply\(.*\))", r"\1.detach()")]
# Every token to every rank, every expert run on all of them: right results, too many bytes.
EVERYWHERE = (r"(?s)(        top_k = chosen\.shape\[1\]\n).*?(\n\n\ndef make_tokens)", "\\1" + """\
        everyone = [len(tokens)] * self.world_size
        arrived = AllToAll.apply(tokens.repeat(self.world_size, 1), everyone, everyone)
        computed = torch.cat([expert(arrived) for expert in self.experts.values()], dim=1)
        results = AllToAll.apply(computed, everyone, everyone)
        every = results.view(self.world_size, len(tokens), EXPERTS // self.world_size, -1)
        every = every.transpose(0, 1).reshape(len(tokens), EXPERTS, -1)
        picked = every.gather(1, chosen[..., None].expand(-1, -1, every.shape[-1]))
        return (picked * gates[..., None]).sum(1)""" + "\\2")


@pytest.mark.slow
@pytest.mark.parametrize("edits, verdicts", [
    ([SWAPPED], [r"in round 0 rank \d called all_to_all_single at line \d+ \(in forward: .*\), called from line \d+ "
                 r"\(in dispatch: `arrived = AllToAll\.apply\(routed, receive, send\)`\) with input_split_sizes .* "
                 r"the two are swapped\."]),
    ([NO_COUNTS], [r"in round 0 rank \d made room for \d+ rows from rank \d \(output_split_sizes .*\), but rank \d "
                   r"sent \d+: the loads are uneven, .* no counts were exchanged before the tokens\."]),
    ([EVERYWHERE], [r"in round 0 rank 0 sent 384 bytes of tokens to rank 1 \(12 rows of 32 bytes at .*\), but its "
                    r"tokens chose rank 1's experts 8 times \(256 bytes\): more bytes than the dispatch needs\."]),
    # independent mistakes share a run: one verdict each
    ([*DETACHED, NOT_UNSORTED], [r"in round 0 no rows travelled during rank \d's backward, though 2 all-to-all\(s\) "
                                 r"carried rows in its forward",
                                 r"in round 0 \(top_k 1\) rank \d's output holds the right results in the wrong rows "
                                 r"\(token \d+'s row holds token \d+'s result\)"]),
], ids=["splits swapped", "no counts exchanged", "every token everywhere", "detached, not un-sorted"])
def test_a_seeded_mistake_gets_its_own_verdict(edits, verdicts, tmp_path):
    problems = checked(seeded(tmp_path, SOLUTION, *edits), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.match(verdict, problem, re.S), (verdict, problems)


# Programs learners wrote from the starting file (tests/independent/): a right one with other bookkeeping passes; the
# tokens' rows detached, or the gates, are named as such (the all-to-alls are autograd Functions in both).
@pytest.mark.slow
@pytest.mark.parametrize("part, verdicts", [
    ("expert_dispatch_chunks.py", []),
    ("expert_dispatch_tokens_detached.py", [r"in round 0 \(top_k 1\) the tokens' gradients are only what reaches them "
                                            r"through the router \(the gates\)"]),
    ("expert_dispatch_gates_detached.py", [r"in round 0 \(top_k 1\) the router's gradient, summed over the ranks, is 0 "
                                           r"at most .* the gates that weigh each result were cut from the router"]),
], ids=["right: chunks by sender and expert", "tokens detached", "gates detached"])
def test_a_program_written_independently_gets_the_verdicts_of_its_mistakes(part, verdicts, tmp_path):
    problems = checked(written(tmp_path, "exercises/11_expert_dispatch/start.py", part), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.match(verdict, problem), (verdict, problems)
        assert "autograd Function" not in problem, problem
