"""Hangs fail fast: a node that never arrives, or a rank that never reaches a collective, ends the job with an
error within the time the learner set, instead of a silent wait (torchrun's rendezvous waits 600 s by default,
a process group 10 to 30 minutes)."""
import re
import time

import pytest

from expect import PEER_GONE, assert_only_own_lines
from harness.jobs import free_port, output, run, start, torchrun, torchrun_node
from harness.jobs.processes import alive
from utils.launch import known_cause

STARTUP = 60  # generous: starting torchrun and its workers takes 3 s here, 20 s on a loaded 2-core machine


@pytest.mark.slow
def test_a_node_that_never_arrives_ends_the_rendezvous_after_join_timeout(tmp_path):
    join_timeout = 4
    job = run(torchrun_node("multinode.py", 4, 2, endpoint=f"127.0.0.1:{free_port()}", run_id="lonely",
                            launcher_args=["--rdzv_conf", f"join_timeout={join_timeout}"]),
              cwd=tmp_path, timeout=join_timeout + STARTUP, check=False)  # --nnodes=2, but only this node starts
    assert job.returncode not in (0, None), job.output[-3000:]
    assert "RendezvousTimeoutError" in job.output, job.output[-3000:]
    assert job.seconds() >= join_timeout, f"gave up after {job.seconds():.1f} s, before join_timeout"
    assert "epoch" not in job.output, "no training starts with half the nodes"


@pytest.mark.slow
def test_a_rank_that_skips_a_collective_makes_the_others_fail_within_the_timeout(tmp_path):
    timeout = 4
    # rank 1 skips the first epoch's loss all_reduce (call 2; call 1 is the resume check) and never comes back
    with start(torchrun("multinode.py", 4, 2, "--timeout", timeout), cwd=tmp_path, skip_all_reduce=(1, 2)) as job:
        job.wait_for(r"rank 1 skips its all_reduce number 2", timeout=STARTUP)
        skipped = time.monotonic()
        [code] = job.wait(timeout=timeout + STARTUP)
        took = time.monotonic() - skipped
    assert code is not None, f"still waiting {timeout + STARTUP} s after the skip:\n{job.output[-3000:]}"
    assert code != 0
    assert took >= timeout - 1, f"failed {took:.1f} s after the skip: not from the timeout"
    assert f"Timed out waiting {timeout * 1000}ms" in job.output or "Watchdog caught collective operation timeout" \
        in job.output, job.output[-3000:]  # gloo's words, then NCCL's
    assert "epoch 0 |" not in job.output, "rank 0 must not report an epoch whose loss it could not reduce"


@pytest.mark.slow
def test_a_rank_stuck_in_a_2d_job_makes_the_others_fail_within_the_timeout_of_the_meshs_groups(tmp_path):
    """tensor_parallel.py, dp 2 x tp 2: rank 1 skips its third all_reduce (epoch 0's loss, over its dp group of ranks 1
    and 3) and sleeps 120 s before it makes it. Its peers then wait in the groups init_device_mesh made for the
    mesh's dimensions (rank 3 in dp; ranks 0 and 2 in tp, at the next step), whose own default timeout is 30 minutes
    on gloo: without the job's --timeout on them (utils.mesh_with_timeout) they wait for rank 1, and the job goes on."""
    from utils.gpt import TEXT_VARIABLE, help_pages

    timeout = 5
    (tmp_path / "text.txt").write_text(help_pages()[:4600])  # 64 sequences: 8 optimizer steps an epoch
    command = torchrun("tensor_parallel.py", 3, 3, "--tp", 2, "--workload", "gpt-cpu", "--batch_size", 4,
                       "--timeout", timeout, nproc=4)
    with start(command, cwd=tmp_path, env={TEXT_VARIABLE: tmp_path / "text.txt"}, skip_all_reduce=(1, 3)) as job:
        job.wait_for(r"rank 1 skips its all_reduce number 3", timeout=STARTUP)
        [code] = job.wait(timeout=timeout + STARTUP)  # well before rank 1 wakes up
    assert code is not None and code != 0, job.output[-3000:]
    assert f"Timed out waiting {timeout * 1000}ms" in job.output, job.output[-3000:]
    assert "epoch 2 |" not in job.output, "no rank trains on past a peer that never came"


@pytest.mark.slow
def test_a_rank_stuck_in_a_pipeline_job_makes_the_others_fail_within_the_timeout_with_one_line_each(tmp_path):
    """pipeline_parallel.py, 2 pipelines of 2 stages (--pp 2 on 4 ranks): rank 1 (stage 0 of the second pipeline)
    skips its third all_reduce, its first clipping of the gradient norm along its pipeline, and sleeps 120 s. Its
    peers wait for it in the groups of the (pp, dp) mesh: rank 3 in the clipping all-reduce over pp, ranks 0 and 2 in
    DDP's all-reduce over dp and in the stages' sends and receives. Each rank that gives up says so in one line, with
    the timeout; torchrun then stops the others, the sleeping rank too: nothing is left running."""
    from utils.gpt import TEXT_VARIABLE, help_pages

    timeout = 5
    (tmp_path / "text.txt").write_text(help_pages()[:4600])  # 64 sequences: 8 optimizer steps an epoch
    command = torchrun("pipeline_parallel.py", 3, 3, "--pp", 2, "--workload", "gpt-cpu", "--batch_size", 4,
                       "--microbatches", 2, "--timeout", timeout, nproc=4)
    with start(command, cwd=tmp_path, env={TEXT_VARIABLE: tmp_path / "text.txt"}, skip_all_reduce=(1, 3)) as job:
        workers = job.workers(nproc=4)
        job.wait_for(r"rank 1 skips its all_reduce number 3", timeout=STARTUP)
        skipped = time.monotonic()
        while job.running() and time.monotonic() < skipped + timeout + STARTUP:
            time.sleep(0.1)
        took, left = time.monotonic() - skipped, [rank for rank, pid in workers.items() if alive(pid)]
        [code] = job.wait(timeout=1)
    assert code is not None and code != 0, f"still waiting {took:.0f} s after the skip:\n{job.output[-3000:]}"
    assert not left, f"ranks {left} still ran after torchrun ended"
    lines = re.findall(rf"^error: rank (\d): a collective gave up after --timeout {timeout} s \(Timed out waiting "
                       rf"{timeout * 1000}ms for \w+ operation to complete\): a rank is stuck or gone; the last "
                       "snapshot is kept, and the same command resumes from it$", job.output, re.M)
    assert lines and len(lines) == len(set(lines)) and "1" not in lines, job.output[-3000:]
    assert not re.search(r"^\[rank\d\]:.*Timed out waiting", job.output, re.M), "a timeout shown as a traceback"
    assert "epoch 0 |" not in job.output, "no rank trains on past a peer that never came"


def test_a_timeout_is_told_in_one_line_wherever_it_was_raised_from_and_other_errors_are_not(monkeypatch):
    """The error a worker stops on with one line: gloo's timeout, also as the cause of the error pipelining raises
    around it. Any other error keeps its traceback (None)."""
    monkeypatch.setenv("RANK", "3")
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation "
                           "to complete")
    try:
        try:
            raise timeout
        except RuntimeError as error:
            raise RuntimeError("\nFailed to run stage backward:\n...") from error
    except RuntimeError as wrapped:
        outer = wrapped
    expected = ("error: rank 3: a collective gave up after --timeout 5 s (Timed out waiting 5000ms for recv operation "
                "to complete): a rank is stuck or gone; the last snapshot is kept, and the same command resumes from it")
    assert known_cause(timeout, 5) == known_cause(outer, 5) == expected
    assert known_cause(ValueError("Timed out waiting 5000ms"), 5) is None and known_cause(ValueError("x"), 5) is None


@pytest.mark.parametrize("message, said", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:9602. This is "
     "typically caused by a remote worker crashing.", "Connection closed by peer, at 10.0.0.2"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:62635: Connection reset by peer. "
     "This is typically caused by a remote worker hanging", "Connection reset by peer, at 127.0.0.1"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version "
     "2.21.5", "remote process exited"),
], ids=["gloo, closed", "gloo, reset", "nccl"])
def test_a_peer_gone_in_the_middle_of_a_collective_is_told_in_one_line_wherever_it_was_raised_from(monkeypatch, message,
                                                                                                  said):
    """A peer killed, crashed or cut off while the others wait for it in a collective: gloo's and NCCL's words for it,
    raised as they are (DDP's backward, a collective) or as the cause of another error (pipelining's, autograd's).
    The one line says what happened and what comes next; the jobs that kill a worker (steps 9, 10 and 11) show it."""
    monkeypatch.setenv("RANK", "1")
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as error:
            raise RuntimeError("\nFailed to run stage backward:\n...") from error
    except RuntimeError as wrapped:
        outer = wrapped
    expected = (f"error: rank 1: a peer is gone ({said}), so this rank stops too: torchrun restarts every worker from "
                "the last snapshot if --max_restarts allows, else the same command resumes from it")
    assert known_cause(RuntimeError(message), 60) == known_cause(outer, 60) == expected


@pytest.mark.slow
def test_a_rank_stuck_on_step_11s_mesh_makes_the_others_stop_within_the_timeout_with_one_line_each(tmp_path):
    """one_mesh.py, pp 2 x tp 2 on 4 ranks, asynchronous saves: rank 1 skips its third all_reduce, its first clipping
    of the gradient norm along its pipeline, and sleeps. Its peers wait for it in the mesh's groups (its tp peer in the
    blocks' collectives, its pp peer in the schedule's sends and the clipping). Each rank that gives up, or that then
    finds its peer gone, says so in one line; torch's pipelining printed its whole schedule before (49 lines a rank),
    and a rank whose peer had left printed a traceback."""
    from utils.gpt import help_pages

    timeout = 5
    (tmp_path / "text.txt").write_text(help_pages()[:4600])
    command = torchrun("one_mesh.py", 3, 1, "--workload", "gpt-cpu", "--text", tmp_path / "text.txt", "--pp", 2,
                       "--tp", 2, "--batch_size", 8, "--microbatches", 2, "--async_save", "--timeout", timeout,
                       nproc=4)
    with start(command, cwd=tmp_path, skip_all_reduce=(1, 3)) as job:
        workers = job.workers(nproc=4)
        job.wait_for(r"rank 1 skips its all_reduce number 3", timeout=STARTUP)
        skipped = time.monotonic()
        while job.running() and time.monotonic() < skipped + timeout + STARTUP:
            time.sleep(0.1)
        took, left = time.monotonic() - skipped, [rank for rank, pid in workers.items() if alive(pid)]
        [code] = job.wait(timeout=1)
    assert code is not None and code != 0, f"still waiting {took:.0f} s after the skip:\n{job.output[-3000:]}"
    assert not left, f"ranks {left} still ran after torchrun ended"
    errors = output.errors(job.output)
    ranks = [re.match(r"error: rank (\d+)", line)[1] for line in errors]
    assert errors and all(PEER_GONE.match(line) for line in errors) and len(ranks) == len(set(ranks)), errors
    assert "1" not in ranks and any("a collective gave up" in line for line in errors), errors
    assert_only_own_lines(job)
    assert not re.search(r"Step \d+: ", job.output), job.output[-3000:]
