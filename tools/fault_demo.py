"""Fault-tolerance demo: a worker of a running torchrun job is SIGKILLed, torchrun restarts the group, the job resumes
from its snapshot and finishes.

    python tools/fault_demo.py

Runs `torchrun --standalone --nproc_per_node=2 --max_restarts=1 multigpu_torchrun.py 8 2 --batch_size 8` on CPU in a
temporary directory (removed afterwards), kills rank 1 from outside once a snapshot exists and one more epoch is done,
and prints each event as it happens. About 15 s on a 2-core machine; stops on its own after --timeout seconds.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.jobs import output, start, torchrun  # noqa: E402
from harness.jobs.output import Narrator  # noqa: E402

EPOCHS, SAVE_EVERY, KILL_AFTER = 8, 2, 4  # snapshots after epochs 1, 3, 5, 7; the kill lands in epoch 5
ARGS = (EPOCHS, SAVE_EVERY, "--batch_size", 8)


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
        say(f"starting: torchrun --standalone --nproc_per_node=2 "
            f"--max_restarts=1 multigpu_torchrun.py {' '.join(map(str, ARGS))}")
        narrate = Narrator()
        with start(command, cwd=workdir) as job:
            job.wait_for(rf"\] epoch {KILL_AFTER} \| steps", timeout=left(), echo=narrate)
            pid = job.kill_worker(rank=1)
            say(f"SIGKILL -> rank 1 (pid {pid}), from outside, after epoch {KILL_AFTER}")
            # torchrun notices the group failed: by the killed worker's SIGKILL (-9), or by the survivor, when it saw
            # its peer vanish first: its one line and exit 1 (or gloo's SIGABRT, -6, when a thread of gloo's saw it).
            # Which comes first is a race; the restart is not.
            job.wait_for(r"failed \(exitcode: (?:-9|-6|1)\)", timeout=left(), echo=narrate)
            restarted = job.workers(restart=1, timeout=left())
            say(f"torchrun tore the group down and started it again: TORCHELASTIC_RESTART_COUNT=1, new pids "
                f"{restarted[0]} and {restarted[1]}")
            resumed = job.wait_for(output.RESUMED, timeout=left(), echo=narrate)
            lost = max(0, KILL_AFTER + 1 - int(resumed["epoch"]))  # finished after the last snapshot, before the kill
            say(f"rank {resumed['rank']} reloaded the snapshot: resuming from epoch {resumed['epoch']} (restart "
                f"{resumed['restart']}); {lost} finished epoch(s) and the one in progress are trained again")
            [code] = job.wait(timeout=left(), echo=narrate)
    if code != 0:
        sys.exit(f"error: the job {'was still running after --timeout' if code is None else f'exited {code}'}")
    say(f"the job finished (exit 0): {EPOCHS} epochs in all, one worker killed on the way")


if __name__ == "__main__":
    main()
