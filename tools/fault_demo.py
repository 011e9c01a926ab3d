"""Fault-tolerance demo: a worker of a running torchrun job is SIGKILLed, torchrun restarts the group, the job resumes
from its snapshot and finishes.

    python tools/fault_demo.py

Runs `torchrun --standalone --nproc_per_node=2 --max_restarts=1 multigpu_torchrun.py 8 2 --batch_size 8` on CPU in a
temporary directory (removed afterwards), kills rank 1 from outside once a snapshot exists and one more epoch is done,
and prints each event as it happens. About 15 s on a 2-core machine; stops on its own after --timeout seconds.
"""
import argparse
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]
from support import LogFollower, job_env, kill_tree, start, torchrun, torchrun_workers  # noqa: E402

EPOCHS, SAVE_EVERY, KILL_AFTER = 8, 2, 4  # snapshots after epochs 1, 3, 5, 7; the kill lands in epoch 5
ARGS = (EPOCHS, SAVE_EVERY, "--batch_size", 8)
# Restarted workers need a rendezvous store of their own (see README, fault tolerance).
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Narrator:
    """Echoes the job's lines: the workers' own lines as they are, torchrun's notices of the failure shortened, and
    the surviving worker's traceback (its peer vanished mid-collective) counted instead of shown."""

    def __init__(self):
        self.hidden = 0

    def __call__(self, line):
        if re.match(r"\[rank\d+\]:", line):  # torch prefixes an uncaught exception's lines with the rank
            self.hidden += 1
            return
        if self.hidden:
            print(f"   ({self.hidden} lines of a surviving worker's traceback: its peer is gone)")
            self.hidden = 0
        notice = re.match(r"[WE]\d{4} [\d:.]+ \d+ \S+\] (.*)", line)  # torchrun's log lines
        if notice:
            print(f"   torchrun: {notice[1]}")
        elif line.startswith("[rank"):
            print(f"   {line}")
        elif line.strip():
            print(f"   | {line}")


def say(text):
    print(f"\n>>> {text}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=90, help="seconds before the demo gives up")
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout

    def left():
        return max(1.0, deadline - time.monotonic())

    with tempfile.TemporaryDirectory(prefix="fault-demo-") as workdir:
        command = torchrun("multigpu_torchrun.py", *ARGS, launcher_args=["--max_restarts=1"])
        say(f"starting: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 "
            f"--max_restarts=1 multigpu_torchrun.py {' '.join(map(str, ARGS))}")
        job = start(command, cwd=workdir, env=job_env(ENV), log=Path(workdir) / "job.log")
        log = LogFollower(Path(workdir) / "job.log", job, echo=Narrator())
        try:
            log.wait_for(rf"\] epoch {KILL_AFTER} \| steps", timeout=left())
            workers = torchrun_workers(job.pid, 2, restart=0, timeout=left())
            os.kill(workers[1], signal.SIGKILL)
            say(f"SIGKILL -> rank 1 (pid {workers[1]}), from outside, after epoch {KILL_AFTER}")
            log.wait_for(r"failed \(exitcode: -9\)", timeout=left())  # torchrun noticed, stopped rank 0 too
            restarted = torchrun_workers(job.pid, 2, restart=1, timeout=left())
            say(f"torchrun tore the group down and started it again: TORCHELASTIC_RESTART_COUNT=1, new pids "
                f"{restarted[0]} and {restarted[1]}")
            resumed = log.wait_for(r"\[rank 0/.*resuming from epoch (\d+), restart (\d+)", timeout=left())
            lost = max(0, KILL_AFTER + 1 - int(resumed[1]))  # finished before the kill, after the last snapshot
            say(f"rank 0 reloaded the snapshot: resuming from epoch {resumed[1]} (restart {resumed[2]}); "
                f"{lost} finished epoch(s) and the one in progress are trained again")
            code = job.wait(timeout=left())
            log.new_lines()
        finally:
            if job.poll() is None:
                kill_tree(job)
    if code != 0:
        sys.exit(f"error: the job exited {code}")
    say(f"the job finished (exit 0): {EPOCHS} epochs in all, one worker killed on the way")


if __name__ == "__main__":
    main()
