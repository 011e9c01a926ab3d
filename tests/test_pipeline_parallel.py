"""Step 8, pipeline_parallel.py: 2 stages on 2 ranks train exactly what one process trains (every epoch's loss and the
final weights), whatever the schedule and the number of micro-batches; 2 pipelines of 2 stages on 4 ranks train what
one process with their two batches does; the schedule, as the recorder saw it run, is 1F1B's or GPipe's, and holds as
many micro-batches as it should; a worker SIGKILLed mid-run resumes from the stages' snapshots to the very same end;
bad input stops with one line before any process group forms.

Every job trains the CPU-size GPT (2 blocks: stage 0 holds the embedding and block 0, stage 1 block 1 and the head)
on a short excerpt of the help pages (`--text`): 64 training sequences of 64 characters, batches of 8, so
8 optimizer steps an epoch, 2 epochs, fp32 and dropout 0. Four jobs answer everything (each process of a job spends
~5 s of CPU importing torch and its pipelining): 1F1B with M=4; GPipe with M=4, a worker killed on the way; 1F1B with
M=2; and dp 2 x pp 2 with M=1."""
import json
import math
import re
import runpy
import sys

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from expect import assert_bitwise_equal
from tools import pipeline_timeline
from tools.jobs import output, run, saved_name, script, shared_file, start, torchrun
from utils import make_workload
from utils.gpt import help_pages
from utils.loop import WarmupCosine
from utils.metrics import RUN_DIR_VARIABLE

TEXT_CHARS = 4600  # 90% to train on: 64 sequences of 64 (+1) characters; 7 held out
B, EPOCHS, STEPS = 8, 2, 8  # sequences per batch (per pipeline), epochs, optimizer steps an epoch
STAGE_FILES = ("pp_snapshot.stage0.pt", "pp_snapshot.stage1.pt")


@pytest.fixture(scope="module")
def text():
    return shared_file("help_excerpt.txt", help_pages()[:TEXT_CHARS])  # named by its content: shared jobs match


def gpt_args(text, *more):
    """The GPT of the CPU's size (no dropout) learning `text` (a file), batches of 8, and more arguments."""
    return ("--workload", "gpt-cpu", "--text", text, "--dropout", 0, "--batch_size", B, *more)


def pipeline(tmp_path_factory, text, name, *args, nproc=2, **options):
    """A finished job of pipeline_parallel.py (2 epochs, a snapshot at the end), in a folder of its own; per-rank
    metrics in its runs/."""
    workdir = tmp_path_factory.mktemp(name)
    job = run(torchrun("pipeline_parallel.py", EPOCHS, EPOCHS, *gpt_args(text, *args), nproc=nproc), cwd=workdir,
              env={RUN_DIR_VARIABLE: "runs"}, timeout=240, **options)
    return job


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory, text):
    """1F1B with M=4, every optimizer step recorded: the gradient norm each stage's DDP all-reduced for it.
    notebooks/08_pipeline.ipynb runs the same job: shared, it runs once in a test session."""
    return pipeline(tmp_path_factory, text, "1f1b", "--schedule", "1f1b", "--microbatches", 4, record_steps=True,
                    shared=True)


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory, text):
    """GPipe with M=4, and stage 1's process SIGKILLs itself as epoch 1 begins (after both stages saved epoch 0):
    torchrun restarts both, and each stage reloads its own file."""
    workdir = tmp_path_factory.mktemp("gpipe")
    command = torchrun("pipeline_parallel.py", EPOCHS, 1, *gpt_args(text, "--schedule", "gpipe", "--microbatches", 4),
                       launcher_args=["--max_restarts=1"])
    with start(command, cwd=workdir, kill_at=(0, 1, 1), record=True) as job:
        job.wait(timeout=240)
    return job


@pytest.fixture(scope="module")
def reference(text):
    """What the steps compute, in one process without a pipeline: AdamW, the gradient norm clipped to 1, the warm-up
    + cosine schedule stepped per batch, batches of 8 in the order a 1-replica DistributedSampler deals them. Each
    epoch's mean loss, each step's gradient norm before clipping, the final weights."""
    workload = make_workload("gpt-cpu", text=str(text), dropout=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the jobs run: 2 threads on a busy 2-core machine spin-wait, 10x slower
    loader = DataLoader(workload.train_set, batch_size=B, drop_last=True,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    scheduler = LambdaLR(workload.optimizer, WarmupCosine(EPOCHS * len(loader)))
    losses, norms = [], []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        summed = 0.0
        for source, targets in loader:
            loss = workload.loss_fn(workload.model(source), targets)
            loss.backward()
            summed += loss.item()
            norms.append(torch.nn.utils.clip_grad_norm_(workload.model.parameters(), 1.0).item())
            workload.optimizer.step()
            scheduler.step()
            workload.optimizer.zero_grad(set_to_none=True)
        losses.append(summed / len(loader))
    torch.set_num_threads(threads)
    return dict(losses=losses, norms=norms, weights=tensors(workload.model.state_dict()))


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def tensors(state):
    """A state_dict's tensors (a GPT's also holds the identity of its text, `_extra_state`)."""
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def weights(job):
    """The whole GPT's weights, put together from the stages' snapshot files."""
    whole = {}
    for name in STAGE_FILES:
        whole.update(tensors(load(job.cwd / name)["MODEL_STATE"]))
    return whole


def epoch_losses(job, last_stage_ranks=(1,)):
    """Each epoch's mean loss over the job's samples, unrounded: from the last stages' per-rank metrics files."""
    totals = {}
    for rank in last_stage_ranks:
        for line in (job.cwd / "runs" / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            summed, samples = totals.get(record["epoch"], (0.0, 0))
            totals[record["epoch"]] = (summed + record["loss"] * record["samples"], samples + record["samples"])
    return [summed / samples for _, (summed, samples) in sorted(totals.items())]


def assert_close(actual, expected, atol=5e-5):
    assert actual.keys() == expected.keys()
    worst = max((actual[name] - tensor).abs().max().item() for name, tensor in expected.items())
    assert worst <= atol, f"the weights differ by up to {worst:.2e}"
    return worst


# --- 2 stages are one model -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_stages_on_two_ranks_train_what_one_process_does(one_f_one_b, reference):
    """Every epoch's loss to 1e-5 (measured: 4e-7) and the final weights to 5e-5 (measured: 2.4e-5; Adam's division
    by the gradients' running magnitude magnifies the rounding of micro-batch sums in a few weights, as in test_gpt).

    Adam hardly sees the scale of the gradients, so the weights alone would not show a loss left undivided by M, or
    divided twice: each step's gradient norm, from the two stages' own (what DDP all-reduced, recorded by a
    communication hook), must be the one-process norm of the whole batch's mean. Clipping is on in the first steps
    (the norm is above 1), so the stages must clip by the whole model's norm: each by its own ends elsewhere."""
    assert sum(norm > 1 for norm in reference["norms"]) >= 4, reference["norms"]
    assert epoch_losses(one_f_one_b) == pytest.approx(reference["losses"], abs=1e-5)
    assert_close(weights(one_f_one_b), reference["weights"])
    stages = [[step["grad_norms"] for step in one_f_one_b.steps if step["rank"] == rank] for rank in (0, 1)]
    assert all(len(norms) == 1 for rank in stages for norms in rank), "one all-reduce per step and stage"
    whole = [math.hypot(first[0], last[0]) for first, last in zip(*stages)]
    assert whole == pytest.approx(reference["norms"], rel=1e-4), (whole, reference["norms"])


@pytest.mark.slow
def test_gpipe_killed_and_resumed_ends_bit_for_bit_where_1f1b_does(one_f_one_b, gpipe):
    """GPipe and 1F1B compute the same micro-batches and sum their gradients in the same order: only when each pass
    runs differs, so their snapshots are equal bit for bit (weights, optimizer state, schedule). The GPipe job was
    killed and resumed on the way: only a snapshot that holds all the loop depends on ends there too."""
    assert gpipe.codes == [0], gpipe.output
    assert sorted(re.findall(r"\[rank (\d)/2 \| local \d \| cpu\] resuming from epoch 1, restart 1",
                             gpipe.output)) == ["0", "1"], gpipe.output
    for name in STAGE_FILES:
        assert_bitwise_equal(load(gpipe.cwd / name), load(one_f_one_b.cwd / name), name)


@pytest.mark.slow
def test_with_two_micro_batches_too(tmp_path_factory, text, reference):
    job = pipeline(tmp_path_factory, text, "1f1b2", "--schedule", "1f1b", "--microbatches", 2)
    assert_close(weights(job), reference["weights"])


@pytest.mark.slow
def test_two_pipelines_of_two_stages_train_what_one_process_does_with_both_batches(tmp_path_factory, text,
                                                                                  reference):
    """dp 2 x pp 2 on 4 ranks, 4 sequences per pipeline, in one micro-batch (GPipe, M=1): each step the two
    pipelines' batches are the 8 sequences one process takes (a 2-replica sampler deals positions r, r+2...), and DDP
    averages each stage's gradients with its copy in the other pipeline. Ranks 0 and 1, the first pipeline's stages,
    alone write."""
    job = pipeline(tmp_path_factory, text, "dp2", "--dp", 2, "--batch_size", B // 2, "--schedule", "gpipe",
                   "--microbatches", 1, nproc=4, record=True)
    assert_close(weights(job), reference["weights"])
    assert epoch_losses(job, last_stage_ranks=(1, 3)) == pytest.approx(reference["losses"], abs=1e-5)
    assert output.epoch_losses(job.output) == pytest.approx(dict(enumerate(reference["losses"])), abs=1e-4)
    assert sorted({(rank, saved_name(path)) for _, rank, path in job.writes}) == \
        [(0, "pp_snapshot.stage0.pt"), (1, "pp_snapshot.stage1.pt")], job.writes


@pytest.mark.slow
def test_each_stage_writes_its_own_layers_and_state(one_f_one_b, reference):
    stage0, stage1 = (load(one_f_one_b.cwd / name) for name in STAGE_FILES)
    assert {name.split(".")[0] for name in tensors(stage0["MODEL_STATE"])} == {"embed", "block0"}
    assert {name.split(".")[0] for name in tensors(stage1["MODEL_STATE"])} == {"block1", "head"}
    for snapshot in (stage0, stage1):
        assert (snapshot["EPOCHS_RUN"], snapshot["SCHEDULER_STATE"]["last_epoch"]) == (EPOCHS, EPOCHS * STEPS)
        assert set(snapshot) == {"MODEL_STATE", "OPTIMIZER_STATE", "SCHEDULER_STATE", "RNG_STATES", "EPOCHS_RUN"}
    assert {rank for _, rank, _ in one_f_one_b.writes} == {0, 1}, "one writer per stage"


@pytest.mark.slow
def test_the_gpt_is_put_back_together_for_the_held_out_loss_and_a_sample(one_f_one_b):
    """Rank 0 (stage 0) prints the mean loss of all samples, the held-out loss of the whole model, and its text."""
    assert re.search(r"^\[rank 0/2 \| local 0 \| cpu\] epoch 1 \| steps 8 \| loss [\d.]+ \| [\d,]+ tokens/s$",
                     one_f_one_b.output, re.M), one_f_one_b.output
    assert output.held_out(one_f_one_b.output)["samples"] == 7
    [(steps, sample)] = output.samples(one_f_one_b.output)
    assert steps == EPOCHS * STEPS and len(sample) >= 190, sample


# --- the schedule, as it ran ------------------------------------------------------------------------------------------

def recorded_steps(job, restart=0, epochs=EPOCHS):
    """{step: events} of the first `epochs` epochs of an attempt. (Stage 0 of the GPipe job may begin the forwards
    of epoch 1's first step before stage 1 is killed: that step, cut short, is left out.)"""
    steps = pipeline_timeline.by_step(job.records("pipeline.jsonl"), restart)
    assert set(range(epochs * STEPS)) <= set(steps), sorted(steps)
    return {step: events for step, events in steps.items() if step < epochs * STEPS}


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
    gpipe_steps, one_f_one_b_steps = recorded_steps(gpipe, epochs=1), recorded_steps(one_f_one_b)
    for step, events in [*gpipe_steps.items(), *recorded_steps(gpipe, restart=1, epochs=1).items()]:
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


# --- bad input --------------------------------------------------------------------------------------------------------

def run_main(monkeypatch, world_size, *args):
    """pipeline_parallel.py's __main__ in this process, as torchrun starts rank 0 of `world_size`: its checks come
    before init_process_group. The SystemExit it stops with."""
    monkeypatch.setattr(sys, "argv", ["pipeline_parallel.py", "2", "1", *map(str, args)])
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "LOCAL_WORLD_SIZE": world_size,
                        "WORLD_SIZE": world_size}.items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script("pipeline_parallel.py"), run_name="__main__")
    return stop.value


@pytest.mark.parametrize("world_size, args, message", [
    (3, ["--workload", "gpt-cpu"], "error: 3 pipeline stages (3 processes / --dp 1) but the GPT has 2 blocks: each "
                                   "stage needs one at least; start fewer processes or raise --dp"),
    (3, ["--dp", 2], "error: --dp 2 does not divide the 3 processes: each of the --dp pipelines needs as many "
                     "processes as it has stages"),
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


@pytest.mark.parametrize("args, words", [(["--microbatches", 0], "argument --microbatches: must be at least 1, got 0"),
                                         (["--workload", "synthetic"], "argument --workload: invalid choice"),
                                         (["--precision", "fp16"], "argument --precision: invalid choice")])
def test_no_micro_batches_another_workload_or_fp16_are_refused_by_the_parser(monkeypatch, capsys, args, words):
    """fp16 would need a gradient scaler whose decision to skip a step all the stages share."""
    assert run_main(monkeypatch, 2, *args).code == 2
    assert f"pipeline_parallel.py: error: {words}" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: a stage on each")
def test_two_stages_on_two_gpus_train_the_gpu_size_in_bf16_over_nccl(tmp_path):
    """The GPU size (6 blocks: 3 per stage) on the help pages, bf16 autocast (the last stage's logits in bf16), NCCL's
    point-to-point between the stages: it learns, each stage saves its own file, and 1F1B ran as 1F1B."""
    job = run(torchrun("pipeline_parallel.py", 2, 2, "--precision", "bf16", "--microbatches", 4, nproc=2),
              cwd=tmp_path, gpu=True, record=True, timeout=600)
    assert job.losses[1] < job.losses[0] and "[rank 1/2 | local 1 | cuda:1]" in job.output, job.output
    assert {saved_name(path) for _, _, path in job.writes} == set(STAGE_FILES)
    events = pipeline_timeline.by_step(job.records("pipeline.jsonl"))[1]
    assert pipeline_timeline.order(events, 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
