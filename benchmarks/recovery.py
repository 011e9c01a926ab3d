"""Recovery from a killed worker, measured in one run: how long torchrun takes to get a job training again after a
SIGKILL, next to a cold start of the same job, and how much work the failure cost.

    python benchmarks/recovery.py                       # multigpu_torchrun.py 50 10, 2 processes, kill after epoch 15
    python benchmarks/recovery.py --epochs 50 --save_every 10 --kill_after 15 --nproc 2

The job is the tutorial's `torchrun --standalone --nproc_per_node=N --max_restarts=1 multigpu_torchrun.py E S`. Rank 1
is SIGKILLed right after rank 0 prints epoch `--kill_after`; torchrun tears the group down, starts it again, and the
workers resume from the last snapshot. Times come from the moment each line appears in the job's output; the first
training step of an epoch is dated by subtracting that epoch's duration (its samples / samples per second).
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
from utils import positive_int  # noqa: E402

TRAIN_SAMPLES = 2048  # the synthetic workload's training set: what one epoch reports samples per second over
EPOCH_LINE = r"\] epoch (\d+) \| steps \d+ \| loss [\d.]+ \| ([\d,]+) samples/s"
# Restarted workers need a rendezvous store of their own (see README, fault tolerance).
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def epoch_seconds(match):
    return TRAIN_SAMPLES / float(match[2].replace(",", ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=50)
    parser.add_argument("--save_every", type=positive_int, default=10)
    parser.add_argument("--kill_after", type=positive_int, default=15, help="kill rank 1 after this epoch's line")
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds before the job is given up")
    args = parser.parse_args()
    if not args.save_every <= args.kill_after < args.epochs - 1:
        parser.error("--kill_after must come after the first snapshot and leave epochs to train after the kill")

    with tempfile.TemporaryDirectory(prefix="recovery-") as workdir:
        log_path = Path(workdir) / "job.log"
        command = torchrun("multigpu_torchrun.py", args.epochs, args.save_every, nproc=args.nproc,
                           launcher_args=["--max_restarts=1"])
        launched = time.monotonic()
        job = start(command, cwd=workdir, env=job_env(ENV), log=log_path)
        log = LogFollower(log_path, job)
        try:
            first = log.wait_for(EPOCH_LINE, timeout=args.timeout)
            cold_line = time.monotonic() - launched
            cold_step = cold_line - epoch_seconds(first)
            snapshot_at = None
            while True:  # follow rank 0 up to the kill point, noting when the last snapshot was written
                line = log.wait_for(rf"{EPOCH_LINE}|\] epoch (\d+) \| snapshot saved", timeout=args.timeout)
                if line[3] is not None:
                    snapshot_at, snapshot_epoch = time.monotonic(), int(line[3])
                elif int(line[1]) >= args.kill_after:
                    break
            victim = torchrun_workers(job.pid, args.nproc, restart=0)[1 % args.nproc]
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            resumed = log.wait_for(r"\[rank 0/.*resuming from epoch (\d+), restart 1", timeout=args.timeout)
            to_resume = time.monotonic() - killed
            first_after = log.wait_for(EPOCH_LINE, timeout=args.timeout)
            to_line = time.monotonic() - killed
            to_step = to_line - epoch_seconds(first_after)
            code = job.wait(timeout=args.timeout)
        finally:
            if job.poll() is None:
                kill_tree(job)
        output = log_path.read_text()
    if code != 0:
        sys.exit(f"error: the job exited {code}; its output ends:\n{output[-3000:]}")

    epochs_before_kill = max(int(epoch) for epoch, _ in re.findall(EPOCH_LINE, output[:output.index(resumed[0])]))
    resumed_from = int(resumed[1])
    redone = epochs_before_kill + 1 - resumed_from
    print(f"torchrun --standalone --nproc_per_node={args.nproc} --max_restarts=1 multigpu_torchrun.py "
          f"{args.epochs} {args.save_every}: rank 1 (pid {victim}) SIGKILLed after epoch {args.kill_after}")
    print(f"cold start   launch -> first training step         {cold_step:6.2f} s   (-> first epoch line "
          f"{cold_line:.2f} s)")
    print(f"recovery     kill -> snapshot loaded (resume line)  {to_resume:6.2f} s")
    print(f"             kill -> first resumed training step   {to_step:6.2f} s   (-> first epoch line "
          f"{to_line:.2f} s)")
    print(f"ratio        recovery / cold start                  {to_step / cold_step:6.2f}")
    print(f"work lost    {redone} finished epoch(s) since the snapshot of epoch {snapshot_epoch} "
          f"(epochs {resumed_from}-{epochs_before_kill}) plus the one in progress, trained again:")
    print(f"             {killed - snapshot_at:.2f} s of training between that snapshot and the kill")


if __name__ == "__main__":
    main()
