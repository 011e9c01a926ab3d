"""What the tests share: how to run a step script the way a user does, and how to read what it printed.

One place for it, so every test launches, bounds and parses jobs the same way.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from utils import free_port

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]  # the `torchrun` command, from this interpreter
AUDIT_DIR = Path(__file__).resolve().parent / "audit"  # its sitecustomize.py records torch.save calls and samples

EPOCH_LINE = re.compile(r"\[rank (\d+)/(\d+)[^\]]*\] epoch (\d+) \| steps (\d+) \| loss ([\d.]+)|"
                        r"\[(?:cpu|cuda[:\d]*)\] epoch (\d+) \| steps (\d+) \| loss ([\d.]+)")


def script(name):
    return str(REPO / name)


def job_env(extra=None, audit_file=None, samples_file=None, kill_at=None):
    """The environment of a launched job: one CPU thread per process (this machine has 2 cores), unbuffered
    output, and, with audit_file, a record of every file torch.save writes and which process wrote it; with
    samples_file, the sample indices each process trained on per epoch; with kill_at=(restart, rank, epoch),
    that worker SIGKILLs itself as it begins that epoch (tests/audit/sitecustomize.py does all three)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
    return subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=env or job_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_tree(proc, sig=signal.SIGKILL):
    """Kill a process started by start() and everything it started."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def run_together(commands, cwds, env, logs, timeout):
    """Start every command (one torchrun per node, say) in its directory with output to its log, and wait for all of
    them, `timeout` s at most in total; then kill whatever is left. Return (exit codes, whether time ran out)."""
    procs = [start(cmd, cwd=cwd, env=env, log=log) for cmd, cwd, log in zip(commands, cwds, logs)]
    deadline, timed_out = time.monotonic() + timeout, False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc in procs:
        kill_tree(proc)  # also whatever a finished launcher left behind
    return [proc.returncode for proc in procs], timed_out


def torchrun(name, *args, nproc=2, launcher_args=()):
    """`torchrun --standalone --nproc_per_node=N name args...` on a free port, as a command list."""
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *launcher_args, script(name), *map(str, args)]


def torchrun_node(name, *args, nnodes=2, nproc=1, endpoint, run_id="test", launcher_args=()):
    """One node's torchrun of a multi-node job with c10d rendezvous at `endpoint` (host:port)."""
    return [*TORCHRUN, f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", f"--rdzv_id={run_id}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", *launcher_args, script(name), *map(str, args)]


def epoch_losses(output):
    """{epoch: loss} from the per-epoch lines a step prints (each epoch's last report wins)."""
    losses = {}
    for match in EPOCH_LINE.finditer(output):
        groups = match.groups()
        epoch, loss = (groups[2], groups[4]) if groups[2] is not None else (groups[5], groups[7])
        losses[int(epoch)] = float(loss)
    return losses


def recorded_writes(audit_file):
    """[(pid, rank or None, path), ...] for every torch.save the audited processes made."""
    if not Path(audit_file).exists():
        return []
    rows = [line.split("\t") for line in Path(audit_file).read_text().splitlines()]
    return [(int(pid), None if rank == "-" else int(rank), path) for pid, rank, path in rows]


def recorded_samples(samples_file):
    """One dict per completed pass over a DataLoader, in the order they ended: pid, rank, restart, sampler (class
    name), epoch (the sampler's set_epoch value, or None), number (the pass's number in its process, from 0),
    ddp (the model was wrapped in DDP), indices (the samples, in training order)."""
    if not Path(samples_file).exists():
        return []
    return [json.loads(line) for line in Path(samples_file).read_text().splitlines()]


__all__ = ["PYTHON", "REPO", "TORCHRUN", "epoch_losses", "free_port", "job_env", "kill_tree", "recorded_samples",
           "recorded_writes", "run", "run_together", "script", "start", "torchrun", "torchrun_node"]
