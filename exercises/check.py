"""Check a workshop exercise: run your script for real (CPU processes, a few seconds) and watch what it does.

    python exercises/check.py 1 my_ddp.py        # 1. one process -> DDP with mp.spawn
    python exercises/check.py 2 my_restart.py    # 2. survive a kill: snapshot and resume under torchrun
    python exercises/check.py 3 my_nodes.py      # 3. two nodes: one writer, and every node resumes alike
    python exercises/check.py 4 my_accum.py      # 4. gradient accumulation with no_sync (the GPT of step 6)
    python exercises/check.py 5 my_2d.py         # 5. 2D parallelism: the data split over dp, not every rank
    python exercises/check.py 6 my_cp.py         # 6. context parallelism: which chunks of a sequence a rank holds
    python exercises/check.py 7 my_ddp_by_hand.py  # 7. DDP by hand: hooks, buckets, overlap with backward
    python exercises/check.py 8 my_zero.py         # 8. ZeRO by hand: the optimizer's state, then the gradients
    python exercises/check.py 9 my_fsdp.py         # 9. FSDP's choices: the units, and resharding after forward
    python exercises/check.py 10 my_pipeline.py    # 10. a pipeline schedule by hand: GPipe, then 1F1B
    python exercises/check.py 11 my_dispatch.py    # 11. the experts' dispatch: two all-to-alls
    python exercises/check.py 12 my_clinic.py      # 12. the hang clinic: which rank, which collective, which line
    python exercises/check.py 13 my_layout.py      # 13. plan a layout: the 8B GPT on 2 nodes of 8 GPUs, planned

It prints what is missing or wrong, in the exercise's terms and with the line to change, and exits 0 only when
everything is right. It judges what the processes did, not how the script is written: the samples each rank trained
on, every rank's parameters after each epoch (DDP keeps them equal), the losses each rank computed (the printed one
is their mean), who saved which file, from which line and when, the state a restarted job resumes from (the one the
killed job had), whether each process closed its process group. For exercises 7-12 (their checkers are check.py
in their folders): every collective each rank called, with its bytes, its line and when it was waited on, each
backward and optimizer step with the gradients and optimizer state it held, and what the exercise builds (FSDP's
units held whole, a pipeline rank's passes and activations, the rows an all-to-all moved, every rank's Flight
Recorder), against what a correct program computes. harness/jobs records all that, the same job runner the
repository's tests use. For exercise 13 it runs the planner (plan_at_scale.py, step 14) on the layout and judges what
the planner counted: the peak memory of each kind of rank, where tensor parallelism's traffic goes, the step's time.
"""
import argparse
import importlib
import itertools
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python exercises/check.py` from anywhere

import torch  # noqa: E402

from exercises.judging import (COLLECTIVE_TIMEOUT_S, LOSS_TOLERANCE, WORLD_SIZE, exit_problems, lines_in,  # noqa: E402
                               listed, one_thread, ranks_of)
from harness.jobs import PYTHON, free_port, run, saved_name, shown, torchrun, torchrun_node  # noqa: E402
from harness.jobs.output import epoch_losses  # noqa: E402
from utils import make_workload  # noqa: E402

EXERCISES = {1: "01_ddp", 2: "02_survive_a_kill", 3: "03_two_nodes", 4: "04_grad_accum",  # their folders in exercises/
             5: "05_tensor_parallel", 6: "06_context_parallel", 7: "07_ddp_by_hand", 8: "08_zero_by_hand",
             9: "09_fsdp_choices", 10: "10_pipeline_by_hand", 11: "11_expert_dispatch", 12: "12_hang_clinic",
             13: "13_plan_a_layout"}
# The track inside the machinery (7-12), and planning a layout (13): each exercise's checker is check.py in its folder.
INSIDE = {7: "ddp_by_hand", 8: "zero_by_hand", 9: "fsdp_choices", 10: "pipeline_by_hand", 11: "expert_dispatch",
          12: "hang_clinic", 13: "plan_a_layout"}
# What solves each exercise: the step scripts (1-6), then each exercise's own solution.py, which a learner compares with
SOLUTIONS = {1: "multigpu.py", 2: "multigpu_torchrun.py", 3: "multinode.py", 4: "gpt.py", 5: "tensor_parallel.py",
             6: "context_parallel.py", **{number: f"exercises/{EXERCISES[number]}/solution.py" for number in INSIDE}}
KILLED_EPOCH = 2  # exercise 2 kills rank 1 as it begins this epoch
SLOW_SAVE_S = 0.5  # exercises 2 and 3 make every save this much slower (a slow disk): a rank that runs ahead shows,
# even on a busy machine that delays it for a moment


def launch(commands, workdirs, record_dir, timeout, kill_at=None, slow_save=None):
    """Run one command per node, each in its directory, until all end or `timeout` s pass (then kill them all);
    the finished job, with what it recorded."""
    return run(*commands, cwd=workdirs, logs=record_dir, record=True, kill_at=kill_at, slow_save=slow_save,
               timeout=timeout, check=False)


# Each *_problems function returns a list of sentences, empty when all is well. Those that judge records take the
# rows themselves (job.samples, job.records(...)): tests/test_exercises.py gives them rows it makes up.

def process_problems(samples):
    if not samples:
        return ["it never trained: no process iterated over a DataLoader"]
    ranks = ranks_of(samples)
    if ranks == [None] and len({row["pid"] for row in samples}) == 1:
        return [f"only one process trained: start {WORLD_SIZE} processes (mp.spawn(main, args=(world_size, args), "
                "nprocs=world_size)) and call dist.init_process_group in each"]
    if ranks != list(range(WORLD_SIZE)):
        return [f"the processes that trained had ranks {ranks}, expected {list(range(WORLD_SIZE))}: each process "
                "must join the process group with its own rank before training"]
    return []


def ddp_problems(samples):
    bare = sorted({row["rank"] for row in samples if not row["ddp"]}, key=str)
    if not bare:
        return []
    return [f"rank {listed(bare)} trained a model not wrapped in DistributedDataParallel: its gradients were never "
            "averaged with the other ranks', so each rank trained a different model; wrap it: "
            "DDP(model, device_ids=...)"]


def epochs_of(samples):
    """{(restart, pass number): {rank: its record of that pass}}: what each rank did, epoch by epoch."""
    epochs = {}
    for row in samples:
        epochs.setdefault((row["restart"], row["number"]), {})[row["rank"]] = row
    return epochs


def shard_problems(samples):
    dataset_size = len(make_workload().train_set)
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        epoch = f"epoch {number}" + (f" after restart {restart}" if restart else "")
        by_rank = {rank: row["indices"] for rank, row in rows.items()}
        for (rank_a, a), (rank_b, b) in itertools.combinations(sorted(by_rank.items()), 2):
            shared = set(a) & set(b)
            if len(shared) > WORLD_SIZE:  # DistributedSampler pads by < world_size samples to even out the shards
                sampler = next(row["sampler"] for row in samples if row["rank"] == rank_a)
                return [f"ranks {rank_a} and {rank_b} trained on the same samples: {len(shared)} of the "
                        f"{len(a)} samples rank {rank_a} saw in {epoch} were also rank {rank_b}'s. The DataLoader "
                        f"uses a {sampler}: give it sampler=DistributedSampler(dataset) (and shuffle=False), so "
                        "each rank gets its own 1/world_size of the data"]
        unseen = dataset_size - len(set().union(*map(set, by_rank.values())))
        if unseen > 0:
            return [f"no rank trained on {unseen} of the {dataset_size} samples in {epoch}: together the ranks must "
                    "cover the whole dataset (DistributedSampler does, with the process group's rank and size)"]
    return []


def order_problems(samples):
    for rank in ranks_of(samples):
        passes = [row for row in samples if row["rank"] == rank]
        for earlier, later in zip(passes, passes[1:]):
            if earlier["restart"] == later["restart"] and earlier["indices"] == later["indices"]:
                why = (f" (its {later['sampler']}'s epoch stayed {later['epoch']})" if later["epoch"] is not None
                       else "")
                return [f"rank {rank} trained on the same samples in the same order in epochs {earlier['number']} "
                        f"and {later['number']}{why}: call self.train_data.sampler.set_epoch(epoch) at the start "
                        "of every epoch, so each epoch gets a new shuffle (the same one on every rank)"]
    return []


def writer_problems(saves, script, multinode=False):
    if not saves:
        return ["nothing was saved: save every save_every epochs (and after the last one)"]
    ranks = sorted({save["rank"] for save in saves}, key=str)
    files = sorted({saved_name(save["path"]) for save in saves})
    where = lines_in(next(save["stack"] for save in saves if save["rank"] == ranks[-1]), script)
    at = f" around the save at {', called from '.join(where)}" if where else ""
    if len(ranks) > 1:
        fix = ("only global rank 0 writes (RANK, or dist.get_rank()): LOCAL_RANK is 0 on every node, so "
               f"`if local_rank == 0:` makes one writer per node; test the global rank{at}" if multinode
               else "the replicas are identical, so one writer is enough: only rank 0 writes "
               f"(`if self.rank == 0:`{at})")
        return [f"ranks {listed(ranks)} all wrote {listed(files)}: {fix}"]
    if ranks != [0] and ranks != [None]:
        return [f"rank {ranks[0]} wrote {listed(files)}, not rank 0: by convention rank 0 writes files{at}"]
    return []


def divergence_problems(samples, script):
    """DDP keeps the replicas equal: after every epoch, every rank's parameters are the same, bit for bit."""
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        rows = list(rows.values())
        hashes = {row["rank"]: row.get("params") for row in rows}
        if None in hashes.values() or len(set(hashes.values())) == 1:
            continue
        epoch = f"epoch {number}" + (f" after restart {restart}" if restart else "")
        bypass = next((row["bypass"] for row in rows if row.get("bypass")), None)
        where = lines_in(bypass, script, innermost=1)
        fix = (f"At {where[0]} it calls the model inside DDP directly (self.model.module), which skips DDP's gradient "
               "all-reduce: call the DDP-wrapped model, self.model(source)" if where else
               "every training step must run forward and backward through the DDP-wrapped model")
        return [f"after {epoch} the ranks' parameters differed (ranks {listed(sorted(hashes, key=str))} hold "
                f"{len(set(hashes.values()))} different models): their gradients were not averaged, so each rank "
                f"trained a model of its own. {fix}"]
    return []


def barrier_problems(begins, saves, script):
    """With every save slowed down, no rank may begin an epoch while the last snapshot is still being written (a save
    that a kill cut short was still being written when the job ended)."""
    ended = {(save["pid"], save["began"]): save for save in saves}
    for save in (row for row in begins if row["what"] == "save"):
        done = ended.get((save["pid"], save["began"]))
        for row in begins:
            if (row["what"] == "pass" and row["rank"] != save["rank"] and row["restart"] == save["restart"]
                    and save["began"] < row["began"] < (done["ended"] if done else float("inf"))):
                where = lines_in(done["stack"], script)[1:] if done else []
                return [f"rank {row['rank']} began epoch {row['epoch']} while rank {save['rank']} was still writing "
                        f"the snapshot (this check makes every save {SLOW_SAVE_S} s slower, as a slow disk would): a "
                        "kill then loses the epoch before too. After the save, every rank must wait until it is on "
                        "disk: dist.barrier(), on every rank, after the `if ... == 0:` save"
                        + "".join(f" ({place})" for place in where)]
    return []


def teardown_problems(exits):
    last = max((row["restart"] for row in exits), default=0)  # an attempt torchrun stopped ended as it could
    still_open = sorted({row["rank"] for row in exits if row["open"] and row["restart"] == last}, key=str)
    if not still_open:
        return []
    ranks = (f"ranks {listed(still_open)} exited with their" if len(still_open) > 1
             else f"rank {still_open[0]} exited with its")
    return [f"{ranks} process group still open: call dist.destroy_process_group() "
            "at the end of main, on every rank (before exit_without_teardown()); it closes the connections to the "
            "other ranks (with NCCL, a group left open can hang the exit or leak GPU memory)"]


def resume_problems(samples):
    """A run resumed from a snapshot goes on exactly as an uninterrupted one: the first epoch after a restart
    starts from the very parameters and optimizer state the epoch before it ended with."""
    first = {}
    for row in samples:
        first.setdefault(row["pid"], row)
    for row in first.values():
        if not row["restart"] or not row.get("epoch") or "params_before" not in row:
            continue
        before = [earlier for earlier in samples if earlier["rank"] == row["rank"] and earlier["epoch"] ==
                  row["epoch"] - 1 and earlier["restart"] < row["restart"]]
        if not before:
            continue
        before = before[-1]
        what = ("its parameters" if row["params_before"] != before["params"] else
                "its optimizer's state" if row["optimizer_before"] != before["optimizer"] else None)
        if what is None:
            continue
        fix = ("save self.optimizer.state_dict() in the snapshot (_save_snapshot) and load it back with "
               "self.optimizer.load_state_dict(...) (_load_snapshot): Adam's running averages are part of the training"
               if what == "its optimizer's state" else
               "save self.model.module.state_dict() in the snapshot and load it back before wrapping in DDP")
        those = "those" if what == "its parameters" else "the one"
        return [f"rank {row['rank']} resumed epoch {row['epoch']} after the restart, but {what} differed from {those} "
                f"it had at the end of epoch {row['epoch'] - 1}, so the resumed run is not the run that was "
                f"interrupted: {fix}"]
    return []


def restart_problems(samples, epochs, no_barrier=False):
    """Where the job restarted after the kill in epoch KILLED_EPOCH resumed and how far it went (rank 0's passes);
    when at the right epoch, whether it resumed the state that epoch began with (resume_problems)."""
    restarted = [row for row in samples if row["restart"] >= 1 and row["rank"] == 0]
    if not restarted:
        return ["no rank trained after the restart"]
    resumed_at = [row["epoch"] for row in restarted]
    if None in resumed_at:
        return ["the restarted job's sampler has no epoch: use a DistributedSampler and set_epoch"]
    expected = [KILLED_EPOCH - 1, KILLED_EPOCH] if no_barrier else [KILLED_EPOCH]
    first, problems = min(resumed_at), []
    if first == 0:
        problems.append(f"after the kill in epoch {KILLED_EPOCH} the restarted job started over from epoch 0: "
                        f"epochs 0-{KILLED_EPOCH - 1} were lost. Save a snapshot (model, optimizer, epochs run) every "
                        "save_every epochs, and at start load it, if it exists, and go on from there")
    elif first < min(expected):
        problems.append(f"the restarted job repeated epoch {listed(range(first, KILLED_EPOCH))}, which finished and "
                        f"was saved before the kill: store the number of epochs *run* (epoch + 1) and start there")
    elif first > max(expected):
        problems.append(f"the restarted job skipped epoch {listed(range(KILLED_EPOCH, first))}, which the kill "
                        "interrupted: resume at the first epoch that did not finish")
    if max(resumed_at) != epochs - 1:
        problems.append(f"the restarted job stopped after epoch {max(resumed_at)}, not {epochs - 1}")
    # the state is judged only at the right epoch: one resumed at a wrong epoch cannot be the state it began with
    return problems or resume_problems(samples)


def last_saved(writes, workdir):
    """The file the job saved last (a .tmp written then renamed counts under its final name), or None."""
    for _, _, path in reversed(writes):
        final = Path(path).with_name(saved_name(path))
        if final.exists():
            return final
    return None


def model_state_in(saved):
    """The model's state_dict inside what was saved: the dict itself, or a dict of tensors nested in it."""
    if isinstance(saved, dict) and saved and all(isinstance(value, torch.Tensor) for value in saved.values()):
        return saved
    for value in saved.values() if isinstance(saved, dict) else ():
        found = model_state_in(value)
        if found is not None:
            return found
    return None


def checkpoint_problems(job, workdir, script):
    path = last_saved(job.writes, workdir)
    if path is None:
        return []  # writer_problems says it
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        return [f"{path.name} cannot be loaded ({type(error).__name__}: {str(error).splitlines()[0]})"]
    return saved_state_problems(path.name, saved, job.records("saves.jsonl"), script)


def saved_state_problems(name, saved, saves, script):
    """Whether what was saved in the file `name` holds a model state_dict that a fresh model loads."""
    state = model_state_in(saved)
    if state is None:
        return [f"{name} holds no model state_dict"]
    model = make_workload().model
    if set(state) == {f"module.{key}" for key in model.state_dict()}:
        where = "".join(f" in what the save at {line} writes" for line in lines_in(saves[-1]["stack"] if saves else (),
                                                                                     script, innermost=1))
        return [f"{name} holds the DDP wrapper's state_dict (every key starts with 'module.'), which a plain "
                f"model cannot load: save self.model.module.state_dict(), the model inside DDP{where}"]
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        return [f"{name} does not load into a fresh model: {str(error).splitlines()[0]}"]
    return []


def pass_epoch(row, samples):
    """The epoch a pass trained: its sampler's (set_epoch's); when that stayed put over its attempt's passes (set_epoch
    never called), its number among them, which is the epoch in a job that never restarted (None after a restart:
    nothing tells)."""
    if row["epoch"] is None:
        return row["number"]
    if sum(other["rank"] == row["rank"] and other["restart"] == row["restart"] and other["epoch"] == row["epoch"]
           for other in samples) == 1:
        return row["epoch"]
    return row["number"] if row["restart"] == 0 else None


def loss_problems(output, epochs, samples):
    losses = epoch_losses(output)
    missing = [epoch for epoch in range(epochs) if epoch not in losses]
    if missing:
        return [f"no line reported epoch {listed(missing)}: after each epoch rank 0 prints "
                "`[rank 0/2 | cpu] epoch K | steps S | loss L | ...`"]
    if not losses[epochs - 1] < 0.5 * losses[0]:
        return [f"the model did not learn: the loss went from {losses[0]} (epoch 0) to {losses[epochs - 1]} "
                f"(epoch {epochs - 1})"]
    for epoch, printed in sorted(losses.items()):  # the last attempt's record of each epoch, rank by rank
        own = {row["rank"]: row for row in samples if pass_epoch(row, samples) == epoch}
        if len(own) < 2 or any(row.get("loss") is None for row in own.values()):
            continue
        weights = {rank: len(row["indices"]) for rank, row in own.items()}
        mean = sum(own[rank]["loss"] * weights[rank] for rank in own) / sum(weights.values())
        if abs(printed - mean) <= LOSS_TOLERANCE:
            continue
        rank, nearest = min(((rank, row["loss"]) for rank, row in own.items()), key=lambda item: abs(item[1] - printed))
        whose = (f"rank {rank}'s own loss ({nearest:.4f})" if abs(nearest - printed) <= LOSS_TOLERANCE
                 else "neither the mean nor any one rank's loss")
        return [f"epoch {epoch}'s printed loss {printed:.4f} is {whose}, not the mean over the ranks ({mean:.4f}): "
                "before rank 0 prints, sum the [loss sum, samples] totals of every rank with dist.all_reduce(totals) "
                "(on every rank), then divide"]
    return []


def training_problems(job, workdir, epochs, script, multinode=False, snapshots=False):
    """Everything a correct data-parallel run shows, whatever the launcher. What the records show names a mistake
    better than the crash it may cause: a crash is shown only when the records explain nothing."""
    if job.timed_out:
        return exit_problems(job, script)
    trained = process_problems(job.samples)
    if trained and not job.ok:
        return exit_problems(job, script)
    if trained:
        return trained
    problems = (ddp_problems(job.samples) or divergence_problems(job.samples, script)) + shard_problems(job.samples)
    saves = job.records("saves.jsonl")
    problems += order_problems(job.samples) + writer_problems(saves, script, multinode)
    problems += checkpoint_problems(job, workdir, script)
    problems += barrier_problems(job.records("begins.jsonl"), saves, script) if snapshots else []
    if not job.ok:
        return problems or exit_problems(job, script)
    return problems + loss_problems(job.output, epochs, job.samples) + teardown_problems(job.records("exits.jsonl"))


def check_ddp(script, workdir, say):
    """Exercise 1: `python SCRIPT 3 1 --world_size 2` trains 2 DDP ranks on disjoint, reshuffled shards."""
    epochs = 3
    cmd = [PYTHON, script, epochs, 1, "--world_size", WORLD_SIZE, "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}")
    job = launch([cmd], [workdir], workdir / "records", timeout=90)
    return training_problems(job, workdir, epochs, script)


def check_resume(script, workdir, say):
    """Exercise 2: under torchrun --max_restarts=2, rank 1 is killed as it begins epoch 2; the job must resume
    at epoch 2 (no epoch lost, none repeated) and finish."""
    epochs = 4
    # two restarts allowed, so one that fails for reasons of its own (a slow start on a busy machine) is retried
    cmd = [*torchrun(script, epochs, 1, nproc=WORLD_SIZE, launcher_args=["--max_restarts=2"]),
           "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}")
    say(f"         and killing rank 1 (SIGKILL) as it begins epoch {KILLED_EPOCH}; every save takes {SLOW_SAVE_S} s "
        "longer (a slow disk)")
    job = launch([cmd], [workdir], workdir / "records", timeout=120, kill_at=(0, 1, KILLED_EPOCH),
                 slow_save=SLOW_SAVE_S)
    restarted = [row for row in job.samples if row["restart"] >= 1 and row["rank"] == 0]
    if not job.timed_out and not restarted and not any(row["restart"] == 0 and row["number"] >= KILLED_EPOCH - 1
                                                  for row in job.samples):
        return exit_problems(job, script) or [f"the job ended before epoch {KILLED_EPOCH}, so it was never killed"]
    problems = training_problems(job, workdir, epochs, script, snapshots=True)
    if not job.ok:
        return problems
    # without a barrier, the kill can land before the last snapshot is on disk: resuming an epoch early is then right
    no_barrier = any("barrier()" in problem for problem in problems)
    return problems + restart_problems(job.samples, epochs, no_barrier)


def check_two_nodes(script, workdir, say):
    """Exercise 3: two torchrun "nodes" on this machine. Sharing one directory they train with one writer;
    each in its own directory (a disk of its own) with the snapshot on node 0's only, they must not train
    out of step: stop with an error, or resume every rank from the same epoch."""
    epochs, endpoint = 3, f"127.0.0.1:{free_port()}"
    cmd = [*torchrun_node(script, epochs, 1, endpoint=endpoint, run_id="check"), "--timeout", COLLECTIVE_TIMEOUT_S]
    shared = workdir / "shared"
    shared.mkdir()
    say(f"running: {shown(cmd)}   (twice: 2 nodes sharing one directory; every save takes {SLOW_SAVE_S} s longer)")
    job = launch([cmd, cmd], [shared, shared], workdir / "records-shared", timeout=120,
                 slow_save=SLOW_SAVE_S)
    problems = training_problems(job, shared, epochs, script, multinode=True, snapshots=True)
    snapshot = last_saved(job.writes, shared)
    if problems or snapshot is None:
        return problems
    nodes = [workdir / "node0", workdir / "node1"]
    for node in nodes:
        node.mkdir()
    shutil.copy(snapshot, nodes[0] / snapshot.name)
    more_epochs, endpoint = epochs + 2, f"127.0.0.1:{free_port()}"
    cmd = [*torchrun_node(script, more_epochs, 1, endpoint=endpoint, run_id="check"), "--timeout", 30]
    say(f"running it again for {more_epochs} epochs, each node in its own directory; only node 0's has "
        f"{snapshot.name}")
    job = launch([cmd, cmd], nodes, workdir / "records-apart", timeout=90)
    first_epoch = {rank: min(row["number"] if row["epoch"] is None else row["epoch"]
                             for row in job.samples if row["rank"] == rank) for rank in ranks_of(job.samples)}
    if len(set(first_epoch.values())) > 1:
        starts = "; ".join(f"rank {rank} began at epoch {epoch}" for rank, epoch in first_epoch.items())
        ended = ("it hung until stopped" if job.timed_out else "it finished as if all was well" if job.codes == [0, 0]
                 else "it crashed once their collectives no longer matched")
        return [f"the nodes trained out of step: {starts} (each node read its own disk), and {ended}. Before "
                "training, check that every rank resumes from the same epoch (all_reduce it) and stop with an "
                "error that says to put --snapshot_path on storage every node shares"]
    if first_epoch:
        return exit_problems(job, script)  # every rank resumed from the same epoch (e.g. rank 0's snapshot was shared)
    if job.timed_out:
        return [f"it hung for {job.limit} s instead of stopping with an error when the nodes' snapshots differ"]
    if job.codes == [0, 0]:
        return ["it exited 0 without training when the nodes' snapshots differ: stop with an error instead"]
    errors = [line for line in job.output.splitlines() if line.startswith("error")]
    if not errors:  # it stopped, but not on purpose: a crash is no refusal
        return exit_problems(job, script)
    say(f"it refused to train out of step, with: {errors[0]}")
    return []


# --- exercise 4: gradient accumulation (self-contained: its own job, records and reference) --------------------------

ACCUM_K, ACCUM_BATCH, ACCUM_EPOCHS = 2, 4, 2  # micro-batches per step, micro-batch per rank, epochs
ACCUM_TEXT_CHARS = 4600  # a short excerpt of the help pages: 64 training blocks, so 4 optimizer steps an epoch


def accumulation_reference(text):
    """What a correct run's first optimizer step and schedule look like, computed here in one process without DDP
    (dropout 0): the norm of the mean gradient over the step's 2 x K x b samples (the first 2Kb of the sampler's
    epoch-0 order: rank r trains on positions r, r+2, ...), the peak learning rate and the optimizer steps of an
    epoch."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    workload = make_workload("gpt-cpu", text=str(text), dropout=0)
    per_step = WORLD_SIZE * ACCUM_K * ACCUM_BATCH
    sampler = DistributedSampler(workload.train_set, num_replicas=1, rank=0)
    source, targets = next(iter(DataLoader(workload.train_set, batch_size=per_step, sampler=sampler)))
    workload.loss_fn(workload.model(source), targets).backward()
    norm = torch.cat([p.grad.flatten() for p in workload.model.parameters()]).double().norm().item()
    # Each rank's micro-batches in an epoch, as the step's DataLoader deals them (the sampler pads the data to a
    # multiple of the ranks, the last micro-batch may be short); the last optimizer step takes what is left of them.
    micro_batches = len(DataLoader(workload.train_set, batch_size=ACCUM_BATCH,
                                   sampler=DistributedSampler(workload.train_set, num_replicas=WORLD_SIZE, rank=0)))
    steps_per_epoch = -(-micro_batches // ACCUM_K)
    return norm, workload.optimizer.param_groups[0]["lr"], steps_per_epoch


def accumulation_problems(steps, reference):
    """What the recorded optimizer steps of rank 0 say about the accumulation: their number, the all-reduce rounds
    each took, the size of the first one's gradient, and the learning rate each used. With the right number of steps,
    the communication (or, when that is right, the gradient's size) and the schedule are judged apart: a script can
    get both wrong."""
    from utils.loop import WarmupCosine

    norm, peak_lr, steps_per_epoch = reference
    expected_steps, K = ACCUM_EPOCHS * steps_per_epoch, ACCUM_K
    if not steps:
        return ["no optimizer step was taken (or the model was not wrapped in DDP)"]
    if len(steps) != expected_steps:
        return [f"rank 0 took {len(steps)} optimizer steps in {ACCUM_EPOCHS} epochs, expected {expected_steps}: "
                f"with --grad_accum {K}, step the optimizer once per {K} micro-batches (when `last` is True), "
                "not after every micro-batch"]
    problems = []
    rounds = sorted({step["rounds"] for step in steps})
    ratio = steps[0]["grad_norms"][0] / norm
    # With a round per micro-batch, the first round's gradient is not the step's: its size says nothing then.
    if rounds != [1]:
        problems.append(f"DDP all-reduced the gradients {listed(rounds)} time(s) per optimizer step, once per "
                        f"micro-batch: with --grad_accum {K} that is {K}x the communication. Run all but the last "
                        "micro-batch inside `with self.model.no_sync():`, the forward too (DDP decides in forward "
                        "whether backward syncs)")
    elif abs(ratio - K) < 0.01 * K:
        problems.append(f"the gradient of an optimizer step is {ratio:.2f}x the mean over its micro-batches: the K={K} "
                        "micro-batches' gradients add up, so divide each micro-batch's loss by K (by `micro_batches`) "
                        "before backward")
    elif abs(ratio - 1) > 0.01:
        problems.append(f"the gradient of the first optimizer step is {ratio:.2f}x the mean over its {K} "
                        f"micro-batches on {WORLD_SIZE} ranks, expected 1x: each step must average exactly those "
                        "samples")
    factor = WarmupCosine(expected_steps)
    for number, step in enumerate(steps):
        expected = peak_lr * factor(number)
        if abs(step["lr"] - expected) > 1e-6 * peak_lr:
            problems.append(f"optimizer step {number} used learning rate {step['lr']:.3g}, expected {expected:.3g}: "
                            "the warm-up + cosine schedule counts optimizer steps, so call scheduler.step() once per "
                            "optimizer step (after the last micro-batch), not once per micro-batch")
            break
    return problems


def check_grad_accum(script, workdir, say):
    """Exercise 4: 2 ranks, --grad_accum 2, dropout 0, on a short text; every optimizer step recorded (its learning
    rate, and the gradient all-reduces DDP ran for it)."""
    from utils.gpt import help_pages

    text = workdir / "text.txt"
    text.write_text(help_pages()[:ACCUM_TEXT_CHARS])
    cmd = [*torchrun(script, ACCUM_EPOCHS, ACCUM_EPOCHS, nproc=WORLD_SIZE), "--workload", "gpt-cpu", "--batch_size",
           ACCUM_BATCH, "--grad_accum", ACCUM_K, "--timeout", COLLECTIVE_TIMEOUT_S, "--text", text, "--dropout", 0]
    say(f"running: {shown(cmd)}   ({ACCUM_TEXT_CHARS:,} characters of Python's help pages)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record_steps=True, timeout=120, check=False)
    problems = exit_problems(job)
    if problems:
        return problems
    return accumulation_problems([step for step in job.steps if step["rank"] == 0], accumulation_reference(text))


# --- exercise 5: 2D parallelism, dp 2 x tp 2 (self-contained: its own job, records and reference) -------------------

TP_NPROC, TP_SIZE, TP_BATCH, TP_EPOCHS = 4, 2, 4, 2  # processes, --tp, batch per dp rank, epochs
TP_TEXT_CHARS = 4600  # a short excerpt of the help pages: 64 training blocks, 8 optimizer steps an epoch


def two_d_reference(text):
    """{epoch: mean loss} of one process training the GPT (dropout 0) as tensor_parallel.py's loop does (AdamW, no
    schedule) with the global batch of the 2 dp ranks, over the samples in their order: what a correct run computes."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    workload = make_workload("gpt-cpu", text=str(text), dropout=0)
    sampler = DistributedSampler(workload.train_set, num_replicas=1, rank=0)
    loader = DataLoader(workload.train_set, batch_size=TP_BATCH * TP_NPROC // TP_SIZE, sampler=sampler)
    losses = {}
    for epoch in range(TP_EPOCHS):
        sampler.set_epoch(epoch)
        summed = 0.0
        for source, targets in loader:
            workload.optimizer.zero_grad(set_to_none=True)
            loss = workload.loss_fn(workload.model(source), targets)
            loss.backward()
            workload.optimizer.step()
            summed += loss.item() * len(source)
        losses[epoch] = summed / len(sampler)
    return losses, len(workload.train_set)


def two_d_problems(samples, reference):
    """The ranks of a tp group (the same "dp" coordinate of the mesh) must train on the same batches, the dp groups on
    disjoint parts that cover the data; then each epoch's loss must be what one process computes."""
    losses, dataset_size = reference
    if not samples:
        return ["it never trained: no process iterated over a DataLoader"]
    if any(row.get("mesh") is None for row in samples):
        return ['no rank made a named device mesh: init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", '
                '"tp")) gives every rank its place in the dp x tp grid']
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        epoch = f"epoch {number}" + (f" after restart {restart}" if restart else "")
        groups = {}
        for rank, row in sorted(rows.items()):
            groups.setdefault(row["mesh"]["dp"], []).append(row)
        for dp, (first, *others) in sorted(groups.items()):
            for other in (other for other in others if other["indices"] != first["indices"]):
                share = len(first["indices"])
                split = (f"each rank trained on its own 1/{TP_NPROC} of the data ({share} of {dataset_size} "
                         f"samples), as a DistributedSampler over all {TP_NPROC} ranks (the global rank) deals it. "
                         if share * TP_NPROC <= dataset_size + TP_NPROC else "")
                return [f"ranks {first['rank']} and {other['rank']} form a tp group (dp {dp}: they compute one model "
                        f"together, each with 1/{len(others) + 1} of every block's heads) but trained on different "
                        f"samples in {epoch}, so every step added up two batches' activations: {split}Give the "
                        "sampler the dp group's size and rank: DistributedSampler(dataset, "
                        "num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank()), so the ranks of a tp group "
                        "get the same batches"]
        shares = {dp: set(members[0]["indices"]) for dp, members in groups.items()}
        for (dp_a, a), (dp_b, b) in itertools.combinations(sorted(shares.items()), 2):
            if len(a & b) > len(shares):  # DistributedSampler pads by < dp samples to even out the shards
                return [f"the dp groups {dp_a} and {dp_b} trained on the same samples in {epoch} ({len(a & b)} of "
                        f"{len(a)}): each dp rank must get its own 1/{len(shares)} of the data: "
                        "DistributedSampler(dataset, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank())"]
        unseen = dataset_size - len(set().union(*shares.values()))
        if unseen > 0:
            return [f"no rank trained on {unseen} of the {dataset_size} samples in {epoch}: together the dp groups "
                    "must cover the whole dataset"]
    return mean_loss_problems(samples, losses, "on the same samples",
                              " (the tensor-parallel plan, or the way the data reaches the ranks)")


def mean_loss_problems(samples, reference, how, why=""):
    """Each epoch's loss averaged over the ranks (each holds as much of the batch) against one process's, `how` it
    trains (`reference`: {epoch: loss})."""
    for epoch, expected in reference.items():
        own = [row["loss"] for row in samples if row["epoch"] == epoch and row.get("loss") is not None]
        if own and abs(sum(own) / len(own) - expected) > LOSS_TOLERANCE:
            return [f"epoch {epoch}'s loss, averaged over the ranks, is {sum(own) / len(own):.4f}, but one process "
                    f"training {how} computes {expected:.4f}: the ranks do not compute what the model computes{why}"]
    return []


def check_two_d(script, workdir, say):
    """Exercise 5: 4 ranks, --tp 2 (dp 2 x tp 2), dropout 0, on a short text; the samples each rank trained on and
    their losses recorded."""
    from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages

    text = workdir / "text.txt"
    text.write_text(help_pages()[:TP_TEXT_CHARS])
    cmd = [*torchrun(script, TP_EPOCHS, TP_EPOCHS, nproc=TP_NPROC), "--tp", TP_SIZE, "--workload", "gpt-cpu",
           "--batch_size", TP_BATCH, "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}   (dp 2 x tp 2, dropout 0, on {TP_TEXT_CHARS:,} characters of Python's help pages)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, timeout=180, check=False,
              env={TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0})
    problems = two_d_problems(job.samples, two_d_reference(text)) if job.samples else []
    return problems or exit_problems(job, script)


CP_NPROC, CP_CONTEXT, CP_BATCH, CP_EPOCHS = 2, 64, 8, 2  # processes (one cp group), tokens, sequences a step, epochs
CP_TEXT_CHARS = 4600  # a short excerpt of the help pages: 64 training sequences, 8 optimizer steps an epoch
BALANCE_TOLERANCE = 1.01  # the most one rank's attention scores may exceed another's


def context_reference(text):
    """{epoch: mean loss} of one process training the GPT (dropout 0, context CP_CONTEXT) on whole sequences as
    context_parallel.py's loop does, over the samples in their order: what the cp group computes together when it
    splits every sequence right."""
    from harness.one_process import train_gpt

    return train_gpt(text, CP_BATCH, CP_EPOCHS, context=CP_CONTEXT)["losses"]


def context_problems(samples, reference, context=CP_CONTEXT):
    """A cp group's ranks must hold every position of a sequence once between them; each epoch's loss, averaged over
    the ranks (each holds as many tokens), must be what one process computes on whole sequences; and the causal
    attention's work must fall evenly on the ranks (the query-key scores each rank's ring computed)."""
    if not samples:
        return ["it never trained: no process iterated over a DataLoader"]
    if any(row.get("context") is None for row in samples):
        return ["no rank trained on a part of each sequence: train inside split_sequence(...) (utils/context.py), "
                "which gives the model a rank's chunks, and feed it source[:, positions]"]
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        epoch = f"epoch {number}" + (f" after restart {restart}" if restart else "")
        held = {rank: row["context"]["positions"] for rank, row in sorted(rows.items())}
        seen = [position for positions in held.values() for position in positions]
        twice = sorted({position for position in seen if seen.count(position) > 1})
        never = sorted(set(range(context)) - set(seen))
        if twice or never:
            what = (f"positions {twice[0]} to {twice[-1]} are held by more than one rank" if twice else
                    f"positions {never[0]} to {never[-1]} by none")
            return [f"in {epoch} the ranks' chunks do not cut the sequence of {context} tokens into parts: {what}. "
                    "Every chunk of the 2 x cp must be held by exactly one rank of the cp group"]
    wrong = mean_loss_problems(samples, reference, "on whole sequences")
    if wrong:
        return wrong
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        scores = {rank: row["context"]["scores"] for rank, row in sorted(rows.items())}
        most, least = max(scores, key=scores.get), min(scores, key=scores.get)
        if not scores[least]:
            return [f"rank {least}'s attention computed nothing by the ring in epoch {number}: the check runs "
                    "--exchange ring, and each rank's queries must meet the keys of every chunk before theirs there"]
        if scores[most] > BALANCE_TOLERANCE * scores[least]:
            return [f"rank {most} computed {scores[most] / scores[least]:.2f} times the attention scores rank {least} "
                    f"did in epoch {number} ({scores[most]:,} against {scores[least]:,} per head and sequence, "
                    "forward and backward), and "
                    "every rank waits for the slowest at each step: under the causal mask a query sees the keys "
                    "before it, so the rank holding the end of the sequence does the most. Give each rank an early "
                    "chunk and a late one: of 2 x cp chunks, rank r holds chunks r and 2cp-1-r"]
    return []


def check_context(script, workdir, say):
    """Exercise 6: 2 ranks, --cp 2, the ring, dropout 0, context 64, on a short text; the positions each rank trained
    on, the attention scores its ring computed, and its losses recorded."""
    from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages

    text = workdir / "text.txt"
    text.write_text(help_pages()[:CP_TEXT_CHARS])
    cmd = [*torchrun(script, CP_EPOCHS, CP_EPOCHS, nproc=CP_NPROC), "--cp", CP_NPROC, "--workload", "gpt-cpu",
           "--context", CP_CONTEXT, "--batch_size", CP_BATCH, "--exchange", "ring", "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}   (one cp group of 2, dropout 0, on {CP_TEXT_CHARS:,} characters of Python's help "
        "pages)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, timeout=180, check=False,
              env={TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0})
    problems = context_problems(job.samples, context_reference(text)) if job.samples else []
    return problems or exit_problems(job, script)


def exercise_checker(number):
    """Exercise `number`'s checker: the module check.py in its folder, which has a function check(script, workdir, say).
    (A folder whose name begins with digits is no name an import statement takes: it is imported by its dotted name.)"""
    return importlib.import_module(f"exercises.{EXERCISES[number]}.check")


def inside(number):
    """Exercise `number`'s checker, from check.py in its folder (imported when it runs: each brings its own reference
    and records)."""
    def check_inside(script, workdir, say):
        return exercise_checker(number).check(script, workdir, say)
    return check_inside


CHECKS = {1: check_ddp, 2: check_resume, 3: check_two_nodes, 4: check_grad_accum, 5: check_two_d, 6: check_context,
          **{number: inside(number) for number in INSIDE}}


def check(number, script, workdir, say=lambda line: None):
    """Run exercise `number`'s checks on `script` in the empty directory `workdir`; return the problems found."""
    with one_thread():
        return CHECKS[number](Path(script).resolve(), Path(workdir), say)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercise", type=int, choices=sorted(EXERCISES), help="Which exercise")
    parser.add_argument("script", type=Path, help="Your script")
    args = parser.parse_args()
    if not args.script.is_file():
        sys.exit(f"error: {args.script} is not a file")
    print(f"Exercise {args.exercise}: checking {args.script}")
    with tempfile.TemporaryDirectory(prefix="exercise-") as workdir:
        problems = check(args.exercise, args.script, workdir, say=lambda line: print(f"  {line}"))
    for problem in problems:
        print(f"  ✗ {problem}")
    if problems:
        sys.exit(f"{len(problems)} problem(s). Hints: exercises/{EXERCISES[args.exercise]}/hints.md")
    kind = "step" if args.exercise not in INSIDE else "solution"
    print(f"  ✓ all checks passed. Compare with the repository's {kind}: {SOLUTIONS[args.exercise]}")


if __name__ == "__main__":
    main()
