"""Step 9, context_parallel.py: each sequence split over the ranks of a cp group trains exactly what one process trains
(every epoch's loss and the final weights), with either exchange of keys and values; the attention alone equals
whole attention, outputs and gradients, on 2 and 4 ranks; a worker SIGKILLed mid-run resumes to the same end; a
--cp 2 snapshot resumes with --cp 1; with dropout and bf16 the GPT learns; bad input stops with one line. The ring's
sends, counted and logged in order with its compute: backward sends cp - 1 blocks and cp - 1 of their gradients,
each while the rank computes the next block.

The exact jobs train the CPU-size GPT (context 64: 4 chunks of 16 tokens at --cp 2) on a short excerpt of the help
pages (`--text`): 64 training sequences, 8 per optimizer step (a cp group's batch; 4 per dp group on 4 ranks), so 8
steps an epoch, fp32 and dropout 0. The jobs: --cp 2 on 2 ranks by the ring; --cp 2 x dp 2 on 4 ranks by all-gather,
rank 3 SIGKILLed as it begins epoch 1; the first job's snapshot resumed by one process (--cp 1); a job with dropout
and bf16. The attention alone: one spawn of 4 processes (a ring of 4, and two rings of 2 in it); its traffic and
schedule, another."""
import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expect import (assert_a_peer_gone_is_one_line_a_rank, assert_bitwise_equal, assert_only_own_lines, epoch_losses,
                    farthest, stopped_as_rank_0)
from harness.jobs import free_port, output, run, torchrun, torchrun_node
from harness.one_process import tensors, train_gpt
from utils import evaluate, make_workload
from utils.context import Ring, gathered_attention, positions_of, ring_attention
from utils.metrics import RUN_DIR_VARIABLE

B, EPOCHS, STEPS = 8, 2, 8  # sequences per optimizer step (all dp groups together), epochs, steps an epoch
SNAPSHOT = "cp_snapshot.pt"
# Equal up to float rounding: the ring adds each query's attention up block by block (an online softmax, in float32),
# the all-gather computes it in one piece over a reordered K and V, and Adam magnifies the rounding in a few weights.
# Measured here (torch 2.14.1, x86): every epoch's loss within 2.2e-6, the weights within 4.0e-5 (all three jobs);
# one process training other batches (4 per step) ends 0.126 away.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 2e-4


def context_parallel(folder, text, epochs, *args, nproc=2, batch_size=B, dropout=0, **options):
    """A finished job of context_parallel.py in `folder` (the CPU-size GPT, context 64), a snapshot after every
    epoch; per-rank metrics in its runs/."""
    command = torchrun("context_parallel.py", epochs, 1, "--workload", "gpt-cpu", "--text", text, "--context", 64,
                       "--dropout", dropout, "--batch_size", batch_size, *args, nproc=nproc,
                       launcher_args=["--max_restarts=1"])
    return run(command, cwd=folder, env={RUN_DIR_VARIABLE: "runs"}, timeout=240, **options)


@pytest.fixture(scope="module")
def ring_on_two(tmp_path_factory, text):
    """--cp 2 on 2 ranks (one sequence shared by both), the ring. notebooks/09_context_parallel.ipynb runs the same
    job: shared, it runs once in a test session."""
    return context_parallel(tmp_path_factory.mktemp("ring"), text, EPOCHS, "--cp", 2, "--exchange", "ring",
                            shared=True)


@pytest.fixture(scope="module")
def allgather_on_four_killed(tmp_path_factory, text):
    """--cp 2 x dp 2 on 4 ranks, the all-gather, 4 sequences per dp group; rank 3 SIGKILLs itself as it begins epoch 1:
    torchrun starts the four again, and they resume from the snapshot of epoch 0."""
    return context_parallel(tmp_path_factory.mktemp("allgather"), text, EPOCHS, "--cp", 2, "--exchange", "allgather",
                            nproc=4, batch_size=B // 2, record=True, kill_at=(0, 3, 1))


@pytest.fixture(scope="module")
def alone(tmp_path_factory, text, ring_on_two):
    """The ring job's snapshot (--cp 2, 2 epochs) resumed by one process (--cp 1) for a third epoch."""
    folder = tmp_path_factory.mktemp("alone")
    (folder / SNAPSHOT).write_bytes((ring_on_two.cwd / SNAPSHOT).read_bytes())
    return context_parallel(folder, text, EPOCHS + 1, "--cp", 1, nproc=1)


@pytest.fixture(scope="module")
def reference(text):
    """One process on whole sequences, batches of 8, 3 epochs (the schedule of 2); and one that trains other batches
    (4 per step)."""
    return dict(train_gpt(text, B, EPOCHS + 1, EPOCHS, context=64),
                other_batches=train_gpt(text, B // 2, EPOCHS, context=64))


def weights(job):
    return tensors(torch.load(job.cwd / SNAPSHOT, weights_only=True)["MODEL_STATE"])


# --- a split sequence is one model ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_cp_jobs_train_what_one_process_does(ring_on_two, allgather_on_four_killed, reference):
    """--cp 2 by the ring on 2 ranks, and --cp 2 x dp 2 by the all-gather on 4 (killed and resumed): every epoch's loss
    and the final weights within the tolerances, where one process training other batches ends far outside them.
    Measured (torch 2.14.1, x86): losses within 2.2e-6 (ring) and 3.9e-7 (all-gather), weights within 2.4e-5 and
    4.0e-5; one process training other batches ends 0.126 away."""
    for job in (ring_on_two, allgather_on_four_killed):
        assert epoch_losses(job) == pytest.approx({e: reference["losses"][e] for e in range(EPOCHS)},
                                                  abs=LOSS_TOLERANCE), job.cwd
        assert farthest(weights(job), reference["weights"][EPOCHS]) <= WEIGHT_TOLERANCE, job.cwd
    assert farthest(weights(ring_on_two), reference["other_batches"]["weights"][EPOCHS]) > 100 * WEIGHT_TOLERANCE, \
        "the tolerance tells training on these batches from training on others"
    printed = output.epoch_losses(ring_on_two.output)  # rank 0's line: the mean over all ranks, not its own tokens'
    assert printed == pytest.approx({e: reference["losses"][e] for e in range(EPOCHS)}, abs=1e-4), printed
    assert_only_own_lines(ring_on_two)


@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_last_snapshot_to_the_same_end(allgather_on_four_killed):
    """Rank 3 died as it began epoch 1; torchrun started all four again, they resumed from epoch 0's snapshot, and the
    end is the one-process end (the test above)."""
    job = allgather_on_four_killed
    assert job.resumes == {1: 1}, job.output
    assert sorted(epoch_losses(job)) == [0, 1]
    assert_a_peer_gone_is_one_line_a_rank(job)


@pytest.mark.slow
def test_the_ranks_of_a_cp_group_read_the_same_sequences_and_the_dp_groups_split_them(allgather_on_four_killed):
    """rank = d x cp + c: ranks 0 and 1 (dp group 0) share every sequence, ranks 2 and 3 share the others."""
    rows = {row["rank"]: row for row in allgather_on_four_killed.samples if row["epoch"] == 0}
    assert rows[0]["indices"] == rows[1]["indices"] and rows[2]["indices"] == rows[3]["indices"]
    assert not set(rows[0]["indices"]) & set(rows[2]["indices"])
    assert len(rows[0]["indices"]) + len(rows[2]["indices"]) == 64


@pytest.mark.slow
def test_a_cp_2_snapshot_resumes_with_cp_1_as_one_process_trains(alone, reference):
    """Every rank holds the whole model, so the snapshot is the model's: one process goes on from it, and its third
    epoch is the one-process third epoch."""
    assert output.resumes(alone.output) == {0: EPOCHS}
    assert epoch_losses(alone)[EPOCHS] == pytest.approx(reference["losses"][EPOCHS], abs=LOSS_TOLERANCE)
    assert farthest(weights(alone), reference["weights"][EPOCHS + 1]) <= WEIGHT_TOLERANCE


@pytest.mark.slow
def test_the_whole_model_is_evaluated_and_writes_a_sample(ring_on_two, reference):
    """After training the model takes whole sequences again: the held-out loss is one process's."""
    held_out = output.held_out(ring_on_two.output)
    assert held_out["samples"] == 7 and held_out["loss"] == pytest.approx(reference["held_out"], abs=1e-4)
    [(steps, sample)] = output.samples(ring_on_two.output)
    assert steps == EPOCHS * STEPS and len(sample) >= 190, sample


# --- the attention alone ----------------------------------------------------------------------------------------------

def attention_worker(rank, port, result_path):
    """One of 4 processes: a ring of all 4, and two rings of 2 (ranks 0-1, 2-3), each rank computing its queries'
    attention with both exchanges; the largest difference from whole attention, of outputs and gradients, for each."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)  # the same inputs on every rank: each takes its chunks of them
    B, H, T, D = 2, 3, 32, 8
    q, k, v, grad_out = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(4))
    results = {}
    for name, group, balanced, dropout_p in [("ring of 4", dist.group.WORLD, True, 0.0),
                                             ("ring of 2", pairs[rank // 2], True, 0.0),
                                             ("ring of 4, contiguous", dist.group.WORLD, False, 0.0),
                                             ("ring of 2, dropout", pairs[rank // 2], True, 0.3)]:
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        chunks_by_rank = [[r, 2 * cp - 1 - r] if balanced else [r] for r in range(cp)]
        n_chunks = sum(map(len, chunks_by_rank))
        mine = positions_of(chunks_by_rank[me], n_chunks, T)
        kept = whole_dropout_mask(group, chunks_by_rank, n_chunks, q, dropout_p, seed=1234) if dropout_p else None
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = whole_attention(*whole, kept)
        expected.backward(grad_out)
        for exchange in ("ring", "allgather") if not dropout_p else ("ring",):
            parts = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            if exchange == "ring":
                out = ring_attention(*parts, group, chunks_by_rank, n_chunks) if not dropout_p else \
                    ring_dropout(parts, group, chunks_by_rank, n_chunks, dropout_p, seed=1234)
            else:
                out = gathered_attention(*parts, group, chunks_by_rank, n_chunks)
            out.backward(grad_out[:, :, mine])
            errors = [(out - expected[:, :, mine]).abs().max()] + [
                (part.grad - w.grad[:, :, mine]).abs().max() for part, w in zip(parts, whole)]
            worst = torch.stack(errors).float()
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            results[f"{name}: {exchange}"] = worst.tolist()
    if rank == 0:
        with open(result_path, "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


def whole_attention(q, k, v, kept=None):
    """Causal softmax attention of the whole sequence, written out (dropout: `kept`, the kept weights' scale or 0)."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    weights = F.softmax(scores, dim=-1)
    return (weights if kept is None else weights * kept) @ v


def whole_dropout_mask(group, chunks_by_rank, n_chunks, q, dropout_p, seed):
    """The ring's dropout masks of every pair of chunks, put together over the whole (T, T) score matrix: what the
    ring draws for a pair, from the seed, whichever rank computes it."""
    ring = Ring(group, chunks_by_rank, q[:, :, :q.shape[-2] // dist.get_world_size(group)], dropout_p, seed)
    n, T = ring.n, q.shape[-2]
    kept = torch.zeros(*q.shape[:2], T, T, dtype=torch.float64)
    for a in range(n_chunks):
        for b in range(a + 1):
            block = ring.dropped(torch.ones(*q.shape[:2], n, n), a, b)
            kept[..., a * n:(a + 1) * n, b * n:(b + 1) * n] = block
    return kept


def ring_dropout(parts, group, chunks_by_rank, n_chunks, dropout_p, seed):
    from utils.context import RingAttention
    return RingAttention.apply(*parts, group, chunks_by_rank, n_chunks, dropout_p, seed)


@pytest.mark.slow
def test_the_ring_and_the_all_gather_compute_whole_attention_and_its_gradients():
    """Random queries, keys and values, float64 in (the ring computes in float32): each rank's outputs and the
    gradients of its q, k and v equal whole causal attention's at its positions, on a ring of 4, on two rings of 2
    inside it (their ranks' global numbers are not their ring's), with the contiguous split, and with dropout (the
    ring's masks, the same in forward and backward)."""
    from harness.jobs import spawned_result
    results = spawned_result(attention_worker, (free_port(),), 4, 120, "the attention workers")
    assert set(results) == {"ring of 4: ring", "ring of 4: allgather", "ring of 2: ring", "ring of 2: allgather",
                            "ring of 4, contiguous: ring", "ring of 4, contiguous: allgather",
                            "ring of 2, dropout: ring"}
    for name, errors in results.items():
        assert max(errors) < (1e-6 if "ring:" in name or name.endswith("ring") else 1e-12), (name, errors)


# --- the ring's traffic and its overlap with the compute --------------------------------------------------------------

def traffic_worker(rank, port, result_path):
    """One of 4 processes: a ring of all 4 and two rings of 2 inside it (the balanced split), q, k and v in bfloat16
    (the blocks of keys and values travel in it, their gradients in float32: the dtype tells a send's kind). Each rank
    logs, in one forward and its backward, in the order they happen: every exchange the ring posts (what it sends, its
    bytes), every wait for one, and every chunk pair whose scores it computes (by the rank whose block it is)."""
    from utils.context import RingAttention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    log, post, scores = [], dist.batch_isend_irecv, Ring.scores

    class LoggedRequest:
        def __init__(self, request, transfer):
            self.request, self.transfer = request, transfer

        def wait(self):
            log.append(("wait", self.transfer))
            return self.request.wait()

    def logged_post(ops):
        [sent] = [op.tensor for op in ops if op.op is dist.isend]
        transfer = sum(event[0] == "post" for event in log)
        log.append(("post", transfer, str(sent.dtype).removeprefix("torch."), sent.numel() * sent.element_size()))
        return [LoggedRequest(request, transfer) for request in post(ops)]

    def logged_scores(ring, q, k, a, b):
        log.append(("compute", next(r for r, chunks in enumerate(ring.chunks_by_rank) if b in chunks)))
        return scores(ring, q, k, a, b)

    dist.batch_isend_irecv, Ring.scores = logged_post, logged_scores
    torch.manual_seed(0)
    B, H, T, D = 2, 3, 32, 8
    q, k, v, grad_out = (torch.randn(B, H, T, D, dtype=torch.bfloat16) for _ in range(4))
    results = {}
    for name, group in [("ring of 4", dist.group.WORLD), ("ring of 2", pairs[rank // 2])]:
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        chunks_by_rank = [[r, 2 * cp - 1 - r] for r in range(cp)]
        mine = positions_of(chunks_by_rank[me], 2 * cp, T)
        parts = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        log.clear()
        out = RingAttention.apply(*parts, group, chunks_by_rank, 2 * cp, 0.0, 0)
        forward = list(log)
        log.clear()
        out.backward(grad_out[:, :, mine])
        results[name] = dict(me=me, cp=cp, block=list(torch.stack(parts[1:]).shape), forward=forward,
                             backward=list(log))
    everyone = [None] * 4
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(result_path, "w") as file:
            json.dump(everyone, file)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_logs():
    """Each of the 4 ranks' logs (traffic_worker): for the ring of 4 and its ring of 2."""
    from harness.jobs import spawned_result
    return spawned_result(traffic_worker, (free_port(),), 4, 120, "the traffic workers")


def transfers(log):
    """Per exchange posted, in posting order: (the dtype it sends, its bytes, the blocks (by owner) of the chunk pairs
    the rank computes between the post and the wait for it, one entry per pair)."""
    posts = [event for event in log if event[0] == "post"]
    found = []
    for post in posts:
        # The events came back through JSON, as lists.
        window = log[log.index(post) + 1:log.index(["wait", post[1]])]
        found.append((post[2], post[3], [event[1] for event in window if event[0] == "compute"]))
    return found


@pytest.mark.slow
def test_the_rings_backward_sends_each_block_and_its_gradients_cp_minus_1_times(ring_logs):
    """A block (keys and values of a rank's T/cp positions, stacked: 2 x B x H x T/cp x D numbers) in bfloat16 weighs
    b = 4 B H (T/cp) D bytes. Forward sends cp - 1 blocks; backward cp - 1 blocks again and cp - 1 partial sums of their
    gradients in float32, 2b each: 3 (cp - 1) b in all, three times the forward's (b + 2b per hop), on every rank."""
    for rank, results in enumerate(ring_logs):
        for name, result in results.items():
            # A block's numbers in bfloat16, 2 bytes each.
            cp, block = result["cp"], 2 * torch.Size(result["block"]).numel()
            forward = [(dtype, size) for dtype, size, _ in transfers(result["forward"])]
            backward = [(dtype, size) for dtype, size, _ in transfers(result["backward"])]
            assert forward == [("bfloat16", block)] * (cp - 1), (rank, name, forward)
            assert sorted(backward) == [("bfloat16", block)] * (cp - 1) + [("float32", 2 * block)] * (cp - 1), \
                (rank, name, backward)
            assert sum(size for _, size in backward) == 3 * (cp - 1) * block == 3 * sum(size for _, size in forward)


@pytest.mark.slow
def test_every_send_of_the_ring_travels_while_the_rank_computes_the_next_block(ring_logs):
    """Rank r of a ring of cp holds at step s the block of rank r - s (mod cp). Each exchange is posted before the
    compute it overlaps and waited for after it. Forward: the block sent at step s travels while the rank computes
    block r - s. Backward: likewise the blocks (the first while the rank computes the first half of its own block's
    pairs); the gradients of the block held at step s (1 <= s < cp) are posted once its compute is done and travel
    while the rank computes the whole next block, r - s - 1, the last ones (on their way to their owner) while it
    computes the rest of its own block."""
    for rank, results in enumerate(ring_logs):
        for name, result in results.items():
            cp, me = result["cp"], result["me"]
            forward = [sorted(set(blocks)) for _, _, blocks in transfers(result["forward"])]
            assert forward == [[(me - s) % cp] for s in range(cp - 1)], (rank, name, result["forward"])
            expected = [("bfloat16", [me])]
            for s in range(1, cp):
                expected += [("bfloat16", [(me - s) % cp])] if s < cp - 1 else []
                expected += [("float32", [(me - s - 1) % cp])]
            found = transfers(result["backward"])
            assert [(dtype, sorted(set(blocks))) for dtype, _, blocks in found] == expected, \
                (rank, name, result["backward"])
            # Every pair of the next block, not some: the rank waits for the gradients only once it is done with it.
            computed = [event[1] for event in result["backward"] if event[0] == "compute"]
            for dtype, _, blocks in found[:-1]:
                if dtype == "float32":
                    assert len(blocks) == computed.count(blocks[0]), (rank, name, result["backward"])


# --- in the regime it is run in ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, text):
    """2 nodes x 2 processes: --cp 2 x dp 2 by the ring, bf16 autocast and dropout 0.2 (in the ring's attention too),
    3 epochs of 8 steps (4 sequences per dp group). Recorded."""
    folder = tmp_path_factory.mktemp("two_nodes")
    node = torchrun_node("context_parallel.py", 3, 3, *as_run(text), nproc=2, endpoint=f"127.0.0.1:{free_port()}",
                         run_id=folder.name)
    return run(node, node, cwd=folder, record=True, timeout=240)


def as_run(text):
    """The arguments of the job as practitioners run it."""
    return ("--workload", "gpt-cpu", "--text", text, "--context", 64, "--cp", 2, "--batch_size", 4, "--precision",
            "bf16", "--dropout", 0.2)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, text):
    """The same job on one node of 4 processes."""
    return run(torchrun("context_parallel.py", 3, 3, *as_run(text), nproc=4), cwd=tmp_path_factory.mktemp("one_node"),
               timeout=240)


@pytest.mark.slow
def test_on_two_nodes_a_cp_group_is_one_node_and_with_dropout_and_bf16_the_gpt_learns(two_nodes, text):
    """cp innermost (rank = d x cp + c): the ranks that pass keys and values in every attention share a node, and the
    dp groups, which all-reduce once a step, span the nodes. Dropout and bf16 on, the held-out loss falls below 0.85 of
    the untrained model's."""
    rows = {row["rank"]: row for row in two_nodes.samples if row["epoch"] == 0}
    assert {rank: row["mesh"] for rank, row in rows.items()} == {
        0: {"dp": 0, "cp": 0}, 1: {"dp": 0, "cp": 1}, 2: {"dp": 1, "cp": 0}, 3: {"dp": 1, "cp": 1}}
    node_of = {rank: row["node"] for rank, row in rows.items()}
    assert node_of[0] == node_of[1] != node_of[2] == node_of[3], node_of
    losses = two_nodes.losses
    assert sorted(losses) == [0, 1, 2] and losses[2] < losses[0], two_nodes.output
    untrained = make_workload("gpt-cpu", text=str(text), context=64)
    before = evaluate(untrained.model, untrained.eval_set, untrained.loss_fn, torch.device("cpu"))["loss"]
    assert output.held_out(two_nodes.output)["loss"] < 0.85 * before, (before, two_nodes.output)
    assert_only_own_lines(two_nodes)


@pytest.mark.slow
def test_on_two_nodes_it_trains_what_the_same_ranks_train_on_one_node_bit_for_bit(two_nodes, one_node):
    """The same four ranks on one node: every epoch's loss, the held-out loss and the snapshot (the weights, Adam's
    state, every rank's random state) are the same, bit for bit, with dropout (in the ring's attention too) and bf16:
    where the ranks run changes nothing they compute."""
    assert output.epoch_losses(two_nodes.output) == output.epoch_losses(one_node.output), one_node.output
    assert output.held_out(two_nodes.output) == output.held_out(one_node.output)
    assert_bitwise_equal(torch.load(two_nodes.cwd / SNAPSHOT, weights_only=True),
                         torch.load(one_node.cwd / SNAPSHOT, weights_only=True))


# --- bad input --------------------------------------------------------------------------------------------------------

def run_main(monkeypatch, world_size, *args):
    """context_parallel.py's checks before its process group, in this process (expect.stopped_as_rank_0)."""
    return stopped_as_rank_0(monkeypatch, "context_parallel.py", world_size, *args)


@pytest.mark.parametrize("world_size, args, message", [
    (4, ["--cp", 3], "error: --cp 3 must divide the number of processes (4): they form groups of 3 that share each "
                     "sequence"),
    (4, ["--cp", 4, "--context", 100], "error: the context (100 tokens) must cut into 2 x --cp = 8 chunks of equal "
                                       "length: give a --context that 8 divides"),
])
def test_a_cp_that_cannot_split_the_job_stops_with_one_line_before_the_process_group(monkeypatch, tmp_path,
                                                                                     world_size, args, message):
    monkeypatch.chdir(tmp_path)
    assert str(run_main(monkeypatch, world_size, *args)) == message
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


@pytest.mark.parametrize("option, value", [("--workload", "wide"), ("--cp", "0"), ("--exchange", "p2p"),
                                           ("--context", "0")])
def test_an_option_it_cannot_run_stops_with_one_line_before_anything_starts(monkeypatch, capsys, option, value):
    """Context parallelism splits the GPT's sequences, so no other workload."""
    assert run_main(monkeypatch, 2, option, value).code == 2
    assert re.search(rf"context_parallel.py: error: argument {option}: ", capsys.readouterr().err.splitlines()[-1])


# --- on GPUs ----------------------------------------------------------------------------------------------------------

# One process's losses on the CPU against the same job on GPUs: float32 sums in another order (cuBLAS's). Measured on
# one H200 (torch 2.11, CUDA 13): every epoch's loss within 1.8e-6, the held-out loss within 2.9e-6.
GPU_LOSS_TOLERANCE = 1e-4


@pytest.mark.gpu
def test_on_gpus_the_split_sequences_train_what_one_process_trains_on_the_cpu(tmp_path, text, reference):
    """fp32, dropout 0, the CPU size on the excerpt, context 64: over 2 GPUs by the ring, NCCL's point-to-point
    (--cp 2), on one GPU --cp 1. Every epoch's loss and the held-out loss are one process's on the CPU, within
    GPU_LOSS_TOLERANCE, which one process on other batches is far outside."""
    cp = 2 if torch.cuda.device_count() >= 2 else 1
    job = context_parallel(tmp_path, text, EPOCHS, "--cp", cp, "--exchange", "ring", nproc=cp, gpu=True)
    expected, other = reference["losses"], reference["other_batches"]["losses"]
    assert epoch_losses(job) == pytest.approx({e: expected[e] for e in range(EPOCHS)}, abs=GPU_LOSS_TOLERANCE)
    assert max(abs(other[e] - expected[e]) for e in range(EPOCHS)) > 10 * GPU_LOSS_TOLERANCE
    print(f"largest difference from one process on the CPU: every epoch's loss "
          f"{max(abs(epoch_losses(job)[e] - expected[e]) for e in range(EPOCHS)):.2e}, the held-out loss "
          f"{abs(output.held_out(job.output)['loss'] - reference['held_out']):.2e}")
    assert output.held_out(job.output)["loss"] == pytest.approx(reference["held_out"], abs=GPU_LOSS_TOLERANCE)
    assert f"[rank 0/{cp} | local 0 | cuda:0]" in job.output, job.output


@pytest.mark.gpu
def test_on_gpus_the_gpu_size_trains_with_its_sequences_split_in_bf16_over_nccl(tmp_path):
    """The GPU size (dropout 0.2, in the ring's attention too) on the help pages, sequences of 512 split over 2 GPUs
    (the ring's sends by NCCL's point-to-point), bf16 autocast: it learns. On one GPU, --cp 1: the same code, no
    exchange."""
    cp = 2 if torch.cuda.device_count() >= 2 else 1
    job = run(torchrun("context_parallel.py", 2, 2, "--cp", cp, "--context", 512, "--precision", "bf16", nproc=cp),
              cwd=tmp_path, gpu=True, timeout=600)
    assert job.losses[1] < job.losses[0] and f"[rank 0/{cp} | local 0 | cuda:0]" in job.output, job.output
