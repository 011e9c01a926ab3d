"""Who can reach a job, and what a stranger at its door can do: the trust boundary of docs/multinode.md, measured.

torch.distributed has no authentication: whoever reaches a job's ports can join its store and its process groups.
These tests run the laptop's command of step 3 (`torchrun --standalone`, 2 ranks) and show what listens where, then
send it what a stranger on the network could: bytes that are no protocol, connections held open, and the store's own
protocol setting its keys. The job trains on to the same end as an undisturbed one, or ends within its --timeout
with nothing left running and no traceback of the workers; but a stranger on another host who writes a pickle under
the rendezvous's key runs its code in torchrun, and the job never notices. And a planted sharded snapshot of every
kind, found by a real step, stops it with one line, its code never run. (What a single-file snapshot from someone
else may run: tests/test_fault_tolerance.py; the pickles the steps no longer send: tests/test_steps.py.)
"""
import collections
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from expect import assert_only_own_lines
from tools.jobs import REPO, TORCHRUN, free_port, output, run, script, start, torchrun
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


# --- A planted sharded snapshot: each kind through a real step -------------------------------------------------------
#
# torch's DCP reads a folder's .metadata with pickle.load; where that read fails or gives something empty, it reads
# `__<rank>.metadata` instead (2.14.1; 2.6 does not), with pickle.load again. The steps read a sharded snapshot
# through utils.snapshot_reader.SnapshotReader, once: each folder below is one that a stranger could leave where a
# step looks for its snapshot (or its seed checkpoint). Each stops the step with one line on every rank, the code it
# holds never run (it would create the marker file), and no rank dies of a signal.

class Planted:
    """A stranger's pickle: unpickled, it calls builtins.exec, which creates the file `marker` (any code would run)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def a_whole_snapshot(path):
    """A sharded snapshot of one tensor and a step's name, as DCP writes it: what a planted folder starts from."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP notes that it runs in one process
        dcp.save({"MODEL_STATE": {"w": torch.zeros(2)}, "STEP": "fsdp.py"}, checkpoint_id=path, no_dist=True)


def plant_rank_metadata(path, marker):
    """What DCP reads when .metadata fails it: `__0.metadata` and `__1.metadata`, one for each rank of the job."""
    for rank in range(2):
        (path / f"__{rank}.metadata").write_bytes(pickle.dumps(Planted(marker)))


def storage_meta_of_another_type(path, marker):
    """DCP's own Metadata record, whose storage_meta is a torch.Size (DCP's `storage_meta.load_id = ...` then fails),
    and the rank files DCP falls back to. This one passed the step's check and ran on both ranks of step 5, which then
    resumed, finished with exit 0, and saved over the folder."""
    a_whole_snapshot(path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own file, just written
    metadata.storage_meta = torch.Size([])
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    plant_rank_metadata(path, marker)


def an_empty_dict_that_poses_as_metadata(path, marker):
    """An empty OrderedDict (falsy: DCP falls back to the rank files) carrying a `state_dict_metadata` attribute."""
    a_whole_snapshot(path)
    posing = collections.OrderedDict()
    posing.state_dict_metadata = {}
    (path / ".metadata").write_bytes(pickle.dumps(posing))
    plant_rank_metadata(path, marker)


def tuples_two_million_deep(path, marker):
    """A dict whose key is a tuple nested two million deep: 2 MB and no global at all. Hashing the key as it is
    unpickled overflows the C stack: every rank died of SIGSEGV, with no line."""
    a_whole_snapshot(path)
    (path / ".metadata").write_bytes(b"\x80\x04}" + b")" + b"\x85" * 2_000_000 + b"K\x01s.")


def code_in_metadata(path, marker):
    """A plain pickle of code as .metadata."""
    a_whole_snapshot(path)
    (path / ".metadata").write_bytes(pickle.dumps(Planted(marker)))


def a_rank_file_beside_a_whole_snapshot(path, marker):
    """A whole snapshot, with code in a `__0.metadata` beside its .metadata."""
    a_whole_snapshot(path)
    (path / "__0.metadata").write_bytes(pickle.dumps(Planted(marker)))


NOT_A_SNAPSHOT = ": it is not a sharded snapshot's"
# How torchrun reports a worker killed by a signal of its own (torchrun itself stops the other ranks with SIGTERM).
KILLED_BY_A_SIGNAL = re.compile(r"exitcode\s*: -(?!15\b)\d+|SIGSEGV|Segmentation fault")
TEXT = "--text"  # followed by the tests' excerpt of the help pages, in the steps that take it
# The folder, the step that finds it (its command, where it looks), and the line each rank stops with: the cause.
PLANTED = {
    "storage_meta of another type": (
        storage_meta_of_another_type, ("fsdp.py", 2, 1), "snapshot",
        "in its .metadata, a Metadata's storage_meta is a torch.Size where DCP's StorageMeta or None belongs"
        + NOT_A_SNAPSHOT),
    "an empty dict posing as metadata": (
        an_empty_dict_that_poses_as_metadata, ("fsdp.py", 2, 1), "snapshot",
        "its .metadata holds a collections.OrderedDict where DCP's Metadata belongs" + NOT_A_SNAPSHOT),
    "tuples two million deep": (
        tuples_two_million_deep, ("expert_parallel.py", 1, 1, "--workload", "gpt-moe-cpu", "--ep", 2), "ep_snapshot",
        "its .metadata nests objects more than 64 deep, which no save writes: unpickling it could crash every rank"),
    "code in .metadata": (
        code_in_metadata, ("pipeline_parallel.py", 1, 1, "--pp", 2, "--workload", "gpt-cpu", TEXT), "pp_snapshot",
        "its .metadata would call builtins.exec as it is read: a snapshot holds tensors, numbers and text, and this "
        "one holds code"),
    "a rank file beside a whole snapshot": (
        a_rank_file_beside_a_whole_snapshot, ("tensor_parallel.py", 1, 1, "--tp", 2, "--workload", "gpt-cpu"),
        "tp_snapshot", "it holds __0.metadata, a file of metadata that no step writes (DCP reads one in place of "
                       ".metadata that fails): it is not a snapshot of the steps, or something was planted"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", PLANTED)
def test_a_planted_sharded_snapshot_stops_every_rank_with_one_line_and_its_code_never_runs(tmp_path, text, kind):
    """Each kind of planted folder, found by a step of two ranks as its snapshot: one line, the same on both ranks,
    the code never run, no rank killed by a signal, nothing trained, and the folder as it was."""
    plant, (step, *args), where, cause = PLANTED[kind]
    marker = tmp_path / "the planted code ran"
    plant(tmp_path / where, marker)
    before = {file.name: file.read_bytes() for file in (tmp_path / where).iterdir()}
    args = [part for arg in args for part in ([arg, text] if arg == TEXT else [arg])]
    job = run(torchrun(step, *args, nproc=2), cwd=tmp_path, timeout=300, check=False)
    assert not marker.exists(), f"the planted code ran: {job.output[-3000:]}"
    assert job.returncode not in (0, None) and not KILLED_BY_A_SIGNAL.search(job.output), job.output[-3000:]
    assert set(job.errors) == {f"error: cannot resume from {where} ({cause}); it is left in place: move it away to "
                               "start anew"}, job.output[-3000:]
    assert not job.losses, "it trained anyway"
    assert_only_own_lines(job)
    assert {file.name: file.read_bytes() for file in (tmp_path / where).iterdir()} == before


@pytest.mark.slow
def test_a_planted_seed_checkpoint_stops_every_rank_with_one_line_and_its_code_never_runs(tmp_path, text):
    """The first kind above given as step 11's --seed_checkpoint (tools/seed_checkpoint.py's folder): the same."""
    marker = tmp_path / "the planted code ran"
    storage_meta_of_another_type(tmp_path / "seed", marker)
    job = run(torchrun("one_mesh.py", 1, 1, "--workload", "gpt-cpu", "--text", text, "--pp", 1, "--tp", 2,
                       "--batch_size", 4, "--seed_checkpoint", "seed", nproc=2), cwd=tmp_path, timeout=300,
              check=False)
    assert not marker.exists(), f"the planted code ran: {job.output[-3000:]}"
    assert job.returncode not in (0, None) and not KILLED_BY_A_SIGNAL.search(job.output), job.output[-3000:]
    cause = PLANTED["storage_meta of another type"][-1]
    assert set(job.errors) == {f"error: cannot start from --seed_checkpoint seed ({cause}): write it again with "
                               "tools/seed_checkpoint.py, with the step's --workload and --text"}, job.output[-3000:]
    assert_only_own_lines(job)


def test_every_sharded_load_goes_through_the_snapshot_reader():
    """Every dcp.load of the steps, tools, utils and exercises names its reader (a SnapshotReader): one that names a
    checkpoint_id alone would read the folder with torch's own reader, pickles and rank files included."""
    loads = {}
    for path in [*REPO.glob("*.py"), *REPO.glob("utils/*.py"), *REPO.glob("tools/*.py"),
                 *REPO.glob("exercises/**/*.py")]:
        for call in re.findall(r"dcp\.load\(([^)]*)\)", path.read_text()):
            loads.setdefault(path.relative_to(REPO).as_posix(), []).append(call)
    assert {"fsdp.py", "tensor_parallel.py", "pipeline_parallel.py", "expert_parallel.py", "one_mesh.py", "long_run.py",
            "fault_tolerant.py", "utils/snapshots.py", "utils/snapshot_reader.py"} <= set(loads), loads
    unread = {path: call for path, calls in loads.items() for call in calls if "storage_reader=" not in call}
    assert not unread, unread


# --- A stranger at torchrun's rendezvous port, from another host ------------------------------------------------------
#
# torchrun keeps its rendezvous's state in its store as a base64 pickle, and unpickles it whenever it reads it (about
# once a second while the job runs: torch/distributed/elastic/rendezvous/dynamic_rendezvous.py); the store listens on
# every interface, whatever --rdzv_endpoint says, and list_keys() names the run's key. So whoever reaches the port
# runs code in torchrun, as the user who started it. The stranger here is another host (a network namespace with its
# own address): it finds the key, and writes a state that creates a marker file as it is unpickled and then gives
# torchrun its own state back.

VISITED = ("multigpu_torchrun.py", 60, 30, "--batch_size", 64)  # 60 short epochs: it trains while the stranger knocks
STRANGER = r"""
import base64, pickle, re, sys, time
from datetime import timedelta
import torch.distributed as dist

host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    seen = b""
    for _ in range(600):  # until the rendezvous is complete (its workers started): a minute at most
        keys = [key for key in store.list_keys() if re.fullmatch(r"torch\.rendezvous\.[^.]+", key)]
        state = base64.b64decode(store.get(keys[0])) if keys else b""
        if state.startswith(b"\x80") and pickle.loads(state).complete:  # torchrun's own pickle, read as torchrun does
            break
        # Anything else (torch's placeholder for "none yet", a state not yet written) is read again; a state that is
        # never a pickle within the minute is torch refusing pickles, said with what it was.
        seen = state[:40]
        time.sleep(0.1)
    else:
        if seen and seen != base64.b64decode("Y2FuaW1hZGFnZQ=="):
            sys.exit(f"refused: the rendezvous's state is no pickle ({seen!r})")
        sys.exit("gave up: the rendezvous did not complete within a minute")
except Exception as error:
    sys.exit(f"refused: {type(error).__name__}: {error}")

class Payload:
    def __reduce__(self):  # the code, then torchrun's own state: the job goes on as if nothing happened
        return eval, (f"(open({marker!r}, 'w').close(), __import__('pickle').loads({state!r}))[1]",)

try:
    store.set(keys[0], base64.b64encode(pickle.dumps(Payload())))
except Exception as error:
    sys.exit(f"refused: {type(error).__name__}: {error}")
print(f"wrote {keys[0]}", flush=True)
"""


@pytest.mark.slow
def test_a_stranger_who_reaches_the_rendezvous_port_runs_code_in_torchrun_and_the_pages_say_so(tmp_path):
    """A one-node job whose --rdzv_endpoint is on an interface another host reaches (the bridge of tools/netns.py);
    the stranger, on that other host, writes one key. What torch 2.14.1 does: torchrun runs the stranger's code (the
    marker file), and the job ends as an undisturbed one, exit 0, nothing said. Should torch ever refuse it (a store
    that takes no stranger, a state that is no pickle), the test checks that refusal instead, and the page's words
    with it: one of the two outcomes is asserted, and a stranger's write that met neither fails the test."""
    from tools.netns import namespaces_unavailable, network_namespaces

    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    marker = tmp_path / "the stranger's code ran"
    with network_namespaces(1, tag="s") as (bridge_ip, [stranger_host]):
        port = free_port(bridge_ip)
        # A run id the stranger is not told: list_keys() gives it away.
        command = [*TORCHRUN, "--nnodes=1", "--nproc_per_node=1", "--rdzv_backend=c10d",
                   f"--rdzv_id={os.urandom(4).hex()}", f"--rdzv_endpoint={bridge_ip}:{port}", "--rdzv_conf",
                   "is_host=1", script(VISITED[0]), *map(str, VISITED[1:])]
        with start(command, cwd=tmp_path) as job:  # the stranger knocks as the job starts
            stranger = subprocess.run(stranger_host.cmd(sys.executable, "-c", STRANGER, bridge_ip, port, marker),
                                      capture_output=True, text=True, timeout=120)
            ended_first = not job.running()
            [code] = job.wait(timeout=240)
    # The line that says what it did; torch's client may also warn (a hostname the namespace cannot resolve).
    said = next((line for line in (stranger.stdout + stranger.stderr).splitlines()
                 if line.startswith(("wrote ", "refused:", "gave up:"))), (stranger.stdout + stranger.stderr).strip())
    assert not ended_first, f"the job ended before the stranger was done ({said}): make it longer"
    page = " ".join((REPO / "docs" / "multinode.md").read_text().replace("**", "").lower().split())
    words = "reaching the rendezvous port is running code as the user who started torchrun, on every node"
    if marker.exists():  # the hole, as it is
        assert said.startswith("wrote torch.rendezvous."), said
        assert code == 0 and sorted(job.losses) == list(range(VISITED[1])) and not job.errors, job.output[-3000:]
        assert_only_own_lines(job)
        assert words in page, "the multinode page must say what a stranger at the port does"
    else:  # torch closed it: the stranger was refused, or torchrun refused what it wrote
        refused = said.startswith("refused:") or re.search(r"RendezvousStateError|corrupt", job.output)
        assert refused, f"the stranger wrote its key ({said}), and torchrun neither ran it nor refused it"
        assert words not in page, "torch refuses the stranger now: the pages must say so"
