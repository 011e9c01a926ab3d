"""What the step scripts print, as patterns: the one place that knows the shape of their lines.

Every step tags its lines with where they come from: `[cpu]` or `[cuda]` in step 1, `[rank 0/2 | cpu]` from step 2
on, `[rank 1/4 | local 1 | cuda:1]` once there are several nodes, `[group 1 | rank 0/2 | cpu]` in step 13's replica
groups. The parsers below read a job's whole output.
"""
import re

from utils.memory import COLUMNS

TAG = (r"\[(?:group (?P<group>\d+) \| )?"
       r"(?:rank (?P<rank>\d+)/(?P<world_size>\d+) \| (?:local (?P<local_rank>\d+) \| )?)?"
       r"(?P<device>cpu|cuda(?::\d+)?)\]")
EPOCH = re.compile(TAG + r" epoch (?P<epoch>\d+) \| steps (?P<steps>\d+) \| loss (?P<loss>[\d.]+) \| "
                         r"(?P<rate>[\d,]+) (?P<unit>samples|tokens)/s(?: \| MFU (?P<mfu>[\d.]+)%)?")
SAVED = re.compile(TAG + r" epoch (?P<epoch>\d+) \| (?P<kind>checkpoint|snapshot) saved to (?P<path>\S+)")
RESUMED = re.compile(TAG + r" resuming from epoch (?P<epoch>\d+), restart (?P<restart>\d+)")
HELD_OUT = re.compile(TAG + r" held-out (?P<samples>\d+) samples \| loss (?P<loss>[\d.]+)"
                            r"(?: \| accuracy (?P<accuracy>[\d.]+))?")
# The long run's lines (long_run.py, step 12): every --log_every steps, a held-out loss, a snapshot, a resume, a skip.
STEP = re.compile(TAG + r" step (?P<step>\d+)/(?P<total>\d+) \| (?P<tokens>[\d,]+) tokens \| loss (?P<loss>[\d.]+) \| "
                        r"(?P<rate>[\d,]+) tokens/s(?: \| MFU (?P<mfu>[\d.]+)%)? \| (?P<left>[\d.]+) min left")
STEP_HELD_OUT = re.compile(TAG + r" step (?P<step>\d+) \| held-out loss (?P<loss>[\d.]+)")
STEP_SAVED = re.compile(TAG + r" step (?P<step>\d+) \| snapshot saved to (?P<path>\S+)")
STEP_RESUMED = re.compile(TAG + r" resuming from step (?P<step>\d+) at global batch (?P<batch>\d+), restart "
                                r"(?P<restart>\d+)")
# Step 13's lines (fault_tolerant.py): each group's rank 0 prints every step it committed, a step it did not, and the
# step at which it took a healthy group's state.
GROUP_STEP = re.compile(TAG + r" step (?P<step>\d+) \| participants (?P<participants>\d+) \| "
                              r"loss (?P<loss>[\d.]+) \| weights (?P<weights>[0-9a-f]{8})")
NOT_COMMITTED = re.compile(TAG + r" step (?P<step>\d+) not committed")
HEALED = re.compile(TAG + r" healed at step (?P<step>\d+) from a healthy group")
SKIPPING = re.compile(r"skipping global batches (?P<first>\d+) to (?P<last>\d+) \(--skip (?P<begin>\d+):(?P<end>\d+)\)")
# gpt.py's generated text: a header line, then the sample's lines, each indented by "  | "
SAMPLE = re.compile(TAG + r" sample after (?P<steps>\d+) optimizer steps:\n(?P<text>(?:  \| .*(?:\n|$))*)")
ERROR = re.compile(r"^error: .*$", re.M)  # the one line a step prints when it stops on bad input or a fault
# What launchers, gloo and the C++ layer print around the steps' own lines. By how a line starts: torchrun's log
# records ([W1122 12:00:00...]), the rank-prefixed traceback of a worker that failed ([rank1]: ...), a traceback's
# first line, C++ stack frames, indented lines (but not the "  | " lines of gpt.py's sample), empty lines. By what it
# says: gloo's errors (a peer that vanished mid-collective), torchrun's summary of the workers that failed.
LAUNCHER_NOISE = re.compile(r"^(?:\[?[WEI]\d{4} |\[rank\d+\]:|Traceback \(|frame #|Exception raised from|"
                            r"\s(?! \| )|$)|/gloo/|gloo::|GLHF|Connection (?:reset|closed)|ChildFailedError|"
                            r"torch\.distributed\.elastic|ProcessRaisedException|process \d+ terminated|DistBackendError")


def epoch_losses(output):
    """{epoch: loss} from the epoch lines (an epoch reported twice, before and after a restart: the last wins)."""
    return {int(match["epoch"]): float(match["loss"]) for match in EPOCH.finditer(output)}


def step_lines(output):
    """{step: {"loss", "tokens", "rate"}} from the long run's lines (a step reported twice, before and after a restart:
    the last wins)."""
    return {int(match["step"]): dict(loss=float(match["loss"]), tokens=int(match["tokens"].replace(",", "")),
                                     rate=float(match["rate"].replace(",", ""))) for match in STEP.finditer(output)}


def group_steps(output):
    """{group: {step: {"participants", "loss", "weights"}}} from step 13's lines (a step a group printed twice, before
    and after a restart: the last wins)."""
    steps = {}
    for match in GROUP_STEP.finditer(output):
        steps.setdefault(int(match["group"]), {})[int(match["step"])] = dict(
            participants=int(match["participants"]), loss=float(match["loss"]), weights=match["weights"])
    return steps


def held_out_losses(output):
    """[(step, loss), ...]: every held-out loss the long run printed, in order."""
    return [(int(match["step"]), float(match["loss"])) for match in STEP_HELD_OUT.finditer(output)]


def step_resumes(output):
    """{restart: (step, global batch)}: where rank 0 of the long run resumed in each attempt that found a snapshot."""
    return {int(match["restart"]): (int(match["step"]), int(match["batch"])) for match in STEP_RESUMED.finditer(output)
            if match["rank"] in (None, "0")}


def resumes(output):
    """{restart: epoch}: where rank 0 resumed in each attempt that found a snapshot."""
    return {int(match["restart"]): int(match["epoch"]) for match in RESUMED.finditer(output)
            if match["rank"] in (None, "0")}


def held_out(output):
    """The held-out line's figures, {"samples": ..., "loss": ..., "accuracy": ... or None}, or None."""
    match = HELD_OUT.search(output)
    if match is None:
        return None
    return dict(samples=int(match["samples"]), loss=float(match["loss"]),
                accuracy=None if match["accuracy"] is None else float(match["accuracy"]))


def samples(output):
    """[(optimizer steps, text), ...]: the samples gpt.py printed, in order (the "  | " indents taken off)."""
    return [(int(match["steps"]), "\n".join(line[4:] for line in match["text"].rstrip("\n").split("\n")))
            for match in SAMPLE.finditer(output)]


def words_of(text, letters=3):
    """The words of `text` of at least `letters` letters (runs of ASCII letters), in order."""
    return re.findall(rf"[A-Za-z]{{{letters},}}", text)


def known_words(sample, text, letters=3):
    """The part of a sample's words (of `letters`+ letters) that are words of `text`: how much of what the model
    writes is real words of what it learned (0 for random characters; around a half for a model that has begun to
    spell). None when the sample holds no such word."""
    written, vocabulary = words_of(sample, letters), set(words_of(text, letters))
    return sum(word in vocabulary for word in written) / len(written) if written else None


def throughputs(output):
    """{epoch: (rate, unit, MFU in % or None)} from the epoch lines (the last report of an epoch wins)."""
    return {int(match["epoch"]): (float(match["rate"].replace(",", "")), match["unit"],
                                  None if match["mfu"] is None else float(match["mfu"]))
            for match in EPOCH.finditer(output)}


def errors(output):
    """The `error: ...` lines, in order."""
    return ERROR.findall(output)


def noise(line):
    """True for a line a launcher, gloo or the C++ layer printed (LAUNCHER_NOISE), not the script itself."""
    return LAUNCHER_NOISE.search(line) is not None


def own_lines(output):
    """The steps' own lines, without the launchers' logging and the workers' tracebacks."""
    return [line for line in output.splitlines() if not noise(line)]


def memory_tables(output):
    """{stage: [row, ...]} from the tables `fsdp.py --verbose` prints (utils/memory.py); each row a dict keyed by
    the table's columns, the MiB figures as floats (None where the table says n/a)."""
    row = re.compile(r"^ +(\d+) +(\d+) +(\S+) +(\S+)" + r" +([\d.]+|n/a)" * (len(COLUMNS) - 4) + r"$", re.M)
    tables = {}
    for block in re.split(r"^memory ", output, flags=re.M)[1:]:
        stage = block.split(" (state:", 1)[0]
        tables[stage] = [dict(zip(COLUMNS, [int(values[0]), int(values[1]), values[2], values[3]] +
                                  [None if value == "n/a" else float(value) for value in values[4:]]))
                         for values in row.findall(block)]
    return tables


def slices(output):
    """The rows of the table `tensor_parallel.py --verbose` prints (utils/memory.py: log_slices), each a dict: rank,
    dp, tp (its place in the mesh), matrix (its name in the block), full, tp_slice, stored (shapes, as tuples), KiB."""
    shape = r"(\d+x\d+)"
    row = re.compile(rf"^ +(\d+) +(\d+) +(\d+)  (\S+) +{shape} +{shape} +{shape} +([\d.]+)$", re.M)
    table = output.split("\nslices: ", 1)[1] if "\nslices: " in output else ""

    def dims(text):
        return tuple(map(int, text.split("x")))

    return [dict(rank=int(r[0]), dp=int(r[1]), tp=int(r[2]), matrix=r[3], full=dims(r[4]), tp_slice=dims(r[5]),
                 stored=dims(r[6]), KiB=float(r[7])) for r in row.findall(table)]


class Narrator:
    """An echo for Job.wait_for and Job.wait: a running job's lines as a learner wants to follow them. The steps' own
    lines as they are (a worker whose peer vanished mid-collective says so in one of them), torchrun's log records as
    `torchrun: <message>`, and what torch prefixes with a rank (an error of no known cause's traceback, a library's
    log record) counted instead of shown."""

    def __init__(self, indent="   "):
        self.indent, self.hidden = indent, 0

    def __call__(self, line, node=0):
        if re.match(r"\[rank\d+\]:", line):  # torch prefixes an uncaught exception's lines with the rank
            self.hidden += 1
            return
        if self.hidden:
            print(f"{self.indent}({self.hidden} lines a worker's torch printed, prefixed with its rank)")
            self.hidden = 0
        notice = re.match(r"[WEI]\d{4} [\d:.]+ \d+ \S+\] (.*)", line)  # torchrun's log records
        if notice:
            print(f"{self.indent}torchrun: {notice[1]}")
        elif line.strip():
            print(f"{self.indent}{line}")
