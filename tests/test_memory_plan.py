"""tools/memory_plan.py: the plan of what every rank of one_mesh.py (step 11) holds and sends. Its arithmetic, without
processes: the shards of every layout add up to the whole model (the weights tp replicates once per tp rank), cut as
torch.chunk cuts; checkpointing keeps less, sequence parallelism divides what lies between the blocks by tp; its walk
of the interleaved 1F1B schedule is torch's; FSDP holds two stages' gradients together only when the schedule runs
more than one round; the last stage keeps every micro-batch's logits; --fit finds a layout for the 1B size on 8 GPUs
of 80 GiB and none for the 8B size on one, nor FSDP alone for it on 8, which ZeRO-3 with checkpointing would fit. The
replay of benchmarks/one_mesh.py's memory timeline on made-up events. And the plan against what jobs measure: one job
of 2 ranks, whose measured shards and activations every rank's plan names; and every column of every rank of four
8-rank layouts (benchmarks/one_mesh.py --parts plan, one shared job): the gathered weights and gradients, the
activations, the logits, the pipeline's buffers and all of them together between passes to the byte, the loss's
temporaries to a few bytes a position, the total above the plan by no more than a pass's temporaries, the traffic of
each mesh dimension to the gradient norm's few numbers."""
import dataclasses
import itertools
import json
import math

import pytest
import torch
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from benchmarks.one_mesh import CATEGORIES, plan_layouts, replay
from expect import EXCERPT_CHARS, help_excerpt, rank_records
from tools import memory_plan
from harness.jobs import PYTHON, run, script, torchrun
from tools.memory_plan import ACTIVATION_TOLERANCE, BIG, Layout, check, compare, config_of, plan, schedule, split
from utils import make_workload
from utils.gpt import SIZES
from utils.metrics import RUN_DIR_VARIABLE

CPU = dataclasses.replace(SIZES["cpu"], vocab_size=57)
# Layouts of the CPU GPT (2 blocks: pp 1 or 2), with uneven cuts: 57 characters over tp 4 (15, 15, 15, 12 rows), then
# over dp 8 (a tp slice of 12 rows gives 6 of the 8 dp ranks 2 rows, the other 2 none).
LAYOUTS = [Layout(pp, dp, tp, batch, M, precision, checkpointed)
           for pp, dp, tp in [(1, 1, 1), (1, 2, 2), (2, 1, 1), (2, 2, 2), (2, 8, 4), (1, 3, 1), (1, 1, 4)]
           for batch, M in [(4, 2), (8, 4)] for precision in ("fp32", "bf16") for checkpointed in (False, True)]


def whole_model():
    """The CPU GPT's weights by name, from the model itself (on the meta device: shapes, no memory)."""
    return dict(make_workload("gpt-cpu", text=str(help_excerpt()),
                              dropout=0, device="meta").model.named_parameters())


def test_the_cut_of_a_dimension_is_torch_chunks():
    for n, parts in itertools.product(range(0, 20), range(1, 9)):
        pieces = [len(piece) for piece in torch.arange(n).chunk(parts)] if n else []
        assert [split(n, parts, index) for index in range(parts)] == pieces + [0] * (parts - len(pieces)), (n, parts)


def test_the_shards_of_every_rank_add_up_to_the_whole_model_for_every_layout():
    """Over all ranks: every weight once per tp rank where tp replicates it (the norms, the row-wise biases), else
    once; gradients as many; AdamW's two moments of each and a 4-byte step per parameter on each dp x tp rank."""
    weights = whole_model()
    assert config_of("cpu", help_excerpt()) == CPU
    replicated = sum(p.numel() for name, p in weights.items() if "norm" in name or "proj.bias" in name)
    whole = sum(p.numel() for p in weights.values())
    for layout in LAYOUTS:
        rows = plan(CPU, layout)
        held = sum(row["params"] for row in rows)
        assert held == 4 * (whole + (layout.tp - 1) * replicated), layout
        assert sum(row["grads"] for row in rows) == held
        assert sum(row["optim"] for row in rows) == 2 * held + 4 * len(weights) * layout.dp * layout.tp, layout
        assert sorted(name for row in rows[::layout.dp * layout.tp] for name in row["layers"]) == sorted(
            {name.split(".")[0] for name in weights}), "each layer on one pipeline rank"


def test_a_rank_may_hold_no_row_of_a_tensor():
    """tp 4 cuts the 57 characters 15, 15, 15, 12; dp 8 cuts the last tp slice 2, 2, 2, 2, 2, 2 and nothing twice:
    the head's weight (57 x 64) on the last tp rank of the last dp ranks."""
    rows = plan(CPU, Layout(2, 8, 4))
    head = [row for row in rows if "head" in row["layers"] and row["coordinates"][2] == 3]
    assert [split(12, 8, dp) for dp in range(8)] == [2, 2, 2, 2, 2, 2, 0, 0]
    assert head[6]["params"] < head[5]["params"], "dp rank 6 holds no row of the head's tp slice"


def test_activation_checkpointing_keeps_less():
    for layout in LAYOUTS:
        if layout.checkpoint_activations:
            continue
        plain, checkpointed = plan(CPU, layout), plan(CPU, dataclasses.replace(layout, checkpoint_activations=True))
        for before, after in zip(plain, checkpointed):
            blocks = any(name.startswith("block") for name in before["layers"])
            assert (after["act_step"] < before["act_step"]) == blocks, layout
            assert (after["peak_act"] < before["peak_act"]) == blocks, layout
            assert (after["tp_bytes"] > before["tp_bytes"]) == (blocks and layout.tp > 1), "recomputed collectives"


def test_sequence_parallelism_divides_what_lies_between_the_blocks_by_tp():
    """With checkpointing a block keeps its input alone, which lies between the blocks: sequence parallelism keeps
    1/tp of it (the embedding's positions and the step's ids stay whole); the stages send 1/tp of their activations."""
    positions, ids = 8 * CPU.context, 8 * 8 * CPU.context  # int64: the arange of a micro-batch; the batch's ids
    for tp in (2, 4):
        split_positions = Layout(2, 1, tp, batch_size=8, microbatches=4, checkpoint_activations=True)
        whole_positions = dataclasses.replace(split_positions, sequence_parallel=False)
        for sp, plain in zip(plan(CPU, split_positions), plan(CPU, whole_positions)):
            if sp["layers"] == ["embed", "block1"]:
                assert sp["act_mb"] - positions == (plain["act_mb"] - positions) / tp
                assert sp["act_step"] - ids - 4 * positions == (plain["act_step"] - ids - 4 * positions) / tp
            else:
                assert sp["act_mb"] < plain["act_mb"], "the head's norm keeps 1/tp of its input"
            # Beside the activations, pp sends one number of the clipping's gradient norm (4 bytes, one of 2 ranks).
            assert sp["pp_bytes"] - 4 == (plain["pp_bytes"] - 4) / tp > 0


def test_the_schedule_walked_is_torchs_interleaved_1f1b():
    """The order of forwards and backwards of each local stage, as ScheduleInterleaved1F1B plans it on each rank."""
    for pp, rounds in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4)):
        M = pp * rounds
        for rank in range(pp):
            torchs = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # its plan, without stages to run
            torchs.n_local_stages, torchs.pp_group_size, torchs._n_microbatches = 2, pp, M
            torchs.number_of_rounds, torchs.microbatches_per_round = rounds, pp
            order = [(action.stage_index // pp, 1 if action.computation_type == _ComputationType.FORWARD else -1)
                     for action in torchs._calculate_single_rank_operations(rank) if action is not None]
            assert list(schedule(pp, M, rank)) == order, (pp, M, rank)


def test_the_first_pipeline_rank_holds_the_most_micro_batches():
    """Interleaved 1F1B warms up longest on the first rank: with pp 4 and M 8 (16 stages' micro-batches a rank) the
    first rank holds about 5 micro-batches at once, the last fewer than 2; neither all of the step's."""
    rows = plan(dataclasses.replace(BIG["1b"], n_layer=14), Layout(4, 1, 1, batch_size=8, microbatches=8))
    held = [row["peak_act"] / row["act_mb"] for row in rows]
    assert 4.5 < held[0] < 6 and held[-1] < 2, held
    assert all(row["peak_act"] < row["act_step"] for row in rows)


def test_fsdp_holds_both_stages_gradients_at_once_only_when_a_round_of_micro_batches_follows_another():
    """pp 2, dp 1, fp32: a rank's gathered weights are as many bytes as its shards (no padding, no other dtype), and
    their gradients as many. With M = pp, one round, the later of a rank's stages runs all its backwards, and its
    gradients are reduce-scattered and its weights freed, before the earlier stage's first backward: all the weights
    but one stage's gradients at most. With two rounds the earlier stage's backwards begin before: both stages'."""
    for microbatches, both in ((2, False), (4, True)):
        for row in plan(CPU, Layout(2, 1, 1, batch_size=2 * microbatches, microbatches=microbatches)):
            assert row["params"] < row["gathered"] <= 2 * row["params"]
            assert (row["gathered"] == 2 * row["params"]) == both, (microbatches, row)


def test_the_last_stage_keeps_every_micro_batchs_logits_whatever_its_pipeline_rank():
    """The logits of a micro-batch stay until the step ends, not only while it is in flight: M of them on the ranks of
    the head, whichever pipeline rank holds it (the first warms up longest, the last least), none elsewhere."""
    for layout in LAYOUTS:
        n = layout.batch_size // layout.microbatches * CPU.context
        for row in plan(CPU, layout):
            one = n * split(CPU.vocab_size, layout.tp, row["coordinates"][2]) * (2 if layout.precision == "bf16" else 4)
            assert row["logits"] == layout.microbatches * one * ("head" in row["layers"]), (layout, row)


def test_fit_finds_a_layout_for_1b_on_8_gpus_and_none_for_8b_on_one(capsys):
    memory_plan.main(["--fit", "--gpus", "8", "--gpu_gib", "80", "--size", "1b"])
    listed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  pp ") and line.endswith("fits") for line in listed), listed
    assert len([line for line in listed if line.startswith("  pp ")]) == 20, "pp 1, 2, 4, 8 x tp, with and without AC"
    memory_plan.main(["--fit", "--gpus", "1", "--gpu_gib", "80", "--size", "8b"])
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  pp ")]
    assert len(listed) == 2 and not any(line.endswith("fits") for line in listed), listed
    assert all(total > 0.85 * 80 * 2**30 for _, total, _ in memory_plan.fit(BIG["8b"], 1, 80))
    # On 8 GPUs, 8B sharded over dp 8 alone (pp 1, the step's FSDP: reshard_after_forward=False): every weight
    # gathered in bf16 with its fp32 gradient (weights of 128,256 rows padded to 8 equal shards), the 8 micro-batches'
    # logits (bf16, a sequence of 8,192 positions each), the loss's temporaries: over 85% of 80 GiB even with
    # checkpointing.
    weights = [shape for name in ["embed", *["block"] * 32, "head"] for shape, _ in memory_plan.layer_params(
        BIG["8b"], name)]
    first = plan(BIG["8b"], Layout(1, 8, 1, batch_size=8, microbatches=8, precision="bf16",
                                   checkpoint_activations=True))[0]
    assert first["gathered"] == sum(2 * -(-shape[0] // 8) * 8 * math.prod(shape[1:]) + 4 * math.prod(shape)
                                    for shape in weights)
    assert first["logits"] == 8 * 8192 * 128256 * 2 and first["loss"] == 3 * 8192 * 128256 * 4 + 40 * 8192
    fits = {layout.checkpoint_activations: fit for layout, _, fit in memory_plan.fit(BIG["8b"], 8, 80)
            if (layout.pp, layout.dp, layout.tp) == (1, 8, 1)}
    assert fits == {False: False, True: False}
    # ZeRO-3 (reshard after forward, no pipeline schedule): two layers gathered at a time, one micro-batch's logits:
    # with checkpointing it fits.
    zero3 = {layout.checkpoint_activations: (total, fit) for layout, total, fit in memory_plan.fit(
        BIG["8b"], 8, 80, reshard_after_forward=True) if (layout.pp, layout.dp, layout.tp) == (1, 8, 1)}
    assert zero3[True][1] and not zero3[False][1], zero3
    assert plan(BIG["8b"], Layout(1, 8, 1, 8, 8, "bf16", True, reshard_after_forward=True))[0]["gathered"] < (
        first["gathered"] / 8)
    # The margin: a layout under 80 GiB but over 85% of it does not fit.
    within = [(layout, fit) for layout, total, fit in memory_plan.fit(BIG["8b"], 8, 80) if 68 < total / 2**30 <= 80]
    assert within and not any(fit for _, fit in within), within


def test_the_command_prints_a_row_per_rank(capsys):
    memory_plan.main(["--size", "cpu", "--pp", "2", "--dp", "2", "--tp", "2", "--batch_size", "4",
                      "--microbatches", "2", "--checkpoint_activations", "--precision", "bf16"])
    rows = capsys.readouterr().out.splitlines()[3:]
    assert [int(row.split()[0]) for row in rows] == list(range(8))


def test_check_names_what_disagrees():
    layout = Layout(2, 1, 2)
    records = {row["rank"]: dict(params=row["params"], grads=row["grads"], optim=row["optim"],
                                 activation_bytes=row["act_step"]) for row in plan(CPU, layout, device="cpu")}
    assert check(records, CPU, layout) == []
    records[1]["params"] += 1
    records[2]["activation_bytes"] = round(records[2]["activation_bytes"] * 1.02)
    assert [(rank, field) for rank, field, _, _ in check(records, CPU, layout)] == [(1, "params"),
                                                                                    (2, "activation_bytes")]


@pytest.mark.slow
def test_the_plan_of_every_rank_is_what_a_job_measures(tmp_path):
    """2 ranks, tp 2 (the vocabulary cut 29 and 28), 2 micro-batches of 2 sequences: every rank's params, grads and
    optim to the byte, its activations within ACTIVATION_TOLERANCE (measured here: to the byte)."""
    text = help_excerpt()
    layout = Layout(pp=1, dp=1, tp=2, batch_size=4, microbatches=2)
    job = run(torchrun("one_mesh.py", 1, 1, "--workload", "gpt-cpu", "--text", text, "--dropout", 0, "--batch_size",
                       4, "--pp", 1, "--tp", 2, "--microbatches", 2, nproc=2), cwd=tmp_path,
              env={RUN_DIR_VARIABLE: "runs"}, timeout=240)
    records = rank_records(job)[0]
    compared = compare(records, config_of("cpu", text), layout)
    assert len(compared) == 8 and len({planned for _, field, planned, _ in compared if field == "params"}) == 2
    assert check(records, config_of("cpu", text), layout) == [], compared


def test_the_memory_timeline_names_each_allocation_by_what_held_it():
    """benchmarks/one_mesh.replay on made-up events (time, bytes allocated or freed, address, mark): an allocation
    takes the first category (CATEGORIES' order) it was seen in at any mark of its life (a received input that autograd
    also keeps is a pipeline buffer); one never seen is a temporary; one whose free the profiler missed (another thread
    freed it) ends where its address is allocated again, or, gone at a scan of the live tensors, at the first mark
    after it was made."""
    assert CATEGORIES.index("pipeline") < CATEGORIES.index("saved")
    events = [(0, 100, 1, None), (1, 0, None, 0), (2, 50, 2, None), (3, 30, 3, None), (4, -50, 2, None),
              (5, 0, None, 1), (6, 20, 3, None), (7, 40, 4, None), (8, 0, None, 2), (9, 0, None, 3)]
    marks = [dict(label="m0", seen={1: "saved"}, alive=None), dict(label="m1", seen={1: "pipeline"}, alive=None),
             dict(label="m2", seen={}, alive=None), dict(label="m3", seen={}, alive={1, 3})]
    timeline = replay(events, marks)
    assert [(label, sums["pipeline"], sums["saved"], sums["temporary"]) for label, sums in timeline] == [
        (None, 100, 0, 0), ("m0", 100, 0, 0), (None, 100, 0, 50), (None, 100, 0, 80), (None, 100, 0, 30),
        ("m1", 100, 0, 30), (None, 100, 0, 20), (None, 100, 0, 60), ("m2", 100, 0, 20), ("m3", 100, 0, 20)]


# --- the plan against every rank of four 8-rank layouts ---------------------------------------------------------------

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """benchmarks/one_mesh.py's part 4 on the tests' excerpt of the help pages (a vocabulary of 57): every rank's
    figures of each of its layouts (plan_layouts), {layout name: [figures of rank 0, 1, ...]}. One job of 8 processes
    (~1 minute here), shared."""
    job = run([PYTHON, script("benchmarks/one_mesh.py"), "--parts", "plan", "--chars", EXCERPT_CHARS, "--plan_json",
               "measured.json"], cwd=tmp_path_factory.mktemp("plan"), shared=True, timeout=400)
    return json.loads((job.cwd / "measured.json").read_text())


def planned_and_measured(measured):
    """(layout, the plan's row, the measured figures) for every rank of every layout the job ran."""
    config = config_of("cpu", help_excerpt())
    assert list(measured) == list(plan_layouts())
    return [(layout, row, figures) for name, layout in plan_layouts().items()
            for row, figures in zip(plan(config, layout, device="cpu"), measured[name], strict=True)]


# What the job measures for each column of the plan (MemoryTimeline's categories, by what holds each storage).
MEASURED_AS = {"peak_act": "saved"}


@pytest.mark.slow
@pytest.mark.parametrize("column", ["params", "grads", "optim", "gathered", "logits", "pipeline", "peak_act", "held"])
def test_each_rank_held_at_most_what_the_plan_counts_for_each_column(measured, column):
    """The most each rank held at once in a step: its shards and AdamW's state; FSDP's unsharded weights and the
    gradients accumulated in them; the logits the schedule kept; the receive buffers and the sent tensors; what
    autograd kept; all of them together (with the batch) at a moment between two passes. Tensors of shapes the plan
    knows: to the byte. What autograd keeps and `held`, which includes it, within ACTIVATION_TOLERANCE, as the jobs'
    activations (measured here: to the byte, every rank of every layout)."""
    off = []
    for layout, row, figures in planned_and_measured(measured):
        planned, actual = row[column], figures[MEASURED_AS.get(column, column)]
        tolerance = ACTIVATION_TOLERANCE * actual if column in ("peak_act", "held") else 0
        if abs(planned - actual) > tolerance:
            off.append((layout, row["rank"], planned, actual))
    assert off == [], off


@pytest.mark.slow
def test_the_loss_temporaries_are_three_fp32_slices_of_the_logits_and_a_few_numbers_a_position(measured):
    """On the ranks that hold the head, the most the memory rose in a micro-batch's backward until the logits'
    gradient was made: the plan's LOSS_COPIES fp32 slices of the logits and LOSS_PER_POSITION bytes a position, less at
    most one 8-byte number a position (measured: 33 bytes a position, on vocabulary slices of 12 to 57); none
    elsewhere."""
    for layout, row, figures in planned_and_measured(measured):
        positions = layout.batch_size // layout.microbatches * CPU.context
        if "head" in row["layers"]:
            assert 0 <= row["loss"] - figures["loss"] <= 8 * positions, (layout, row["rank"], row["loss"], figures)
        else:
            assert row["loss"] == figures["loss"] == 0, (layout, row["rank"], figures)


@pytest.mark.slow
def test_the_total_exceeds_the_plan_by_no_more_than_a_pass_temporaries(measured):
    """Everything the allocator held at once, temporaries included: never below the plan's total (which counts nothing
    a rank does not hold at that moment), and above it by no more than pass_temporaries, the most a pass holds beyond
    what the plan counts and leaves to MARGIN: a block's activation gradients and one layer's gathered weights'
    worth of FSDP's buffers (measured: 0.10 to 0.57 of it)."""
    for layout, row, figures in planned_and_measured(measured):
        assert row["total"] <= figures["total"] <= row["total"] + row["pass_temporaries"], (layout, row, figures)


@pytest.mark.slow
@pytest.mark.parametrize("dimension", ["pp", "dp", "tp"])
def test_what_each_rank_sends_over_each_dimension_is_what_the_plan_counts(measured, dimension):
    """The collectives of a step over the dimension's group, weighed as benchmarks/communication.py weighs them (a
    ring's share of each, a send's whole; a group of one rank sends nothing): the plan's figure to the byte, the
    gradient norm's few numbers included."""
    key = f"{dimension}_bytes"
    off = [(layout, row["rank"], row[key], figures[key]) for layout, row, figures in planned_and_measured(measured)
           if figures[key] != row[key]]
    assert off == [], off


def test_fit_plans_only_the_ranks_that_hold_the_most():
    """fit() plans dp rank 0 of every pp x tp coordinate (memory_plan.fullest_ranks): no rank of the layout holds more
    than the dp rank 0 of its coordinate, so their largest total is the layout's, for every layout with uneven cuts
    (the CPU GPT) and the 8B GPT's over 64 GPUs."""
    big = [Layout(pp, dp, tp, 8, 8, "bf16", checkpointed) for pp, dp, tp in [(1, 8, 8), (4, 4, 4), (8, 8, 1)]
           for checkpointed in (False, True)]
    for config, layouts in ((CPU, LAYOUTS), (BIG["8b"], big)):
        for layout in layouts:
            rows = plan(config, layout)
            fullest = memory_plan.fullest_ranks(layout)
            for row in rows:
                pp_rank, _, tp_rank = row["coordinates"]
                first = rows[pp_rank * layout.dp * layout.tp + tp_rank]
                assert first["rank"] in fullest and row["total"] <= first["total"], (layout, row["rank"])
            assert max(rows[rank]["total"] for rank in fullest) == max(row["total"] for row in rows), layout


@pytest.mark.slow  # arithmetic alone, in this process: 13 s of CPU (every layout of 3 sizes on 8, 64 and 512 GPUs)
def test_the_worked_example_is_the_largest_gpt_and_layout_the_plan_picks():
    """docs/reference/plan-at-scale.md's worked example, row by row (8, 64 and 512 H100s): the largest of
    utils/gpt.SHAPES that some layout fits, the layout of the highest MFU on paper, its planned peak, its step, its MFU
    and how many layouts fit, as `tools/memory_plan.py --largest` computes them."""
    from pathlib import Path

    from utils.estimates import GPUS

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "plan-at-scale.md").read_text()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in page.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [row[0] for row in rows] == ["8", "64", "512"], rows
    for gpus, size, _, layout, peak, step, mfu, count in rows:
        name, layouts, _ = memory_plan.largest(int(gpus), GPUS["h100"])
        best = layouts[0]
        picked = " × ".join(f"{dim} {best['layout'][dim]}" for dim in ("pp", "dp", "tp")) + (
            ", recomputation" if best["layout"]["checkpoint_activations"] else "")
        assert (size.split()[0], layout, peak, step, mfu, count) == (
            name.upper(), picked, f"{best['total'] / 2**30:.1f} GiB", f"{best['step']:.2f} s", f"{best['mfu']:.1%}",
            str(len(layouts))), gpus
