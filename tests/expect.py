"""What a correct run of a step shows: assertions that several test files make about a finished job, the sharded
snapshots of steps 5, 7, 8, 10 and 11 read back whole, each epoch's loss over every rank from the per-rank metrics, the
largest difference between two sets of weights, and a step's checks before its process group, run in the test's
process; the excerpt of the help pages that the GPT steps' exact jobs learn; a small disk that fills up."""
import json
import re
import runpy
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness.jobs import output, saved_name, script, shared_file
from utils import make_workload
from utils.gpt import help_pages

# The excerpt of the help pages the GPT steps' exact jobs learn: 90% to train on, 64 sequences of 64 (+1) characters;
# 7 held out. A vocabulary of 57 characters.
EXCERPT_CHARS = 4600


def help_excerpt():
    """The excerpt as a file named by its content (harness.jobs.shared_file): the test files' and the notebooks' jobs
    that learn it name the same file, so a job they share runs once in a test session."""
    return shared_file("help_excerpt.txt", help_pages()[:EXCERPT_CHARS])


def snapshot_of(epochs_run):
    """A snapshot the torchrun steps resume from, made in this process: the synthetic workload after one step."""
    workload = make_workload()
    source, targets = workload.train_set[:32]
    workload.loss_fn(workload.model(source), targets).backward()
    workload.optimizer.step()
    return dict(MODEL_STATE=workload.model.state_dict(), OPTIMIZER_STATE=workload.optimizer.state_dict(),
                EPOCHS_RUN=epochs_run, STEP="multigpu_torchrun.py")


def assert_learned(text, epochs):
    """Every epoch reported once, and the loss of the last below half the first's."""
    losses = output.epoch_losses(text)
    assert sorted(losses) == list(range(epochs)), text
    assert losses[epochs - 1] < 0.5 * losses[0], f"the loss did not fall: {losses}"


def assert_one_writer(writes, expected_path):
    """Exactly one process wrote files, it was rank 0 (or the only process), and it wrote `expected_path` (through
    its own .tmp file, `NAME.PID.tmp`, renamed when complete)."""
    assert writes, "nothing was saved"
    writers = {(pid, rank) for pid, rank, _ in writes}
    assert len(writers) == 1, f"more than one process wrote: {writers}"
    assert {rank for _, rank in writers} <= {0, None}, f"the writer is not rank 0: {writers}"
    assert {str(Path(path).with_name(saved_name(path))) for _, _, path in writes} == {str(expected_path)}, writes


def assert_loads_into_fresh_model(path, key=None, workload="synthetic"):
    """The file holds a plain model's state_dict (under `key` in a snapshot) that loads into a new model."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    make_workload(workload).model.load_state_dict(state[key] if key else state)  # raises on a wrong tensor


def assert_bitwise_equal(actual, expected, where="snapshot"):
    """Every tensor equal bit for bit (torch.equal, same dtype), every other value equal, at any depth."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for index, (item, expected_item) in enumerate(zip(actual, expected)):
            assert_bitwise_equal(item, expected_item, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# What the workers print that is not the steps' own and not torchrun's log records: a line prefixed with its rank by
# torch (a traceback, a library's log record), a traceback, a library's warning, a C++ frame. None of it is a line a
# learner can act on.
LIBRARY_NOISE = re.compile(r"^\[rank\d+\]:|^Traceback \(|Warning: |^frame #|^terminate called", re.M)
# The one line a rank stops with when a peer vanishes mid-collective (utils.launch.known_cause), or when a collective
# gave up waiting for one.
PEER_GONE = re.compile(r"^error: rank \d+: (?:a peer is gone \(Connection (?:closed|reset) by peer, at [\d.]+\), so this "
                       r"rank stops too: torchrun restarts every worker from the last snapshot if --max_restarts "
                       r"allows, else the same command resumes from it|a collective gave up after --timeout \d+ s .*)$")


# torchrun's own goodbye after a multi-node job that ended: the node whose torchrun hosted the rendezvous's store may
# exit first, and another node's torchrun then prints the store's C++ warning with its frames, before its own log
# record that it "has failed to shutdown the rendezvous" (docs/reference/multinode.md, Troubleshooting). The launcher's, after
# every worker ended.
LAUNCHER_GOODBYE = re.compile(r"^\[W\d+ [\d:.]+ TCPStore\.cpp:\d+\] \[c10d\] recvVector failed .*\n"
                              r"(?:(?:Exception raised from |frame #|<omitting python frames>).*\n|\n)*", re.M)
SHUTDOWN_FAILED = re.compile(r"dynamic_rendezvous\.py:\d+\] The node '[^']+' has failed to shutdown the rendezvous")


def assert_only_own_lines(job):
    """The job's workers printed their own lines and nothing of torch's: no traceback, no library warning or log
    record (torchrun's own log records, `W1125 ...`, its report of a job that failed, and its goodbye to a rendezvous
    whose host left first are the launcher's, and allowed: python -m torch.distributed.run's traceback begins in
    <frozen runpy>)."""
    workers = job.output.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0]
    if SHUTDOWN_FAILED.search(workers):
        workers = LAUNCHER_GOODBYE.sub("", workers)
    noise = LIBRARY_NOISE.findall(workers)
    assert not noise, f"{len(noise)} lines of library noise; the output ends:\n{job.output[-3000:]}"


def assert_a_peer_gone_is_one_line_a_rank(job):
    """A job whose worker was killed (SIGKILL) and restarted: each rank that noticed its peer gone before torchrun
    stopped it said so in one line (torchrun may stop a rank first: then it says nothing), and nothing else of the
    workers was printed."""
    assert_only_own_lines(job)
    errors = output.errors(job.output)
    assert all(PEER_GONE.match(line) for line in errors), errors
    ranks = [re.match(r"error: rank (\d+)", line)[1] for line in errors]
    assert len(ranks) == len(set(ranks)), f"a rank said it twice: {errors}"


def rank_records(job):
    """Every rank's per-epoch metrics records (TUTORIAL_RUN_DIR=runs in the job's folder), by epoch then rank; an epoch
    a rank ran twice, before and after a restart, counts once: the last."""
    by_epoch = {}
    for path in (job.cwd / "runs").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_epoch.setdefault(record["epoch"], {})[record["rank"]] = record
    return by_epoch


def epoch_losses(job):
    """Each epoch's mean loss over every rank's tokens, unrounded, from the per-rank metrics files."""
    return {epoch: sum(r["loss"] * r["samples"] for r in ranks.values()) / sum(r["samples"] for r in ranks.values())
            for epoch, ranks in sorted(rank_records(job).items())}


def farthest(actual, expected):
    """The largest difference between two state_dicts' tensors, which must have the same names."""
    assert actual.keys() == expected.keys()
    return max((actual[name] - tensor).abs().max().item() for name, tensor in expected.items())


def sharded_snapshot(folder):
    """A sharded snapshot (torch.distributed.checkpoint's folder) as one dict, every rank's parts put together, read
    without a process group: {"MODEL_STATE": {...}, "EPOCHS_RUN": ..., ...}."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(folder, Path(scratch) / "whole.pt")
        return torch.load(Path(scratch) / "whole.pt", map_location="cpu", weights_only=False)


def stopped_as_rank_0(monkeypatch, step, world_size, *args):
    """`step`'s __main__ run in this process as torchrun starts rank 0 of `world_size` processes, with TOTAL_EPOCHS 2,
    SAVE_EVERY 1 and `args`: the SystemExit it stops with (its checks of the options come before init_process_group,
    which a test's process must never reach)."""
    import utils

    def reached(*_, **__):  # its watch of the group's forming would end this process after --timeout
        raise AssertionError(f"{step} went on to form its process group: no check stopped it")

    monkeypatch.setattr(sys, "argv", [step, "2", "1", *map(str, args)])
    monkeypatch.setattr(utils, "watch_this_worker", reached)
    monkeypatch.setattr(utils, "attempt_store", reached)
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "LOCAL_WORLD_SIZE": world_size,
                        "WORLD_SIZE": world_size}.items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script(step), run_name="__main__")
    return stop.value


@contextmanager
def small_disk(path, free_bytes):
    """A tmpfs mounted at `path` with about `free_bytes` left (a file fills the rest): a disk that fills up. Needs
    root."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={free_bytes + (1 << 20)}", "tmpfs", str(path)], check=True)
    try:
        (path / "filler").write_bytes(b"\0" * ((1 << 20) - 4096))
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
