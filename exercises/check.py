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
killed job had), whether each process closed its process group. For exercises 7-12: every collective each rank
called, with its bytes, its line and when it was waited on, each backward and optimizer step with the gradients and
optimizer state it held, and what the exercise builds (FSDP's units held whole, a pipeline rank's passes and
activations, the rows an all-to-all moved, every rank's Flight Recorder), against what a correct program computes.
harness/jobs records all that, the same job runner the repository's tests use. For exercise 13 it runs the planner
(plan_at_scale.py, step 14) on the layout and judges what the planner counted: the peak memory of each kind of rank,
where tensor parallelism's traffic goes, the step's time.

Each exercise is one folder of exercises/: its starting file, hints, solution (7-13), its checker (check.py) and what
the recorder notes for it beyond its own (recorder.py, 7-11). This file only finds the exercise's checker and runs it;
what several checkers share is exercises/judging.py.
"""
import argparse
import importlib
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python exercises/check.py` from anywhere

from exercises.judging import one_thread  # noqa: E402

EXERCISES = {1: "01_ddp", 2: "02_survive_a_kill", 3: "03_two_nodes", 4: "04_grad_accum",  # their folders in exercises/
             5: "05_tensor_parallel", 6: "06_context_parallel", 7: "07_ddp_by_hand", 8: "08_zero_by_hand",
             9: "09_fsdp_choices", 10: "10_pipeline_by_hand", 11: "11_expert_dispatch", 12: "12_hang_clinic",
             13: "13_plan_a_layout"}
# What solves each exercise, which a learner compares theirs with: the step it leads to (1-6), or its own solution.py
STEPS = {1: "multigpu.py", 2: "multigpu_torchrun.py", 3: "multinode.py", 4: "gpt.py", 5: "tensor_parallel.py",
         6: "context_parallel.py"}
SOLUTIONS = {**STEPS, **{number: f"exercises/{folder}/solution.py" for number, folder in EXERCISES.items()
                         if number not in STEPS}}


def exercise_checker(number):
    """Exercise `number`'s checker: the module check.py in its folder, which has a function check(script, workdir, say).
    (A folder whose name begins with digits is no name an import statement takes: it is imported by its dotted name.)"""
    return importlib.import_module(f"exercises.{EXERCISES[number]}.check")


def check(number, script, workdir, say=lambda line: None):
    """Run exercise `number`'s checks on `script` in the empty directory `workdir`; return the problems found."""
    with one_thread():
        return exercise_checker(number).check(Path(script).resolve(), Path(workdir), say)


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
    kind = "step" if args.exercise in STEPS else "solution"
    print(f"  ✓ all checks passed. Compare with the repository's {kind}: {SOLUTIONS[args.exercise]}")


if __name__ == "__main__":
    main()
