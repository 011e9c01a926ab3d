"""What the tests share: how to run a step script the way a user does, and how to read what it printed.

One place for it, so every test launches, bounds and parses jobs the same way.
"""
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from tools.launch import PYTHON, REPO, TORCHRUN, epoch_losses, script, torchrun, torchrun_node
from tools.netns import Host, namespaces_unavailable, network_namespaces
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


def descendants(pid):
    """Every process started by `pid`, directly or not (read from /proc; empty where there is no /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc, sig=signal.SIGKILL):
    """Kill a process started by start() and everything it started. torchrun starts each worker in a session of
    its own, so killing the launcher's process group alone would leave the workers running: the group is frozen
    first (no new children), then every descendant is signalled too."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGSTOP)
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on a SIGTERM only once it runs again
    proc.wait(timeout=30)


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


def recorded_writes(audit_file):
    """[(pid, rank or None, path), ...] for every torch.save the audited processes made."""
    if not Path(audit_file).exists():
        return []
    rows = [line.split("\t") for line in Path(audit_file).read_text().splitlines()]
    return [(int(pid), None if rank == "-" else int(rank), path) for pid, rank, path in rows]


__all__ = ["PYTHON", "REPO", "TORCHRUN", "Host", "descendants", "epoch_losses", "finish", "free_port", "job_env",
           "kill_tree", "namespaces_unavailable", "network_namespaces", "read_log", "recorded_writes", "run", "script",
           "start", "torchrun", "torchrun_node", "wait_for"]
