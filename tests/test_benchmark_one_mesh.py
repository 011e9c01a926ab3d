"""benchmarks/one_mesh.py: its report on passes made up here (each rank's idle time over its stages, the fastest step
of a configuration, the formula with one or two stages per rank, a missing gradient named), and the benchmark run end
to end with tiny settings, where what must hold whatever the timings holds: step 8's 1F1B runs one stage per rank and
step 11's interleaved schedules two (4 stages on 2 ranks, the V of ZBV its own), each rank runs a forward and a
backward per micro-batch and stage (the zero-bubble schedules a W pass as well), every pp-only schedule's gradients
are one process's, activation checkpointing keeps less than half the bytes for backward, and sequence parallelism
fewer than step 7's plan: exactly the LayerNorms' inputs (and their statistics) of the positions another rank holds."""
import re

import pytest

from benchmarks import one_mesh as benchmark
from harness.jobs import PYTHON, run, script


def passes(*spans):
    """A step's events from (rank, stage, 'F', 'B' or 'W', micro-batch, began, ended) in hundredths of a second."""
    kinds = {"F": "forward", "B": "backward", "W": "weight"}
    return [dict(rank=rank, stage=stage, microbatch=microbatch, began=began / 100, ended=ended / 100,
                 **{"pass": kinds[kind]}) for rank, stage, kind, microbatch, began, ended in spans]


def test_each_rank_is_measured_over_both_its_stages_against_its_formula(capsys):
    """Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3: a rank is busy while either of its stages computes. The
    slower step of a configuration is not the one reported; the zero-bubble schedule has no formula, and its W
    passes count as work."""
    one_f_one_b = passes((0, 0, "F", 0, 0, 2), (1, 1, "F", 0, 2, 4), (1, 1, "B", 0, 4, 6), (0, 0, "B", 0, 6, 8),
                         (0, 0, "F", 1, 2, 4), (1, 1, "F", 1, 6, 8), (1, 1, "B", 1, 8, 10), (0, 0, "B", 1, 10, 12))
    interleaved = passes((0, 0, "F", 0, 0, 1), (1, 1, "F", 0, 1, 2), (0, 2, "F", 0, 2, 3), (1, 3, "F", 0, 3, 4),
                         (1, 3, "B", 0, 4, 5), (0, 2, "B", 0, 5, 6), (1, 1, "B", 0, 6, 7), (0, 0, "B", 0, 7, 8))
    slower = [dict(event, began=2 * event["began"], ended=2 * event["ended"]) for event in interleaved]
    zero_bubble = interleaved[:-1] + passes((0, 0, "B", 0, 7, 7.5), (0, 2, "W", 0, 7.5, 8))
    benchmark.report_pipeline([("1f1b", 2, {0: one_f_one_b}), ("interleaved", 2, {1: slower, 2: interleaved}),
                               ("zero-bubble-plain", 2, {3: zero_bubble})],
                              {"zero-bubble-plain": (3e-8, ["head.linear.weight"])})
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    # 1F1B: 120 ms, each rank busy 80 of them; interleaved: 80 ms, rank 0 busy 40 (stages 0 and 2), rank 1 40;
    # the formula (2 - 1) / (v 2 + 2 - 1): 1/3 with one stage per rank, 1/5 with two.
    assert rows == ["| 1f1b | 0 / 1 | 2 | 4 | 120 | 1.00x | 80 | 33% | 33% | 33% |",
                    "| interleaved | 0 2 / 1 3 | 2 | 4 | 80 | 0.67x | 40 | 50% | 50% | 20% |",
                    "| zero-bubble-plain | 0 2 / 1 3 | 2 | 5 | 80 | 0.67x | 40 | 50% | 50% | - |"], text
    assert "interleaved: mean idle M=2 50% (formula 20%)" in text
    assert "zero-bubble-plain: mean idle M=2 50%\n" in text
    assert ("zero-bubble-plain (ScheduleInterleavedZeroBubble), pp 2: gradients within 3.0e-08 of one process's; NO "
            "gradient for head.linear.weight") in text


def test_a_steps_passes_are_those_recorded_in_its_window_on_each_rank():
    """Each rank's clock window of a step takes that rank's passes only: the ranks' windows differ."""
    records = passes((0, 0, "F", 0, 1, 2), (1, 1, "F", 0, 3, 4), (0, 0, "F", 0, 5, 6), (1, 1, "F", 0, 7, 8))
    steps = benchmark.by_window(records, [[(0, 0.025), (0, 0.045)], [(0.045, 0.065), (0.065, 0.085)]])
    assert [[(e["rank"], e["began"]) for e in steps[n]] for n in (0, 1)] == [[(0, 0.01), (1, 0.03)],
                                                                            [(0, 0.05), (1, 0.07)]]


def table(text, title):
    """The body rows of the markdown table that follows the line starting with `title`, as lists of cells."""
    after = text[text.index(title):]
    lines = [line for line in after.split("\n\n")[1].splitlines() if line.startswith("| ")][1:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.mark.slow
def test_one_mesh_benchmark_measures_the_schedules_checkpointing_and_sequence_parallelism(tmp_path):
    """2 processes for the pipeline (M = 2, batches of 4), 4 for the zero-bubble check under FSDP, 2 for the memory
    part (batches of 4 sequences of 64 characters, tp 2)."""
    text = run([PYTHON, script("benchmarks/one_mesh.py"), "--microbatches", 2, "--batch_size", 4, "--ac_batch", 4,
                "--steps", 1, "--rounds", 1, "--chars", 6000, "--zero_bubble_fsdp"], cwd=tmp_path, timeout=280).output
    rows = {row[0]: row[1:] for row in table(text, "1. The bubble")}
    assert list(rows) == benchmark.SCHEDULES, text
    # The stages each rank ran, the passes of rank 0 (F and B per micro-batch and stage; W too for zero bubble),
    # and the formula: 1/3 with one stage per rank at M = 2, 1/5 with two.
    assert {name: (row[0], row[2], row[-1]) for name, row in rows.items()} == {
        "1f1b": ("0 / 1", "4", "33%"), "interleaved": ("0 2 / 1 3", "8", "20%"),
        "interleaved-plain": ("0 2 / 1 3", "8", "20%"), "zero-bubble-plain": ("0 2 / 1 3", "12", "-"),
        "zbv-plain": ("0 3 / 1 2", "12", "-")}, text
    for schedule, name in benchmark.PLAIN.items():
        for where in ("pp 2", "pp 2 x dp 2 under FSDP"):
            found = re.search(rf"^{schedule} \({name}\), {where}: gradients within ([\d.e+-]+) of one process's; "
                              r"every parameter has one$", text, re.M)
            assert found and float(found[1]) < 1e-5, (schedule, where, text)
    (_, plain_mib, _), (_, checkpointed_mib, _) = table(text, "2. Activation checkpointing")
    assert float(checkpointed_mib) < float(plain_mib) / 2, text
    (_, step7_mib, _), (_, sp_mib, _) = table(text, "3. Sequence parallelism")
    # Where step 7 keeps each LayerNorm's whole input (4 sequences x 64 positions x 64 wide, float32) and its mean and
    # deviation per position, sequence parallelism keeps the rank's half of the positions: two LayerNorms, 66 KiB
    # less. The matrices' inputs, gathered whole, are the same (the table's MiB are rounded to 0.01).
    assert float(step7_mib) - float(sp_mib) == pytest.approx(2 * 4 * 32 * (64 + 2) * 4 / 2**20, abs=0.01), text
    assert re.search(r"^activation checkpointing keeps 0\.\d\dx the activations", text, re.M), text
    assert re.search(r"^sequence parallelism keeps 0\.\d\dx step 7's activations per rank", text, re.M), text
