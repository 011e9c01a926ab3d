"""What the tests share: how to run a step script the way a user does, and how to read what it printed.

One place for it, so every test launches, bounds and parses jobs the same way.
"""
import os
import signal
import subprocess
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
    """Kill a process started by start() and everything it started."""
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


__all__ = ["PYTHON", "REPO", "TORCHRUN", "epoch_losses", "free_port", "job_env", "kill_tree", "recorded_writes",
           "run", "script", "start", "torchrun", "torchrun_node"]
