"""Step 14, plan_at_scale.py: the planner runs the steps' own code for one rank of a job of any size, in one process,
and what it counts is what real jobs do. Against real gloo jobs of five steps (DDP, FSDP, 2D, pp x dp x tp, EP), every
rank, recorded by harness/jobs' traffic plugin: every collective of a step (kind, group, bytes) and the weights,
gradients and optimizer state each rank holds, to the byte; the activations autograd keeps, to the byte (the mixture
of experts, whose router sends each rank a share of tokens that depends on the data: over its ep group). Against
tools/memory_plan.py's arithmetic at 8, 64 and 1,024 ranks: the same figures. The napkin math (utils/estimates.py)
against hand computations; bad layouts stop with one line.

The real jobs train the CPU-size GPT on the tests' excerpt of the help pages (64 sequences of 64 characters), one
epoch of 4 to 8 optimizer steps; the third step of each rank is compared (the first ones set things up: DDP rebuilds
its buckets after the first, and says so to the other ranks in the second)."""
import json
from collections import Counter

import pytest

import plan_at_scale
from harness.jobs import run, torchrun
from tools.memory_plan import ACTIVATION_TOLERANCE, Layout, config_of
from utils.estimates import GPUS, device_flops, mfu, recomputed_flops, step_time, textbook
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, SHAPES, flops_per_token
from utils.traffic import sent_per_rank

COMPARED_STEP = 3
# Each layout: the real job's command (the excerpt and dropout 0 come from the environment) and the planner's options
# for the same job.
JOBS = {
    "DDP (gpt.py)": (torchrun("gpt.py", 1, 1, "--workload", "gpt-cpu", "--batch_size", 8, nproc=2),
                     ["--step", "gpt", "--world", 2, "--batch_size", 8, "--microbatches", 1]),
    "FSDP (fsdp.py)": (torchrun("fsdp.py", 1, 1, "--workload", "gpt-cpu", "--batch_size", 8, nproc=2),
                       ["--step", "fsdp", "--world", 2, "--batch_size", 8, "--microbatches", 1]),
    "2D (tensor_parallel.py)": (
        torchrun("tensor_parallel.py", 1, 1, "--workload", "gpt-cpu", "--batch_size", 8, "--tp", 2, nproc=4),
        ["--step", "tensor_parallel", "--world", 4, "--tp", 2, "--batch_size", 8, "--microbatches", 1]),
    "pp x dp x tp (one_mesh.py)": (
        torchrun("one_mesh.py", 1, 1, "--workload", "gpt-cpu", "--batch_size", 4, "--pp", 2, "--tp", 2,
                 "--microbatches", 2, nproc=8),
        ["--step", "one_mesh", "--world", 8, "--pp", 2, "--tp", 2, "--batch_size", 4, "--microbatches", 2]),
    "EP (expert_parallel.py)": (
        torchrun("expert_parallel.py", 1, 1, "--workload", "gpt-moe-cpu", "--batch_size", 4, "--ep", 2, nproc=4),
        ["--step", "expert_parallel", "--world", 4, "--ep", 2, "--batch_size", 4, "--microbatches", 1]),
}


def planned(options, text):
    """The planner's plan of every rank (in this process: it is one process by design), fp32 as the jobs train."""
    args = plan_at_scale.parse([*map(str, options), "--size", "cpu", "--text", str(text), "--precision", "fp32",
                                "--ranks", "all"])
    return plan_at_scale.plan_job(args, say=lambda line: None)


@pytest.fixture(scope="module")
def real_and_planned(tmp_path_factory, text):
    """real_and_planned(layout): (each rank's record of its third step, the plan): the real job, recorded by the
    traffic plugin (shared: notebooks/14_plan_at_scale.ipynb reads the same), and the planner's plan of it; each
    made once, when a test first asks for it."""
    done = {}

    def get(name):
        if name not in done:
            command, options = JOBS[name]
            job = run(command, cwd=tmp_path_factory.mktemp("real"), record=True, timeout=300, shared=True,
                      env={"JOB_RECORD_PLUGINS": "traffic", TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0})
            records = {record["rank"]: record for record in job.records("traffic.jsonl")
                       if record["step"] == COMPARED_STEP}
            done[name] = records, planned(options, text)
        return done[name]

    return get


def collectives(calls):
    """A step's collectives as a multiset of (kind, the group's ranks, bytes)."""
    return Counter((kind, tuple(members), size) for kind, members, size in calls)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a real job (its own bound: 300 s) and every rank of it planned, on a busy machine
@pytest.mark.parametrize("layout", JOBS)
def test_every_rank_holds_and_sends_what_the_planner_counts(real_and_planned, layout):
    """Each rank's weights, gradients and AdamW's state to the byte; every collective of its step, the same kind over
    the same ranks with the same bytes, as many times. The mixture of experts' all-to-alls of tokens carry what its
    routers chose, data the planner cannot know (fake tensors hold no values): the planner routes evenly; the real
    job's are as many and, over each ep group, as many bytes in all (every token sent is received)."""
    records, plan = real_and_planned(layout)
    assert sorted(records) == [p["rank"] for p in plan["plans"]], "a record of every rank"
    counts = 8 * plan["config"]["experts"]  # the bytes of an all-to-all of the counts: an int64 an expert
    routed = Counter()  # the tokens' all-to-alls: ("planned" or "real", the group's ranks) -> their bytes in all
    for p in plan["plans"]:
        real = records[p["rank"]]
        assert {key: p[key] for key in ("params", "grads", "optim")} == {key: real[key] for key in
                                                                         ("params", "grads", "optim")}, p["rank"]
        mine = collectives([c["kind"], c["members"], c["bytes"]] for c in p["collectives"])
        theirs = collectives(real["collectives"])
        for who, calls in (("planned", mine), ("real", theirs)):
            tokens = [key for key in calls if key[0] == "all-to-all" and key[2] != counts]
            routed[(who, "all-to-alls")] += sum(calls[key] for key in tokens)
            for key in tokens:
                routed[(who, key[1])] += calls.pop(key) * key[2]
        assert mine == theirs, (p["rank"], mine - theirs, theirs - mine)
    for (who, group), value in routed.items():
        assert value == routed[("real" if who == "planned" else "planned", group)], routed


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [name for name in JOBS if not name.startswith("pp")])
def test_every_rank_keeps_for_backward_what_the_planner_counts(real_and_planned, layout):
    """What autograd keeps for backward in a step (utils/memory.saved_for_backward, as one_mesh.py measures it), each
    rank to the byte; the mixture of experts' over each ep group, within 1%: an expert's activations grow with the
    tokens the router sends it, the even routing's group total against the real one's (the regrouping's indices are
    not linear in them)."""
    records, plan = real_and_planned(layout)
    if not layout.startswith("EP"):
        assert [(p["rank"], p["activations"]) for p in plan["plans"]] == [
            (p["rank"], records[p["rank"]]["activations"]) for p in plan["plans"]]
        return
    for group in ({0, 1}, {2, 3}):
        planned_bytes = sum(p["activations"] for p in plan["plans"] if p["rank"] in group)
        real_bytes = sum(records[rank]["activations"] for rank in group)
        assert planned_bytes == pytest.approx(real_bytes, rel=0.01), (group, planned_bytes, real_bytes)


@pytest.fixture(scope="module")
def mesh8(tmp_path_factory, text):
    """tests/test_one_mesh.py's job of 8 ranks (pp 2 x dp 2 x tp 2, 2 micro-batches of 2 sequences): shared, it runs
    once in a test session. Run without the recorder, whose counting of each pipeline stage's forward would hide what
    the step measures itself."""
    return run(torchrun("one_mesh.py", 3, 1, "--workload", "gpt-cpu", "--text", text, "--dropout", 0, "--batch_size",
                        4, "--pp", 2, "--tp", 2, "--microbatches", 2, nproc=8), cwd=tmp_path_factory.mktemp("mesh8"),
               env={"TUTORIAL_RUN_DIR": "runs"}, timeout=300, shared=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_rank_of_the_mesh_keeps_what_it_says_it_keeps_and_the_planner_counts(real_and_planned, mesh8):
    """one_mesh.py's own memory lines (its first step's activations, its weights, gradients and Adam's state, every
    rank): the planner's figures, within memory_plan.ACTIVATION_TOLERANCE for the activations (to the byte here)."""
    from expect import rank_records

    lines = rank_records(mesh8)[0]
    _, plan = real_and_planned("pp x dp x tp (one_mesh.py)")
    for p in plan["plans"]:
        line = lines[p["rank"]]
        assert {key: p[key] for key in ("params", "grads", "optim")} == {key: line[key] for key in
                                                                         ("params", "grads", "optim")}
        assert p["activations"] == pytest.approx(line["activation_bytes"], rel=ACTIVATION_TOLERANCE), p["rank"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [8, 64, 1024])
def test_the_planner_counts_what_the_memory_plan_computes_at_8_64_and_1024_ranks(world, text):
    """The first and the last pipeline rank of step 11's mesh (pp 2, tp 2, dp the rest; bf16, checkpointed, 4
    micro-batches): their shards, gradients and Adam's state, what autograd keeps, and the bytes they send over each
    dimension, as tools/memory_plan.py computes them from the shapes alone (its figures are checked against real jobs
    in tests/test_memory_plan.py): equal."""
    options = ["--step", "one_mesh", "--world", world, "--pp", 2, "--tp", 2, "--batch_size", 8, "--microbatches", 4,
               "--checkpoint_activations", "--precision", "bf16"]
    args = plan_at_scale.parse([*map(str, options), "--size", "cpu", "--text", str(text)])
    planned_ranks = plan_at_scale.plan_job(args, say=lambda line: None)["plans"]
    layout = Layout(2, world // 4, 2, batch_size=8, microbatches=4, precision="bf16", checkpoint_activations=True)
    config = config_of("cpu", text)
    for p in planned_ranks:
        computed = plan_row(config, layout, p["rank"])
        sent = {dim: round(sum(row["sent"] for row in p["tally"] if row["group"] == dim)) for dim in ("pp", "dp", "tp")}
        assert (p["params"], p["grads"], p["optim"], p["activations"]) == tuple(
            computed[key] for key in ("params", "grads", "optim", "act_step")), p["rank"]
        assert sent == {dim: computed[f"{dim}_bytes"] for dim in ("pp", "dp", "tp")}, p["rank"]


def plan_row(config, layout, rank):
    """tools/memory_plan.py's row of one rank (CPU: LayerNorm's statistics in the compute dtype)."""
    from tools.memory_plan import plan_rank

    return plan_rank(config, layout, rank, device="cpu")


TEXTBOOK = {"gpt": ["--world", 8, "--batch_size", 8], "fsdp": ["--world", 8, "--batch_size", 8],
            "tensor_parallel": ["--world", 8, "--tp", 2, "--batch_size", 8],
            "expert_parallel": ["--world", 8, "--ep", 2, "--batch_size", 4]}
LEFT_OUT = 0.02  # what the formulas leave out, at the CPU size: FSDP's padding, the norms and biases tp copies


@pytest.mark.slow  # four ranks of the CPU-size GPT traced in this process: 25 s of CPU
@pytest.mark.parametrize("step", TEXTBOOK)
def test_the_textbook_formulas_are_the_planners_counts_but_for_what_they_leave_out(step, text):
    """docs/reference/plan-at-scale.md's formulas (utils/estimates.textbook) against the planner's rank 0 of 8 ranks,
    bf16: what it holds and what it sends over each group, within 2% (at the CPU size, 64 wide, the biases and norms
    the formulas leave out come to 1.3% of a tp rank's state); no group the formulas miss."""
    options = ["--step", step, *TEXTBOOK[step], "--microbatches", 1, "--precision", "bf16", "--ranks", 0]
    args = plan_at_scale.parse([*map(str, options), "--size", "cpu", "--text", str(text)])
    plan = plan_at_scale.plan_job(args, say=lambda line: None)
    rank = plan["plans"][0]
    config = plan_at_scale.model_config(args)
    book = textbook(step, config, 8, tp=args.tp, ep=args.ep, sequences=args.batch_size, precision="bf16")
    sent = Counter()
    for row in rank["tally"]:
        sent[row["group"]] += row["sent"]
    assert rank["params"] + rank["grads"] + rank["optim"] == pytest.approx(book["state"], rel=LEFT_OUT)
    assert set(sent) == set(book["sent"]), (sent, book["sent"])
    for group, bytes_ in book["sent"].items():
        assert sent[group] == pytest.approx(bytes_, rel=LEFT_OUT), group


# --- the napkin math, by hand ----------------------------------------------------------------------------------------

def test_a_devices_model_flops_are_6n_plus_attention_over_its_tokens_shared_by_tp_pp_and_cp():
    """The 8B shape, by hand: N, the weights that multiply (every block, the final norm and the head; the embeddings
    are looked up), 6 N a token plus attention's 12 L C T; a dp rank's 8 sequences of 8,192 tokens, computed by its
    tp x pp x cp devices together."""
    config = SHAPES["8b"]
    C, L, T, V = 4096, 32, 8192, 128256
    block = 12 * C * C + 13 * C  # q, k, v, proj (C x C and a bias each), fc and proj (4 C x C, biases), 2 norms
    N = L * block + 2 * C + C * V
    assert flops_per_token(config) == 6 * N + 12 * L * C * T
    per_token = 6 * N + 12 * L * C * T
    assert device_flops(config, 8) == 8 * T * per_token
    assert device_flops(config, 8, tp=8, pp=4, cp=2) == 8 * T * per_token / 64
    # The mistake of dividing by the dp ranks alone: the job's tokens over 1,024 devices are each device's share only
    # when divided by all of them (dp 16 x tp 8 x pp 8), not by dp's 16.
    job = 16 * 8 * T * per_token
    assert job / 1024 == device_flops(config, 8, tp=8, pp=8)
    assert job / 16 == 64 * device_flops(config, 8, tp=8, pp=8)
    # Recomputation adds a third of the blocks' forward and backward (the head and the embeddings are not
    # recomputed): hardware's work, not the model's.
    head = 6 * (2 * C + C * V)
    assert recomputed_flops(config, 8) == pytest.approx(8 * T * (per_token - head) / 3)


def test_the_mfu_of_a_step_is_its_model_flops_over_the_peak_in_its_time():
    """A device doing 989e12 x 0.5 model FLOPs in one second on an H100 (989 TFLOP/s dense bf16) is at 50%."""
    assert GPUS["h100"].flops == 989e12 and GPUS["h200"].flops == 989e12
    assert mfu(989e12 * 0.5, 1.0, 989e12) == pytest.approx(0.5)
    assert mfu(2e15, 4.0, 1e15) == pytest.approx(0.5)


def test_a_steps_time_adds_the_bubble_tensor_and_pipeline_traffic_and_what_fsdps_outlasts_of_the_compute():
    """By hand, on an H100 (989e12 FLOP/s, NVLink 450e9 B/s, the network 50e9 B/s each way): 989e12 FLOPs are 1 s of
    compute; pp 4 with 8 micro-batches and 2 stages a rank idles 3/16 of it; 45e9 tp bytes on NVLink 0.1 s, 5e9 pp
    bytes on the network 0.1 s; 40e9 dp bytes on the network, 0.8 s, run beside the compute and add nothing, 60e9
    (1.2 s) add 0.2 s."""
    gpu = GPUS["h100"]
    time = step_time(989e12, gpu, tp_bytes=45e9, dp_bytes=40e9, pp_bytes=5e9, pp=4, microbatches=8)
    assert time["compute"] == pytest.approx(1.0) and time["bubble"] == pytest.approx(3 / 16)
    assert (time["tp"], time["pp"], time["dp"]) == pytest.approx((0.1, 0.1, 0.8))
    assert time["exposed"] == pytest.approx(0.2) and time["step"] == pytest.approx(1 + 3 / 16 + 0.2)
    assert step_time(989e12, gpu, dp_bytes=60e9)["exposed"] == pytest.approx(0.2)
    assert step_time(989e12, gpu, tp_bytes=45e9, tp_link="network")["tp"] == pytest.approx(0.9), "tp off NVLink"
    assert step_time(989e12, gpu, recomputed=989e12 / 2)["compute"] == pytest.approx(1.5)


def test_a_ring_sends_its_share_of_each_buffer():
    """(n - 1)/n of an all-gather's output or a reduce-scatter's input, twice that for an all-reduce, a send whole, a
    group of one nothing, an all-to-all what it sends to others."""
    assert sent_per_rank(dict(kind="all-gather", ranks=4, bytes=400)) == 300
    assert sent_per_rank(dict(kind="reduce-scatter", ranks=8, bytes=800)) == 700
    assert sent_per_rank(dict(kind="all-reduce", ranks=2, bytes=100)) == 100
    assert sent_per_rank(dict(kind="send/recv", ranks=2, bytes=100)) == 100
    assert sent_per_rank(dict(kind="all-reduce", ranks=1, bytes=100)) == 0
    assert sent_per_rank(dict(kind="all-to-all", ranks=4, bytes=400, sent=123)) == 123


def test_a_group_is_on_nvlink_when_its_ranks_are_one_nodes_gpus():
    assert plan_at_scale.link_of([0, 1, 2, 3, 4, 5, 6, 7], 8) == "nvlink"
    assert plan_at_scale.link_of([8, 9], 8) == "nvlink"
    assert plan_at_scale.link_of([7, 8], 8) == "network"
    assert plan_at_scale.link_of([0, 16, 32], 8) == "network"


@pytest.mark.parametrize("argv, line", [
    (["--world", "1000"], "--world 1000 is not a whole number of pp x tp x ep = 64 grids"),
    (["--pp", "1", "--tp", "3", "--world", "6", "--microbatches", "1"],
     "--tp 3 must divide the heads (32) and the context (8,192)"),
    (["--microbatches", "4", "--batch_size", "8"], "--microbatches 4 must be a multiple of --pp 8 (rounds of pp)"),
    (["--microbatches", "3", "--batch_size", "8"], "--microbatches 3 must divide --batch_size 8"),
    (["--pp", "32", "--tp", "1", "--microbatches", "32", "--batch_size", "32"],
     "--pp 32 makes 64 stages, more than the GPT's 34 layers (its blocks, the embedding and the head)"),
    (["--step", "fsdp", "--world", "64"], "fsdp.py takes one batch a step: --microbatches 1"),
    (["--step", "expert_parallel", "--world", "64", "--ep", "16", "--experts", "8", "--microbatches", "1"],
     "--ep 16 must divide the 8 experts of a layer"),
])
def test_a_layout_the_step_cannot_run_stops_with_one_line_before_anything_is_traced(argv, line):
    with pytest.raises(SystemExit) as stopped:
        plan_at_scale.plan_job(plan_at_scale.parse(argv), say=lambda line: None)
    assert str(stopped.value) == f"error: {line}"
