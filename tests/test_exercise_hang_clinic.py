"""Exercise 12, the hang clinic: each verdict of exercises/12_hang_clinic/check.py on Flight Recorder dumps and results
made up here, the one-rank reference, and (slow) the start file and seeded mistakes of the solution run for real,
each reaching its own verdict."""
import re
import time

import pytest

from exercises.check import exercise_checker
from mistakes import CHECKING, exercise_problems, seeded, written
from harness.jobs import REPO, start, torchrun

hang_clinic = exercise_checker(12)  # exercises/12_hang_clinic/check.py
(CASE_TIMEOUT_S, CASES, GAVE_UP, RANKS, START, diagnosis_problems, hang_problems, one_rank_collectives, parting,
 read_diagnosis, reference_results, result_problems, solution_traffic, traffic_problems) = (
    hang_clinic.CASE_TIMEOUT_S, hang_clinic.CASES, hang_clinic.GAVE_UP, hang_clinic.RANKS, hang_clinic.START,
    hang_clinic.diagnosis_problems, hang_clinic.hang_problems, hang_clinic.one_rank_collectives, hang_clinic.parting,
    hang_clinic.read_diagnosis, hang_clinic.reference_results, hang_clinic.result_problems,
    hang_clinic.solution_traffic, hang_clinic.traffic_problems)

pytestmark = CHECKING  # the slow tests run checks

SOLUTION = "exercises/12_hang_clinic/solution.py"
LIBRARY = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
STARTUP = 120  # generous: starting torchrun and three workers takes 10 s here, a minute and more at a load of 30


def entry(record, collective, line, caller=120):
    """One entry of a rank's Flight Recorder dump, its frames innermost first: torch's function, then start.py's."""
    return {"record_id": record, "profiling_name": f"gloo:{collective}",
            "frames": [{"name": collective, "filename": LIBRARY, "line": 3906},
                       {"name": "helper", "filename": str(START), "line": line},
                       {"name": "train", "filename": str(START), "line": caller}]}


def dumps(*calls_per_rank):
    return {rank: {"entries": [entry(record, *call) for record, call in enumerate(calls)], "pg_config": {}}
            for rank, calls in enumerate(calls_per_rank)}


def test_the_rank_unlike_the_others_at_the_first_parting_is_found_with_its_collective_and_line():
    steady = [("all_reduce", 64), ("all_reduce", 64)]
    found = parting(dumps([*steady, ("reduce", 93)], [*steady, ("all_reduce", 64)], [*steady, ("all_reduce", 64)]),
                    START)
    assert found == {"rank": 0, "collective": "reduce", "line": 93, "others": [("all_reduce", 64)], "position": 3}


def test_the_lone_rank_may_be_any_rank_and_the_line_is_start_pys_innermost():
    found = parting(dumps([("all_reduce", 158)], [("all_reduce", 158)], [("barrier", 188)]), START)
    assert (found["rank"], found["collective"], found["line"]) == (2, "barrier", 188)


def test_ranks_that_never_part_or_part_evenly_name_no_rank():
    assert parting(dumps([("all_reduce", 64)] * 3, [("all_reduce", 64)] * 3, [("all_reduce", 64)] * 3), START) is None
    assert parting(dumps([("reduce", 93)], [("reduce", 93)], [("all_reduce", 64)], [("all_reduce", 64)]),
                   START) is None


TRUTH = {"rank": 0, "collective": "broadcast", "line": 125, "others": [("barrier", 137)], "position": 1}


def named(rank=0, collective="broadcast", line=125):
    return {"order": {"rank": rank, "collective": collective, "line": line}}


def test_a_diagnosis_that_names_the_rank_the_collective_and_the_line_passes():
    assert diagnosis_problems("order", named(), TRUTH) == []
    for spelled in ("dist.broadcast", "dist.broadcast()", "torch.distributed.broadcast", "gloo:broadcast", "Broadcast"):
        assert diagnosis_problems("order", named(collective=spelled), TRUTH) == [], spelled
    for line in ("125", "start.py:125", " 125 "):
        assert diagnosis_problems("order", named(line=line), TRUTH) == [], line


@pytest.mark.parametrize("diagnosis, verdict", [
    ({"order": {"rank": None, "collective": None, "line": None}}, r"^case order: DIAGNOSIS\['order'\] is not filled "
     r"in: run the case with the Flight Recorder on"),
    ({}, r"is not filled in"),
    (named(rank=1), r"^case order: the diagnosis names rank 1, but that rank called what the others called"),
    (named(collective="barrier"), r"^case order: the diagnosis names barrier as rank 0's collective, but it called "
     r"another one there"),
    (named(line=137), r"^case order: the diagnosis names line 137, but rank 0's broadcast there was called from "
     r"another line of start.py"),
], ids=["unfilled", "missing", "wrong rank", "wrong collective", "wrong line"])
def test_a_wrong_diagnosis_is_told_what_is_wrong_without_the_answer(diagnosis, verdict):
    [problem] = diagnosis_problems("order", diagnosis, TRUTH)
    assert re.search(verdict, problem), problem
    assert "125" not in problem


REFERENCE = {"held_out": 0.25, "weights": [-0.9, 1.3]}


def test_the_result_of_the_correct_program_passes_within_float_rounding():
    assert result_problems("heldout", {"held_out": 0.25 + 1e-7, "weights": [-0.9, 1.3]}, REFERENCE) == []


@pytest.mark.parametrize("result, verdict", [
    (None, r"^case heldout: rank 0 printed no result line"),
    ({"held_out": 0.31, "weights": [-0.9, 1.3]}, r"^case heldout: it ended, but rank 0's held_out is 0.31, while "
     r"the correct program \(the same case on one rank, where no collective can be out of step\) gives 0.25: the "
     r"held-out loss \(the mean over every held-out sample, each counted once"),
    ({"held_out": 0.25, "weights": [-0.8, 1.3]}, r"rank 0's weights is \[-0.8, 1.3\].*every rank must apply the "
     r"same mean gradient"),
], ids=["no result", "held-out loss", "weights"])
def test_a_result_unlike_the_correct_programs_is_named(result, verdict):
    [problem] = result_problems("heldout", result, REFERENCE)
    assert re.search(verdict, problem), problem


def test_a_fixed_case_that_still_hangs_names_the_ranks_that_gave_up():
    output = ("error: rank 2: a collective gave up after --timeout 5 s (Timed out waiting 5000ms for recv operation to "
              "complete): a rank is stuck or gone; the last snapshot is kept, and the same command resumes from it\n"
              "error: rank 0: a peer is gone (Connection closed by peer, at 127.0.0.1), so this rank stops too\n")
    [problem] = hang_problems("branch", output)
    assert problem.startswith("case branch: it still hangs: ranks 0 and 2 gave up waiting in a collective after "
                              "--timeout 5 s: every rank must call the same collectives in the same order"), problem
    assert hang_problems("branch", "[rank 0/3 | cpu] case branch | result {}\n") == []


def test_the_diagnosis_is_read_from_the_script_and_start_py_leaves_it_to_fill():
    assert read_diagnosis(START) == {case: {"rank": None, "collective": None, "line": None} for case in CASES}
    assert set(read_diagnosis(REPO / SOLUTION)) == set(CASES)


def test_a_script_without_a_diagnosis_is_told_to_keep_it(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text("print('no diagnosis here')\n")
    [problem] = hang_clinic.check(script, tmp_path, say=print)
    assert problem.startswith("the script has no DIAGNOSIS = {...}"), problem


def test_one_rank_alone_gets_back_from_each_collective_what_it_gave():
    import torch

    alone, tensor = one_rank_collectives(), torch.tensor([1.0, 2.0])
    gathered = [torch.zeros(2)]
    assert alone.all_reduce(tensor) is None and tensor.tolist() == [1.0, 2.0]
    alone.all_gather(gathered, tensor)
    assert gathered[0].tolist() == [1.0, 2.0]


def test_what_each_rank_of_the_repositorys_fixed_cases_sends_is_counted_rank_by_rank():
    """The model's two 4 x 4 weights (64 bytes each) are all-reduced at each of the 30 steps (3,840 bytes); the branch
    case adds 3 reduces of a loss (4 bytes), the held-out case one all-reduce of 2 totals, the order case the two
    weights broadcast."""
    sent = {case: {rank: sum(size for _, size, _ in calls) for rank, calls in solution_traffic(case).items()}
            for case in CASES}
    assert sent == {"branch": dict.fromkeys(range(3), 3852), "heldout": dict.fromkeys(range(3), 3848),
                    "order": dict.fromkeys(range(3), 3968)}
    assert ("broadcast", 64, "broadcast_weights") in solution_traffic("order")[1]


def recorded(rank, op, size, function, count=1):
    return [dict(event="call", rank=rank, op=op, bytes=[size], caller=["/my_clinic.py", 1, function])] * count


def test_a_fix_that_removes_a_collective_is_named_with_what_it_carried():
    expected = {rank: [("all_reduce", 64, "average_gradients")] * 2 + [("broadcast", 64, "broadcast_weights")] * 2
                for rank in range(3)}
    kept = [row for rank in range(3) for row in recorded(rank, "all_reduce", 64, "average_gradients", 2)
            + recorded(rank, "broadcast", 128, "warm_start")]
    assert traffic_problems("order", kept, expected) == []  # the same bytes, sent another way
    dropped = [row for rank in range(3) for row in recorded(rank, "all_reduce", 64, "average_gradients", 2)
               + (recorded(rank, "broadcast", 64, "broadcast_weights", 2) if rank == 0 else [])]
    [problem] = traffic_problems("order", dropped, expected)
    assert problem == ("case order: it ended with the right result, but rank 1 sent 128 bytes in collectives, where "
                       "the correct program's rank 1 sends 256 (broadcast in broadcast_weights(): 128 bytes, the fixed "
                       "case 0): the fix removed communication. Each rank gets the same number here only because it "
                       "can compute it alone; a fix makes every rank call the same collectives in the same order, and "
                       "keeps what they carry"), problem


def test_the_reference_is_start_pys_own_cases_on_one_rank():
    references = reference_results()
    assert set(references) == set(CASES)
    # The same training in the branch and held-out cases; the order case starts from rank 0's warmed-up weights.
    assert references["branch"]["weights"] == references["heldout"]["weights"] != references["order"]["weights"]


# --- the start file and seeded mistakes, run for real --------------------------------------------------------------

def checked(script, tmp_path):
    return exercise_problems(12, script, tmp_path)


@pytest.mark.slow
def test_a_rank_that_starts_late_joins_the_group_and_a_stuck_collective_still_gives_up_at_the_timeout(tmp_path):
    """The checker starts several three-rank jobs at once, each with --timeout 5: on a busy machine a rank can reach
    init_process_group long after the others. The group waits --rendezvous_timeout (120 s) for it; once formed, each
    collective waits only --timeout. Here rank 2 arrives 15 s late and case branch hangs as start.py gives it: the
    group forms (with --timeout as its bound too, ranks 0 and 1 stopped at 5 s: "the process group did not form"),
    then the hang ends at --timeout (with the group's bound it would last 120 s)."""
    late = 15
    command = torchrun("exercises/12_hang_clinic/start.py", "--case", "branch", "--timeout", CASE_TIMEOUT_S,
                       nproc=RANKS)
    with start(command, cwd=tmp_path, stall_init=f"{RANKS - 1}:{late}") as job:
        job.wait_for(rf"rank {RANKS - 1} calls init_process_group", timeout=STARTUP + late)
        arrived = time.monotonic()
        [code] = job.wait(timeout=150)
        took = time.monotonic() - arrived
    assert "did not form" not in job.output, job.output[-3000:]
    assert code != 0 and GAVE_UP.search(job.output), job.output[-3000:]
    # the case trains a few steps before its hang, and ending the ranks takes seconds more on a busy machine
    assert took < CASE_TIMEOUT_S + 45, f"the hang ended {took:.0f} s after the group could form"


@pytest.mark.slow
def test_the_mistakes_learners_make_each_get_their_own_verdict(tmp_path):
    """One run, six mistakes: in each case a wrong part of the diagnosis; a case left as start.py has it, which
    still hangs; fixes that silence the hang but change what the program computes."""
    script = seeded(
        tmp_path, SOLUTION,
        # the diagnosis: the rank that waited (the others), not the one out of step
        (r'"branch": \{"rank": 0,', '"branch": {"rank": 1,'),
        # the diagnosis: the line of the collective the others called (the barrier), not rank 2's
        (r'"heldout": \{"rank": 2, "collective": "barrier", "line": 188\}',
         '"heldout": {"rank": 2, "collective": "barrier", "line": 158}'),
        # the diagnosis: the collective the others called there
        (r'"order": \{"rank": 0, "collective": "broadcast",', '"order": {"rank": 0, "collective": "barrier",'),
        # the branch left as start.py has it: only rank 0 calls the reduce, and the others wait in the next
        # collective until --timeout
        (r"    total = loss.detach\(\).clone\(\)\n    dist.reduce\(total, dst=0\)\n    return total.item\(\) / "
         r"world_size if rank == 0 else None\n",
         "    if rank == 0:\n        total = loss.detach().clone()\n        dist.reduce(total, dst=0)\n"
         "        return total.item() / world_size\n    return None\n"),
        # the held-out samples that do not divide the ranks left out: every rank evaluates 2
        (r"mine = list\(range\(rank, HELD_OUT_SAMPLES, world_size\)\)",
         "mine = list(range(rank, HELD_OUT_SAMPLES - HELD_OUT_SAMPLES % world_size, world_size))"),
        # the hang silenced by dropping the broadcast on every rank: only rank 0 starts from the warmed-up weights
        (r"    dist.barrier\(\)\n    broadcast_weights\(model\)\n", "    dist.barrier()\n"),
    )
    problems = checked(script, tmp_path)
    verdicts = [
        r"^case branch: the diagnosis names rank 1, but that rank called what the others called",
        r"^case branch: it still hangs: rank",
        r"^case heldout: the diagnosis names line 158, but rank 2's barrier there was called from another line",
        r"^case heldout: it ended, but rank 0's held_out is .* each counted once",
        r"^case order: the diagnosis names barrier as rank 0's collective",
        r"^case order: it ended, but rank 0's weights is .*every rank must apply the same mean gradient",
    ]
    assert len(problems) == len(verdicts), problems
    for verdict, problem in zip(verdicts, problems):
        assert re.search(verdict, problem), (verdict, problems)


# Programs learners wrote from the starting file (tests/independent/): other right fixes, with a diagnosis spelled as
# calls, pass; fixes that remove the collective where each rank can recompute the number are named, case by case.
@pytest.mark.slow
@pytest.mark.parametrize("part, verdicts", [
    ("hang_clinic_other_fixes.py", []),
    ("hang_clinic_recomputed.py", [
        r"^case branch: it ended with the right result, but rank 0 sent 3,840 bytes in collectives, where the correct "
        r"program's rank 0 sends 3,852 \(reduce in logged_loss\(\): 12 bytes, the fixed case 0\): the fix removed "
        r"communication",
        r"^case heldout: it ended with the right result, but rank 0 sent 3,840 bytes .*\(all_reduce in "
        r"held_out_loss\(\): 8 bytes, the fixed case 0\)",
        r"^case order: it ended with the right result, but rank 0 sent 3,840 bytes .*\(broadcast in "
        r"broadcast_weights\(\): 128 bytes, the fixed case 0\)"]),
], ids=["right: other fixes, the diagnosis spelled as calls", "collectives removed, numbers recomputed"])
def test_a_program_written_independently_gets_the_verdicts_of_its_mistakes(part, verdicts, tmp_path):
    problems = checked(written(tmp_path, "exercises/12_hang_clinic/start.py", part), tmp_path)
    assert len(problems) == len(verdicts), problems
    for problem, verdict in zip(problems, verdicts):
        assert re.search(verdict, problem), (verdict, problems)
