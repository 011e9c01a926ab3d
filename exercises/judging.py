"""What the exercises' checkers share (each exercise's own is check.py in its folder): the learner's lines as their
editor shows them, a job's end (a hang, a crash) said in the learner's terms, without what gloo and torchrun print
around it, and the verdicts of more than one exercise: what every data-parallel run shows (exercises 1-3), and an
epoch's loss against one process's (5 and 6).

Each *_problems function returns a list of sentences, empty when all is well. Those that judge records take the rows
themselves (job.samples, job.records(...)): tests/test_exercises.py gives them rows it makes up."""
import contextlib
import importlib.util
import itertools
import linecache
import re
from pathlib import Path

import torch

from harness.jobs import saved_name
from harness.jobs.output import epoch_losses, noise
from utils import make_workload

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 60  # passed as --timeout: a stuck collective fails instead of hanging forever (slow starts pass)
# How long a check of the track inside the machinery (7-12) lets its jobs run before it stops them. A rank stuck in a
# collective ends by itself after its --timeout; this bounds the rest (a loop that never ends), and leaves a busy
# machine room: a job of 2 ranks needs about 15 s of CPU (torch's import, mostly), which two cores shared by 16
# runnable processes give it in 2 minutes.
JOB_LIMIT_S = 300
LOSS_TOLERANCE = 1e-4  # the epoch line prints 4 decimals: a printed loss within this of a value is that value
SLOW_SAVE_S = 0.5  # exercises 2 and 3 make every save this much slower (a slow disk): a rank that runs ahead shows,
# even on a busy machine that delays it for a moment


def ranks_of(rows):
    return sorted({row["rank"] for row in rows}, key=str)


def listed(numbers):
    numbers = [str(n) for n in numbers]
    return " and ".join(numbers) if len(numbers) < 3 else ", ".join(numbers[:-1]) + " and " + numbers[-1]


def line_of(script, number, function):
    """`line N (in function: `code`)`, the learner's own line, as their editor shows it."""
    code = linecache.getline(str(script), number).split("  #")[0].strip()  # the code, without its comment
    return f"line {number} (in {function}: `{code}`)" if code else f"line {number} (in {function})"


def lines_in(stack, script, innermost=2):
    """The `innermost` frames of a recorded stack that are the learner's script's, innermost first."""
    mine = [frame for frame in stack or () if Path(frame[0]) == Path(script)]
    return [line_of(script, number, function) for _, number, function in reversed(mine[-innermost:])]


def traceback_line(output, script, before=None):
    """The learner's line a traceback in `output` ends in (before position `before`), or None."""
    found = list(re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', output[:before]))
    mine = [match for match in found if Path(match[1]) == Path(script)]
    return line_of(script, int(mine[-1][2]), mine[-1][3]) if mine else None


# Crashes a learner's mistake causes, by the error they raise: (pattern, what to say; {where} is the learner's line)
KNOWN_CRASHES = [
    (r"sampler option is mutually exclusive with shuffle",
     "the DataLoader was given shuffle=True and a DistributedSampler ({where}): the sampler does the shuffling (a new "
     "order every epoch, from set_epoch, the same on every rank), so the DataLoader must not: pass shuffle=False"),
]


def exit_problems(job, script=None):
    if job.timed_out:
        return [f"it did not finish within {job.limit} s and was stopped: a rank is probably waiting in a "
                "collective (init_process_group, all_reduce, barrier) that another rank never reaches, such as a "
                "barrier inside `if rank == 0:`, or ranks that run a different number of epochs"]
    failed = [code for code in job.codes if code != 0]
    if not failed:
        return []
    output = job.output
    for pattern, verdict in KNOWN_CRASHES:
        match = re.search(pattern, output)
        if match:
            return [verdict.format(where=traceback_line(output, script, match.start()) or "see its traceback")]
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in output.strip().splitlines()]
    # what gloo and torchrun print around the learner's own error (a peer that vanished mid-collective, the launcher's
    # summary of failed workers) is left out
    errors = [line for line in lines if re.match(r"(error: |\w+(Error|Exception)\b)", line) and not noise(line)]
    errors = list(dict.fromkeys(errors))  # every rank, every restart says the same: once is enough
    first = output.find(errors[0]) if errors else None  # the learner's line its traceback ends in
    where = traceback_line(output, script, first) if script else None
    errors = errors[:4] or [line for line in lines if not noise(line)][-8:]
    shown_lines = "\n".join("      " + line for line in errors)
    return [f"it exited with code {failed[0]}" + (f", at {where}" if where else "") +
            f"; what it printed about that:\n{shown_lines}"]


def script_module(path, name):
    """A script loaded as a module named `name`, its main() not run (it runs under `if __name__ == "__main__":`): an
    exercise's model, data and optimizer, as its solution (or the learner's copy, or start.py) defines them."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def one_thread():
    """torch's work in this process (a reference trained here) on one thread, as the jobs' processes compute: on two
    cores that the jobs and other work share, two threads that wait for each other made a reference of exercise 7
    take 57 s instead of 3 (at load 21), and they sum in another order than the jobs."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --- what every data-parallel run shows (exercises 1-3) ---------------------------------------------------------------

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


# --- an epoch's loss against one process's (exercises 5 and 6) --------------------------------------------------------

def mean_loss_problems(samples, reference, how, why=""):
    """Each epoch's loss averaged over the ranks (each holds as much of the batch) against one process's, `how` it
    trains (`reference`: {epoch: loss})."""
    for epoch, expected in reference.items():
        own = [row["loss"] for row in samples if row["epoch"] == epoch and row.get("loss") is not None]
        if own and abs(sum(own) / len(own) - expected) > LOSS_TOLERANCE:
            return [f"epoch {epoch}'s loss, averaged over the ranks, is {sum(own) / len(own):.4f}, but one process "
                    f"training {how} computes {expected:.4f}: the ranks do not compute what the model computes{why}"]
    return []
