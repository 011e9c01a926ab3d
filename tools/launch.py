"""How jobs of the step scripts are launched, watched, stopped and read: shared by the tools, benchmarks and tests."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]  # the `torchrun` command, from this interpreter
AUDIT_DIR = REPO / "tests" / "audit"  # its sitecustomize.py records every torch.save of a job

EPOCH_LINE = re.compile(r"\[(?:rank \d+/\d+[^\]]*|cpu|cuda[:\d]*)\] epoch (\d+) \| steps \d+ \| loss ([\d.]+)")


def script(name):
    return str(REPO / name)


def torchrun(name, *args, nproc=2, launcher_args=()):
    """`torchrun --standalone --nproc_per_node=N name args...` as a command list."""
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *launcher_args, script(name), *map(str, args)]


def torchrun_node(name, *args, nnodes=2, nproc=1, endpoint, run_id="test", launcher_args=()):
    """One node's torchrun of a multi-node job with c10d rendezvous at `endpoint` (host:port)."""
    return [*TORCHRUN, f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", f"--rdzv_id={run_id}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", *launcher_args, script(name), *map(str, args)]


def epoch_losses(output):
    """{epoch: loss} from the per-epoch lines a step prints (each epoch's last report wins)."""
    return {int(epoch): float(loss) for epoch, loss in EPOCH_LINE.findall(output)}


def job_env(extra=None, audit_file=None, gpu=False, samples_file=None, kill_at=None):
    """The environment of a launched job: the CPU (gloo) unless gpu=True, one CPU thread per process, unbuffered
    output, and, with audit_file, a record of every file torch.save writes and which process wrote it; with
    samples_file, the sample indices each process trained on per epoch; with kill_at=(restart, rank, epoch), that
    worker SIGKILLs itself as it begins that epoch (tests/audit/sitecustomize.py does all three)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU jobs stay CPU jobs on a machine with GPUs
    env.pop("LOCAL_RANK", None)
    if audit_file or samples_file or kill_at:
        env["PYTHONPATH"] = os.pathsep.join([str(AUDIT_DIR), env.get("PYTHONPATH", "")])
    if audit_file:
        env["AUDIT_WRITES_TO"] = str(audit_file)
    if samples_file:
        env["AUDIT_SAMPLES_TO"] = str(samples_file)
    if kill_at:
        env["AUDIT_KILL_AT"] = ":".join(map(str, kill_at))
    env.update(extra or {})
    return env


def start(cmd, cwd, env=None, log=None):
    """Start a command in its own process group (so the whole tree can be killed); output goes to `log`."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=env or job_env(), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc, sig=signal.SIGKILL):
    """Kill a process started by start() and everything it started. torchrun starts each worker in a session of
    its own, so killing the launcher's process group alone would leave the workers running: the group is frozen
    first (no new children), then every descendant is signalled too."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGSTOP)
    for pid in [*descendant_pids(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on a SIGTERM only once it runs again
    proc.wait(timeout=30)


def child_pids(pid):
    """Pids of the live (not zombie) processes whose parent is `pid`, read from Linux's /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        state, parent = stat[stat.rindex(")") + 2:].split()[:2]  # the name in (...) may hold spaces
        if int(parent) == pid and state != "Z":
            children.append(int(entry.name))
    return children


def descendant_pids(pid):
    """Pids of the live children of `pid`, their children, and so on."""
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def process_env(pid):
    """The environment a process was started with (/proc/<pid>/environ), as a dict."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def torchrun_workers(agent_pid, nproc, restart=0, timeout=60):
    """{rank: pid} of the workers a torchrun agent started for attempt `restart` (its TORCHELASTIC_RESTART_COUNT),
    waiting until all `nproc` of them are up. `agent_pid` is the torchrun process itself."""
    deadline = time.monotonic() + timeout
    while True:
        workers = {}
        for pid in child_pids(agent_pid):
            try:
                env = process_env(pid)
            except OSError:
                continue
            if env.get("TORCHELASTIC_RESTART_COUNT") == str(restart) and "RANK" in env:
                workers[int(env["RANK"])] = pid
        if len(workers) == nproc:
            return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchrun (pid {agent_pid}) has {len(workers)} of {nproc} workers of restart "
                               f"{restart} after {timeout} s")
        time.sleep(0.02)


class LogFollower:
    """Reads a log file that a running job is writing, line by line, from where the last read stopped."""

    def __init__(self, path, proc=None, echo=None):
        self.path, self.proc, self.echo = Path(path), proc, echo  # echo(line): called for every line consumed
        self.offset = 0

    def _lines(self):
        """The complete lines written after `offset`, one at a time; each is consumed when the caller takes it."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as log:
            log.seek(self.offset)
            data = log.read()
        for line in data[:data.rfind(b"\n") + 1].splitlines(keepends=True):  # a line still being written waits
            self.offset += len(line)
            text = line.decode(errors="replace").rstrip("\n")
            if self.echo:
                self.echo(text)
            yield text

    def new_lines(self):
        """Every complete line written since the last read."""
        return list(self._lines())

    def wait_for(self, pattern, timeout=60):
        """The match in the next line that matches `pattern` (the lines before it are consumed, those after it are
        not); fails clearly if the job exits or the deadline passes first."""
        pattern, deadline = re.compile(pattern), time.monotonic() + timeout
        while True:
            exited = self.proc is not None and self.proc.poll() is not None  # before reading: its last lines count
            for line in self._lines():
                match = pattern.search(line)
                if match:
                    return match
            if exited or time.monotonic() > deadline:
                why = f"exited {self.proc.returncode}" if exited else f"ran {timeout} s"
                tail = self.path.read_text()[-3000:] if self.path.exists() else "(no log)"
                raise AssertionError(f"the job {why} before printing a line matching {pattern.pattern!r}; "
                                     f"its log ends:\n{tail}")
            time.sleep(0.01)


def wait_for(condition, timeout, what, interval=0.1):
    """Poll `condition()` until it returns something truthy (returned); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"gave up after {timeout} s waiting for {what}")


def read_log(path):
    return Path(path).read_text(errors="replace") if Path(path).exists() else ""


def finish(procs, timeout):
    """Wait for every process in `procs` (all share one deadline); return their exit codes, None for a process
    still running at the deadline (it is then killed with its whole tree)."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for proc in procs:
        kill_tree(proc)
    return codes
