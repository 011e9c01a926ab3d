"""Step 8, pipeline_parallel.py: 2 stages on 2 ranks train exactly what one process trains (every epoch's loss and the
final weights), whatever the schedule; the snapshot holds the whole model under its own names and resumes on another
cut (2 stages -> 1 process -> 2 pipelines of 2 stages on 4 ranks), still as one process trains; the schedule, as the
recorder saw it run, is 1F1B's or GPipe's; on two nodes the pipelines cross the nodes, and with dropout and bf16 the
GPT learns and a worker SIGKILLed mid-run resumes to the very same end, bit for bit; bad input stops with one line.

The exact jobs train the CPU-size GPT (2 blocks: stage 0 holds the embedding and block 0, stage 1 block 1 and the
head) on a short excerpt of the help pages (`--text`): 64 training sequences of 64 characters, batches of 8, so 8
optimizer steps an epoch, fp32 and dropout 0. The jobs (each process spends ~5 s of CPU importing torch and its
pipelining): 1F1B with M=4; GPipe with M=4; the 1F1B snapshot resumed on 1 process, then on 4 ranks; a pair of
two-node jobs; a job with no batch to train on."""
import json
import math
import re
import shutil
from argparse import Namespace

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from expect import assert_bitwise_equal, sharded_snapshot, stopped_as_rank_0
from tools import pipeline_timeline
from harness.jobs import free_port, output, run, torchrun, torchrun_node
from harness.one_process import train_gpt
from utils import make_workload
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE
from utils.metrics import RUN_DIR_VARIABLE
from utils.pipeline import require_a_batch, require_pipeline_fits

B, EPOCHS, STEPS = 8, 2, 8  # sequences per batch (all pipelines together), epochs, optimizer steps an epoch
SNAPSHOT = "pp_snapshot"
# Equal up to float rounding: one process sums the whole batch's gradients at once, the stages micro-batch by
# micro-batch, and Adam's division by the gradients' running magnitude magnifies the difference in a few weights (at
# the CPU size's learning rate, 6e-3). Measured here (torch 2.14.1, x86): every epoch's loss within 5e-7, the weights
# within 5.0e-5 after 16 steps and 6.0e-5 after 32 (2 stages, then the other cuts); one process training other
# batches (4 per step) ends 0.13 away.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 2e-4


def gpt_args(text, *more, batch_size=B):
    """The GPT of the CPU's size (no dropout) learning `text` (a file), in batches of `batch_size` per pipeline."""
    return ("--workload", "gpt-cpu", "--text", text, "--dropout", 0, "--batch_size", batch_size, *more)


def pipeline(folder, text, epochs, *args, nproc=2, batch_size=B, **options):
    """A finished job of pipeline_parallel.py in `folder`, a snapshot at the end; per-rank metrics in its runs/."""
    return run(torchrun("pipeline_parallel.py", epochs, epochs, *gpt_args(text, *args, batch_size=batch_size),
                        nproc=nproc), cwd=folder, env={RUN_DIR_VARIABLE: "runs"}, timeout=240, **options)


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory, text):
    """1F1B with M=4 on 2 ranks (--pp 2), every optimizer step recorded: the gradient norm each stage's DDP
    all-reduced for it. notebooks/08_pipeline.ipynb runs the same job: shared, it runs once in a test session."""
    return pipeline(tmp_path_factory.mktemp("1f1b"), text, EPOCHS, "--schedule", "1f1b", "--microbatches", 4,
                    record_steps=True, shared=True)


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory, text):
    """GPipe with M=4, every pass recorded."""
    return pipeline(tmp_path_factory.mktemp("gpipe"), text, EPOCHS, "--schedule", "gpipe", "--microbatches", 4,
                    record=True)


@pytest.fixture(scope="module")
def another_cut(tmp_path_factory, text, one_f_one_b):
    """The 1F1B job's snapshot (2 stages, 2 epochs) resumed by one process holding the whole GPT (--pp 1) for a third
    epoch; that snapshot resumed on 4 ranks, 2 pipelines of 2 stages (1F1B, M=2), 4 sequences per pipeline, for a
    fourth: (one process's job, the 4 ranks' job)."""
    folder = tmp_path_factory.mktemp("another_cut")
    shutil.copytree(one_f_one_b.cwd / SNAPSHOT, folder / SNAPSHOT)
    alone = pipeline(folder, text, EPOCHS + 1, "--pp", 1, nproc=1, logs=folder / "alone")
    four = pipeline(folder, text, EPOCHS + 2, "--pp", 2, "--microbatches", 2, nproc=4, batch_size=B // 2,
                    logs=folder / "four", record=True)
    return alone, four


@pytest.fixture(scope="module")
def reference(text):
    """One process, batches of 8, 4 epochs; and the weights of one that trains other batches (4 per step)."""
    return dict(train_gpt(text, B, EPOCHS + 2, EPOCHS, drop_last=True),
                other_batches=train_gpt(text, B // 2, EPOCHS, drop_last=True))


def tensors(state):
    """A state_dict's tensors (a GPT's also holds the identity of its text, `_extra_state`)."""
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def weights(job):
    """The whole GPT's weights from the job's snapshot, every rank's part put together."""
    return tensors(sharded_snapshot(job.cwd / SNAPSHOT)["MODEL_STATE"])


def epoch_losses(job, last_stage_ranks=(1,)):
    """Each epoch's mean loss over the job's samples, unrounded: from the last stages' per-rank metrics files (a rank
    that held no last stage in an epoch reports no samples in it)."""
    totals = {}
    for rank in last_stage_ranks:
        for line in (job.cwd / "runs" / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if not record["samples"]:
                continue
            summed, samples = totals.get(record["epoch"], (0.0, 0))
            totals[record["epoch"]] = (summed + record["loss"] * record["samples"], samples + record["samples"])
    return {epoch: summed / samples for epoch, (summed, samples) in sorted(totals.items())}


def assert_close(actual, expected, atol=WEIGHT_TOLERANCE):
    assert actual.keys() == expected.keys()
    worst = max((actual[name] - tensor).abs().max().item() for name, tensor in expected.items())
    assert worst <= atol, f"the weights differ by up to {worst:.2e}"
    return worst


# --- 2 stages are one model -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_stages_on_two_ranks_train_what_one_process_does(one_f_one_b, reference):
    """Every epoch's loss and the final weights within the tolerances, where one process training other batches
    ends far outside them.

    Adam hardly sees the scale of the gradients, so the weights alone would not show a loss left undivided by M, or
    divided twice: each step's gradient norm, from the two stages' own (what DDP all-reduced, recorded by a
    communication hook), must be the one-process norm of the whole batch's mean. Clipping is on in the first steps
    (the norm is above 1), so the stages must clip by the whole model's norm: each by its own ends elsewhere."""
    assert sum(norm > 1 for norm in reference["norms"]) >= 4, reference["norms"]
    assert epoch_losses(one_f_one_b) == pytest.approx({e: reference["losses"][e] for e in range(EPOCHS)},
                                                      abs=LOSS_TOLERANCE)
    assert_close(weights(one_f_one_b), reference["weights"][EPOCHS])
    assert max((weights(one_f_one_b)[name] - tensor).abs().max() for name, tensor in
               reference["other_batches"]["weights"][EPOCHS].items()) > 100 * WEIGHT_TOLERANCE, \
        "the tolerance tells training on these batches from training on others"
    stages = [[step["grad_norms"] for step in one_f_one_b.steps if step["rank"] == rank] for rank in (0, 1)]
    assert all(len(norms) == 1 for rank in stages for norms in rank), "one all-reduce per step and stage"
    whole = [math.hypot(first[0], last[0]) for first, last in zip(*stages)]
    assert whole == pytest.approx(reference["norms"][:EPOCHS * STEPS], rel=1e-4), (whole, reference["norms"])


@pytest.mark.slow
def test_gpipe_ends_bit_for_bit_where_1f1b_does(one_f_one_b, gpipe):
    """GPipe and 1F1B compute the same micro-batches and sum their gradients in the same order: only when each pass
    runs differs, so their snapshots are equal bit for bit (weights, optimizer state, schedule, random state)."""
    assert_bitwise_equal(sharded_snapshot(gpipe.cwd / SNAPSHOT), sharded_snapshot(one_f_one_b.cwd / SNAPSHOT))


@pytest.mark.slow
def test_the_snapshot_holds_the_whole_model_under_its_own_names_each_stage_writing_its_layers(one_f_one_b):
    """One snapshot for the whole pipeline: every rank writes its part (its stage's layers, their optimizer state
    under the same names), rank 0 the metadata; read back whole, it is the GPT's state_dict and its loop's state."""
    folder = one_f_one_b.cwd / SNAPSHOT
    assert sorted(path.name for path in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    snapshot = sharded_snapshot(folder)
    assert set(snapshot) == {"MODEL_STATE", "OPTIMIZER_STATE", "SCHEDULER_STATE", "RNG_STATES", "EPOCHS_RUN", "STEP"}
    assert (snapshot["EPOCHS_RUN"], snapshot["STEP"]) == (EPOCHS, "pipeline_parallel.py")
    assert snapshot["SCHEDULER_STATE"]["last_epoch"] == EPOCHS * STEPS
    gpt = make_workload("gpt-cpu").model.state_dict()
    assert tensors(snapshot["MODEL_STATE"]).keys() == tensors(gpt).keys()
    assert {name for name in snapshot["OPTIMIZER_STATE"] if name.startswith("state.")} == {
        f"state.{name}.{moment}" for name in tensors(gpt) for moment in ("step", "exp_avg", "exp_avg_sq")}
    stored = FileSystemReader(folder).read_metadata().storage_data  # which rank's file holds each weight
    writer = {index.fqn.removeprefix("MODEL_STATE."): place.relative_path for index, place in stored.items()
              if index.fqn.startswith("MODEL_STATE.")}
    for name in tensors(gpt):
        stage = 0 if name.split(".")[0] in ("embed", "block0") else 1
        assert writer[name] == f"__{stage}_0.distcp", (name, writer[name])


@pytest.mark.slow
def test_the_snapshot_resumes_on_another_cut_as_one_process_trains(another_cut, reference):
    """2 stages -> 1 process (one stage: the whole GPT) -> 2 pipelines of 2 stages on 4 ranks: every rank reads the
    layers its stage holds, under their names; the epochs after each resume are what one process trains, and the two
    pipelines' batches of 4 are one process's batch of 8 (DDP averages each stage's gradients over its copies)."""
    alone, four = another_cut
    assert output.resumes(alone.output) == {0: EPOCHS} and output.resumes(four.output) == {0: EPOCHS + 1}
    assert epoch_losses(alone, last_stage_ranks=(0,)) == pytest.approx({EPOCHS: reference["losses"][EPOCHS]},
                                                                       abs=LOSS_TOLERANCE)
    assert epoch_losses(four, last_stage_ranks=(2, 3)) == pytest.approx(
        {EPOCHS + 1: reference["losses"][EPOCHS + 1]}, abs=LOSS_TOLERANCE)
    assert_close(weights(four), reference["weights"][EPOCHS + 2])
    layout = {row["rank"]: row["mesh"] for row in four.samples}
    assert layout == {0: {"pp": 0, "dp": 0}, 1: {"pp": 0, "dp": 1}, 2: {"pp": 1, "dp": 0}, 3: {"pp": 1, "dp": 1}}


@pytest.mark.slow
def test_the_gpt_is_put_back_together_for_the_held_out_loss_and_a_sample(one_f_one_b, reference):
    """Rank 0 (stage 0) prints the mean loss of all samples, the held-out loss of the whole model put back together
    from both stages (what one process's model scores), and its text."""
    assert re.search(r"^\[rank 0/2 \| local 0 \| cpu\] epoch 1 \| steps 8 \| loss [\d.]+ \| [\d,]+ tokens/s$",
                     one_f_one_b.output, re.M), one_f_one_b.output
    held_out = output.held_out(one_f_one_b.output)
    assert held_out["samples"] == 7 and held_out["loss"] == pytest.approx(reference["held_out"], abs=1e-4)
    [(steps, sample)] = output.samples(one_f_one_b.output)
    assert steps == EPOCHS * STEPS and len(sample) >= 190, sample


# --- the schedule, as it ran ------------------------------------------------------------------------------------------

def recorded_steps(job):
    """{step: events} of every optimizer step of the job."""
    steps = pipeline_timeline.by_step(job.records("pipeline.jsonl"))
    assert set(steps) == set(range(EPOCHS * STEPS)), sorted(steps)
    return steps


@pytest.mark.slow
def test_1f1b_alternates_a_forward_and_a_backward_and_holds_at_most_two_micro_batches(one_f_one_b):
    """Stage 0 fills the pipeline with 2 forwards (stages - 0), stage 1 with 1; then each backward frees a micro-batch
    before the next forward: stage 0 never holds more than 2 micro-batches' activations, stage 1 never more than 1."""
    for step, events in recorded_steps(one_f_one_b).items():
        assert pipeline_timeline.order(events, 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], step
        assert pipeline_timeline.order(events, 1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"], step
        assert [pipeline_timeline.held(events, stage)[0] for stage in (0, 1)] == [2, 1], step
        assert_data_flows_between_the_stages(events)


@pytest.mark.slow
def test_gpipe_runs_every_forward_first_and_holds_every_micro_batch(gpipe, one_f_one_b):
    """All 4 forwards, then all 4 backwards, on both stages: each stage holds the whole batch's activations at its
    peak, twice (stage 0) and four times (stage 1) what 1F1B holds with the same micro-batches."""
    gpipe_steps, one_f_one_b_steps = recorded_steps(gpipe), recorded_steps(one_f_one_b)
    for step, events in gpipe_steps.items():
        for stage in (0, 1):
            assert pipeline_timeline.order(events, stage) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"], step
        assert [pipeline_timeline.held(events, stage)[0] for stage in (0, 1)] == [4, 4], step
        assert_data_flows_between_the_stages(events)
    for stage, times in ((0, 2), (1, 4)):
        peaks = [pipeline_timeline.held(steps[1], stage)[1] for steps in (gpipe_steps, one_f_one_b_steps)]
        assert peaks[0] == pytest.approx(times * peaks[1], rel=0.05), (stage, peaks)


def assert_data_flows_between_the_stages(events):
    """Stage 1's forward of a micro-batch starts after stage 0's has ended (it needs its activations), and stage 0's
    backward after stage 1's (it needs the gradient of its output)."""
    ends = {(e["stage"], e["pass"], e["microbatch"]): e["ended"] for e in events}
    for e in events:
        before = (0, "forward", e["microbatch"]) if e["stage"] == 1 and e["pass"] == "forward" else \
            (1, "backward", e["microbatch"]) if e["stage"] == 0 and e["pass"] == "backward" else None
        assert before is None or e["began"] >= ends[before], (e, before)


# --- as practitioners run it: two nodes, dropout, bf16 ----------------------------------------------------------------

def on_two_nodes(folder, text, **options):
    """pipeline_parallel.py on two torchrun nodes of 2 processes each, meeting on loopback, both in `folder` (as on a
    shared file system): --pp 2, dropout 0.2, bf16 autocast, 1F1B with M=2 and 4 sequences per pipeline, 2 epochs and
    a snapshot after each. Recorded."""
    node = torchrun_node("pipeline_parallel.py", 2, 1, "--workload", "gpt-cpu", "--pp", 2, "--batch_size", 4,
                         "--microbatches", 2, "--precision", "bf16", nproc=2, endpoint=f"127.0.0.1:{free_port()}",
                         run_id=folder.name, launcher_args=["--max_restarts=1"])
    return run(node, node, cwd=folder, env={TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0.2}, record=True, timeout=240,
               **options)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, text):
    """The job on two nodes, uninterrupted; and the same job with rank 3 SIGKILLed as it begins epoch 1 (the second
    and last): the torchruns of both nodes start their workers again, and they resume from the snapshot of epoch 0."""
    return (on_two_nodes(tmp_path_factory.mktemp("two_nodes"), text),
            on_two_nodes(tmp_path_factory.mktemp("two_nodes_killed"), text, kill_at=(0, 3, 1)))


@pytest.mark.slow
def test_on_two_nodes_each_node_holds_one_stage_and_every_pipeline_crosses_them(two_nodes):
    """pp outermost (rank = stage x dp + d): the copies of a stage, which DDP all-reduces every step, are the
    processes of one node; a pipeline, which sends one activation per micro-batch, spans the nodes."""
    rows = {row["rank"]: row for row in two_nodes[0].samples if row["epoch"] == 0}
    assert {rank: row["mesh"] for rank, row in rows.items()} == {
        0: {"pp": 0, "dp": 0}, 1: {"pp": 0, "dp": 1}, 2: {"pp": 1, "dp": 0}, 3: {"pp": 1, "dp": 1}}
    node_of = {rank: row["node"] for rank, row in rows.items()}
    assert node_of[0] == node_of[1] != node_of[2] == node_of[3], node_of
    for pipeline_ranks in ((0, 2), (1, 3)):  # the two stages of each pipeline: on both nodes, on the same batches
        assert {node_of[rank] for rank in pipeline_ranks} == {0, 1}
        assert rows[pipeline_ranks[0]]["indices"] == rows[pipeline_ranks[1]]["indices"]
    assert not set(rows[0]["indices"]) & set(rows[1]["indices"]), "the two pipelines split the data"


@pytest.mark.slow
def test_on_two_nodes_with_dropout_and_bf16_it_learns_and_a_killed_worker_resumes_to_the_same_end_bit_for_bit(
        two_nodes):
    """The regime the step is run in: bf16, dropout 0.2, two nodes. The loss falls; the worker killed on node 1
    restarts with its node's, the other node's workers start again too, every rank resumes from epoch 1, and the
    snapshot after the last epoch (weights, optimizer state, schedule, each rank's random state) is the
    uninterrupted job's, bit for bit. Every rank drew other dropout masks than every other (its own seed)."""
    whole, killed = two_nodes
    losses = whole.losses
    assert sorted(losses) == [0, 1] and losses[1] < losses[0], whole.output
    assert killed.ok and any(row["restart"] == 1 for row in killed.samples), killed.output
    assert sorted(re.findall(r"\[rank (\d)/4[^\]]*\] resuming from epoch 1", killed.output)) == ["0", "1", "2", "3"]
    assert_bitwise_equal(sharded_snapshot(killed.cwd / SNAPSHOT), sharded_snapshot(whole.cwd / SNAPSHOT))
    for epoch in range(2):
        draws = [row["draws"]["dropout"] for row in whole.samples if row["epoch"] == epoch]
        assert len(draws) == 4 and len(set(draws)) == 4, f"epoch {epoch}: two ranks drew the same masks"


# --- bad input --------------------------------------------------------------------------------------------------------

def run_main(monkeypatch, world_size, *args):
    """pipeline_parallel.py's checks before its process group, in this process (expect.stopped_as_rank_0)."""
    return stopped_as_rank_0(monkeypatch, "pipeline_parallel.py", world_size, *args)


@pytest.mark.parametrize("world_size, args, message", [
    (3, ["--workload", "gpt-cpu", "--pp", 3], "error: --pp 3 stages but the GPT has 2 blocks: each stage needs one at "
                                              "least; lower --pp"),
    (3, ["--pp", 2], "error: --pp 2 does not divide the 3 processes: they form pipelines of 2 stages, a process each"),
    (2, ["--batch_size", 8, "--microbatches", 3], "error: --microbatches 3 does not divide --batch_size 8: the "
                                                  "micro-batches must all have one size"),
    (2, ["--microbatches", 1], "error: --schedule 1f1b needs a micro-batch per stage at least (2), got "
                               "--microbatches 1: raise it, or use --schedule gpipe"),
])
def test_a_pipeline_that_cannot_be_built_stops_with_one_line_before_the_process_group(monkeypatch, tmp_path,
                                                                                     world_size, args, message):
    monkeypatch.chdir(tmp_path)
    assert str(run_main(monkeypatch, world_size, *args)) == message
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.7.1"])
def test_1f1b_on_cpu_processes_is_refused_where_torchs_pipelining_hangs_on_gloo(monkeypatch, tmp_path, version):
    """torch 2.6 and 2.7 wait for one of the works gloo's batch_isend_irecv returns: 1F1B hangs there (run with 2.6.0
    and 2.7.1; 2.8.0 trains). One line instead, before the process group; GPipe, one operation at a time, runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", version)
    assert str(run_main(monkeypatch, 2, "--workload", "gpt-cpu")) == (
        f"error: --schedule 1f1b hangs on CPU processes (gloo) with torch {version}, whose pipelining waits for one of "
        "a step's sends and receives and drops the others (fixed in torch 2.8): use --schedule gpipe, or torch 2.8 or "
        "newer")
    options = Namespace(pp=2, workload="gpt-cpu", microbatches=4, batch_size=8, schedule="gpipe")
    require_pipeline_fits(options, 2)
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    require_pipeline_fits(Namespace(**dict(vars(options), schedule="1f1b")), 2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_torch_2_9s_pipelining_is_refused_on_cpu_processes_with_one_line(monkeypatch, tmp_path, schedule):
    """2.9 opens each pipeline with a send of an int64 to a neighbour that receives a float32: gloo stops the job on it
    (run with 2.9.1, both schedules; 2.8.0 and 2.10.0 train). One line instead, before the process group."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    assert str(run_main(monkeypatch, 2, "--workload", "gpt-cpu", "--schedule", schedule)) == (
        "error: torch 2.9.1's pipelining opens each pipeline with a send of another size than its neighbour receives "
        "(fixed in torch 2.10), which fails on CPU processes and across nodes: use torch 2.8, or 2.10 or newer")
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    require_pipeline_fits(Namespace(pp=2, workload="gpt-cpu", microbatches=4, batch_size=8, schedule=schedule), 2)


@pytest.mark.parametrize("args, words", [(["--microbatches", 0], "argument --microbatches: must be at least 1, got 0"),
                                         (["--workload", "synthetic"], "argument --workload: invalid choice"),
                                         (["--precision", "fp16"], "argument --precision: invalid choice")])
def test_no_micro_batches_another_workload_or_fp16_are_refused_by_the_parser(monkeypatch, capsys, args, words):
    """fp16 would need a gradient scaler whose decision to skip a step all the stages share."""
    assert run_main(monkeypatch, 2, *args).code == 2
    assert f"pipeline_parallel.py: error: {words}" in capsys.readouterr().err


def test_a_pipeline_whose_share_of_the_data_holds_no_whole_batch_is_refused():
    """The 64 sequences over 2 pipelines, 32 each, in batches of 64: drop_last leaves none."""
    data = make_workload("gpt-cpu", text=None).train_set
    loader = DataLoader(data, batch_size=len(data), drop_last=True, sampler=DistributedSampler(data, 2, 0))
    with pytest.raises(SystemExit) as stop:
        require_a_batch(loader)
    assert str(stop.value) == (f"error: each of the 2 pipelines gets {len(data) // 2} sequences an epoch, fewer than "
                               f"--batch_size {len(data)}: no whole batch to train on; lower --batch_size, or start "
                               "fewer pipelines (fewer processes, or a larger --pp)")
    require_a_batch(DataLoader(data, batch_size=len(data) // 2, drop_last=True, sampler=DistributedSampler(data, 2, 0)))


@pytest.mark.slow
def test_a_batch_larger_than_a_pipelines_share_stops_every_rank_with_one_line_before_training(tmp_path, text):
    """Two pipelines of one stage (--pp 1), 32 sequences each, --batch_size 64: one line from each rank, where the
    loop used to end the epoch on a variable never set; no snapshot written."""
    job = run(torchrun("pipeline_parallel.py", 1, 1, *gpt_args(text, "--pp", 1, batch_size=64), nproc=2),
              cwd=tmp_path, timeout=120, check=False)
    assert job.returncode not in (0, None) and not re.search(r"^\[rank\d\]:", job.output, re.M), job.output
    assert set(job.errors) == {"error: each of the 2 pipelines gets 32 sequences an epoch, fewer than --batch_size "
                               "64: no whole batch to train on; lower --batch_size, or start fewer pipelines (fewer "
                               "processes, or a larger --pp)"}, job.output
    assert not (tmp_path / SNAPSHOT).exists() and "epoch 0 |" not in job.output


# --- GPUs -------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: a stage on each")
def test_two_stages_on_two_gpus_train_the_gpu_size_in_bf16_over_nccl(tmp_path):
    """The GPU size (6 blocks: 3 per stage) on the help pages, bf16 autocast (the last stage's logits in bf16), NCCL's
    point-to-point between the stages: it learns, the snapshot holds the whole model, and 1F1B ran as 1F1B."""
    job = run(torchrun("pipeline_parallel.py", 2, 2, "--precision", "bf16", "--microbatches", 4, nproc=2),
              cwd=tmp_path, gpu=True, record=True, timeout=600)
    assert job.losses[1] < job.losses[0] and "[rank 1/2 | local 1 | cuda:1]" in job.output, job.output
    assert sharded_snapshot(tmp_path / SNAPSHOT)["EPOCHS_RUN"] == 2
    events = pipeline_timeline.by_step(job.records("pipeline.jsonl"))[1]
    assert pipeline_timeline.order(events, 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
