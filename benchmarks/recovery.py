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
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.jobs import machine_summary, output, start, torchrun  # noqa: E402
from utils import positive_int  # noqa: E402

TRAIN_SAMPLES = 2048  # the synthetic workload's training set: what one epoch reports samples per second over


def epoch_seconds(match):
    return TRAIN_SAMPLES / float(match["rate"].replace(",", ""))


def measure(args):
    """Run the job, kill its last rank after epoch --kill_after; the moments that matter, in seconds since the launch
    (the kill's `killed`) or since the kill (`to_*`), and the job's timeline of lines."""
    with tempfile.TemporaryDirectory(prefix="recovery-") as workdir:
        command = torchrun("multigpu_torchrun.py", args.epochs, args.save_every, nproc=args.nproc,
                           launcher_args=["--max_restarts=1"])
        with start(command, cwd=workdir) as job:
            first = job.wait_for(output.EPOCH, timeout=args.timeout)
            cold_line = job.seconds()
            cold_step = cold_line - epoch_seconds(first)
            while int(job.wait_for(output.EPOCH, timeout=args.timeout)["epoch"]) < args.kill_after:
                pass  # follow rank 0 up to the kill point
            victim_rank = args.nproc - 1  # not the writer, when there are several
            victim = job.kill_worker(rank=victim_rank)
            killed = job.seconds()
            resumed = job.wait_for(output.RESUMED, timeout=args.timeout)
            to_resume = job.seconds() - killed
            first_after = job.wait_for(output.EPOCH, timeout=args.timeout)
            to_line = job.seconds() - killed
            to_step = to_line - epoch_seconds(first_after)
            [code] = job.wait(timeout=args.timeout)
        text = job.output
    if code != 0:
        sys.exit(f"error: the job {'ran past --timeout' if code is None else f'exited {code}'}; its output ends:\n"
                 f"{text[-3000:]}")
    return dict(victim_rank=victim_rank, victim=victim, cold_line=cold_line, cold_step=cold_step, killed=killed,
                resumed_from=int(resumed["epoch"]), to_resume=to_resume, to_line=to_line, to_step=to_step,
                timeline=job.timeline)


def report(args, timeline, killed, resumed_from, victim_rank, victim, cold_step, cold_line, to_resume, to_step,
           to_line):
    """The cold start against the recovery, and the work the kill cost, from measure()'s figures."""
    before_kill = [(seconds, line) for seconds, _, line in timeline if seconds <= killed]
    epochs_before_kill = max(int(match["epoch"]) for _, line in before_kill for match in [output.EPOCH.search(line)]
                             if match)
    snapshot_epoch = resumed_from - 1  # the snapshot the job resumed from: written after this epoch
    snapshot_at = next(seconds for seconds, _, line in timeline for match in [output.SAVED.search(line)]
                       if match and int(match["epoch"]) == snapshot_epoch)
    redone = epochs_before_kill + 1 - resumed_from
    print(machine_summary())
    print(f"torchrun --standalone --nproc_per_node={args.nproc} --max_restarts=1 multigpu_torchrun.py "
          f"{args.epochs} {args.save_every}: rank {victim_rank} (pid {victim}) SIGKILLed after epoch "
          f"{args.kill_after}")
    print(f"cold start   launch -> first training step         {cold_step:6.2f} s   (-> first epoch line "
          f"{cold_line:.2f} s)")
    print(f"recovery     kill -> snapshot loaded (resume line)  {to_resume:6.2f} s")
    print(f"             kill -> first resumed training step   {to_step:6.2f} s   (-> first epoch line "
          f"{to_line:.2f} s)")
    print(f"ratio        recovery / cold start                  {to_step / cold_step:6.2f}")
    print(f"work lost    {redone} finished epoch(s) since the snapshot of epoch {snapshot_epoch}"
          + (f" (epochs {resumed_from}-{epochs_before_kill})" if redone else "")
          + " plus the one in progress, trained again:")
    print(f"             {max(0.0, killed - snapshot_at):.2f} s of training between that snapshot and the kill")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=50)
    parser.add_argument("--save_every", type=positive_int, default=10)
    parser.add_argument("--kill_after", type=positive_int, default=15, help="kill the last rank after this epoch")
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds before the job is given up")
    args = parser.parse_args()
    if not args.save_every <= args.kill_after < args.epochs - 1:
        parser.error("--kill_after must come after the first snapshot and leave epochs to train after the kill")
    report(args, **measure(args))


if __name__ == "__main__":
    main()
