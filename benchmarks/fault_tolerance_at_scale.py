"""The work one failure costs under each strategy, measured in one run: the same SIGKILL of one worker before the
same optimizer step, in a job that restarts the world (step 3, multigpu_torchrun.py under torchrun --max_restarts=1)
and in a job of replica groups (step 13, fault_tolerant.py: two groups of one rank, a lighthouse, each group's torchrun
with --max_restarts=1). The same data, model and batch (2 x 32 samples a step, 32 steps an epoch).

    python benchmarks/fault_tolerance_at_scale.py                       # a snapshot every 2 epochs, kill at step 100
    python benchmarks/fault_tolerance_at_scale.py --save_every 2 --kill_at 100
    python benchmarks/fault_tolerance_at_scale.py --workload wide       # steps ~10x slower: the redone steps show
    python benchmarks/fault_tolerance_at_scale.py --waits --group_timeout 20    # what the survivor waits for, by fault

Times come from the recorder (harness/jobs): the moment every optimizer step of every process began. Each job is stopped
once it has shown what it costs (they are given more epochs than they take). Restarting the world, every rank stops;
the job redoes the steps since its last snapshot, and is "back" when it reaches the step the kill interrupted. Replica groups: the other group never stops; its longest wait is the lighthouse's heartbeat timeout
(2 s here) before it takes the dead group for dead; the killed group's share of the data is not trained while it is
away (the global batch halves), and it comes back with the healthy group's state at the step the job is at.

--waits measures instead what the other group waits for, fault by fault (a job of two groups of one rank each, group
1's worker failed once in each way, --repeat times, the job's --timeout --group_timeout): a SIGKILL (the kernel closes
the worker's connections at once), its whole torchrun SIGKILLed (a machine gone), a SIGSTOP for good (a machine that
hangs, or vanishes without closing its connections), a SIGSTOP of 1.5 x --timeout that then resumes, the return of a
group (the heal), and, with groups of two ranks, group 1's rank 1 SIGSTOPped for good while its rank 0 heartbeats on.
Each row: group 0's waits of more than 1.5 s between two of its optimizer steps from the fault on, and the line group 0
ended with if it ended.
"""
import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.jobs import (free_port, kill_when_training_together, lighthouse, machine_summary,  # noqa: E402
                        next_heal, output, replica_groups, start, torchrun)
from utils import positive_int  # noqa: E402

STEPS_PER_EPOCH = 32  # 2048 samples, 2 x 32 a step


def restart_the_world(args, workdir):
    """multigpu_torchrun.py on 2 ranks, rank 1 SIGKILLed before its optimizer step --kill_at; torchrun restarts both.
    The job is stopped once rank 0 of the new attempt has trained past the step the kill interrupted."""
    command = torchrun("multigpu_torchrun.py", args.epochs, args.save_every, "--workload", args.workload,
                       launcher_args=["--max_restarts=1"])
    with start(command, cwd=workdir, record_steps=True, kill_at_step=(0, 1, args.kill_at)) as job:
        resumed = int(job.wait_for(output.RESUMED, timeout=args.timeout)["epoch"]) * STEPS_PER_EPOCH
        first, second = until(job, args.timeout, lambda first, second: len(second) > len(first) - resumed)
    reached = len(first)  # optimizer steps rank 0 took before the job stopped (numbered from 1)
    killed = first[-1]["at"]
    back = second[reached - resumed - 1]["at"]
    return dict(reached=reached, redone=reached - resumed, ranks=2, stall=second[0]["at"] - killed, back=back - killed)


def until(job, timeout, done):
    """Rank 0's recorded steps of the first and the second attempt, once done(first, second) holds."""
    deadline = time.monotonic() + timeout
    while True:
        rank0 = [step for step in job.steps if step["rank"] == 0]
        first, second = ([step for step in rank0 if step["restart"] == attempt] for attempt in (0, 1))
        if done(first, second):
            return first, second
        if not job.running() or time.monotonic() > deadline:
            sys.exit(f"error: the job {'ended' if not job.running() else 'ran past --timeout'} before it was back "
                     f"at the step of the kill; its output ends:\n{job.output[-3000:]}")
        time.sleep(0.2)


def replica_groups_job(args, workdir):
    """fault_tolerant.py, 2 groups of 1 rank; group 1's worker SIGKILLed once the groups have committed step --kill_at - 1
    together (a step or two later: the kill comes from outside). The job is stopped once group 1, restarted by its
    torchrun, has healed and trained 10 steps with group 0."""
    port = free_port()
    commands = [lighthouse(port), *replica_groups("fault_tolerant.py", args.epochs, args.save_every, "--workload",
                                                  args.workload, port=port, launcher_args=["--max_restarts=1"])]
    with start(*commands, cwd=workdir, services=1, record_steps=True) as job:
        kill_when_training_together(job, steps=args.kill_at - 1, timeout=args.timeout)
        healed = next_heal(job, 1, timeout=args.timeout)
        step = -1
        while step < healed + 10:
            match = job.wait_for(output.GROUP_STEP, timeout=args.timeout)
            step = int(match["step"]) if match["group"] == "1" else step
        job.new_lines()
    steps = output.group_steps(job.output)
    by_process = {}
    for record in job.steps:
        by_process.setdefault(record["pid"], []).append(record["at"])
    survivor = max(by_process.values(), key=len)  # group 0's one process: it took every step of the job
    stall = max(later - earlier for earlier, later in zip(survivor, survivor[1:]))
    killed_at = max(step for step, line in steps[1].items() if step < healed)
    alone = [step for step, line in steps[0].items() if killed_at < step and line["participants"] == 1]
    together = [step for step in steps[1] if step > healed and step in steps[0]]
    return dict(stall=stall, redone=len(output.NOT_COMMITTED.findall(job.node_output(1))), alone=len(alone),
                killed=killed_at, healed=healed, equal_after=all(steps[0][step]["weights"] == steps[1][step]["weights"]
                                               for step in together))


def survivor_waits(args, workdir):
    """[(fault, group 0's waits over WAIT_S from the fault on)]: one job per fault (see the module's docstring), each
    stopped once group 0 has trained 20 steps in a row without a wait after the fault (after the heal, for a kill)."""
    faults = []
    for fault in [fault for fault in ("kill", "node", "stop", "pause", "rank") for _ in range(args.repeat)]:
        port = free_port()
        commands = [lighthouse(port), *replica_groups("fault_tolerant.py", args.epochs, args.epochs, "--timeout",
                                                      args.group_timeout, port=port, nproc=2 if fault == "rank" else 1,
                                                      launcher_args=["--max_restarts=1"])]
        with start(*commands, cwd=workdir / f"{fault}{len(faults)}", services=1, record_steps=True) as job:
            until_together(job, 30, args.timeout)
            at = time.time()
            if fault == "kill":
                job.kill_worker(rank=0, node=2)
            elif fault == "node":
                job.kill_node(2)
            else:
                stopped = job.kill_worker(rank=1 if fault == "rank" else 0, node=2, sig=signal.SIGSTOP)
            settled_from = at
            if fault == "pause":
                time.sleep(1.5 * args.group_timeout)
                os.kill(stopped, signal.SIGCONT)
                settled_from = time.time()  # what its return costs counts too
            if fault == "kill":  # and its return: a group joins the quorum, and heals
                job.wait_for(output.HEALED, timeout=args.timeout)
                healed = settled_from = time.time()
            ended = until_quiet(job, settled_from, args.timeout)
        waits = [(earlier, later - earlier) for earlier, later in pairwise(survivor_steps(job)) if later > at]
        if fault == "kill":
            faults.append(("kill", [wait for begun, wait in waits if wait > WAIT_S and begun < healed - 1]))
            faults.append(("return", [wait for begun, wait in waits if wait > WAIT_S and begun >= healed - 1]))
        else:
            faults.append((fault, [wait for _, wait in waits if wait > WAIT_S] + ([ended] if ended else [])))
    return faults


WAIT_S = 1.5  # a longer gap between two of group 0's steps is a wait (a step on a busy machine can take a second)


def pairwise(items):
    return zip(items, items[1:])


def survivor_steps(job):
    """When group 0's worker (the process that took the most steps) began each of its optimizer steps."""
    by_process = {}
    for record in job.steps:
        by_process.setdefault(record["pid"], []).append(record["at"])
    return max(by_process.values(), key=len)


def until_together(job, steps, timeout):
    """Follow the job until group 1 has committed `steps` with group 0."""
    step = -1
    while step < steps:
        match = job.wait_for(output.GROUP_STEP, timeout=timeout)
        step = int(match["step"]) if match["group"] == "1" and match["participants"] == "2" else step


def until_quiet(job, since, timeout):
    """Follow the job until group 0 has trained 20 steps in a row without a wait (WAIT_S) since `since` (time.time()),
    after its last wait if it waited: None; or until group 0 ends: the line it ended with."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.procs[1].poll() is not None:
            job.new_lines()
            return (output.errors(job.node_output(1)) or [f"exit code {job.procs[1].poll()}"])[-1]
        job.new_lines()
        steps = [at for at in survivor_steps(job) if at > since] if job.steps else []
        gaps = [later - earlier for earlier, later in pairwise(steps)]
        last_wait = max([index for index, gap in enumerate(gaps) if gap > WAIT_S], default=-1)
        if len(gaps) - last_wait > 20:
            return
        time.sleep(0.5)
    sys.exit(f"error: group 0 did not train 20 steps after its wait within {timeout} s; the job's output ends:\n"
             f"{job.output[-3000:]}")


def report_waits(args, faults):
    print(machine_summary())
    print(f"two groups of one rank, --timeout {args.group_timeout}, the lighthouse's heartbeat timeout 2 s; group 1's "
          "worker failed once in each way")
    print(f"| what happened to group 1 | group 0's longest wait | its waits over {WAIT_S} s |")
    print("|---|---|---|")
    for fault, waits in faults:
        shown = ", ".join(wait if isinstance(wait, str) else f"{wait:.1f} s" for wait in waits) or "none"
        longest = max([wait for wait in waits if not isinstance(wait, str)], default=0)
        print(f"| {WAITS[fault]} | {longest:.1f} s | {shown} |")


WAITS = {"kill": "its worker SIGKILLed: the kernel closes its connections",
         "node": "its torchrun and worker SIGKILLed: its machine gone, the connections closed",
         "stop": "its worker SIGSTOPped for good: a machine that hangs, or vanishes with its connections open",
         "pause": "its worker SIGSTOPped for 1.5 x --timeout, then resumed",
         "return": "it comes back (restarted by its torchrun) and heals",
         "rank": "groups of two ranks: its rank 1 SIGSTOPped for good (its rank 0 heartbeats on)"}


def report(args, world, groups):
    print(machine_summary())
    print(f"the same kill before optimizer step {args.kill_at} of one worker; --workload {args.workload}, "
          f"{STEPS_PER_EPOCH} steps an epoch, 2 x 32 samples a step, a snapshot every {args.save_every} epochs")
    print("| strategy | steps trained again | the others stood still | back at the step of the kill | "
          "samples not trained |")
    print("|---|---|---|---|---|")
    print(f"| restart the world (step 3) | {world['redone']} x {world['ranks']} ranks (since the snapshot) | "
          f"{world['stall']:.2f} s (every rank) | {world['back']:.2f} s after the kill | 0 |")
    print(f"| replica groups (step 13) | {groups['redone']} | {groups['stall']:.2f} s (the survivor's longest wait) | "
          f"never stopped (group 1 killed after step {groups['killed']}, back at step {groups['healed']}) | "
          f"{groups['alone'] * 32} "
          f"({groups['alone']} steps of group 1's share) |")
    print(f"the groups equal after the heal: {groups['equal_after']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=50, help="more than the jobs take: they are stopped")
    parser.add_argument("--save_every", type=positive_int, default=2, help="epochs between snapshots")
    parser.add_argument("--kill_at", type=positive_int, default=100, help="the optimizer step killed (from 1)")
    parser.add_argument("--workload", default="synthetic", choices=["synthetic", "wide"],
                        help="wide: the same data on a ~1M-parameter model, each step ~10x slower")
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds before a job is given up")
    parser.add_argument("--waits", action="store_true", help="measure what the other group waits for, by fault")
    parser.add_argument("--group_timeout", type=positive_int, default=20, help="the groups' --timeout (--waits)")
    parser.add_argument("--repeat", type=positive_int, default=1, help="how many times each fault (--waits)")
    args = parser.parse_args()
    if args.waits:
        with tempfile.TemporaryDirectory(prefix="fault-tolerance-") as workdir:
            report_waits(args, survivor_waits(args, Path(workdir)))
        return
    if not args.save_every * STEPS_PER_EPOCH < args.kill_at < (args.epochs - 10) * STEPS_PER_EPOCH:
        parser.error("--kill_at must come after the first snapshot and leave ten epochs to train after it")
    with tempfile.TemporaryDirectory(prefix="fault-tolerance-") as workdir:
        world = restart_the_world(args, Path(workdir) / "world")
        groups = replica_groups_job(args, Path(workdir) / "groups")
    report(args, world, groups)


if __name__ == "__main__":
    main()
