"""What every exercise's checker shares: the learner's lines as their editor shows them, and a job's end (a hang, a
crash) said in the learner's terms, without what gloo and torchrun print around it."""
import contextlib
import importlib.util
import linecache
import re
from pathlib import Path

from harness.jobs.output import noise

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 60  # passed as --timeout: a stuck collective fails instead of hanging forever (slow starts pass)
# How long a check of the track inside the machinery (7-12) lets its jobs run before it stops them. A rank stuck in a
# collective ends by itself after its --timeout; this bounds the rest (a loop that never ends), and leaves a busy
# machine room: a job of 2 ranks needs about 15 s of CPU (torch's import, mostly), which two cores shared by 16
# runnable processes give it in 2 minutes.
JOB_LIMIT_S = 300
LOSS_TOLERANCE = 1e-4  # the epoch line prints 4 decimals: a printed loss within this of a value is that value


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
