"""Who can reach a job, and what a stranger at its door can do: the trust boundary of docs/multinode.md, measured.

torch.distributed has no authentication: whoever reaches a job's ports can join its store and its process groups.
These tests run the laptop's command of step 3 (`torchrun --standalone`, 2 ranks) and show what listens where, then
send it what a stranger on the network could: bytes that are no protocol, connections held open, and the store's own
protocol setting its keys. The job trains on to the same end as an undisturbed one, or ends within its --timeout
with nothing left running and no traceback of the workers. (What a snapshot from someone else may run:
tests/test_fault_tolerance.py; the pickles the steps no longer send: tests/test_steps.py.)
"""
import os
import re
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from expect import assert_only_own_lines
from tools.jobs import output, run, start, torchrun
from tools.jobs.processes import alive, listening, process_env

COMMAND = ("multigpu_torchrun.py", 40, 10, "--batch_size", 8, "--timeout", 10)  # 40 epochs: about 10 s here
STARTUP = 60


def stores_of(job):
    """The ports torchrun's stores listen on (its rendezvous's and the one it hands the workers), and the run's id."""
    worker = next(iter(job.workers().values()))
    return sorted(port for _, port in listening(job.procs[0].pid)), process_env(worker)["TORCHELASTIC_RUN_ID"]


@pytest.mark.slow
def test_under_standalone_the_workers_listen_on_loopback_and_torchrun_s_stores_on_every_interface(tmp_path):
    """--standalone keeps the workers' gloo on 127.0.0.1, but torchrun's two stores listen on every interface (::, so
    IPv4 too): torch's TCPStore binds no address of its own choosing, and torchrun passes it no socket to listen on.
    docs/multinode.md says what keeps strangers away from them on a laptop (a firewall) and on a cluster."""
    with start(torchrun(*COMMAND), cwd=tmp_path) as job:
        job.wait_for(output.EPOCH, timeout=STARTUP)
        workers = [address for pid in job.workers().values() for address, _ in listening(pid)]
        stores = listening(job.procs[0].pid)
    assert workers and set(workers) == {"127.0.0.1"}, workers
    assert len(stores) == 2 and {address for address, _ in stores} <= {"::", "0.0.0.0"}, stores


def strangers_bytes_and_held_connections(ports):
    """What anyone on the network can send: random bytes three times, then 100 connections held open, to each port."""
    for port in ports:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(os.urandom(4096))
    return [socket.create_connection(("127.0.0.1", port)) for port in ports for _ in range(100)]


@pytest.mark.slow
def test_a_stranger_sending_bytes_or_holding_connections_leaves_the_job_training_to_its_own_end(tmp_path):
    """While the job trains, a stranger sends bytes that are no protocol to both of torchrun's stores and holds 100
    connections open to each: the job trains to the end, to the snapshot an undisturbed run of the same command
    writes, bit for bit."""
    undisturbed = run(torchrun(*COMMAND), cwd=tmp_path / "undisturbed", timeout=120)
    (tmp_path / "visited").mkdir()
    with start(torchrun(*COMMAND), cwd=tmp_path / "visited") as job:
        job.wait_for(output.EPOCH, timeout=STARTUP)
        held = strangers_bytes_and_held_connections(stores_of(job)[0])
        [code] = job.wait(timeout=120)
        for sock in held:
            sock.close()
    assert code == 0 and sorted(job.losses) == list(range(40)), job.output[-3000:]
    assert_only_own_lines(job)
    reference = torch.load(undisturbed.cwd / "snapshot.pt", weights_only=True)
    visited = torch.load(job.cwd / "snapshot.pt", weights_only=True)
    assert all(torch.equal(visited["MODEL_STATE"][name], value) for name, value in reference["MODEL_STATE"].items())


@pytest.mark.slow
def test_a_stranger_speaking_the_store_s_protocol_ends_the_job_within_the_timeout_with_nothing_left(tmp_path):
    """A stranger who speaks the store's protocol (a TCPStore client) can read and write the job's keys: here it
    overwrites the rendezvous's state with bytes of its own, and deletes the key the workers counted their attempts
    with. torchrun's agent finds its state corrupt and stops with its own report; its workers stop with it, each with
    one line at most ("torchrun ... is gone"), within the job's --timeout; nothing of the job is left running, and the
    last snapshot is whole."""
    with start(torchrun(*COMMAND), cwd=tmp_path) as job:
        job.wait_for(output.SAVED, timeout=STARTUP)
        workers = job.workers()
        ports, run_id = stores_of(job)
        visited = time.monotonic()
        for port in ports:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
            store.set(f"torch.rendezvous.{run_id}", b"\x00not the rendezvous's state")
            store.delete_key("attempts")
        while job.running() and time.monotonic() < visited + 10 + 5:
            time.sleep(0.1)
        took = time.monotonic() - visited
        [code] = job.wait(timeout=1)
    assert code not in (0, None) and took < 15, (code, took, job.output[-3000:])
    assert not [rank for rank, pid in workers.items() if alive(pid)], "a worker went on without its torchrun"
    # torchrun's own report (its traceback through the rendezvous) is the launcher's; the workers printed nothing of
    # torch's (their tracebacks and torch's log records carry their rank), and at most their one line.
    assert not re.search(r"^\[rank\d+\]:|^terminate called|Warning: ", job.output, re.M), job.output[-3000:]
    assert all(re.match(r"error: rank \d: torchrun \(pid \d+\) is gone", line) for line in job.errors), job.errors
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] % 10 == 0
