"""Step 6, gpt.py: the GPT learns; gradient accumulation is exact and no_sync() really skips the all-reduce; bf16 on
the CPU tracks fp32; a worker SIGKILLed mid-training (dropout on) resumes to a bitwise-identical end, and a snapshot
resumes on more ranks with the schedule going on where it was; --compile; bad options and snapshots of another model
or text stop with one line; fsdp.py trains the GPT too.

Every job trains on a short excerpt of the help pages (`--text`): 64 training blocks of 64 characters, so
2 ranks x K=2 micro-batches x batch 4 make 4 optimizer steps an epoch. Each job is shared by the tests that read it
(a 2-process job costs ~11 s of CPU before its first step)."""
import argparse
import math
import re
import runpy
import sys

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from expect import EXCERPT_CHARS, assert_bitwise_equal, assert_one_writer
from harness.jobs import output, run, script, start, torchrun
from utils import evaluate, make_workload
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages
from utils.loop import PEAK_VARIABLE, WarmupCosine, compiler_missing, peak_flops
from utils.metrics import RUN_DIR_VARIABLE

B, K = 4, 2  # micro-batch per rank, micro-batches per optimizer step
STEPS_PER_EPOCH = 64 // (2 * K * B)  # 4
EPOCHS = 2
ACCUMULATED = ("--batch_size", B, "--grad_accum", K)
SNAPSHOT = "gpt_snapshot.pt"
LR = 6e-3  # the CPU size's peak learning rate
DROPOUT = 0.1  # the CPU size has none; the runs that prove the random states are resumed need some


def gpt_args(text, *more):
    """The GPT of the CPU's size, learning `text` (a file), and more arguments."""
    return ("--workload", "gpt-cpu", "--text", text, *more)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory, text):
    """2 ranks x K=2 micro-batches of 4, fp32, dropout 0, 2 epochs; every optimizer step recorded (its learning rate
    and the gradient all-reduces DDP ran for it), and per-rank metrics (runs/). notebooks/06_gpt.ipynb runs the same
    job: shared, it runs once in a test session."""
    return run(torchrun("gpt.py", EPOCHS, EPOCHS, *gpt_args(text, *ACCUMULATED, "--dropout", 0)),
               cwd=tmp_path_factory.mktemp("accumulated"), env={RUN_DIR_VARIABLE: "runs"}, record_steps=True,
               timeout=180, shared=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, text):
    """The same with dropout on (0.1), 3 epochs, a snapshot after each: the run a killed one must end exactly like."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    return run(torchrun("gpt.py", 3, 1, *gpt_args(text, *ACCUMULATED, "--dropout", DROPOUT)), cwd=workdir,
              record=True, timeout=180)


def untrained_held_out_loss(text, workload="gpt-cpu"):
    built = make_workload(workload, text=str(text))
    return evaluate(built.model, built.eval_set, built.loss_fn, torch.device("cpu"))["loss"]


def train_in_one_process(text, batch_size, epochs=EPOCHS):
    """What gpt.py's optimizer steps compute, written out in one process without DDP (dropout 0): AdamW, the
    gradient norm clipped to 1, the warm-up + cosine schedule stepped per optimizer step, over the samples in the
    order a 2-rank DistributedSampler deals them (rank r gets shuffled positions r, r+2...: one batch of 4b holds
    exactly the 2 ranks' K=2 micro-batches of b). Returns the final weights and each step's gradient norm before
    clipping."""
    workload = make_workload("gpt-cpu", text=str(text), dropout=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the jobs run: 2 threads on a busy 2-core machine spin-wait, 10x slower (measured)
    loader = DataLoader(workload.train_set, batch_size=batch_size,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    scheduler = LambdaLR(workload.optimizer, WarmupCosine(epochs * len(loader)))
    norms = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            workload.loss_fn(workload.model(source), targets).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(workload.model.parameters(), 1.0).item())
            workload.optimizer.step()
            scheduler.step()
            workload.optimizer.zero_grad(set_to_none=True)
    torch.set_num_threads(threads)
    return workload.model.state_dict(), norms


def tensors(state_dict):
    """The tensors of a model's state_dict (the GPT's also holds `_extra_state`: the text it learned)."""
    return {name: value for name, value in state_dict.items() if isinstance(value, torch.Tensor)}


def max_difference(a, b):
    return max((a[name] - tensor).abs().max().item() for name, tensor in tensors(b).items())


# --- it learns, and says so -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_gpt_learns_reports_tokens_per_s_and_prints_a_sample(uninterrupted, text):
    """12 optimizer steps on 4,140 characters: the held-out loss falls below 0.85 of the untrained model's (~ln 64,
    the excerpt's distinct characters)."""
    job = uninterrupted
    assert sorted(job.losses) == [0, 1, 2] and job.losses[2] < job.losses[0], job.output
    before, after = untrained_held_out_loss(text), output.held_out(job.output)["loss"]
    assert after < 0.85 * before, (before, after)
    rates = output.throughputs(job.output)
    assert all(unit == "tokens" and rate > 0 and mfu is None for rate, unit, mfu in rates.values()), rates  # CPU
    [(steps, sample)] = output.samples(job.output)
    assert steps == 3 * STEPS_PER_EPOCH and len(sample) >= 190, sample  # 200 characters after the prompt
    assert_one_writer(job.writes, job.cwd / SNAPSHOT)


@pytest.mark.slow
def test_the_snapshot_holds_everything_the_loop_depends_on(uninterrupted):
    snapshot = load(uninterrupted.cwd / SNAPSHOT)
    assert set(snapshot) == {"MODEL_STATE", "OPTIMIZER_STATE", "SCHEDULER_STATE", "SCALER_STATE", "RNG_STATES",
                             "EPOCHS_RUN", "STEP"}
    assert snapshot["EPOCHS_RUN"] == 3 and snapshot["STEP"] == "gpt.py"
    assert snapshot["SCHEDULER_STATE"]["last_epoch"] == 3 * STEPS_PER_EPOCH  # stepped once per optimizer step
    schedule = snapshot["SCHEDULER_STATE"]["lr_lambdas"][0]  # WarmupCosine's own state: how long, where
    assert schedule["total_steps"] == 3 * STEPS_PER_EPOCH, schedule
    assert snapshot["MODEL_STATE"]["_extra_state"]["text"]["characters"] == EXCERPT_CHARS  # what the GPT learned
    assert snapshot["SCALER_STATE"] == {}  # fp32: the gradient scaler is off
    cpu_states = [cpu for cpu, cuda in snapshot["RNG_STATES"]]
    assert len(cpu_states) == 2 and not torch.equal(*cpu_states), "each rank's own random state (dropout)"


# --- gradient accumulation --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_accumulating_two_micro_batches_of_b_end_where_one_process_with_4b_does(accumulated, text):
    """Exact up to float rounding: the same 16 samples per optimizer step, summed in another order. Adam divides by
    the gradients' running magnitude, which magnifies that rounding in a few of the 111k weights (measured: at most
    1.8e-5); without accumulation (2 ranks x 4, i.e. one process with 8) the weights end 7e-2 away.

    Adam hardly sees the scale of the gradients (and clipping to 1 hides more), so the weights alone would not show
    micro-batch losses left undivided by K: each step's all-reduced gradient (recorded by a DDP communication hook)
    must also have the norm of the mean over the step's 16 samples, not K times it."""
    two_ranks = load(accumulated.cwd / SNAPSHOT)["MODEL_STATE"]
    reference, norms = train_in_one_process(text, 2 * K * B)
    assert two_ranks.keys() == reference.keys()
    for name, tensor in tensors(reference).items():
        torch.testing.assert_close(two_ranks[name], tensor, rtol=0, atol=5e-5, msg=name)
    assert max_difference(two_ranks, train_in_one_process(text, 2 * B)[0]) > 2e-3
    all_reduced = [step["grad_norms"] for step in steps_of(accumulated, 0)]
    assert all_reduced == [[pytest.approx(norm, rel=1e-4)] for norm in norms], (all_reduced, norms)


def steps_of(job, rank):
    return [step for step in job.steps if step["rank"] == rank]


@pytest.mark.slow
def test_no_sync_all_reduces_the_gradients_once_per_optimizer_step_not_once_per_micro_batch(accumulated):
    for rank in (0, 1):
        steps = steps_of(accumulated, rank)
        assert len(steps) == EPOCHS * STEPS_PER_EPOCH, steps
        assert [step["rounds"] for step in steps] == [1] * len(steps), f"rank {rank}: {steps}"  # K=2 without no_sync
        assert all(step["buckets"] >= 1 for step in steps)
    for step0, step1 in zip(steps_of(accumulated, 0), steps_of(accumulated, 1)):  # both ranks got the same average
        assert step0["grad_norms"] == pytest.approx(step1["grad_norms"], rel=1e-6)


@pytest.mark.slow
def test_the_schedule_warms_up_then_decays_once_per_optimizer_step(accumulated):
    factor = WarmupCosine(EPOCHS * STEPS_PER_EPOCH)
    lrs = [step["lr"] for step in steps_of(accumulated, 0)]
    assert lrs == pytest.approx([LR * factor(step) for step in range(len(lrs))], rel=1e-9)
    assert lrs[-1] < 0.2 * max(lrs)


def test_a_schedule_resumed_as_it_was_started_is_the_same_bit_for_bit():
    uninterrupted, resumed = WarmupCosine(40), WarmupCosine(40)
    resumed.resume(step=13, steps_left=40 - 13)
    assert [resumed(step) for step in range(13, 41)] == [uninterrupted(step) for step in range(13, 41)]


def test_a_schedule_resumed_with_other_arguments_goes_on_from_where_it_was_to_the_floor_at_the_last_step():
    """Twice the steps left (another world size, batch or accumulation; more epochs): no jump, and the floor (0.1)
    exactly at the new last step. A finished schedule extended by more epochs stays at the floor."""
    schedule = WarmupCosine(40)
    before = schedule(20)
    schedule.resume(step=20, steps_left=40)
    factors = [schedule(step) for step in range(20, 61)]
    assert factors[0] == pytest.approx(before) and factors[-1] == pytest.approx(0.1)
    assert factors[-2] > 0.1 + 1e-4, "it reaches the floor at the new last step, not at the old one (step 40)"
    assert all(later < earlier for earlier, later in zip(factors, factors[1:])), "it decays at every step"
    finished = WarmupCosine(40)
    finished.resume(step=40, steps_left=25)
    assert {round(finished(step), 12) for step in range(40, 66)} == {0.1}


@pytest.mark.slow
def test_a_snapshot_resumes_on_more_ranks_than_wrote_it_with_the_schedule_going_on(uninterrupted, text, tmp_path):
    """2 ranks wrote it after 3 epochs of a run planned for 6 (the uninterrupted run's snapshot, its schedule and
    learning rate set as a 6-epoch run's are after 3: what such a run leaves when it is stopped). 3 ranks resume it to
    end after a 4th epoch (an elastic job that grew, and a shorter plan): 3 optimizer steps, 3 ranks x K=2 x 4 of the
    64 sequences. The third rank has no saved random state: it keeps its own seed's. The learning rate goes on from
    where the schedule stood (step 12 of 24) and the 12 planned steps left are fitted to the 3 this run takes: no jump
    back up a cosine recomputed for the new command, no stop half-way down the old one."""
    planned = WarmupCosine(6 * STEPS_PER_EPOCH)
    snapshot = load(uninterrupted.cwd / SNAPSHOT)
    for schedule in snapshot["SCHEDULER_STATE"]["lr_lambdas"]:
        schedule.update(vars(planned))
    snapshot["SCHEDULER_STATE"]["_last_lr"] = [LR * planned(12)] * 2
    for group in snapshot["OPTIMIZER_STATE"]["param_groups"]:
        group["lr"] = LR * planned(12)
    torch.save(snapshot, tmp_path / SNAPSHOT)
    job = run(torchrun("gpt.py", 4, 1, *gpt_args(text, *ACCUMULATED, "--dropout", DROPOUT), nproc=3), cwd=tmp_path,
              record_steps=True, timeout=180)
    assert "[rank 0/3 | local 0 | cpu] resuming from epoch 3, restart 0" in job.output, job.output
    assert sorted(job.losses) == [3] and not job.errors, job.output
    lrs = [step["lr"] for step in steps_of(job, 0)]
    assert lrs == pytest.approx([LR * planned(step) for step in (12, 16, 20)], rel=1e-9), lrs
    assert len(load(tmp_path / SNAPSHOT)["RNG_STATES"]) == 3
    # 64 sequences do not split in 3: DistributedSampler pads the shuffled list with its first indices to 66, so each
    # rank gets 22 and two sequences are trained on twice an epoch (drop_last=True would drop the tail instead).
    shares = {row["rank"]: row["indices"] for row in job.samples}
    assert sorted(shares) == [0, 1, 2] and [len(indices) for indices in shares.values()] == [22] * 3, shares
    seen = [index for indices in shares.values() for index in indices]
    assert set(seen) == set(range(64)) and len(seen) - len(set(seen)) == 2, "only the padding repeats"


def test_a_step_that_fp16_skipped_is_no_step_of_the_schedule(tmp_path):
    """An overflow makes the gradient scaler skip the optimizer step (and lower its scale): the schedule must not
    move either. gpt.py's _run_batch, in this process, with an fp16-style scaler and a loss that overflows."""
    import gpt

    workload = excerpt_gpt(tmp_path)
    trainer = gpt.Trainer.__new__(gpt.Trainer)
    trainer.model, trainer.optimizer, trainer.device = workload.model, workload.optimizer, torch.device("cpu")
    trainer.scheduler = LambdaLR(workload.optimizer, WarmupCosine(10))
    trainer.scaler, trainer.dtype = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16), None
    trainer.args = argparse.Namespace(grad_clip=1.0)
    source, targets = workload.train_set[:2]
    trainer.loss_fn = lambda logits, targets: workload.loss_fn(logits, targets) * float("inf")
    trainer._run_batch(source, targets, micro_batches=1, last=True)
    assert (trainer.scaler.get_scale(), trainer.scheduler.last_epoch) == (2.0 ** 15, 0), "skipped: no schedule step"
    trainer.loss_fn = workload.loss_fn
    trainer._run_batch(source, targets, micro_batches=1, last=True)
    assert trainer.scheduler.last_epoch == 1, "a step taken is a step of the schedule"


# --- precision --------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_on_the_cpu_tracks_fp32(accumulated, text, tmp_path):
    """The same optimizer steps in bf16 autocast: one process with K=2 micro-batches of 8 takes the same 16 samples
    per step as the accumulated fp32 job (the test above shows the layouts agree). Measured: the epoch losses agree
    to 2e-4; the tolerance is 0.02."""
    job = run(torchrun("gpt.py", EPOCHS, EPOCHS, *gpt_args(text, "--batch_size", 2 * B, "--grad_accum", K,
                                                           "--precision", "bf16", "--dropout", 0), nproc=1), cwd=tmp_path)
    fp32, bf16 = accumulated.losses, job.losses
    assert sorted(bf16) == sorted(fp32) == list(range(EPOCHS)) and bf16[1] < bf16[0], job.output
    for epoch in fp32:
        assert bf16[epoch] == pytest.approx(fp32[epoch], abs=0.02), (bf16, fp32)
    held_out = [output.held_out(printed)["loss"] for printed in (job.output, accumulated.output)]
    assert held_out[0] == pytest.approx(held_out[1], abs=0.02), held_out


# --- a killed worker --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_worker_killed_mid_training_with_dropout_on_resumes_to_a_bitwise_identical_end(uninterrupted, text,
                                                                                        tmp_path):
    """Dropout draws random numbers: only a snapshot that holds every rank's random state (and the schedule's, the
    scaler's, the optimizer's) lets the restarted workers draw what the killed ones would have."""
    command = torchrun("gpt.py", 3, 1, *gpt_args(text, *ACCUMULATED, "--dropout", DROPOUT),
                       launcher_args=["--max_restarts=1"])
    with start(command, cwd=tmp_path) as job:
        job.wait_for(r"\] epoch 0 \| snapshot saved")  # rank 1 dies in epoch 1 (or 2), after a snapshot
        job.kill_worker(rank=1)
        [code] = job.wait(timeout=150)
    assert code == 0, job.output
    assert job.resumes and min(job.resumes.values()) >= 1, f"it did not resume from a snapshot:\n{job.output}"
    assert_bitwise_equal(load(tmp_path / SNAPSHOT), load(uninterrupted.cwd / SNAPSHOT))


# --- torch.compile -------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason=f"torch.compile cannot run here: {compiler_missing()}")
def test_compile_with_ddp_trains_as_eager_does_and_keeps_one_all_reduce_per_step(text, tmp_path):
    """The smallest job that compiles DDP's model and takes optimizer steps through no_sync(): 1 process (DDP still
    all-reduces, with itself), 2 steps of K=2 micro-batches of 16."""
    args = (1, 1, *gpt_args(text, "--batch_size", 16, "--grad_accum", K, "--dropout", 0))
    compiled = run(torchrun("gpt.py", *args, "--compile", nproc=1), cwd=tmp_path / "compiled", record_steps=True,
                   timeout=400)
    eager = run(torchrun("gpt.py", *args, nproc=1), cwd=tmp_path / "eager", timeout=120)
    assert compiled.losses[0] == pytest.approx(eager.losses[0], abs=2e-3), (compiled.output, eager.output)
    assert [step["rounds"] for step in compiled.steps] == [1, 1], compiled.steps
    assert output.samples(compiled.output), "the sample is generated by the eager model inside"


# --- bad options ------------------------------------------------------------------------------------------------------

def run_main(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["gpt.py", *map(str, args)])
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # as torchrun starts it: the checks come before init_process_group
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script("gpt.py"), run_name="__main__")
    return stop.value


def test_grad_accum_must_be_at_least_one(monkeypatch, capsys):
    assert run_main(monkeypatch, 2, 1, "--grad_accum", 0).code == 2
    assert "error: argument --grad_accum: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_fp16_without_cuda_stops_with_one_line(monkeypatch):
    message = str(run_main(monkeypatch, 2, 1, "--precision", "fp16"))
    assert message == ("error: --precision fp16 needs a CUDA GPU (its gradient scaler is for GPUs); on a CPU use "
                       "--precision bf16")


def test_compile_without_a_compiler_stops_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    message = str(run_main(monkeypatch, 2, 1, "--compile"))
    assert re.fullmatch(r"error: --compile needs a compiler to build its kernels, and there is no C\+\+ compiler: "
                        r"\S+no-such-compiler is not on PATH \(set CXX to one\); leave --compile out to train "
                        r"without it", message), message


@pytest.mark.parametrize("option, message", [
    (("--grad_clip", -1), "error: --grad_clip is the largest gradient norm a step may have: more than 0, got -1.0 "
                          "(inf turns clipping off)"),
    (("--grad_clip", 0), "error: --grad_clip is the largest gradient norm a step may have: more than 0, got 0.0 "
                         "(inf turns clipping off)"),
    (("--grad_clip", "nan"), "error: --grad_clip is the largest gradient norm a step may have: more than 0, got nan "
                             "(inf turns clipping off)"),
])
def test_a_gradient_limit_that_would_freeze_or_reverse_training_stops_with_one_line(monkeypatch, option, message):
    assert str(run_main(monkeypatch, 2, 1, *option)) == message


@pytest.mark.parametrize("variable, value, message", [
    (DROPOUT_VARIABLE, "abc", r"\$TUTORIAL_GPT_DROPOUT \(what --dropout is when not given\) expected a number, got "
                              r"'abc'; set it right or unset it"),
    (DROPOUT_VARIABLE, "2", r"\$TUTORIAL_GPT_DROPOUT \(what --dropout is when not given\) must be from 0 up to \(not "
                            r"including\) 1, got 2; set it right or unset it"),
    (PEAK_VARIABLE, "abc", r"\$TUTORIAL_PEAK_TFLOPS \(what --peak_tflops is when not given\) expected a number, got "
                           r"'abc'; set it right or unset it"),
])
def test_a_variable_that_stands_for_an_option_is_checked_before_any_work(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    stop = str(run_main(monkeypatch, 2, 1))
    assert re.fullmatch("error: " + message, stop), stop


def test_a_dropout_of_one_or_more_is_refused_by_the_option(monkeypatch, capsys):
    assert run_main(monkeypatch, 2, 1, "--dropout", 1).code == 2
    assert "error: argument --dropout: must be from 0 up to (not including) 1, got 1" in capsys.readouterr().err


def excerpt_gpt(tmp_path, name="excerpt.txt", reversed_=False):
    """The GPT workload of the CPU's size on the tests' excerpt of the help pages (or on that excerpt backwards: the
    same characters, another text), written to tmp_path/name."""
    path = tmp_path / name
    path.write_text(help_pages()[:EXCERPT_CHARS][::-1 if reversed_ else 1])
    return make_workload("gpt-cpu", text=str(path))


def snapshot_problem(tmp_path, snapshot):
    """What gpt.py's Trainer says when it finds `snapshot` (a dict) at its snapshot path: its _load_snapshot runs in
    this process on a Trainer with the GPT, its optimizer, schedule and scaler (no process group is needed)."""
    import gpt

    path = tmp_path / SNAPSHOT
    torch.save(snapshot, path)
    workload = excerpt_gpt(tmp_path)
    trainer = gpt.Trainer.__new__(gpt.Trainer)  # the attributes _load_snapshot uses, without __init__'s collectives
    trainer.model, trainer.optimizer, trainer.device = workload.model, workload.optimizer, torch.device("cpu")
    trainer.schedule = WarmupCosine(10)
    trainer.scheduler = LambdaLR(workload.optimizer, trainer.schedule)
    trainer.scaler = torch.amp.GradScaler("cpu", enabled=False)
    trainer.snapshot_path, trainer.global_rank, trainer.tag = str(path), 0, "[rank 0/1 | local 0 | cpu]"
    with pytest.raises(SystemExit) as stop:
        trainer._load_snapshot()
    return str(stop.value)


def test_a_snapshot_of_another_model_stops_with_one_line_that_says_what_it_holds(tmp_path):
    """Step 3's snapshot of the synthetic workload's model, found by gpt.py: load_state_dict's own message names
    only the model ("Error(s) in loading state_dict for GPT:"); the line names the keys that do not fit."""
    other = make_workload("synthetic")
    message = snapshot_problem(tmp_path, dict(MODEL_STATE=other.model.state_dict(), EPOCHS_RUN=1))
    assert re.fullmatch(rf"error: cannot resume from \S+{SNAPSHOT} \(RuntimeError: it holds another model than this "
                        r"GPT: missing _extra_state, embed\.token\.weight, embed\.position\.weight \(\+\d+ more\); "
                        r"unexpected 0\.weight, 0\.bias, \S+ \(\+\d+ more\)\); it is left in place: move it away to "
                        r"start anew", message), message


def test_a_snapshot_of_a_gpt_of_another_text_stops_with_one_line(tmp_path):
    """The same model size, the same characters (the excerpt written backwards), another text: the weights would
    load, and training would go on silently on what the model never learned, without the text's identity in its
    state."""
    other = excerpt_gpt(tmp_path, "backwards.txt", reversed_=True)
    assert other.model.vocab == excerpt_gpt(tmp_path).model.vocab, "the test needs two texts of one vocabulary"
    message = snapshot_problem(tmp_path, dict(MODEL_STATE=other.model.state_dict(), EPOCHS_RUN=1))
    assert re.fullmatch(rf"error: cannot resume from \S+{SNAPSHOT} \(ValueError: it holds a GPT of another text "
                        rf"\(backwards\.txt, {EXCERPT_CHARS:,} characters\) than this run's "
                        rf"\(excerpt\.txt, {EXCERPT_CHARS:,} characters\): give the text it was trained on "
                        r"\(--text; step 12: --data\), or another --snapshot_path to start anew\); it is left in "
                        r"place: move it away to start anew", message), message


def test_a_snapshot_without_the_loops_state_stops_with_one_line(tmp_path):
    """multinode.py's keys only (model, optimizer, epochs): gpt.py cannot resume bit for bit from it."""
    workload = excerpt_gpt(tmp_path)
    message = snapshot_problem(tmp_path, dict(MODEL_STATE=workload.model.state_dict(),
                                              OPTIMIZER_STATE=workload.optimizer.state_dict(), EPOCHS_RUN=1))
    assert message.startswith("error: cannot resume from") and "KeyError: 'SCHEDULER_STATE'" in message, message


# --- FSDP ----------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_fsdp_shards_the_gpt_block_by_block_and_trains_it(text, tmp_path):
    """fsdp.py's units are the GPT's children (embedding, each block, head) and the root; 2 epochs of 8 steps. fsdp.py
    has no schedule: at the GPT's constant peak rate, 16 steps of 8 sequences are too few for each epoch's training
    loss to fall steadily, but the held-out loss shows what it learned."""
    job = run(torchrun("fsdp.py", 2, 2, "--workload", "gpt-cpu", "--batch_size", B), cwd=tmp_path,
              env={TEXT_VARIABLE: text}, timeout=180)
    assert sorted(job.losses) == [0, 1], job.output
    assert output.held_out(job.output)["loss"] < 0.8 * untrained_held_out_loss(text), job.output


# --- the MFU's peak -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA L4", 121), ("NVIDIA L40", 181),
    ("NVIDIA L40S", 362), ("NVIDIA A10", 125), ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 4090", 165),
    ("NVIDIA GeForce RTX 3090", 71), ("NVIDIA B200", None), ("Tesla T4", None),
])
def test_the_peak_of_a_gpu_is_its_own_datasheets_and_an_unknown_one_has_none(monkeypatch, name, tflops):
    """Names as torch.cuda.get_device_name() gives them. Each card gets its own figure, never one whose name is part of
    its own (the L40 is not an L4, the H100 NVL not the SXM H100, the A10G not the A10); a card the table does not
    hold has no peak, so no MFU is printed for it (TUTORIAL_PEAK_TFLOPS then gives one)."""
    monkeypatch.delenv(PEAK_VARIABLE, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops("cuda:0") == (None if tflops is None else tflops * 1e12)
    monkeypatch.setenv(PEAK_VARIABLE, "50")
    assert peak_flops("cuda:0") == 50e12


# --- GPUs ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_bf16_and_compile_train_on_gpus_with_one_all_reduce_per_step(tmp_path):
    """The GPU size on the help pages (no $TUTORIAL_GPT_TEXT), bf16 autocast, compiled, K=2: it learns, reports the
    model-FLOPs utilisation, and still all-reduces once per optimizer step."""
    nproc = min(2, torch.cuda.device_count())
    job = run(torchrun("gpt.py", 2, 2, "--precision", "bf16", "--compile", "--grad_accum", K, nproc=nproc),
              cwd=tmp_path, gpu=True, record_steps=True, timeout=600)
    assert job.losses[1] < job.losses[0] and "| cuda:0]" in job.output, job.output
    if peak_flops("cuda") is not None:  # a GPU of the table, or $TUTORIAL_PEAK_TFLOPS
        assert all(mfu is not None and 0 < mfu < 100 for _, _, mfu in output.throughputs(job.output).values())
    assert {step["rounds"] for step in job.steps} == {1}, job.steps


@pytest.mark.gpu
def test_fp16_with_a_gradient_scaler_trains_on_gpus_and_saves_the_scaler(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    job = run(torchrun("gpt.py", 2, 2, "--precision", "fp16", "--grad_accum", K, nproc=nproc), cwd=tmp_path,
              gpu=True, timeout=300)
    assert job.losses[1] < job.losses[0], job.output
    scaler = load(tmp_path / SNAPSHOT)["SCALER_STATE"]
    # an enabled scaler's state: its scale starts at 2**16 and only halves (an overflow) or doubles from there
    assert math.log2(scaler["scale"]).is_integer() and scaler["growth_interval"] == 2000, scaler
    rng = load(tmp_path / SNAPSHOT)["RNG_STATES"]
    assert all(cuda is not None for _, cuda in rng), "the CUDA generator's state (dropout on the GPU) is saved"
    # the snapshot is loaded onto the GPU (map_location): its generator states must still go back in
    resumed = run(torchrun("gpt.py", 3, 1, "--precision", "fp16", "--grad_accum", K, nproc=nproc), cwd=tmp_path,
                  gpu=True, timeout=300)
    assert "resuming from epoch 2" in resumed.output and sorted(resumed.losses) == [2], resumed.output
