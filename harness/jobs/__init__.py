"""Running a job of the step scripts: start it, bound it, follow what it prints, kill a worker or a node, and read
what it did. The tests, the exercise checker, the notebooks, the demo and the benchmarks all run jobs this way.

    job = start(torchrun("multigpu_torchrun.py", 9, 3), cwd=tmp_path, record=True)
    job.wait_for(output.SAVED)       # the next line that matches; fails naming why if the job ends first
    job.kill_worker(rank=1)          # SIGKILL from outside, as the kernel's OOM killer would
    job.wait(timeout=120)            # exit codes; whatever still runs at the deadline is killed (code None)
    job.output, job.losses, job.samples, job.writes

A job is one command per node ("node": one launcher, e.g. one torchrun), each started in a session of its own, so
its whole process tree can be stopped, with its output in a log file (a file, not a pipe: nobody has to keep reading
for the job to go on). `run()` starts a job and waits for it.

The environment: the CPU (gloo) unless gpu=True, one compute thread per process, unbuffered output, and the repository
on PYTHONPATH (a learner's script elsewhere still imports `utils`). With record=True the job's processes load
recorder/sitecustomize.py (and its parts, recorder/recording/), which records each torch.save and the samples each
rank trains on, epoch by epoch, and each pass of a pipeline stage (job.records("pipeline.jsonl"), read by
tools/pipeline_timeline.py); record_steps=True adds every optimizer step (its learning rate, and the gradient
all-reduces DDP ran for it); record_collectives=True every collective a process called, when it waited for it, each
backward and optimizer step (job.records("collectives.jsonl"): what the workshop's build-it-yourself exercises are
judged by); kill_at, kill_at_step, skip_all_reduce and stall_init inject faults through it, slow_save makes every save
slower (recording/saves.py says how), and hold=True holds step 13's replica groups before they meet, until
job.release().

Shared runs: run(..., shared=True) in a test session (the suite sets $JOB_SHARED_DIR for it) runs a job that several
tests and notebooks ask for once: the first to ask runs it in a folder of the session's, the others wait for it and
get the same finished job (its folder is theirs to read, not to change). shared_file() gives such jobs their input
files under a name that only their content decides, shared_folder() a folder of them. Outside a test session,
run(..., shared=True) just runs the job.
"""
import fcntl
import hashlib
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.jobs import output
from harness.jobs.processes import kill_tree, torchrun_workers

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]  # the `torchrun` command, from this interpreter
RECORDER = Path(__file__).resolve().parent / "recorder"
# torchrun's switch for a fresh rendezvous store per attempt. The steps no longer need it (utils.attempt_store gives
# each attempt keys of its own in torchrun's shared store); tests use it to check that the other path works too.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
SHARED_VARIABLE = "JOB_SHARED_DIR"  # a folder of one test session: run(..., shared=True) runs each job there once
LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def free_port(host="127.0.0.1"):
    """A TCP port nobody listens on right now (the OS picks it), for a rendezvous on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def script(name):
    """A file of the repository, by its path from the repository's root."""
    return str(REPO / name)


def python(name, *args):
    """`python name args...` as a command list."""
    return [PYTHON, script(name), *map(str, args)]


def torchrun(name, *args, nproc=2, launcher_args=()):
    """`torchrun --standalone --nproc_per_node=N name args...` as a command list."""
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *launcher_args, script(name), *map(str, args)]


def torchrun_node(name, *args, nnodes=2, nproc=1, endpoint, run_id="job", launcher_args=()):
    """One node's torchrun of a multi-node job, meeting the others at a c10d rendezvous at `endpoint` (host:port)."""
    return [*TORCHRUN, f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", f"--rdzv_id={run_id}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", *launcher_args, script(name), *map(str, args)]


def lighthouse(port, min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000):
    """Step 13's lighthouse (torchft_lighthouse, installed beside this Python) on 127.0.0.1:`port`, as a command list:
    a step's quorum needs `min_replicas` groups; it waits up to `join_timeout_ms` for a group that heartbeats but has
    not asked to join yet, and takes a group whose heartbeat stopped `heartbeat_timeout_ms` ago for dead. RUST_LOG=warn,
    as the step's page starts it: at torchft's default level it logs 4-5 lines a step."""
    return ["env", "RUST_LOG=warn", str(Path(PYTHON).parent / "torchft_lighthouse"), "--min_replicas", str(min_replicas),
            "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", str(join_timeout_ms),
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]


def replica_groups(name, *args, port, groups=2, nproc=1, launcher_args=()):
    """Step 13's replica groups, each one `torchrun --standalone` (a rendezvous of its own) of `nproc` ranks, meeting
    at the lighthouse on 127.0.0.1:`port`: a command list per group. Start them after lighthouse(port), in one job."""
    return [torchrun(name, *args, "--group", group, "--groups", groups, "--lighthouse", f"http://127.0.0.1:{port}",
                     nproc=nproc, launcher_args=launcher_args) for group in range(groups)]


def kill_when_training_together(job, rank=0, steps=50, timeout=120):
    """In a job of step 13's two replica groups, SIGKILL `rank` of group 1 once it has committed step `steps` with
    group 0 (either group may start first, and a kill before the other group is there shows nothing): that step."""
    step = -1
    while step < steps:
        match = job.wait_for(output.GROUP_STEP, timeout=timeout)
        step = int(match["step"]) if match["group"] == "1" and match["participants"] == "2" else step
    job.kill_worker(rank=rank, node=2)
    return step


def next_heal(job, group, timeout=120):
    """Follow a job of step 13's replica groups to the next line in which `group` says it healed: the step it healed
    at. After kill_when_training_together, that is the killed group's return (its heal at a late start, if any, came
    before its first step, and is behind)."""
    while True:
        match = job.wait_for(output.HEALED, timeout=timeout)
        if match["group"] == str(group):
            return int(match["step"])


def shown(command):
    """A command as a learner types it: `python`, `torchrun` and the repository's files by their own names."""
    text = " ".join(map(str, command)).replace(" ".join(TORCHRUN), "torchrun").replace(PYTHON, "python")
    text = text.replace(str(Path(PYTHON).parent / "torchft_lighthouse"), "torchft_lighthouse")
    text = text.replace("env RUST_LOG=", "RUST_LOG=")  # a shell sets a variable for one command without `env`
    return text.replace(str(REPO) + os.sep, "")


def machine_summary():
    """One line: what runs the jobs here, and how busy the machine is (other work skews every timing)."""
    import platform

    import torch

    gpus = torch.cuda.device_count()
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"{os.cpu_count()} CPU cores ({platform.machine()})"
            + (f", {gpus} x {torch.cuda.get_device_name(0)} (NCCL)" if gpus else ", no GPU (gloo)")
            + f", torch {torch.__version__}{load}")


def environment(extra=None, gpu=False, record_dir=None, kill_at=None, skip_all_reduce=None, stall_init=None,
                record_steps=False, slow_save=None, kill_at_step=None, record_collectives=False, hold=None):
    """The environment of a job's processes (see the module's docstring); `extra` last (a value None removes a
    variable; a PYTHONPATH in it goes before the repository's)."""
    extra = dict(extra or {})
    env = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    # RUST_LOG is left as it is: step 13 quiets torchft's Rust side itself, and its lighthouse is started quiet
    # (lighthouse()), as the step's page starts it.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU jobs stay CPU jobs on a machine with GPUs
    injected = kill_at or kill_at_step or skip_all_reduce or stall_init is not None or slow_save or hold
    paths = [str(RECORDER)] if record_dir or injected else []
    paths += [str(extra.pop("PYTHONPATH", "")), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    if record_dir:
        env["JOB_RECORD_DIR"] = str(record_dir)
    if record_dir and record_steps:
        env["JOB_RECORD_STEPS"] = "1"
    if record_dir and record_collectives:
        env["JOB_RECORD_COLLECTIVES"] = "1"
    if kill_at:
        env["JOB_KILL_AT"] = ":".join(map(str, kill_at))
    if kill_at_step:
        env["JOB_KILL_AT_STEP"] = ":".join(map(str, kill_at_step))
    if slow_save:
        env["JOB_SLOW_SAVE"] = str(slow_save)
    if skip_all_reduce:
        env["JOB_SKIP_ALL_REDUCE"] = ":".join(map(str, skip_all_reduce))
    if stall_init is not None:
        env["JOB_STALL_INIT"] = str(stall_init)
    if hold:
        env["JOB_HOLD"] = str(hold)
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


class Job:
    """A running (then finished) job: one command per node. See the module's docstring; start() makes one.

    cwd: the folder each node runs in (one for all, or a list; `cwds` holds them, `cwd` the first node's); logs: where
    the logs and records go (default: the first node's folder); env: extra variables for every node, node_env: a dict
    per node on top of them; record_collectives (implies record): every torch.distributed collective and point-to-point
    op, each backward and optimizer step (the workshop's build-it-yourself exercises); record_steps (implies record):
    every optimizer step's learning rate and gradient
    all-reduces too; services: how many of the first commands serve the others and do not end by themselves (step 13's
    lighthouse): the job ends when the others have, and a service still serving then counts as exit code 0. hold: each
    process that starts a torchft Manager (step 13's groups) waits there until release(). `limit`: the seconds wait()
    gave it (None until then).
    """

    def __init__(self, *commands, cwd, env=None, node_env=None, gpu=False, record=False, kill_at=None,
                 skip_all_reduce=None, stall_init=None, slow_save=None, logs=None, record_steps=False,
                 kill_at_step=None, services=0, record_collectives=False, hold=False):
        self.services = services
        self.cwds = [Path(folder) for folder in (cwd if isinstance(cwd, (list, tuple)) else [cwd] * len(commands))]
        self.limit = None
        self.commands = [[str(part) for part in command] for command in commands]
        self.logs_dir = Path(logs or self.cwds[0])
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.recorded = record = record or record_steps or record_collectives
        self.held = self.logs_dir / "held" if hold else None
        if hold:
            self.held.mkdir()
        env = environment(env, gpu, self.logs_dir if record else None, kill_at, skip_all_reduce, stall_init,
                          record_steps, slow_save, kill_at_step, record_collectives, self.held)
        self.logs = [self.logs_dir / f"node{node}.log" for node in range(len(commands))]
        self.began, self.timeline, self.codes = time.monotonic(), [], None
        self._offsets, self._queue = [0] * len(commands), []
        self.procs = []
        for node, (command, folder, log) in enumerate(zip(self.commands, self.cwds, self.logs)):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(
                    command, cwd=folder, env=dict(env, **(node_env[node] if node_env else {})), stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True))

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.stop()

    @property
    def cwd(self):
        """The folder the first node ran in (where a one-node job's files are)."""
        return self.cwds[0]

    # --- following it -------------------------------------------------------------------------------------------

    def seconds(self):
        """Seconds since the job started."""
        return time.monotonic() - self.began

    def note(self, text):
        """Add an event of one's own (a kill, say) to the timeline, at this moment."""
        self.timeline.append((self.seconds(), None, text))

    def _read(self):
        """Queue the complete lines written since the last read, each with the second it was read (a line still
        being written waits for the next read)."""
        for node, log in enumerate(self.logs):
            with open(log, "rb") as file:
                file.seek(self._offsets[node])
                data = file.read()
            complete = data[:data.rfind(b"\n") + 1]
            self._offsets[node] += len(complete)
            self._queue += [(self.seconds(), node, raw.decode(errors="replace")) for raw in complete.splitlines()]

    def _consume(self, echo=None):
        """The oldest queued line as (node, line), now on the timeline and echoed (echo(line, node)); or None."""
        if not self._queue:
            return None
        seconds, node, line = self._queue.pop(0)
        self.timeline.append((seconds, node, line))
        if echo:
            echo(line, node)
        return node, line

    def new_lines(self, echo=None):
        """Every line written since the last read, as (node, line)."""
        self._read()
        return list(iter(lambda: self._consume(echo), None))

    def wait_for(self, *patterns, timeout=60, echo=None):
        """The match of the next line that matches one of `patterns` (strings or compiled regexes; `match.re` tells
        which): the lines up to it are consumed, those after it are not. Fails naming what happened if the job ends
        or `timeout` s pass first."""
        patterns = [re.compile(pattern) if isinstance(pattern, str) else pattern for pattern in patterns]
        deadline = time.monotonic() + timeout
        while True:
            ended = not self.running()  # before reading: the last lines of a job that just ended count
            self._read()
            for _, line in iter(lambda: self._consume(echo), None):
                for pattern in patterns:
                    match = pattern.search(line)
                    if match:
                        return match
            if ended or time.monotonic() > deadline:
                why = f"ended with exit codes {self.poll()}" if ended else f"ran {timeout} s"
                wanted = " or ".join(repr(pattern.pattern) for pattern in patterns)
                raise AssertionError(f"the job {why} before printing a line matching {wanted}; its output ends:\n"
                                     f"{self.output[-3000:]}")
            time.sleep(0.01)

    # --- its processes ------------------------------------------------------------------------------------------

    def poll(self):
        """Each node's exit code, None for one still running."""
        return [proc.poll() for proc in self.procs]

    def running(self):
        """True while any node runs (a service does not count)."""
        return None in self.poll()[self.services:]

    def workers(self, node=0, restart=0, nproc=None, timeout=60):
        """{global rank: pid} of the workers node `node`'s torchrun started for attempt `restart`."""
        if nproc is None:
            nproc = int(next(part.split("=")[1] for part in self.commands[node]
                             if part.startswith("--nproc_per_node=")))
        return torchrun_workers(self.procs[node].pid, nproc, restart, timeout)

    def release(self, processes, timeout=300):
        """In a job started with hold=True: wait until `processes` processes wait to start their torchft Manager (one
        a replica group of one rank), then let them all go on at once. Fails naming how many came if the job ends or
        `timeout` s pass first."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = len(list(self.held.glob("held-*")))
            if waiting >= processes:
                break
            if not self.running() or time.monotonic() > deadline:
                why = f"ended with exit codes {self.poll()}" if not self.running() else f"ran {timeout} s"
                raise AssertionError(f"the job {why} with {waiting} of {processes} processes at their torchft Manager; "
                                     f"its output ends:\n{self.output[-3000:]}")
            time.sleep(0.05)
        (self.held / "go").touch()
        self.note(f"{processes} processes released")

    def kill_worker(self, rank, restart=0, node=0, nproc=None, sig=signal.SIGKILL):
        """Send `sig` (SIGKILL: no handler, no cleanup) to the worker of `rank` in attempt `restart`; its pid."""
        pid = self.workers(node, restart, nproc)[rank]
        os.kill(pid, sig)
        self.note(f"{signal.Signals(sig).name} to rank {rank} (pid {pid})")
        return pid

    def kill_node(self, node, sig=signal.SIGKILL):
        """Node `node`'s launcher and everything it started, at once: the machine is gone."""
        kill_tree(self.procs[node].pid, sig)
        self.note(f"{signal.Signals(sig).name} to node {node}")

    def wait(self, timeout, echo=None):
        """Wait for every node (one deadline for all), following the output; whatever still runs at the deadline is
        killed with its whole tree. Returns the exit codes, None for a node stopped at the deadline."""
        self.limit = timeout
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            self.new_lines(echo)
            time.sleep(0.02)
        self.codes = self.poll()
        self.codes[:self.services] = [0 if code is None and not self.running() else code
                                      for code in self.codes[:self.services]]
        self.new_lines(echo)
        self.stop()
        return self.codes

    def stop(self):
        """Kill whatever is left of every node (idempotent)."""
        for proc in self.procs:
            kill_tree(proc.pid)
            proc.wait(timeout=30)
        if self.codes is None:
            self.codes = self.poll()

    @property
    def timed_out(self):
        return self.codes is not None and None in self.codes

    @property
    def ok(self):
        return self.codes is not None and all(code == 0 for code in self.codes)

    @property
    def returncode(self):
        """The exit code of a one-node job (None: stopped at the deadline)."""
        assert len(self.procs) == 1, "a job of several nodes has .codes"
        return self.codes[0] if self.codes is not None else self.procs[0].poll()

    # --- what it printed and did ---------------------------------------------------------------------------------

    def node_output(self, node):
        return self.logs[node].read_text(errors="replace")

    @property
    def output(self):
        """Everything every node printed, node after node."""
        return "".join(self.node_output(node) for node in range(len(self.logs)))

    @property
    def losses(self):
        return output.epoch_losses(self.output)

    @property
    def resumes(self):
        return output.resumes(self.output)

    @property
    def errors(self):
        return output.errors(self.output)

    @property
    def writes(self):
        return recorded_writes(self.logs_dir)

    @property
    def samples(self):
        """One dict per completed pass over a DataLoader, in the order they ended: pid, rank, restart, sampler (class
        name), epoch (its set_epoch value, or None), number (the pass's number in its process), ddp (the model was
        wrapped in DDP), mesh (the rank's coordinates in a named device mesh, e.g. {"dp": 0, "tp": 1}, or None),
        indices (the samples, in training order), and what recorder/recording/samples.py's docstring lists."""
        return self.records("samples.jsonl")

    @property
    def steps(self):
        """One dict per optimizer step of a job recorded with record_steps, in the order they were taken: pid, rank,
        restart, step (its number in its process), at (time.time() as it began), lr (the learning rate it used), rounds
        (gradient all-reduce rounds since the step before: one per backward that synced), buckets, grad_norms (each
        round's all-reduced gradient norm). A process without DDP has rounds 0."""
        return self.records("steps.jsonl")

    def records(self, name):
        """The JSON lines of one of the recorder's files (saves.jsonl, exits.jsonl...; recorder/sitecustomize.py says
        which of its parts writes each, and the part what it holds)."""
        return recorded(self.logs_dir, name)

    def writers(self):
        """(ranks that wrote files, the files' names): a temporary file counts under the name it was renamed to."""
        ranks = sorted({rank for _, rank, _ in self.writes}, key=str)
        files = sorted({saved_name(path) for _, _, path in self.writes})
        return ranks, files

    def describe(self):
        return "; ".join(f"node {node}: `{shown(command)}` exited {code}"
                         for node, (command, code) in enumerate(zip(self.commands, self.codes or self.poll())))


def saved_name(path):
    """A saved file's name; a temporary one (`snapshot.pt.tmp`, or utils.replacing's `snapshot.pt.1234.tmp`) under
    the name it is renamed to."""
    return re.sub(r"(\.\d+)?\.tmp$", "", Path(path).name)


def recorded_writes(folder):
    """[(pid, rank or None, absolute path), ...]: every torch.save of a recorded job, in order."""
    path = Path(folder) / "writes.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(pid), None if rank == "-" else int(rank), file) for pid, rank, file in rows]


def recorded(folder, name):
    """The JSON lines of one of the recorder's files in `folder` (samples.jsonl, steps.jsonl, saves.jsonl...), as
    dicts, in order; [] when the job wrote none."""
    path = Path(folder) / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def spawned_result(worker, args, nprocs, timeout, what):
    """Run worker(rank, *args, result_path) in `nprocs` processes started by mp.spawn (the benchmarks' in-process
    jobs), for at most `timeout` s; the JSON its rank 0 wrote to result_path. A failing worker raises here, with its
    traceback; one past the time stops them all with one line naming `what`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        context = mp.spawn(worker, args=(*args, str(result_path)), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                sys.exit(f"error: {what} took longer than --timeout {timeout} s")
        return json.loads(result_path.read_text())


class FinishedJob(Job):
    """A job another caller of the session ran (run(..., shared=True)): the same properties, read from its folder;
    nothing runs any more, so there is nothing to follow, kill or wait for."""

    def __init__(self, folder):
        state = json.loads((folder / "job.json").read_text())
        self.commands, self.codes, self.limit = state["commands"], state["codes"], state["limit"]
        self.cwds, self.logs_dir = [folder / "work"] * len(self.commands), folder / "logs"
        self.logs = [self.logs_dir / f"node{node}.log" for node in range(len(self.commands))]
        self.recorded, self.procs, self.timeline, self.began = state["recorded"], [], [], time.monotonic()
        self._offsets, self._queue, self.services = [0] * len(self.commands), [], 0

    def poll(self):
        return list(self.codes)

    def stop(self):
        pass


def shared_file(name, content):
    """A file holding `content` (text) for jobs run with shared=True: in a test session it lies in the session's shared
    folder under a name its content decides, so two tests that write the same text name the same file (and their
    commands, hence their jobs, are the same); outside one, in a temporary folder of this process."""
    folder = Path(os.environ.get(SHARED_VARIABLE) or tempfile.mkdtemp(prefix="job-files-")) / "files"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(content.encode()).hexdigest()[:16]}-{name}"
    if not path.exists():
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(content)
        os.replace(partial, path)
    return path


def shared_folder(name, make):
    """A folder that `make(path)` creates and fills, for jobs run with shared=True: in a test session, made once in
    the session's shared folder under `name` (which must name all its content depends on), the other callers waiting
    for it; outside one, in a temporary folder of this process."""
    folder = Path(os.environ.get(SHARED_VARIABLE) or tempfile.mkdtemp(prefix="job-files-")) / "files"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / name).exists():
            make(folder / name)
    return folder / name


def _shared_run(commands, timeout, options):
    """run()'s job, run once in the session's shared folder by whichever caller asks first (see the module's
    docstring): the same commands and options (but for where it runs) name the same job; an option given its default
    value (gpu=False, say) names the same job as one left out."""
    options.pop("cwd", None), options.pop("logs", None)
    defaults = inspect.signature(Job.__init__).parameters
    options = {name: value for name, value in options.items()
               if name not in defaults or defaults[name].default != value}
    key = json.dumps(dict(commands=[[str(part) for part in command] for command in commands],
                          options={name: repr(value) for name, value in sorted(options.items())}), sort_keys=True)
    folder = Path(os.environ[SHARED_VARIABLE]) / "jobs" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first caller runs it; the others wait here, then read what it did
        if not (folder / "job.json").exists():
            (folder / "work").mkdir(exist_ok=True)
            with Job(*commands, cwd=folder / "work", logs=folder / "logs", **options) as job:
                job.wait(timeout)
            (folder / "key.json").write_text(key)
            (folder / "job.json").write_text(json.dumps(dict(commands=job.commands, codes=job.codes, limit=job.limit,
                                                             recorded=job.recorded)))
    return FinishedJob(folder)


def start(*commands, **options):
    """Start a job: one command per node (see Job for the options)."""
    return Job(*commands, **options)


def run(*commands, timeout=120, check=True, shared=False, **options):
    """Start a job and wait for it (at most `timeout` s); with check, fail unless every node exited 0. shared=True: in a
    test session, the same job asked for by several tests and notebooks runs once (see the module's docstring); its
    folder (job.cwd) is then the session's, and the job must not need anything in it beforehand."""
    if shared and os.environ.get(SHARED_VARIABLE):
        job = _shared_run(commands, timeout, options)
    else:
        # As a context, the job is stopped if the wait is cut short (Ctrl-C, a test's timeout): its processes run
        # in sessions of their own, which no signal to this process reaches.
        with Job(*commands, **options) as job:
            job.wait(timeout)
    if check and not job.ok:
        raise AssertionError(f"{job.describe()}; its output ends:\n{job.output[-4000:]}")
    return job
