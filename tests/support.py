"""What the tests share: how to run a step script the way a user does, and how to read what it printed.

One place for it, so every test launches, bounds and parses jobs the same way; the launching and watching itself
lives in tools/launch.py (the demo and benchmarks use it too), network namespaces in tools/netns.py.
"""
import json
import subprocess
from pathlib import Path

from tools.launch import (PYTHON, REPO, TORCHRUN, LogFollower, child_pids, descendant_pids, epoch_losses, finish,
                          job_env, kill_tree, process_env, read_log, script, start, torchrun, torchrun_node,
                          torchrun_workers, wait_for)
from tools.netns import Host, namespaces_unavailable, network_namespaces
from utils import free_port


def run(cmd, cwd, timeout=120, env=None, check=True):
    """Run a command to completion (bounded); return its CompletedProcess with stdout+stderr in .output."""
    cmd = [str(part) for part in cmd]
    proc = subprocess.run(cmd, cwd=cwd, env=env or job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, start_new_session=True)
    proc.output = proc.stdout
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.output[-4000:]}")
    return proc


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


__all__ = ["PYTHON", "REPO", "TORCHRUN", "Host", "LogFollower", "child_pids", "descendant_pids", "epoch_losses",
           "finish", "free_port", "job_env", "kill_tree", "namespaces_unavailable", "network_namespaces",
           "process_env", "read_log", "recorded_samples", "recorded_writes", "run", "script", "start", "torchrun",
           "torchrun_node", "torchrun_workers", "wait_for"]
