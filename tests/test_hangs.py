"""Hangs fail fast: a node that never arrives, or a rank that never reaches a collective, ends the job with an
error within the time the learner set, instead of a silent wait (torchrun's rendezvous waits 600 s by default,
a process group 10 to 30 minutes)."""
import time
from pathlib import Path

import pytest

from support import (finish, free_port, job_env, kill_tree, read_log, run, start, torchrun, torchrun_node,
                     wait_for)

pytestmark = pytest.mark.slow
SKIP_COLLECTIVE = Path(__file__).resolve().parent / "skip_collective"  # its sitecustomize.py makes a rank skip
STARTUP = 60  # generous: starting torchrun and its workers takes 3 s here, 20 s on a loaded 2-core machine


def test_a_node_that_never_arrives_ends_the_rendezvous_after_join_timeout(tmp_path):
    join_timeout = 4
    began = time.monotonic()
    proc = run(torchrun_node("multinode.py", 4, 2, endpoint=f"127.0.0.1:{free_port()}", run_id="lonely",
                             launcher_args=["--rdzv_conf", f"join_timeout={join_timeout}"]),
               cwd=tmp_path, timeout=join_timeout + STARTUP, check=False)  # --nnodes=2, but only this node starts
    took = time.monotonic() - began
    assert proc.returncode != 0
    assert "RendezvousTimeoutError" in proc.output, proc.output[-3000:]
    assert took >= join_timeout, f"gave up after {took:.1f} s, before join_timeout"
    assert "epoch" not in proc.output, "no training starts with half the nodes"


def test_a_rank_that_skips_a_collective_makes_the_others_fail_within_the_timeout(tmp_path):
    timeout, log = 4, tmp_path / "job.log"
    # rank 1 skips the first epoch's loss all_reduce (call 2; call 1 is the resume check) and never comes back
    env = job_env({"PYTHONPATH": str(SKIP_COLLECTIVE), "SKIP_ALL_REDUCE": "1:2"})
    job = start(torchrun("multinode.py", 4, 2, "--timeout", timeout), cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: "rank 1 skips its all_reduce number 2" in read_log(log), STARTUP, "the skipped all_reduce")
        skipped = time.monotonic()
        [code] = finish([job], timeout=timeout + STARTUP)
        took = time.monotonic() - skipped
    finally:
        kill_tree(job)
    output = read_log(log)
    assert code is not None, f"still waiting {timeout + STARTUP} s after the skip:\n{output[-3000:]}"
    assert code != 0
    assert took >= timeout - 1, f"failed {took:.1f} s after the skip: not from the timeout"
    assert f"Timed out waiting {timeout * 1000}ms" in output or "Watchdog caught collective operation timeout" \
        in output, output[-3000:]  # gloo's words, then NCCL's
    assert "epoch 0 |" not in output, "rank 0 must not report an epoch whose loss it could not reduce"
