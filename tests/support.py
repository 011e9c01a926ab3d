"""What the tests share: how to run a step script the way a user does, and how to read what it printed.

One place for it, so every test launches, bounds and parses jobs the same way.
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tools.launch import PYTHON, REPO, TORCHRUN, epoch_losses, script, torchrun, torchrun_node
from utils import free_port

AUDIT_DIR = Path(__file__).resolve().parent / "audit"  # its sitecustomize.py records every torch.save


def job_env(extra=None, audit_file=None, gpu=False):
    """The environment of a launched job: the CPU (gloo) unless gpu=True, one CPU thread per process, unbuffered
    output, and, with audit_file, a record of every file torch.save writes and which process wrote it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests stay CPU tests on a machine with GPUs
    env.pop("LOCAL_RANK", None)
    if audit_file:
        env["PYTHONPATH"] = os.pathsep.join([str(AUDIT_DIR), env.get("PYTHONPATH", "")])
        env["AUDIT_WRITES_TO"] = str(audit_file)
    env.update(extra or {})
    return env


def run(cmd, cwd, timeout=120, env=None, check=True):
    """Run a command to completion (bounded); return its CompletedProcess with stdout+stderr in .output."""
    cmd = [str(part) for part in cmd]
    proc = subprocess.run(cmd, cwd=cwd, env=env or job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, start_new_session=True)
    proc.output = proc.stdout
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.output[-4000:]}")
    return proc


def start(cmd, cwd, env=None, log=None):
    """Start a command in its own process group (so the whole tree can be killed); output goes to `log`."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=env or job_env(), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc, sig=signal.SIGKILL):
    """Kill a process started by start() and everything it started, also the processes that left its process
    group (torchrun starts every worker in a session of its own)."""
    for pid in descendant_pids(proc.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def recorded_writes(audit_file):
    """[(pid, rank or None, path), ...] for every torch.save the audited processes made."""
    if not Path(audit_file).exists():
        return []
    rows = [line.split("\t") for line in Path(audit_file).read_text().splitlines()]
    return [(int(pid), None if rank == "-" else int(rank), path) for pid, rank, path in rows]


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


__all__ = ["PYTHON", "REPO", "TORCHRUN", "LogFollower", "child_pids", "descendant_pids", "epoch_losses", "free_port",
           "job_env", "kill_tree", "process_env", "recorded_writes", "run", "script", "start", "torchrun",
           "torchrun_node", "torchrun_workers"]
