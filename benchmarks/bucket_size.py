"""Where a step's time goes as the bucket size changes: exercise 7's solution (DDP by hand: hooks, buckets, waits) on
2 CPU ranks, swept over --bucket_mb, against the model of a bucket's cost, latency plus bytes over bandwidth.

    python benchmarks/bucket_size.py                                   # --bucket_mb 0 0.001 0.1 0.2 1
    python benchmarks/bucket_size.py --bucket_mb 0 0.1 1 --steps 40 --rounds 5

Two processes (one CPU thread each, gloo) train exercises/07_ddp_by_hand/solution.py's MLP with its HandDDP, each
bucket size in turn for --steps optimizer steps, round after round (the order reversed every other round, so that
the load on the machine drifts against no one; round 0 warms up). The job runner's recorder notes every all-reduce
(bytes, start), every wait(), each backward and each optimizer step (harness/jobs/recorder: collectives.jsonl). Per
bucket size, its fastest step (other work on the machine only ever slows a step down), the mean of its 2 ranks:
  all-reduces  per step (the buckets: the MLP's 8 gradients, 466,472 bytes, packed in the order backward hands them
               over, a bucket sent once it holds --bucket_mb MiB)
  step ms      from the optimizer step before to this one's start (the step, forward, backward, finish()), on the
               slower rank; `median step ms`, the median over the measured steps, shows how much the machine's load
               added
  backward ms  loss.backward(), during which the hooks start the full buckets' all-reduces
  after ms     from backward's end to the optimizer step: finish() sends the last bucket, waits, copies back
  waiting ms   the part of `after` spent inside wait(): communication backward did not hide
  calls ms     the time spent inside the all_reduce calls themselves (during backward or after it): gloo hands the
               buffer to a thread of its own, which on a busy CPU competes with the one that called; the recorder's
               note of each call (its caller's line) is in it too
  model ms     what the model says the step's all-reduces cost one after the other: buckets x alpha + 466,472 / beta,
               the time backward could hide
The model's alpha and beta: synchronous all-reduces of --sizes bytes (both ranks leave a barrier first; per size the
fastest of its --repeats on either rank), fitted to alpha + bytes / beta (least squares of the relative
error, the sizes being a thousand times apart).
"""
import argparse
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/bucket_size.py` from anywhere

from harness.jobs import RECORDER, free_port, machine_summary, recorded, spawned_result  # noqa: E402
from utils import non_negative_number, positive_int  # noqa: E402

WORLD_SIZE = 2


def worker(rank, args, result_path):
    import json

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from exercises.check import exercise_checker
    from utils import exit_without_teardown

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=args.timeout))
    module = exercise_checker(7).exercise()  # exercise 7's solution, as its checker loads it
    dataset = module.make_dataset()
    batches = list(DataLoader(dataset, batch_size=16, drop_last=True,
                              sampler=DistributedSampler(dataset, num_replicas=WORLD_SIZE, rank=rank)))
    # The recorder numbers the optimizer steps of this process from 0: the numbers each bucket size measured.
    measured, taken = {bucket_mb: [] for bucket_mb in args.bucket_mb}, 0
    for round_ in range(args.rounds + 1):
        for bucket_mb in args.bucket_mb if round_ % 2 else args.bucket_mb[::-1]:
            model = module.make_model()
            optimizer = module.make_optimizer(model)
            hand_ddp = module.HandDDP(model, bucket_mb)
            dist.barrier()
            for index in range(args.steps):
                source, targets = batches[index % len(batches)]
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(source), targets).backward()
                hand_ddp.finish()
                optimizer.step()
                if round_ > 0:  # round 0 warms up
                    measured[bucket_mb].append(taken)
                taken += 1
    # The model's calibration: one synchronous all-reduce of each size at a time, both ranks leaving a barrier.
    for size in args.sizes:
        buffer = torch.zeros(size // 4)
        for _ in range(args.repeats):
            dist.barrier()
            dist.all_reduce(buffer)
    if rank == 0:
        Path(result_path).write_text(json.dumps({"steps": [[mb, numbers] for mb, numbers in measured.items()],
                                                 "calibrated_after": taken}))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


def measure(args, record_dir):
    """(worker's result, the recorded events: collectives.jsonl's records)."""
    paths = [str(RECORDER), str(REPO), os.environ.get("PYTHONPATH")]  # the recorder loads in the spawned workers
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                      CUDA_VISIBLE_DEVICES="", JOB_RECORD_DIR=str(record_dir), JOB_RECORD_COLLECTIVES="1",
                      PYTHONPATH=os.pathsep.join(filter(None, paths)))
    result = spawned_result(worker, (args,), WORLD_SIZE, args.timeout, "the bucket-size benchmark")
    return result, recorded(record_dir, "collectives.jsonl")


def fit(points):
    """Least squares of seconds = alpha + bytes / beta over [(bytes, seconds)], each point's error relative to its
    time (sizes a thousand times apart: plain least squares would fit the largest alone): (alpha s, beta bytes/s;
    beta None when the time does not grow with the bytes)."""
    weights = [1 / seconds**2 for _, seconds in points]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points)) / total
    mean_y = sum(w * y for w, (_, y) in zip(weights, points)) / total
    slope = (sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points))
             / sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points)))
    return mean_y - slope * mean_x, (1 / slope if slope > 0 else None)


def calibration(records, after):
    """[(bytes, seconds)]: per size of the synchronous all-reduces made after optimizer step `after`, the fastest of
    its calls on either rank (other work on the machine only ever slows a call down)."""
    times = {}
    for row in records:
        if row["event"] == "call" and row["op"] == "all_reduce" and row["step"] == after:
            times.setdefault(sum(row["bytes"]), []).append(row["ended"] - row["began"])
    return [(size, min(seconds)) for size, seconds in sorted(times.items())]


def summary(bucket_mb, numbers, records):
    """One bucket size's fastest step (from its start to the next step's, on the slower rank: other work on the
    machine only ever slows a step down), its parts in ms (the mean of the ranks), its all-reduces and their bytes;
    and the median step."""
    from exercises.check import exercise_checker

    wanted = set(numbers)
    waits = {(row["pid"], row["seq"]): row for row in records if row["event"] == "wait"}
    began = {(row["rank"], row["step"]): row["began"] for row in records if row["event"] == "step"}
    ranks = sorted({rank for rank, _ in began})
    # A step's length: from the step before it began to its own optimizer step's start, which holds its forward,
    # its backward and what finish() does after it.
    lengths = {number: max(began[rank, number] - began[rank, number - 1] for rank in ranks) for number in wanted
               if number - 1 in wanted and all((rank, number - 1) in began for rank in ranks)}
    fastest = min(lengths, key=lengths.get)
    steps = [step for step in exercise_checker(7).steps_of(records) if step[1] == fastest]

    def mean_ms(part):
        return statistics.mean(part(backward, calls, step) for _, _, backward, calls, step in steps) * 1e3

    def waited(calls):
        return sum(waits[call["pid"], call["seq"]]["ended"] - waits[call["pid"], call["seq"]]["began"]
                   for call in calls if (call["pid"], call["seq"]) in waits)

    return dict(bucket_mb=bucket_mb, all_reduces=len(steps[0][3]),
                sizes=[sum(call["bytes"]) for call in sorted(steps[0][3], key=lambda call: call["began"])],
                step=lengths[fastest] * 1e3, median_step=statistics.median(lengths.values()) * 1e3,
                backward=mean_ms(lambda backward, calls, step: backward["ended"] - backward["began"]),
                after=mean_ms(lambda backward, calls, step: step["began"] - backward["ended"]),
                waiting=mean_ms(lambda backward, calls, step: waited(calls)),
                calls=mean_ms(lambda backward, calls, step: sum(call["ended"] - call["began"] for call in calls)))


def report(rows, points):
    """The table of the bucket sizes, the calibration and its fit, and each size's cost by the model."""
    alpha, beta = fit(points)
    print("| bucket_mb | all-reduces/step | bucket bytes (in order sent) | step ms | backward ms | after ms | "
          "waiting ms | calls ms | model ms | median step ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        total = sum(row["sizes"])
        model = (row["all_reduces"] * alpha + (total / beta if beta else 0)) * 1e3
        print(f"| {row['bucket_mb']:g} | {row['all_reduces']:g} | {', '.join(f'{size:,}' for size in row['sizes'])} | "
              f"{row['step']:.2f} | {row['backward']:.2f} | {row['after']:.2f} | {row['waiting']:.2f} | "
              f"{row['calls']:.2f} | {model:.2f} | {row['median_step']:.2f} |")
    print("\nsynchronous all-reduce, by size (the fastest call):")
    print("| bytes | measured ms | fitted ms |")
    print("|---:|---:|---:|")
    for size, seconds in points:
        print(f"| {size:,} | {seconds * 1e3:.3f} | {(alpha + (size / beta if beta else 0)) * 1e3:.3f} |")
    bandwidth = f"beta = {beta / 1e6:,.0f} MB/s" if beta else "beta: no growth with the bytes measured"
    print(f"\nfit: alpha = {alpha * 1e6:,.0f} us per all-reduce, {bandwidth}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket_mb", type=non_negative_number, nargs="+", default=[0, 0.001, 0.1, 0.2, 1],
                        help="bucket sizes in MiB (0: a bucket per parameter; default 0 0.001 0.1 0.2 1)")
    parser.add_argument("--steps", type=positive_int, default=20, help="optimizer steps per turn (default 20)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[4096, 65536, 262144, 1048576, 4194304],
                        help="bytes of the calibration's all-reduces (default 4 KiB to 4 MiB)")
    parser.add_argument("--repeats", type=positive_int, default=20, help="all-reduces per size (default 20)")
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds the run may take")
    args = parser.parse_args()
    if len(set(args.sizes)) < 2:
        sys.exit("error: --sizes needs two different sizes at least, to fit a line")

    print(f"exercise 7's HandDDP, 2 ranks, {args.steps} steps x {args.rounds} rounds per bucket size, on "
          f"{machine_summary()}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        result, records = measure(args, scratch)
    rows = [summary(bucket_mb, numbers, records) for bucket_mb, numbers in result["steps"]]
    report(rows, calibration(records, result["calibrated_after"]))
    print(f"at the end: {machine_summary()}")


if __name__ == "__main__":
    main()
