"""What the launchers (torchrun, mp.spawn) need that the steps do not teach: a store that is this torchrun attempt's
own, workers that stop with their launcher, signals passed on to the workers (and a torchrun worker's quiet stop on
Ctrl-C), and a rendezvous port that is checked.
"""
import contextlib
import hashlib
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from utils.files import UNFINISHED, remove

POLL_S = 0.05


def _stop(message):
    """End this process at once with one line (from any thread: a worker thread cannot raise in the main one)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _watch(timeout_s, launcher_pid, rendezvous_s=None):
    """Background duties of a torchrun worker: stop if its process group has not formed within timeout_s (rendezvous_s,
    when the group has a bound of its own to form in), and stop as soon as its launcher is gone, for the whole life of
    the worker. Once the group has formed, the first duty is done: after destroy_process_group() dist.is_initialized()
    is False again, and a worker that goes on (evaluating, plotting) must not be taken for one whose group never
    formed."""
    deadline, formed = time.monotonic() + (rendezvous_s or timeout_s), False
    bound = f"--timeout {timeout_s} s" if rendezvous_s is None else f"--rendezvous_timeout {rendezvous_s} s"
    while True:
        formed = formed or dist.is_initialized()
        if not formed and time.monotonic() > deadline:
            _stop(f"error: rank {os.environ.get('RANK')}: the process group did not form within {bound}: a rank did "
                  "not arrive, or its address cannot be reached (see the troubleshooting docs)")
        if os.getppid() != launcher_pid:  # torchrun was killed (SIGKILL leaves it no time to stop its workers)
            _stop(f"error: rank {os.environ.get('RANK')}: torchrun (pid {launcher_pid}) is gone, so this worker "
                  "stops; run the same command again to resume from the last snapshot")
        time.sleep(1 if formed else POLL_S)


def _stop_on_ctrl_c(signum, _frame):
    """A torchrun worker's SIGINT handler. A terminal's Ctrl-C reaches torchrun alone (it starts each worker in a
    session of its own); torchrun then sends SIGINT to every worker, waits for them, and prints its own report. Without
    this handler each worker prints a KeyboardInterrupt traceback, dozens of lines per rank. With it, the worker
    removes the temporary it was writing (the last whole snapshot stays), local rank 0 says in one line what is kept
    and how to go on, and the worker ends at once (exit 130, as after Ctrl-C). Ending here is as safe as a crash, which
    every file the steps write survives (utils.replacing); what would be left half written is removed first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not interrupt the stop
    for tmp in list(UNFINISHED):
        remove(tmp)
    with contextlib.suppress(Exception):
        sys.stdout.flush()  # the lines printed so far (a print cut short by the signal may refuse: nothing to lose)
    if os.environ.get("LOCAL_RANK") == "0":
        os.write(2, f"error: stopped by {signal.Signals(signum).name} (Ctrl-C), with every worker of this node; the "
                    "last snapshot saved is kept, and the same command resumes from it\n".encode())
    os._exit(130)


# The Flight Recorder (docs/flight-recorder.md): torch keeps each rank's last collectives when one of these variables
# gives it a number of entries (the second is the older name), and a dump goes to one of these prefixes plus the rank.
FLIGHT_RECORDER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FLIGHT_RECORDER_PREFIX = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"  # torch's own default


def flight_recorder_on():
    sizes = [os.environ.get(name, "").strip() for name in FLIGHT_RECORDER_SIZE]
    return any(size.isdigit() and int(size) > 0 for size in sizes)


def dump_prefix():
    """Where the Flight Recorder's dumps go: this prefix plus each rank's number."""
    return next((os.environ[name] for name in FLIGHT_RECORDER_PREFIX if os.environ.get(name)), DEFAULT_DUMP_PREFIX)


def dump_flight_recorder():
    """Write this rank's Flight Recorder (its last collectives, each with the Python lines that called it) to the dump
    prefix plus the rank, as torch's analyzer reads it (`torchfrtrace FOLDER -p PREFIX`); the path written, or a
    sentence saying why there is none. NCCL's watchdog writes such a dump when a collective times out; gloo writes
    none, so the steps write it here, when a collective gave up, and a script may call this at its end. torch 2.14
    records gloo's groups without their names (pg_config holds one group named ''), and the analyzer then stops with a
    KeyError: the table is filled in from torch.distributed's own list of groups."""
    import pickle

    import torch

    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return f"torch {torch.__version__} has no Flight Recorder for gloo (torch 2.14 has)"
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    try:
        trace = pickle.loads(dump())
        world = dist.distributed_c10d._world
        groups = {name: {"name": name, "desc": getattr(group, "group_desc", name),
                         "ranks": str(sorted(world.pg_group_ranks.get(group, {})))}
                  for group, name in (world.pg_names.items() if dist.is_initialized() else ())}
        trace["pg_config"] = {**{key: value for key, value in trace.get("pg_config", {}).items() if key}, **groups}
        with open(f"{dump_prefix()}{rank}", "wb") as file:
            pickle.dump(trace, file)
    except Exception as error:  # a dump must never hide the error it goes with
        return f"no Flight Recorder dump ({type(error).__name__}: {error})"
    return f"{dump_prefix()}{rank}"


def _where_the_dump_is():
    """What a collective's one-line timeout ends with: where this rank's Flight Recorder dump is, when it is on."""
    if not flight_recorder_on():
        return ""
    written = dump_flight_recorder()
    if not os.path.isfile(written):
        return f"; {written}"
    folder, prefix = os.path.split(os.path.abspath(dump_prefix()))
    return f"; the Flight Recorder's dump is {written} (every rank's: torchfrtrace {folder} -p {prefix})"


def _wait_for_the_other_dumps(timeout_s):
    """Once this rank wrote its dump, wait (at most timeout_s) until every rank of the job has written its own: the
    first rank to stop makes torchrun stop the others, and a rank stopped before its own collective gave up would leave
    no dump, which the analyzer needs from every rank."""
    world_size, deadline = int(os.environ.get("WORLD_SIZE", 1)), time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(os.path.isfile(f"{dump_prefix()}{rank}")
                                                  for rank in range(world_size)):
        time.sleep(POLL_S)


def known_cause(error, timeout_s):
    """The one line a torchrun worker stops with for an error whose cause is known (None for any other), found in
    `error` or the errors it was raised from (torch.distributed.pipelining re-raises a failed send as the cause of its
    own error; DDP and autograd raise a collective's error as their own): a collective that gave up waiting for a peer,
    gloo's "Timed out waiting 60000ms for recv operation to complete", from any of the job's process groups; and a peer
    that vanished in the middle of a collective (killed, crashed, its machine gone), which gloo reports as "Connection
    closed by peer [ADDRESS]:PORT" or "Read error [ADDRESS]:PORT: Connection reset by peer", and NCCL as "remote process
    exited or there was a network error". And step 13's (torchft's): a server that does not answer (the lighthouse,
    or the Manager of the group's rank 0), and a step's quorum that did not come within the timeout."""
    rank = os.environ.get("RANK")
    while error is not None:
        message = str(error) if isinstance(error, (RuntimeError, TimeoutError)) else ""
        unanswered = re.search(r"failed to connect to (\S+) within timeout", message)
        if unanswered:
            return (f"error: rank {rank}: nothing answers at {unanswered[1]} within --timeout {timeout_s} s: the "
                    "lighthouse is not running or cannot be reached (start it first: torchft_lighthouse; --lighthouse "
                    "gives its address); the snapshot on disk is kept, and the same command resumes from it")
        if isinstance(error, TimeoutError) and "Timeout expired" in message:
            return (f"error: rank {rank}: no quorum within --timeout {timeout_s} s: the lighthouse is gone or cannot "
                    "be reached; the snapshot on disk is kept, and the same commands resume from it once it runs")
        waited = re.search(r"Timed out waiting \d+ms[^\n]*", message)
        if waited:
            return (f"error: rank {rank}: a collective gave up after --timeout {timeout_s} s "
                    f"({waited[0].rstrip('. ')}): a rank is stuck or gone; the last snapshot is kept, and the same "
                    "command resumes from it" + _where_the_dump_is())
        gone = re.search(r"Connection (?:closed|reset) by peer|remote process exited", message)
        if gone:
            where = re.search(r"\[([^\]\s]+)\]:\d+", message)
            return (f"error: rank {rank}: a peer is gone ({gone[0]}" + (f", at {where[1]}" if where else "") + "), "
                    "so this rank stops too: torchrun restarts every worker from the last snapshot if --max_restarts "
                    "allows, else the same command resumes from it" + _where_the_dump_is())
        error = error.__cause__ or error.__context__
    return None


def _one_line_for_known_causes(timeout_s, shown):
    """A torchrun worker's sys.excepthook: an error whose cause is known (known_cause) ends the worker with one line
    that says what happened and what to do, instead of a traceback of dozens; any other error is shown as `shown`
    shows it. init_process_group wraps the hook it finds (it prefixes every line with the rank, writing them to a
    buffer first), so the line goes straight to the process's stderr."""
    def hook(kind, error, traceback):
        line = known_cause(error, timeout_s)
        if line is None:
            return shown(kind, error, traceback)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.write(2, f"{line}\n".encode())
        if "the Flight Recorder's dump is" in line:
            _wait_for_the_other_dumps(timeout_s)
        os._exit(1)

    return hook


def watch_this_worker(timeout_s, rendezvous_s=None):
    """Make this torchrun worker stop with one line instead of hanging or printing a traceback; call it in main, just
    before the process group forms. timeout_s is the job's --timeout; rendezvous_s, when given, bounds the forming of
    the group instead (a busy machine can take far longer to start every rank than a collective may wait for one).

    - A watch (a daemon thread): if the process group has not formed within that bound, the worker stops with one line
      (gloo's own connect can wait 5 x the timeout); if torchrun is gone, it stops with one line instead of training on
      alone, writing the snapshot a new job reads.
    - Ctrl-C (torchrun passes it to every worker): the temporary being written is removed, local rank 0 says in one
      line what is kept, and the worker ends (exit 130), instead of a KeyboardInterrupt traceback per rank.
    - An error whose cause is known (a collective that gave up waiting for a peer, above all): one line, not a
      traceback.
    - Every line this worker prints reaches the terminal or the log in one write: unbuffered (PYTHONUNBUFFERED, as a
      job runner sets it), Python writes a message and its newline apart, and two ranks' one-line errors, printed at
      the same moment, ran together on one line.
    """
    threading.Thread(target=_watch, args=(timeout_s, os.getppid(), rendezvous_s), daemon=True).start()
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)
    signal.signal(signal.SIGINT, _stop_on_ctrl_c)
    sys.excepthook = _one_line_for_known_causes(timeout_s, sys.excepthook)


def attempt_store(timeout_s, rendezvous_s=None):
    """The store the workers of this torchrun attempt form their process group in: pass it to init_process_group.
    timeout_s is the job's --timeout; rendezvous_s, when given, bounds the forming of the group instead (as
    watch_this_worker's).

    Why: since torch 2.5, torchrun keeps one store for the whole job and hands it to every attempt's workers, and the
    process group writes each rank's address under the same keys at every attempt. After a restart, a rank can read
    the address of a peer that died with the previous attempt: init_process_group then fails, or waits 5 x its
    timeout (pytorch#135712; TORCHELASTIC_RESTART_COUNT cannot tell attempts apart, each node counts only its own).
    How: torchrun stops every worker of an attempt before it starts the next, so rank 0 deletes the other ranks'
    hello keys; each of them writes a fresh random nonce there until rank 0 answers with that nonce and a number from
    store.add, new at every attempt; all ranks then keep their keys under that number. When torchrun gives each
    attempt a store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or torch < 2.5), there is nothing to do:
    None, and init_process_group uses the usual env:// rendezvous.

    The store itself has no side effect on this process: watch_this_worker, called before, bounds the wait.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    deadline = time.monotonic() + (rendezvous_s or timeout_s)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          timeout=timedelta(seconds=rendezvous_s or timeout_s))
    if rank == 0:
        attempt = str(store.add("attempts", 1))
        for other in range(1, world_size):
            store.delete_key(f"hello/{other}")  # a dead worker's, or a live one's: that one writes it again
        for other in range(1, world_size):
            store.wait([f"hello/{other}"], timedelta(seconds=max(0.001, deadline - time.monotonic())))
            store.set(f"answer/{other}", store.get(f"hello/{other}").decode() + ":" + attempt)
    else:
        nonce = uuid.uuid4().hex
        while True:
            store.set(f"hello/{rank}", nonce)
            if store.check([f"answer/{rank}"]):
                quoted, _, attempt = store.get(f"answer/{rank}").decode().partition(":")
                if quoted == nonce:  # no earlier attempt can have written this nonce
                    break
            time.sleep(POLL_S)  # watch_this_worker's watch stops this process when the time is up
    return dist.PrefixStore(f"attempt{attempt}", store)


SPEAKER_GRACE_S = 5  # how long a rank that stops silently leaves the one that says why to say it


def stop_once(line, here, code=1):
    """Stop this worker for a reason every rank meets alike: with `line` where `here` is true (one rank for all), else
    silently with the same exit code, once the rank that says it has had the time to: torchrun stops every worker as
    soon as one has ended, and the rank with the line could be stopped before it is out."""
    if here:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(SPEAKER_GRACE_S)
    raise SystemExit(code)


def said_in_an_earlier_attempt(line):
    """Whether an earlier torchrun attempt of this job already said `line` on this node; from now on, also that this
    one did. torchrun starts every worker again at each restart (--max_restarts), and a mistake that no restart can fix
    (the arguments, the data, a snapshot) is met again at every attempt: said once, it is not said again. torchrun
    (torch 2.5 and later) keeps one store for all the attempts of a job, where the lines said are counted, by node
    (GROUP_RANK). False where there is no such store, or it does not answer: that attempt says the line too."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    key = f"said_once/{os.environ.get('GROUP_RANK', '0')}/{hashlib.sha256(line.encode()).hexdigest()}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=SPEAKER_GRACE_S))
        return store.add(key, 1) > 1
    except Exception:  # a line said twice is better than none
        return False


def stop_once_per_node(line):
    """Stop this torchrun worker for a mistake that every rank of its node meets alike, before its process group forms:
    local rank 0 says `line`, once for the job (said_in_an_earlier_attempt); the other ranks stop silently, once it has
    had the time to (stop_once)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        stop_once(line, here=False)
    if said_in_an_earlier_attempt(line):
        raise SystemExit(1)
    raise SystemExit(line)


def errors_said_once(parser):
    """`parser`, whose errors are said once on each node. torchrun starts every worker with the same arguments, and
    starts them all again at each restart (--max_restarts): a mistake in them would be printed by every rank of every
    attempt, a usage block each, though no restart can fix it. Local rank 0 of torchrun's first attempt prints it (each
    node's terminal says why its torchrun stopped); every other worker exits with the same code (2), silently (in the
    first attempt, once local rank 0 has had the time to print it)."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if os.environ.get("LOCAL_RANK", "0") != "0" and first_attempt:
        parser.error = lambda message: stop_once(None, False, code=2)
    elif not first_attempt:
        parser.error = lambda message: parser.exit(2)
    return parser


@contextlib.contextmanager
def said_once_per_node(timeout_s):
    """Around a torchrun worker's checks that every rank of a node makes alike: before its process group forms (its
    arguments, its files), and after, the resume from a snapshot that every rank reads from the node's disk. A mistake
    they find stops every rank, and is said once, by local rank 0, at the first attempt of the job that meets it (a
    restart by torchrun meets it again: said_in_an_earlier_attempt). The other ranks say nothing and wait for torchrun
    to stop them, which it does as soon as local rank 0 has exited: a rank that exited first would have torchrun stop
    local rank 0 before it said anything. One that is still waiting after timeout_s (local rank 0 found no mistake:
    the files changed between their checks) says it too, and exits. Only a stop with a line (SystemExit("error: ..."))
    is said once: a crash, with its traceback, ends each rank as it would without this."""
    try:
        yield
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        if os.environ.get("LOCAL_RANK", "0") != "0":
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                time.sleep(POLL_S)
        elif said_in_an_earlier_attempt(stop.code):
            raise SystemExit(1) from None
        raise


def stop_on_signals():
    """In a step's own process (step 1's, or step 2's, which starts the workers with mp.spawn): SIGINT (Ctrl-C,
    `kill -INT`) and SIGTERM end it with one line, and stop its workers too, at once. Without it Python prints a
    KeyboardInterrupt traceback, and step 2's exit waits for the workers, which train on to the last epoch. A torchrun
    worker has a handler of its own (watch_this_worker installs it). A save under way is undone (utils.replacing removes
    the file being written), so the checkpoint on disk is the last one saved, whole."""
    def stop(signum, _frame):
        workers = multiprocessing.active_children()
        for worker in workers:
            worker.terminate()  # SIGTERM: the files they write are replaced atomically, so none is left half written
        for worker in workers:
            worker.join(timeout=10)
        raise SystemExit(f"error: stopped by {signal.Signals(signum).name}" + (", with every worker" if workers else "")
                         + "; the checkpoint on disk is the last one saved")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)


def rendezvous_port(host="127.0.0.1"):
    """MASTER_PORT for workers of this machine: the user's, checked (a whole number, 1-65535, free), else a free one.

    A bad or busy port would otherwise surface seconds later, as a traceback in every spawned process."""
    chosen = os.environ.get("MASTER_PORT")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            port = int(chosen) if chosen else 0
            if not 0 <= port <= 65535 or (chosen and port == 0):
                raise ValueError
            sock.bind((host, port))
        except ValueError:
            raise SystemExit(f"error: MASTER_PORT={chosen} is not a port number (1-65535): unset it to use a free "
                             "one") from None
        except OSError as error:
            raise SystemExit(f"error: MASTER_PORT={chosen} cannot be used ({error.strerror}): choose another, or "
                             "unset it to use a free one") from None
        return str(sock.getsockname()[1])


def collectives_timeout(timeout_s, group=None):
    """Every collective of `group` (the default one: None) gives up after timeout_s from now on, whatever bound the
    group was made with. torch 2.14 has dist.set_timeout; older releases (2.6 among them) have the same function as
    dist.distributed_c10d._set_pg_timeout, which 2.14 keeps as a deprecated alias."""
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timedelta(seconds=timeout_s), group)


def mesh_with_timeout(mesh, timeout_s):
    """`mesh`, its process groups bound by the job's timeout. init_device_mesh makes a group for each dimension of a
    mesh with torch's default timeout (30 minutes on gloo, 10 on nccl), not the timeout of the default group
    (pytorch#119574): a rank stuck in a tensor-parallel all-reduce would keep its peers waiting that long."""
    for name in mesh.mesh_dim_names:
        collectives_timeout(timeout_s, mesh.get_group(name))
    return mesh
