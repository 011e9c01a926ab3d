"""Exercise 12's checker: the hang clinic. Two things are judged for each case (branch, heldout, order).

The diagnosis: the learner's DIAGNOSIS names the rank out of step, the collective it called and the line of start.py
that called it. The truth is not written down here: the checker runs the case of start.py, as the repository gives
it, with torch's Flight Recorder on, reads every rank's dump, and finds the first collective at which the ranks
parted: the rank whose call there differs from all the others', what it called, and from which line of start.py.

The fix: the learner's script runs the case on RANKS CPU ranks within --timeout, and rank 0's result must be what the
correct program computes: start.py's own case on one rank, where no collective can be out of step (every collective
of one rank gives back what it was given), computed here, in this process. And a fix makes the ranks agree; it does
not remove what they send each other: every rank of the fixed case (its collectives recorded) sends at least the bytes
the repository's fixed case sends on that rank (solution.py's case, its collectives counted here, rank by rank). A
collective dropped where each rank can recompute the same number (every rank warming up the same weights itself)
gives the right result here and is caught there.
"""
import ast
import json
import math
import pickle
import re
import time
import types
from pathlib import Path

from exercises.judging import JOB_LIMIT_S, exit_problems, listed, script_module
from harness.jobs import REPO, shown, start, torchrun

START = REPO / "exercises/12_hang_clinic/start.py"
SOLUTION = REPO / "exercises/12_hang_clinic/solution.py"
CASES = ("branch", "heldout", "order")
RANKS = 3  # three ranks: at the first collective where they part, the one out of step is the one unlike the others
CASE_TIMEOUT_S = 5  # --timeout: a stuck collective gives up after this, and the run ends
FLIGHT_RECORDER_ENTRIES = 2000  # more than any case calls
RESULT = re.compile(r"case (\w+) \| result (\{.*\})")
GAVE_UP = re.compile(r"^error: rank (\d+): a (?:collective gave up after --timeout|peer is gone)", re.MULTILINE)
TOLERANCE = 1e-4  # the ranks' mean gradient and one rank's whole-set gradient differ by float rounding only
# The truth found for a start.py, by its text: every check in one process (the tests') runs start.py's cases once.
_TRUTHS = {}
WHAT_THE_RESULT_SAYS = {
    "history": "the logged losses (the mean of every rank's loss, every LOG_EVERY steps)",
    "held_out": "the held-out loss (the mean over every held-out sample, each counted once, whatever rank holds it)",
    "weights": "the trained weights' sums (every rank must apply the same mean gradient)",
}


# --- the diagnosis --------------------------------------------------------------------------------------------------

def read_diagnosis(script):
    """The learner's DIAGNOSIS dict, as written in their script (a literal), or None if there is none."""
    for node in ast.parse(Path(script).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "DIAGNOSIS" for target in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def calls_of(dump, script):
    """A rank's collectives in its dump, in the order it issued them: (collective, line of `script` that called it)."""
    calls = []
    for entry in sorted(dump["entries"], key=lambda entry: entry["record_id"]):
        lines = [frame["line"] for frame in entry.get("frames", ()) if Path(frame["filename"]) == Path(script)]
        calls.append((entry["profiling_name"].split(":")[-1], lines[0] if lines else None))
    return calls


def parting(dumps, script):
    """Where the ranks' collectives first differ, from every rank's Flight Recorder dump ({rank: dump}): {"rank",
    "collective", "line", "others"} (others: what the other ranks called there, as (collective, line)), or None when
    every rank issued the same collectives from the same lines."""
    calls = {rank: calls_of(dump, script) for rank, dump in dumps.items()}
    for position in range(max(map(len, calls.values()), default=0)):
        here = {rank: ranks_calls[position] if position < len(ranks_calls) else (None, None)
                for rank, ranks_calls in calls.items()}
        if len(set(here.values())) == 1:
            continue
        alike = {}
        for rank, call in here.items():
            alike.setdefault(call, []).append(rank)
        alone = [ranks[0] for ranks in alike.values() if len(ranks) == 1]
        if len(alone) != 1:
            return None
        rank = alone[0]
        collective, line = here[rank]
        return {"rank": rank, "collective": collective, "line": line,
                "others": sorted({call for other, call in here.items() if other != rank}, key=str),
                "position": position + 1}
    return None


def collective_name(name):
    """A collective as the diagnosis may spell it (`dist.reduce()`, `torch.distributed.all_reduce`, `gloo:reduce`,
    `all-reduce`), as torch names it."""
    name = re.sub(r"^(torch\.distributed\.|dist\.|gloo:)", "", str(name).strip())
    return re.sub(r"\(.*\)$", "", name).strip().replace("-", "_").lower()


def line_number(line):
    """A line as the diagnosis may give it (186, "186", "start.py:186"), as a number; None if it is none."""
    found = re.fullmatch(r"(?:.*:)?\s*(\d+)\s*", str(line))
    return int(found[1]) if found else None


def diagnosis_problems(case, diagnosis, truth):
    """The learner's diagnosis of one case against the truth `parting` found."""
    named = (diagnosis or {}).get(case) or {}
    if any(named.get(key) is None for key in ("rank", "collective", "line")):
        return [f"case {case}: DIAGNOSIS[{case!r}] is not filled in: run the case with the Flight Recorder on "
                "(docs/flight-recorder.md), read every rank's dump, and name the rank out of step, the collective it "
                "called where the others called another, and the line of start.py that called it"]
    if named["rank"] != truth["rank"]:
        return [f"case {case}: the diagnosis names rank {named['rank']}, but that rank called what the others "
                f"called: find the first collective (by its number in each rank's dump) at which one rank differs "
                "from all the others (torchfrtrace names it the culprit, or all the others when it compares "
                "against that rank)"]
    if collective_name(named["collective"]) != truth["collective"]:
        return [f"case {case}: the diagnosis names {named['collective']} as rank {truth['rank']}'s collective, but "
                f"it called another one there (the dump's entry names it, as gloo:NAME)"]
    if line_number(named["line"]) != truth["line"]:
        return [f"case {case}: the diagnosis names line {named['line']}, but rank {truth['rank']}'s "
                f"{truth['collective']} there was called from another line of start.py (the frames of its entry "
                "in the dump: torchfrtrace -v, or the entry's 'frames')"]
    return []


# --- the fix --------------------------------------------------------------------------------------------------------

def result_of(output, case):
    """What rank 0 printed as the case's result, or None."""
    found = [json.loads(match[2]) for match in RESULT.finditer(output) if match[1] == case]
    return found[-1] if found else None


def close(got, expected):
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(close, got, expected))
    return isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


def hang_problems(case, output):
    """A fixed case that still hangs: the ranks that gave up waiting in a collective (the steps' one line each)."""
    ranks = sorted({int(match[1]) for match in GAVE_UP.finditer(output)})
    if not ranks:
        return []
    return [f"case {case}: it still hangs: rank{'s' if len(ranks) > 1 else ''} {listed(ranks)} gave up waiting in a "
            f"collective after --timeout {CASE_TIMEOUT_S} s: every rank must call the same collectives in the same "
            "order (run the case with the Flight Recorder on to see where they part)"]


def result_problems(case, result, reference):
    """Rank 0's result of the learner's fixed case against the correct program's."""
    if result is None:
        return [f"case {case}: rank 0 printed no result line (`case {case} | result {{...}}`): keep the script's "
                "report at the end of main"]
    for key, expected in reference.items():
        if not close(result.get(key), expected):
            return [f"case {case}: it ended, but rank 0's {key} is {result.get(key)}, while the correct program "
                    f"(the same case on one rank, where no collective can be out of step) gives {expected}: "
                    f"{WHAT_THE_RESULT_SAYS[key]}. A fix must keep what the collective computed, on every rank, not "
                    "drop it (nor drop samples)"]
    return []


def one_rank_collectives():
    """torch.distributed as one rank sees it alone: every collective gives back what it was given."""
    def nothing(*args, **kwargs):
        return None

    def all_gather(outputs, tensor, *args, **kwargs):
        outputs[0].copy_(tensor)

    def gather(tensor, gather_list=None, *args, **kwargs):
        if gather_list:
            gather_list[0].copy_(tensor)

    def copy_into(output, tensor, *args, **kwargs):
        output.copy_(tensor.reshape(output.shape))

    return types.SimpleNamespace(
        all_reduce=nothing, reduce=nothing, broadcast=nothing, barrier=nothing, all_gather=all_gather,
        gather=gather, all_gather_into_tensor=copy_into, reduce_scatter_tensor=copy_into,
        get_rank=lambda *args, **kwargs: 0, get_world_size=lambda *args, **kwargs: 1)


def counting_collectives(rank, calls):
    """torch.distributed as rank `rank` of RANKS calls it, each collective only noted in `calls` as (its name, the bytes
    of the tensors it was given, the function that called it), none run: what a rank sends, for a case whose control
    flow does not depend on what the collectives return."""
    import sys

    import torch

    def counting(name):
        def collective(*args, **kwargs):
            tensors = [value for value in [*args, *kwargs.values()] if isinstance(value, torch.Tensor)]
            tensors += [item for value in [*args, *kwargs.values()] if isinstance(value, (list, tuple))
                        for item in value if isinstance(item, torch.Tensor)]
            calls.append((name, sum(tensor.numel() * tensor.element_size() for tensor in tensors),
                          sys._getframe(1).f_code.co_name))
        return collective

    return types.SimpleNamespace(**{name: counting(name) for name in (
        "all_reduce", "reduce", "broadcast", "barrier", "all_gather", "gather", "scatter", "reduce_scatter",
        "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv")},
        get_rank=lambda *args, **kwargs: rank, get_world_size=lambda *args, **kwargs: RANKS)


def solution_traffic(case, solution=SOLUTION):
    """{rank: [(collective, bytes, function), ...]}: what each rank of the repository's fixed case sends, counted."""
    module = script_module(solution, "hang_clinic_solution")
    traffic = {}
    for rank in range(RANKS):
        traffic[rank] = []
        module.dist = counting_collectives(rank, traffic[rank])
        module.run_case(case, rank, RANKS)
    return traffic


def traffic_problems(case, collectives, expected, script=None):
    """Each rank's bytes sent in the learner's fixed case (`collectives`: its collectives.jsonl rows) against the
    repository's fixed case's (`expected`: solution_traffic): a fix may reorder or reshape the collectives, not
    remove what they carry."""
    for rank, calls in sorted(expected.items()):
        mine = [row for row in collectives if row["event"] == "call" and row["rank"] == rank]
        sent, needed = sum(sum(row["bytes"]) for row in mine), sum(size for _, size, _ in calls)
        if sent >= needed:
            continue
        by_function = {}
        for name, size, function in calls:
            by_function.setdefault((name, function), 0)
            by_function[(name, function)] += size
        kept = {}
        for row in mine:
            function = (row.get("caller") or [None, None, None])[2]
            kept.setdefault((row["op"], function), 0)
            kept[(row["op"], function)] += sum(row["bytes"])
        missing = [(name, function, size) for (name, function), size in by_function.items()
                   if kept.get((name, function), 0) < size]
        what = "; ".join(f"{name} in {function}(): {size:,} bytes, the fixed case {kept.get((name, function), 0):,}"
                         for name, function, size in missing[:2])
        return [f"case {case}: it ended with the right result, but rank {rank} sent {sent:,} bytes in collectives, "
                f"where the correct program's rank {rank} sends {needed:,} ({what}): the fix removed communication. "
                "Each rank gets the same number here only because it can compute it alone; a fix makes every rank "
                "call the same collectives in the same order, and keeps what they carry"]
    return []


def reference_results(start=START):
    """Each case's result as the correct program computes it: start.py's case on one rank, in this process."""
    module = script_module(start, "hang_clinic_start")
    module.dist = one_rank_collectives()
    return {case: module.run_case(case, 0, 1) for case in CASES}


# --- running it -----------------------------------------------------------------------------------------------------

def case_command(script, case):
    return torchrun(str(script), "--case", case, "--timeout", CASE_TIMEOUT_S, nproc=RANKS)


def read_dumps(folder):
    dumps = {}
    for path in Path(folder).glob("fr_*"):
        with open(path, "rb") as file:
            dumps[int(path.name.removeprefix("fr_"))] = pickle.load(file)
    return dumps


def check(script, workdir, say):
    script, workdir = Path(script).resolve(), Path(workdir)
    diagnosis = read_diagnosis(script)
    if diagnosis is None:
        return ["the script has no DIAGNOSIS = {...} (a dict literal, as start.py gives it): keep it, and fill it in"]
    # Every run at once: start.py's cases with the Flight Recorder on (the truth), and the learner's fixed cases.
    known = _TRUTHS.get(START.read_text())
    truth_jobs, fixed_jobs = {}, {}
    for case in CASES:
        dumps = workdir / f"truth_{case}"
        dumps.mkdir(parents=True, exist_ok=True)
        if known is None:
            truth_jobs[case] = start(case_command(START, case), cwd=dumps, env={
                "TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES, "TORCH_FR_DUMP_TEMP_FILE": f"{dumps}/fr_"})
        fixed = workdir / f"fixed_{case}"
        fixed.mkdir(parents=True, exist_ok=True)
        say(f"running: {shown(case_command(script, case))}")
        # The learner's runs record nothing: a Flight Recorder turned on in their shell would only slow a hang's end.
        fixed_jobs[case] = start(case_command(script, case), cwd=fixed, logs=fixed / "records",
                                 record_collectives=True,
                                 env={"TORCH_FR_BUFFER_SIZE": None, "TORCH_NCCL_TRACE_BUFFER_SIZE": None})
    references = reference_results()
    deadline = time.monotonic() + JOB_LIMIT_S
    problems, truths = [], {}
    for case in CASES:
        for job in filter(None, (truth_jobs.get(case), fixed_jobs[case])):
            with job:
                job.wait(max(1.0, deadline - time.monotonic()))
        truth = truths[case] = known[case] if known else parting(read_dumps(workdir / f"truth_{case}"), START)
        if truth is None:
            problems.append(f"case {case}: start.py's ranks did not part in this run (or left no Flight Recorder "
                            "dump): the diagnosis cannot be judged")
        else:
            problems += diagnosis_problems(case, diagnosis, truth)
        job = fixed_jobs[case]
        ended = hang_problems(case, job.output) or exit_problems(job, script)
        if ended:
            problems += [problem if problem.startswith("case ") else f"case {case}: {problem}" for problem in ended]
        else:
            problems += (result_problems(case, result_of(job.output, case), references[case])
                         or traffic_problems(case, job.records("collectives.jsonl"), solution_traffic(case), script))
    if None not in truths.values():
        _TRUTHS[START.read_text()] = truths
    return problems
