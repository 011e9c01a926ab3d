"""`make demo`: every step of the tutorial, briefly, on whatever this machine has (GPUs, or the CPU).

Runs in runs/demo/ so checkpoints and snapshots land there, prints each command before running it and what it
printed, then a summary of the loss each step started and ended with. Every step is bounded: one that fails or
runs past --timeout stops the demo with a line that names it and where its log is. Step 13 (replica groups) has one
of its groups SIGKILLed while it runs and is stopped once that group is back; it shows the lines that tell what
happened, not every step's. Step 14 runs no job: one process plans rank 0 of a 1,024-GPU job with step 7's code, and
the summary says what that rank would hold, peak at and send.
"""
import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from harness.jobs import (REPO, free_port, lighthouse, machine_summary, output, python, replica_groups,  # noqa: E402
                        run, shown, start, torchrun, torchrun_node)
from utils.estimates import GPUS as GPU_SHAPES  # noqa: E402
from utils.gpt import TEXT_VARIABLE, help_pages  # noqa: E402

EPOCHS, SAVE_EVERY = 5, 2
GPT_EPOCHS = 4  # on a CPU an epoch of the help pages takes ~5 s on 2 quiet cores: 4 are enough to see words appear
# Steps 7 to 11 train MESH_EPOCHS short epochs each, so that their loss is seen falling over as many lines. On a CPU
# each trains on the help pages' first CHARS[step] characters: in about the time that fewer epochs of more text took
# (step 7: 2 epochs of 40,000; steps 8 to 10: one of the whole pages, 464,970; step 11: one of 40,000).
MESH_EPOCHS = 3
CHARS = {"tensor_parallel.py": 27_000, "pipeline_parallel.py": 155_000, "context_parallel.py": 155_000,
         "expert_parallel.py": 155_000, "one_mesh.py": 13_500}
RUN_DIR = REPO / "runs" / "demo"
GPUS = torch.cuda.device_count()
# Step 13: two groups of one process (one GPU each where there are 2, else the CPU), 32 steps an epoch. Group 1 is
# killed once both have trained FT_KILL_AFTER steps together, before any snapshot: all it comes back with is group 0's.
# The demo follows the job instead of racing it: the survivor alone is quick (a step every 16 to 28 ms on 2 CPU cores,
# no all-reduce between groups), a start is slow (mostly `import torch`: 2.3 s after the kill on a quiet machine, 11 s
# at a load of 6), and a job short enough for the demo ended before group 1 was back in half the tries on a busy
# machine. So the groups are given FT_EPOCHS, more than any start takes, and the demo stops the job once group 1, back,
# has trained FT_STOP_AFTER steps with group 0: 11 s on 2 cores at a load of 3, and the same story at any load.
FT_EPOCHS, FT_KILL_AFTER, FT_STOP_AFTER = 100, 10, 20
# Step 14: rank 0 of a 1,024-GPU job of the 1B GPT's shape (16 blocks, 2,048 wide, a vocabulary of 128,256, a context
# of 8,192), laid out by step 7's code (dp 128 x tp 8), one sequence a dp rank. The cost of a trace grows with the
# blocks a rank runs times its micro-batches: this one is 24 s of CPU on the 2 cores here, the import of torch
# included (the 8B at step 11's pp 8 x tp 8, the page's plan, is 78 s for its two kinds of rank: too long for a demo).
PLAN = ["--step", "tensor_parallel", "--world", 1024, "--tp", 8, "--size", "1b", "--batch_size", 1, "--microbatches", 1]
NOTICE = re.compile(r"[WEI]\d{4} [\d:.]+ \d+ \S+\] (.*)")  # a torchrun log record, as output.Narrator reads them


# torchrun's banner when it starts several workers without OMP_NUM_THREADS: its two lines and their frame of stars.
OMP_BANNER = re.compile(r"^\*{20,}$|^Setting OMP_NUM_THREADS environment variable for each process")
explained = []  # the banner is explained the first time it is left out


def where(path):
    """A path as the demo prints it: from the repository's root when it is inside."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def show(title, *commands, timeout, narrated=False, env=None, **options):
    """Run the commands side by side (one per node) as a learner would (all cores: no OMP_NUM_THREADS of ours), echo
    them (with the variables `env` sets) and the steps' own lines (a narrated demo's lines all); the finished job."""
    print(f"\n=== {title}", flush=True)
    for command in commands:
        print("$", *(f"{name}={where(Path(value))}" for name, value in (env or {}).items()), shown(command), flush=True)
    name = Path(next(part for part in commands[0] if str(part).endswith(".py"))).stem
    job = run(*commands, cwd=RUN_DIR, logs=RUN_DIR / name, gpu=True, timeout=timeout, check=False,
              env={"OMP_NUM_THREADS": None, **(env or {})}, **options)
    if narrated:
        print(job.output.rstrip(), flush=True)
    else:
        lines = output.own_lines(job.output)
        if any(OMP_BANNER.search(line) for line in lines):
            lines = [line for line in lines if not OMP_BANNER.search(line)]
            if not explained:
                lines.insert(0, "(torchrun's banner about OMP_NUM_THREADS, left out here and below: with the variable "
                                "unset it gives each worker one thread, so that workers do not fight over the cores)")
                explained.append(True)
        print("\n".join(lines), flush=True)
    return require_ok(title, job, timeout)


def require_ok(title, job, timeout):
    """The finished job; or the demo stops with one line naming the step, why, and where its log is."""
    if not job.ok:
        why = f"still running after {timeout} s" if job.timed_out else f"exit codes {job.codes}"
        sys.exit(f"demo: '{title}' failed ({why}; its log: {where(job.logs_dir)}/)")
    return job


def show_replica_groups(title, epochs, kill_after, stop_after, timeout):
    """Step 13 as a learner runs it: a lighthouse, then one torchrun per group (--max_restarts=1: a group's torchrun
    starts it again once), each command echoed. Once group 1 has printed step `kill_after` with both groups in it, its
    rank 0 is SIGKILLed from outside; once it is back and has printed `stop_after` more steps with both groups, the
    demo stops the job. Then its lines, short (replica_lines), what happened narrated; the job, the kill and the stop
    noted on its timeline."""
    print(f"\n=== {title}", flush=True)
    port, folder = free_port(), RUN_DIR / "fault_tolerant"
    # A snapshot only after the last epoch, which the demo never reaches: group 1 has nothing on disk to come back to.
    commands = [lighthouse(port), *replica_groups("fault_tolerant.py", epochs, epochs, port=port,
                                                  launcher_args=["--max_restarts=1"])]
    for command in commands:
        print("$", shown(command), flush=True)
    # Each group one GPU of its own where there are two: NCCL takes no two ranks on one GPU; else both on the CPU.
    devices = ["0", "1"] if GPUS >= 2 else ["", ""]
    folder.mkdir()  # the job's folder, its logs in it: apart from the other steps' files
    deadline = time.monotonic() + timeout
    together = re.compile(r"\[group 1 .*\] step (\d+) \| participants 2 ")

    def until(pattern, done, what):  # follow the job to a line that matches and done(match) holds; else stop here
        try:
            while not done(match := job.wait_for(pattern, timeout=max(1.0, deadline - time.monotonic()))):
                pass
            return match
        except AssertionError:  # the job ended, or ran past the deadline, first
            job.wait(timeout=0)
            require_ok(title, job, timeout)
            sys.exit(f"demo: '{title}' failed (the job ended before {what}; its log: {where(job.logs_dir)}/)")

    with start(*commands, cwd=folder, gpu=True, services=1, env={"OMP_NUM_THREADS": None},
               node_env=[{}, *({"CUDA_VISIBLE_DEVICES": device} for device in devices)]) as job:
        until(together, lambda match: int(match[1]) >= kill_after, f"group 1 trained step {kill_after} with group 0")
        job.kill_worker(rank=0, node=2, nproc=1)
        back = int(until(output.HEALED, lambda match: match["group"] == "1", "group 1 was back")["step"])
        until(together, lambda match: int(match[1]) >= back + stop_after, f"group 1 trained {stop_after} steps back")
        running = job.poll()  # None for every node that still runs: all of them, unless one failed on its own
        job.note(f"the demo stops the job, {stop_after} steps after group 1's heal")
    job.new_lines()  # what the groups printed before the stop, on the timeline too
    if any(code is not None for code in running):
        sys.exit(f"demo: '{title}' failed (exit codes {running} before the demo stopped it; its log: "
                 f"{where(job.logs_dir)}/)")
    for line in replica_lines(job):
        print(line, flush=True)
    return job


def replica_lines(job):
    """Step 13's job in the lines that tell what happened, in the order they were printed: of each stretch of a group's
    step lines with the same participants, the first and the last, and how many were left out between them; the other
    lines of the groups' own; torchrun's records as `torchrun (group G): ...`; and `>>>` lines that say what happened:
    a group that joined late at the start, the kill, the killed group's return, the stop, what the survivor did."""
    lines, stretches = [], {}  # {group: [participants, its stretch's held-back last line, how many left out]}
    facts = replica_facts(job)

    def end(group):  # the group's stretch is over: its last line, after the count of those left out before it
        participants, held, left_out = stretches.pop(group, (None, None, 0))
        if left_out:
            lines.append(f"   ... {left_out} more step(s) of group {group}, participants {participants}")
        if held:
            lines.append(held)

    for _, node, line in job.timeline:
        step = output.GROUP_STEP.search(line)
        group = int(step["group"]) if step else None
        if node is None and line.startswith("SIGKILL"):  # kill_worker's note: the stretches end at the kill
            for open_group in list(stretches):
                end(open_group)
            lines.append(f">>> SIGKILL -> group 1's rank 0 ({line.split('(')[1]}, from outside, after its step "
                         f"{facts['killed_at']}: group 0 trains on; torchrun starts group 1 again (--max_restarts=1)")
        elif node is None:  # the demo's note of its stop, told at the end
            continue
        elif step and stretches.get(group, [None])[0] == int(step["participants"]):
            stretch = stretches[group]
            stretch[1], stretch[2] = line, stretch[2] + (stretch[1] is not None)
        elif step:
            end(group)
            lines.append(line)
            stretches[group] = [int(step["participants"]), None, 0]
        elif node and (NOTICE.match(line) or not output.noise(line)):
            end(node - 1)
            lines.append(f"   torchrun (group {node - 1}): {NOTICE.match(line)[1]}" if NOTICE.match(line) else line)
            healed = output.HEALED.search(line)
            if healed and int(healed["step"]) <= facts["killed_at"]:
                other = 1 - int(healed["group"])
                lines.append(f">>> group {healed['group']} joined at step {healed['step']}, after group {other} had "
                             f"begun without it (the lighthouse waits for one group: --min_replicas 1): it took group "
                             f"{other}'s state, as a group that comes back does")
            elif healed:
                lines.append(f">>> group 1 is back: torchrun started it again, and it took group 0's weights and "
                             f"optimizer state at step {healed['step']} over the network ({facts['disk']}); from that "
                             "step on, both groups print the same weights")
    for open_group in list(stretches):
        end(open_group)
    lines.append(f">>> the demo stops the job: group 1 has trained {facts['last'] - facts['back']} steps with group 0 "
                 f"since its heal, and the rest of the {FT_EPOCHS} epochs would go the same way")
    survivor = facts["survivor"]
    lines.append(f">>> group 0 {'never stopped' if facts['unbroken'] else 'skipped or repeated steps'}: steps "
                 f"{survivor[0]} to {survivor[-1]}, {facts['alone']} of them alone after the kill, {facts['redone']} "
                 f"done again; at step {facts['last']} both groups hold "
                 f"{'the same weights' if facts['equal'] else 'different weights'}")
    return lines


def replica_facts(job):
    """What step 13's job did, from the lines on its timeline (the kill noted among them): the step group 1 printed
    last before the kill, the step it healed at after it, whether it had a snapshot on disk, the steps group 0
    committed in order, whether they ran on unbroken (each the one before + 1), how many it took alone after the kill
    and did again, the last step both groups printed and whether they held the same weights then."""
    killed = next(index for index, (_, node, line) in enumerate(job.timeline)
                  if node is None and line.startswith("SIGKILL"))
    text = {node: "\n".join(line for _, where, line in job.timeline if where == node) for node in (1, 2)}
    before = [int(match["step"]) for _, node, line in job.timeline[:killed] if node == 2
              for match in [output.GROUP_STEP.search(line)] if match]
    after = [int(match["step"]) for _, node, line in job.timeline[killed:] if node == 2
             for match in [output.HEALED.search(line)] if match]
    survivor = [int(match["step"]) for match in output.GROUP_STEP.finditer(text[1])]
    steps = output.group_steps(text[1] + "\n" + text[2])
    last = max(set(steps[0]) & set(steps.get(1, {})))
    return dict(killed_at=before[-1], back=after[-1] if after else None, survivor=survivor, last=last,
                disk="its snapshot on disk was older" if output.RESUMED.search(text[2]) else
                "it had saved no snapshot yet",
                unbroken=survivor == list(range(survivor[0], survivor[-1] + 1)),
                alone=sum(line["participants"] == 1 for step, line in steps[0].items() if step > before[-1]),
                redone=len(output.NOT_COMMITTED.findall(text[1])),
                equal=steps[0][last]["weights"] == steps[1][last]["weights"], start=(steps[0].get(0) or steps[1][0]),
                end=steps[0][last])


def plan_summary(path):
    """Step 14's line of the summary, from the plan it wrote (plan_at_scale.py --json): the job, whose code laid it
    out, and what the traced rank holds, peaks at and sends over each link."""
    plan = json.loads(path.read_text())
    rank, args = plan["plans"][0], plan["args"]
    gpu, step = GPU_SHAPES[args["gpu"]], rank["estimate"]
    split = {name: args[name] for name in ("pp", "tp", "ep") if args[name] > 1}
    layout = " x ".join(f"{name} {size}" for name, size in {"dp": args["world"] // math.prod(split.values()),
                                                           **split}.items())
    state = rank["params"] + rank["grads"] + rank["optim"]
    over = {}  # what the rank sends a step over each link, and over which groups
    for link, name in (("nvlink", "NVLink"), ("network", "the network")):
        groups = [group for group in step["sent"] if step["links"][group] == link]
        over[link] = f"{sum(step['sent'][group] for group in groups) / 2**30:.2f} GiB over {name} ({', '.join(groups)})"
    return (f"rank {rank['rank']} of a {args['world']:,}-GPU job of the {args['size']} GPT, laid out by "
            f"{args['step']}.py's own code ({layout}) and traced in this one process in {rank['seconds']:.0f} s: it "
            f"holds {state / 2**20:.1f} MiB of weights, gradients and AdamW, peaks at {rank['peak'] / 2**30:.2f} GiB "
            f"(an {args['gpu'].upper()} has {gpu.memory / 2**30:.1f}), and sends {over['nvlink']} and "
            f"{over['network']} a step")


DDP_STEPS = ("multigpu.py", "multigpu_torchrun.py", "multinode.py", "fsdp.py")


def same_computation(jobs):
    """What steps 2 to 5's last losses show: the same numbers mean the same computation, whatever starts the ranks."""
    last = {step: jobs[step].losses[max(jobs[step].losses)] for step in DDP_STEPS}
    if max(last.values()) - min(last.values()) < 1e-4:  # float sums in another order may differ in the last digits
        return (f"\nSteps 2 to 5 end at the same loss ({last['multigpu.py']:.4f}): the same ranks, each on the same "
                "share of the data, average the same gradients. mp.spawn, torchrun, two nodes or FSDP's shards change "
                "how the ranks are started and where the weights live, not what they compute.")
    said = ", ".join(f"{step} {loss:.4f}" for step, loss in last.items())
    return (f"\nSteps 2 to 5 end at different losses ({said}): compare their commands above (the "
            "number of ranks, the precision): each averaged a different batch.")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=int, default=300, help="seconds each step may take")
    args = parser.parse_args()
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    print(f"{machine_summary()}: " + (f"{GPUS} CUDA GPU(s), NCCL" if GPUS else "CPU processes on gloo"))
    began, jobs = time.perf_counter(), {}
    jobs["single_gpu.py"] = show("Step 1: one device", python("single_gpu.py", EPOCHS, SAVE_EVERY),
                                 timeout=args.timeout)
    jobs["multigpu.py"] = show("Step 2: DDP with mp.spawn", python("multigpu.py", EPOCHS, SAVE_EVERY),
                               timeout=args.timeout)
    jobs["multigpu_torchrun.py"] = show("Step 3: torchrun, with a snapshot", torchrun(
        "multigpu_torchrun.py", EPOCHS, SAVE_EVERY, nproc="gpu" if GPUS else 2), timeout=args.timeout)
    # Two "nodes" on this machine: two torchrun agents meeting at one endpoint. With >= 2 GPUs each node gets its
    # own GPUs; otherwise both run on the CPU, one process each.
    node_env = [{"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n * GPUS // 2, (n + 1) * GPUS // 2)))}
                for n in range(2)] if GPUS >= 2 else [{"CUDA_VISIBLE_DEVICES": ""}] * 2
    (RUN_DIR / "snapshot.pt").unlink(missing_ok=True)  # a fresh job: step 3 left its snapshot here
    node = torchrun_node("multinode.py", EPOCHS, SAVE_EVERY, endpoint=f"127.0.0.1:{free_port()}", run_id="demo",
                         nproc="gpu" if GPUS >= 2 else 1)
    jobs["multinode.py"] = show("Step 4: two nodes on localhost", node, node, node_env=node_env, timeout=args.timeout)
    jobs["fsdp.py"] = show("Step 5: FSDP, the model sharded over the ranks", torchrun(
        "fsdp.py", EPOCHS, SAVE_EVERY, nproc="gpu" if GPUS else 2), timeout=args.timeout)
    jobs["gpt.py"] = show("Step 6: a small GPT, 2 micro-batches per optimizer step (no_sync)", torchrun(
        "gpt.py", GPT_EPOCHS, GPT_EPOCHS, "--batch_size", 16, "--grad_accum", 2,
        *(["--precision", "bf16"] if GPUS else []), nproc="gpu" if GPUS else 2), timeout=args.timeout)
    # Steps 7 to 11 on the help pages' start (CHARS), unless a text is set or GPUs train on the whole of them.
    text = dict.fromkeys(CHARS)  # None: the step's own text, the help pages or the one set
    if not GPUS and not os.environ.get(TEXT_VARIABLE):
        for step, chars in CHARS.items():
            excerpt = RUN_DIR / f"help_{chars}.txt"
            excerpt.write_text(help_pages()[:chars])
            text[step] = {TEXT_VARIABLE: excerpt}
    # Step 7: 4 CPU processes (dp 2 x tp 2); on GPUs all of them, tp 2 if it fits. Its snapshot (tp_snapshot/) and
    # full model (tp_model_full.pt) have names of their own, apart from step 5's.
    jobs["tensor_parallel.py"] = show("Step 7: tensor parallelism and FSDP on a dp x tp mesh (a GPT block split in 2)",
                                      torchrun("tensor_parallel.py", MESH_EPOCHS, 1, "--tp", 2 if GPUS % 2 == 0 else 1,
                                               *(["--precision", "bf16"] if GPUS else []), nproc="gpu" if GPUS else 4),
                                      env=text["tensor_parallel.py"], timeout=args.timeout)
    # Each stage runs every batch through its half of the model (--pp 2, by default); a snapshot after the last epoch.
    jobs["pipeline_parallel.py"] = show("Step 8: the GPT in 2 pipeline stages, 4 micro-batches each (1F1B)", torchrun(
        "pipeline_parallel.py", MESH_EPOCHS, MESH_EPOCHS, *(["--precision", "bf16"] if GPUS else []),
        nproc=min(GPUS, 2) or 2), env=text["pipeline_parallel.py"], timeout=args.timeout)
    # Sequences of 128 characters, each shared by 2 ranks (2 chunks each), the ring.
    jobs["context_parallel.py"] = show("Step 9: each sequence split over 2 ranks, keys and values passed in a ring",
                                       torchrun("context_parallel.py", MESH_EPOCHS, MESH_EPOCHS, "--context", 128,
                                                "--cp", min(GPUS, 2) or 2, *(["--precision", "bf16"] if GPUS else []),
                                                nproc=min(GPUS, 2) or 2), env=text["context_parallel.py"],
                                       timeout=args.timeout)
    # Every block's MLP as experts, each of 2 ranks holding half of them (--ep 2), the tokens sent to their experts'
    # rank and back by all-to-all; its sharded snapshot goes to ep_snapshot/.
    jobs["expert_parallel.py"] = show("Step 10: a mixture of experts, each of 2 ranks holding half of them",
                                      torchrun("expert_parallel.py", MESH_EPOCHS, MESH_EPOCHS, "--ep",
                                               min(GPUS, 2) or 2, *(["--precision", "bf16"] if GPUS else []),
                                               nproc=min(GPUS, 2) or 2), env=text["expert_parallel.py"],
                                      timeout=args.timeout)
    # Step 11 on 4 processes, a mesh of pp 2 x tp 2 (dp 1): each pipeline rank holds 2 of the GPT's 4 stages, each
    # stage's blocks split over 2 ranks. On a CPU (8 processes, dp 2, took 1.6 times as long as 4); on GPUs, 4 of
    # them, or a pipeline alone on 2 or 3, both stages on the one rank on 1. Its snapshot: mesh_snapshot/.
    pp, tp = (2, 2) if GPUS >= 4 or not GPUS else (min(GPUS, 2), 1)
    jobs["one_mesh.py"] = show(f"Step 11: one mesh of pp {pp} x tp {tp}, two pipeline stages a rank",
                               torchrun("one_mesh.py", MESH_EPOCHS, MESH_EPOCHS, "--pp", pp, "--tp", tp,
                                        *(["--precision", "bf16"] if GPUS else []), nproc=pp * tp),
                               env=text["one_mesh.py"], timeout=args.timeout)
    # Step 12 on step 11's 4 processes: token files of the help pages written first (on a CPU, the pages of at most
    # 1,500 characters: 409 sequences of 64), then 24 optimizer steps in global batches of 16, a snapshot every 12
    # steps (long_snapshots/), a held-out loss every 12, a line every 6 (TensorBoard's scalars in runs/long_run/).
    data = ["data/help-gpu", "--workload", "gpt-gpu"] if GPUS else ["data/help-short", "--max_chars", 1500]
    show("Step 12: the token files it reads from disk", python("tools/prepare_data.py", *data), timeout=args.timeout)
    jobs["long_run.py"] = show(f"Step 12: the long run, steps not epochs, on pp {pp} x tp {tp}",
                               torchrun("long_run.py", 24, 12, "--data", data[0], "--global_batch", 16, "--log_every",
                                        6, "--eval_every", 12, *(["--precision", "bf16"] if GPUS else []),
                                        "--pp", pp, "--tp", tp, nproc=pp * tp), timeout=args.timeout)
    # Step 13: two replica groups under torchft; group 1 SIGKILLed from outside, group 0 trains on, group 1 comes back
    # and takes group 0's state (show_replica_groups). Its files in runs/demo/fault_tolerant/.
    jobs["fault_tolerant.py"] = show_replica_groups(
        "Step 13: two replica groups under torchft: one is SIGKILLed, the other trains on, the killed one heals",
        FT_EPOCHS, FT_KILL_AFTER, FT_STOP_AFTER, timeout=args.timeout)
    # Step 14: no job runs; one process becomes rank 0 of 1,024 on torch's fake process group and traces a step of
    # step 7's code on fake tensors (PLAN). Its plan, as JSON, in runs/demo/plan.json.
    jobs["plan_at_scale.py"] = show("Step 14: plan one rank of a 1,024-GPU job on this machine, with step 7's code",
                                    python("plan_at_scale.py", *PLAN, "--json", "plan.json"), timeout=args.timeout,
                                    narrated=True)

    fault = show("Step 3 under fire: a worker SIGKILLed, torchrun restarts the group, the job resumes",
                 python("tools/fault_demo.py", "--timeout", args.timeout), timeout=args.timeout + 30, narrated=True)

    print(f"\n=== Summary ({time.perf_counter() - began:.0f} s; files in {where(RUN_DIR)}/)")
    for step, job in jobs.items():
        losses = job.losses
        if step == "plan_at_scale.py":  # a plan, not a training run
            print(f"{step:22} {plan_summary(job.cwd / 'plan.json')}")
        elif step in CHARS:  # steps 7 to 11: every epoch's mean training loss, then the held-out loss after the last
            falling = " -> ".join(f"{losses[epoch]:.4f}" for epoch in sorted(losses))
            held_out = output.held_out(job.output)["loss"]
            print(f"{step:22} loss {falling} (epochs 0 to {max(losses)}); held-out {held_out:.4f} after them")
        elif losses:
            print(f"{step:22} loss {losses[0]:.4f} (epoch 0) -> {losses[max(losses)]:.4f} (epoch {max(losses)})")
        elif output.group_steps(job.output):  # replica groups: a line per step and group, until the demo's stop
            facts = replica_facts(job)
            weights = f"both at weights {facts['end']['weights']}" if facts["equal"] else "the groups apart"
            print(f"{step:22} loss {facts['start']['loss']:.4f} (step 0) -> {facts['end']['loss']:.4f} (step "
                  f"{facts['last']}); group 0 {'never stopped' if facts['unbroken'] else 'skipped steps'} "
                  f"({facts['alone']} steps alone), group 1 healed at step {facts['back']}; {weights} when the demo "
                  "stopped the job")
        else:  # the long run reports windows of steps, and the held-out loss from step 0 on
            lines, held_out = output.step_lines(job.output), output.held_out_losses(job.output)
            before, after = held_out[0], held_out[-1]
            (first, start), (last, end) = min(lines.items()), max(lines.items())
            print(f"{step:22} loss {start['loss']:.4f} (step {first}) -> {end['loss']:.4f} (step {last}); held-out "
                  f"{before[1]:.4f} (step {before[0]}) -> {after[1]:.4f} (step {after[0]})")
    print(same_computation(jobs))
    for steps, text in output.samples(jobs["gpt.py"].output):
        print(f"\nWhat the GPT writes after {steps} optimizer steps:\n{text}")
    require_learning(jobs)
    return jobs, fault


def first_and_last_loss(step, job):
    """The training loss a step's job printed first and last, as the summary reads them; None for step 14's plan,
    which trains nothing."""
    if step == "plan_at_scale.py":
        return None
    if job.losses:  # steps 1 to 11: a mean loss an epoch
        return job.losses[min(job.losses)], job.losses[max(job.losses)]
    if output.group_steps(job.output):  # step 13: a line per step and group
        facts = replica_facts(job)
        return facts["start"]["loss"], facts["end"]["loss"]
    # Step 12: a line per window of steps.
    lines = output.step_lines(job.output)
    return lines[min(lines)]["loss"], lines[max(lines)]["loss"]


def require_learning(jobs):
    """The demo shows every step learning: one whose last training loss is not below its first stops the demo with
    a line naming it, instead of a summary that looks like success."""
    for step, job in jobs.items():
        losses = first_and_last_loss(step, job)
        if losses is not None and not losses[1] < losses[0]:
            sys.exit(f"demo: {step} did not learn (its loss went from {losses[0]:.4f} to {losses[1]:.4f}; its log: "
                     f"{where(job.logs_dir)}/)")


if __name__ == "__main__":
    main()
