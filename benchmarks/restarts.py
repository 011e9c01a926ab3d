"""Restart reliability: how often the tutorial's torchrun job resumes after a worker is SIGKILLed, and how long it
takes.

    python benchmarks/restarts.py --kills 10              # 10 jobs on one node (2 processes), one kill each
    python benchmarks/restarts.py --kills 3 --nproc 1     # one worker per attempt: the cheapest restart
    python benchmarks/restarts.py --kills 3 --nnodes 2    # two torchrun agents on this machine, one process each
    python benchmarks/restarts.py --kills 10 --fresh_store   # with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

Each job is `multigpu_torchrun.py` (or `multinode.py` on two nodes) with `--max_restarts=1` and torchrun's shared
rendezvous store, as the tutorial's command runs it. Once the first snapshot is saved, a worker (the last rank; on two
nodes, node 1's) is SIGKILLed after a random part of an epoch (as long as epoch 0 took; seeded: the same parts every
run). A kill counts as recovered when the restarted workers print `resuming from epoch N` and the job exits 0; the
times run from the kill to that line. Failed restarts show up as restarts that never resume (torchrun then gives up:
exit non-zero) and as gloo's connection errors in the output.
"""
import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.jobs import FRESH_STORE, free_port, machine_summary, output, start, torchrun, torchrun_node  # noqa: E402
from utils import positive_int  # noqa: E402

STEP_ARGS = (1, "--batch_size", 8, "--timeout", 30)  # a snapshot after every epoch (~1 s each here)
TRAIN_SAMPLES = 2048  # the synthetic workload's training set: an epoch's samples, which its line's rate is over


def one_kill(number, args, fraction):
    """Start a job, kill a worker `fraction` of an epoch after the first snapshot; (pause in s, resumed, seconds to
    resume, exit codes, gloo errors seen)."""
    with tempfile.TemporaryDirectory(prefix="restarts-") as workdir:
        if args.nnodes == 1:
            commands = [torchrun("multigpu_torchrun.py", args.epochs, *STEP_ARGS, nproc=args.nproc or 2,
                                 launcher_args=["--max_restarts=1"])]
        else:
            node = torchrun_node("multinode.py", args.epochs, *STEP_ARGS, endpoint=f"127.0.0.1:{free_port()}",
                                 run_id=f"kill{number}", nproc=args.nproc or 1, launcher_args=["--max_restarts=1"])
            commands = [node] * args.nnodes
        with start(*commands, cwd=workdir, env=FRESH_STORE if args.fresh_store else None) as job:
            rate = job.wait_for(output.EPOCH, timeout=args.timeout)["rate"]  # the job's samples/s in epoch 0
            job.wait_for(output.SAVED, timeout=args.timeout)
            victims = job.workers(node=args.nnodes - 1)
            pause = fraction * TRAIN_SAMPLES / float(rate.replace(",", ""))  # within the next epoch, however fast
            time.sleep(pause)
            job.kill_worker(rank=max(victims), node=args.nnodes - 1)
            killed = time.monotonic()
            try:
                job.wait_for(output.RESUMED, timeout=args.timeout)
                to_resume = time.monotonic() - killed
            except AssertionError:  # the job ended, or the time ran out, without resuming
                to_resume = None
            codes = job.wait(timeout=args.timeout)
        text = job.output
    errors = text.count("connectFullMesh") + text.count("Connection refused")
    return pause, to_resume is not None and codes == [0] * args.nnodes, to_resume, codes, errors


def row(number, pause, ok, seconds, codes, errors):
    """A job's row of the table, from what one_kill() measured."""
    resumed_after = "-" if seconds is None else f"{seconds:.1f} s"
    return f"| {number} | {pause:.2f} s | {'yes' if ok else 'NO'} | {resumed_after} | {codes} | {errors} |"


def summary(results):
    """How many of the jobs (one_kill()'s results) resumed, and how long the kill -> resume took for those."""
    times = [seconds for _, ok, seconds, _, _ in results if ok]
    return f"resumed {len(times)} of {len(results)}" + (f"; kill -> resume median {statistics.median(times):.1f} s, "
                                                       f"max {max(times):.1f} s" if times else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=positive_int, default=10, help="jobs to run, one kill each (default 10)")
    parser.add_argument("--nnodes", type=int, choices=[1, 2], default=1, help="torchrun agents (default 1)")
    parser.add_argument("--nproc", type=positive_int, help="workers per agent (default 2 on one node, 1 on two)")
    parser.add_argument("--fresh_store", action="store_true", help="set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    parser.add_argument("--epochs", type=positive_int, default=20, help="epochs per job (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="for the kills' random moments")
    parser.add_argument("--timeout", type=positive_int, default=120, help="seconds each stage may take")
    args = parser.parse_args()
    moments = random.Random(args.seed)
    print(f"{args.kills} jobs, {args.nnodes} node(s), torchrun's {'fresh' if args.fresh_store else 'shared'} store "
          f"per attempt; {machine_summary()}", flush=True)
    print("| job | killed after the first snapshot | resumed | kill -> resume | exit codes | gloo errors |\n"
          "|---:|---:|---|---:|---|---:|")
    results = []
    for number in range(args.kills):
        results.append(one_kill(number, args, moments.random()))
        print(row(number, *results[-1]), flush=True)
    print(f"\n{summary(results)}\nat the end: {machine_summary()}")


if __name__ == "__main__":
    main()
