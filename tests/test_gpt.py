"""Step 6, gpt.py: the GPT learns; gradient accumulation is exact and no_sync() really skips the all-reduce; bf16 on
the CPU tracks fp32; a worker SIGKILLed mid-training (dropout on) resumes to a bitwise-identical end; --compile; bad
options stop with one line; fsdp.py trains the GPT too.

Every job trains on a short excerpt of the help pages ($TUTORIAL_GPT_TEXT): 64 training blocks of 64 characters, so
2 ranks x K=2 micro-batches x batch 4 make 4 optimizer steps an epoch. Each job is shared by the tests that read it
(a 2-process job costs ~11 s of CPU before its first step)."""
import os
import re
import runpy
import sys

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from expect import assert_bitwise_equal, assert_one_writer
from tools.jobs import output, run, script, start, torchrun
from utils import evaluate, make_workload
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages
from utils.loop import PEAK_BF16_FLOPS, compiler_missing, warmup_cosine

TEXT_CHARS = 4600  # 90% to train on: 4,140 characters, 64 blocks of 64 (+1) characters; 7 blocks held out
B, K = 4, 2  # micro-batch per rank, micro-batches per optimizer step
STEPS_PER_EPOCH = 64 // (2 * K * B)  # 4
EPOCHS = 2
ACCUMULATED = ("--workload", "gpt-cpu", "--batch_size", B, "--grad_accum", K)
SNAPSHOT = "snapshot.pt"
LR = 1e-3  # the CPU size's peak learning rate


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "help_excerpt.txt"
    path.write_text(help_pages()[:TEXT_CHARS])
    return path


def gpt_env(text, **more):
    return {TEXT_VARIABLE: text, **more}


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory, text):
    """2 ranks x K=2 micro-batches of 4, fp32, dropout 0, 2 epochs; every optimizer step recorded (its learning rate
    and the gradient all-reduces DDP ran for it)."""
    workdir = tmp_path_factory.mktemp("accumulated")
    job = run(torchrun("gpt.py", EPOCHS, EPOCHS, *ACCUMULATED), cwd=workdir, env=gpt_env(text, **{DROPOUT_VARIABLE: 0}),
              record_steps=True, timeout=180)
    job.snapshot = load(workdir / SNAPSHOT)
    return job


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, text):
    """The same with dropout on (the CPU size's 0.1), 3 epochs, a snapshot after each: the run a killed one must
    end exactly like."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    job = run(torchrun("gpt.py", 3, 1, *ACCUMULATED), cwd=workdir, env=gpt_env(text), record=True, timeout=180)
    job.workdir = workdir
    return job


def untrained_held_out_loss(text, workload="gpt-cpu"):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TEXT_VARIABLE, str(text))
        built = make_workload(workload)
    return evaluate(built.model, built.eval_set, built.loss_fn, torch.device("cpu"))["loss"]


def train_in_one_process(text, batch_size, epochs=EPOCHS):
    """What gpt.py's optimizer steps compute, written out in one process without DDP (dropout 0): AdamW, the
    gradient norm clipped to 1, the warm-up + cosine schedule stepped per optimizer step, over the samples in the
    order a 2-rank DistributedSampler deals them (rank r gets shuffled positions r, r+2...: one batch of 4b holds
    exactly the 2 ranks' K=2 micro-batches of b). Returns the final weights and each step's gradient norm before
    clipping."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TEXT_VARIABLE, str(text))
        patch.setenv(DROPOUT_VARIABLE, "0")
        workload = make_workload("gpt-cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the jobs run: 2 threads on a busy 2-core machine spin-wait, 10x slower (measured)
    loader = DataLoader(workload.train_set, batch_size=batch_size,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    scheduler = LambdaLR(workload.optimizer, warmup_cosine(epochs * len(loader)))
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


def max_difference(a, b):
    return max((a[name] - tensor).abs().max().item() for name, tensor in b.items())


# --- it learns, and says so -------------------------------------------------------------------------------------------

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
    assert_one_writer(job.writes, job.workdir / SNAPSHOT)


def test_the_snapshot_holds_everything_the_loop_depends_on(uninterrupted):
    snapshot = load(uninterrupted.workdir / SNAPSHOT)
    assert set(snapshot) == {"MODEL_STATE", "OPTIMIZER_STATE", "SCHEDULER_STATE", "SCALER_STATE", "RNG_STATES",
                             "STEPS_RUN", "EPOCHS_RUN"}
    assert (snapshot["EPOCHS_RUN"], snapshot["STEPS_RUN"]) == (3, 3 * STEPS_PER_EPOCH)
    assert snapshot["SCHEDULER_STATE"]["last_epoch"] == 3 * STEPS_PER_EPOCH  # stepped once per optimizer step
    assert snapshot["SCALER_STATE"] == {}  # fp32: the gradient scaler is off
    cpu_states = [cpu for cpu, cuda in snapshot["RNG_STATES"]]
    assert len(cpu_states) == 2 and not torch.equal(*cpu_states), "each rank's own random state (dropout)"


# --- gradient accumulation --------------------------------------------------------------------------------------------

def test_two_ranks_accumulating_two_micro_batches_of_b_end_where_one_process_with_4b_does(accumulated, text):
    """Exact up to float rounding: the same 16 samples per optimizer step, summed in another order. Adam divides by
    the gradients' running magnitude, which magnifies that rounding in a few of the 431k weights (measured: at most
    9e-6); without accumulation (2 ranks x 4, i.e. one process with 8) the weights end 1e-2 away.

    Adam hardly sees the scale of the gradients (and clipping to 1 hides more), so the weights alone would not show
    micro-batch losses left undivided by K: each step's all-reduced gradient (recorded by a DDP communication hook)
    must also have the norm of the mean over the step's 16 samples, not K times it."""
    two_ranks = accumulated.snapshot["MODEL_STATE"]
    reference, norms = train_in_one_process(text, 2 * K * B)
    assert two_ranks.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(two_ranks[name], tensor, rtol=0, atol=5e-5, msg=name)
    assert max_difference(two_ranks, train_in_one_process(text, 2 * B)[0]) > 2e-3
    all_reduced = [step["grad_norms"] for step in steps_of(accumulated, 0)]
    assert all_reduced == [[pytest.approx(norm, rel=1e-4)] for norm in norms], (all_reduced, norms)


def steps_of(job, rank):
    return [step for step in job.steps if step["rank"] == rank]


def test_no_sync_all_reduces_the_gradients_once_per_optimizer_step_not_once_per_micro_batch(accumulated):
    for rank in (0, 1):
        steps = steps_of(accumulated, rank)
        assert len(steps) == EPOCHS * STEPS_PER_EPOCH, steps
        assert [step["rounds"] for step in steps] == [1] * len(steps), f"rank {rank}: {steps}"  # K=2 without no_sync
        assert all(step["buckets"] >= 1 for step in steps)
    for step0, step1 in zip(steps_of(accumulated, 0), steps_of(accumulated, 1)):  # both ranks got the same average
        assert step0["grad_norms"] == pytest.approx(step1["grad_norms"], rel=1e-6)


def test_the_schedule_warms_up_then_decays_once_per_optimizer_step(accumulated):
    factor = warmup_cosine(EPOCHS * STEPS_PER_EPOCH)
    lrs = [step["lr"] for step in steps_of(accumulated, 0)]
    assert lrs == pytest.approx([LR * factor(step) for step in range(len(lrs))], rel=1e-9)
    assert lrs[-1] < 0.2 * max(lrs)


# --- precision --------------------------------------------------------------------------------------------------------

def test_bf16_on_the_cpu_tracks_fp32(accumulated, text, tmp_path):
    """The same optimizer steps in bf16 autocast: one process with K=2 micro-batches of 8 takes the same 16 samples
    per step as the accumulated fp32 job (the test above shows the layouts agree). Measured: the epoch losses agree
    to 2e-4; the tolerance is 0.02."""
    job = run(torchrun("gpt.py", EPOCHS, EPOCHS, "--workload", "gpt-cpu", "--batch_size", 2 * B, "--grad_accum", K,
                       "--precision", "bf16", nproc=1), cwd=tmp_path, env=gpt_env(text, **{DROPOUT_VARIABLE: 0}))
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
    command = torchrun("gpt.py", 3, 1, *ACCUMULATED, launcher_args=["--max_restarts=1"])
    with start(command, cwd=tmp_path, env=gpt_env(text)) as job:
        job.wait_for(r"\] epoch 0 \| snapshot saved")  # rank 1 dies in epoch 1 (or 2), after a snapshot
        job.kill_worker(rank=1)
        [code] = job.wait(timeout=150)
    assert code == 0, job.output
    assert job.resumes and min(job.resumes.values()) >= 1, f"it did not resume from a snapshot:\n{job.output}"
    assert_bitwise_equal(load(tmp_path / SNAPSHOT), load(uninterrupted.workdir / SNAPSHOT))


# --- torch.compile -------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason=f"torch.compile cannot run here: {compiler_missing()}")
def test_compile_with_ddp_trains_as_eager_does_and_keeps_one_all_reduce_per_step(text, tmp_path):
    """The smallest job that compiles DDP's model and takes optimizer steps through no_sync(): 1 process (DDP still
    all-reduces, with itself), 2 steps of K=2 micro-batches of 16."""
    args = (1, 1, "--workload", "gpt-cpu", "--batch_size", 16, "--grad_accum", K)
    env = gpt_env(text, **{DROPOUT_VARIABLE: 0})
    compiled = run(torchrun("gpt.py", *args, "--compile", nproc=1), cwd=tmp_path / "compiled", env=env,
                   record_steps=True, timeout=400)
    eager = run(torchrun("gpt.py", *args, nproc=1), cwd=tmp_path / "eager", env=env, timeout=120)
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


def snapshot_problem(tmp_path, snapshot):
    """What gpt.py's Trainer says when it finds `snapshot` (a dict) at its snapshot path: its _load_snapshot runs in
    this process on a Trainer with the GPT, its optimizer, schedule and scaler (no process group is needed)."""
    import gpt

    path = tmp_path / SNAPSHOT
    torch.save(snapshot, path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TEXT_VARIABLE, str(tmp_path / "text.txt"))
        (tmp_path / "text.txt").write_text(help_pages()[:TEXT_CHARS])
        workload = make_workload("gpt-cpu")
    trainer = gpt.Trainer.__new__(gpt.Trainer)  # the attributes _load_snapshot uses, without __init__'s collectives
    trainer.model, trainer.optimizer, trainer.device = workload.model, workload.optimizer, torch.device("cpu")
    trainer.scheduler = LambdaLR(workload.optimizer, warmup_cosine(10))
    trainer.scaler = torch.amp.GradScaler("cpu", enabled=False)
    trainer.snapshot_path, trainer.global_rank, trainer.tag = str(path), 0, "[rank 0/1 | local 0 | cpu]"
    with pytest.raises(SystemExit) as stop:
        trainer._load_snapshot()
    return str(stop.value)


def test_a_snapshot_of_another_model_stops_with_one_line(tmp_path):
    other = make_workload("synthetic")
    message = snapshot_problem(tmp_path, dict(MODEL_STATE=other.model.state_dict(), EPOCHS_RUN=1))
    assert re.fullmatch(rf"error: cannot resume from \S+{SNAPSHOT} \(RuntimeError: Error\(s\) in loading state_dict "
                        r"for GPT:.*\); it is left in place: move it away to start anew", message), message


def test_a_snapshot_without_the_loops_state_stops_with_one_line(tmp_path):
    """multinode.py's keys only (model, optimizer, epochs): gpt.py cannot resume bit for bit from it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TEXT_VARIABLE, str(tmp_path / "text.txt"))
        (tmp_path / "text.txt").write_text(help_pages()[:TEXT_CHARS])
        workload = make_workload("gpt-cpu")
    message = snapshot_problem(tmp_path, dict(MODEL_STATE=workload.model.state_dict(),
                                              OPTIMIZER_STATE=workload.optimizer.state_dict(), EPOCHS_RUN=1))
    assert message.startswith("error: cannot resume from") and "KeyError: 'SCHEDULER_STATE'" in message, message


# --- FSDP ----------------------------------------------------------------------------------------------------------

def test_fsdp_shards_the_gpt_block_by_block_and_trains_it(text, tmp_path):
    """fsdp.py's units are the GPT's children (embedding, each block, head) and the root; 2 epochs of 8 steps."""
    job = run(torchrun("fsdp.py", 2, 2, "--workload", "gpt-cpu", "--batch_size", B), cwd=tmp_path, env=gpt_env(text),
              timeout=180)
    assert job.losses[1] < job.losses[0], job.output
    assert output.held_out(job.output)["loss"] < 0.9 * untrained_held_out_loss(text), job.output


# --- GPUs ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_bf16_and_compile_train_on_gpus_with_one_all_reduce_per_step(tmp_path):
    """The GPU size on the help pages (no $TUTORIAL_GPT_TEXT), bf16 autocast, compiled, K=2: it learns, reports the
    model-FLOPs utilisation, and still all-reduces once per optimizer step."""
    nproc = min(2, torch.cuda.device_count())
    job = run(torchrun("gpt.py", 2, 2, "--precision", "bf16", "--compile", "--grad_accum", K, nproc=nproc),
              cwd=tmp_path, gpu=True, record_steps=True, timeout=600)
    assert job.losses[1] < job.losses[0] and "| cuda:0]" in job.output, job.output
    if os.environ.get("TUTORIAL_PEAK_TFLOPS") or any(name in torch.cuda.get_device_name() for name in PEAK_BF16_FLOPS):
        assert all(mfu is not None and 0 < mfu < 100 for _, _, mfu in output.throughputs(job.output).values())
    assert {step["rounds"] for step in job.steps} == {1}, job.steps


@pytest.mark.gpu
def test_fp16_with_a_gradient_scaler_trains_on_gpus_and_saves_the_scaler(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    job = run(torchrun("gpt.py", 2, 2, "--precision", "fp16", "--grad_accum", K, nproc=nproc), cwd=tmp_path,
              gpu=True, timeout=300)
    assert job.losses[1] < job.losses[0], job.output
    scaler = load(tmp_path / SNAPSHOT)["SCALER_STATE"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] >= 0, scaler
    rng = load(tmp_path / SNAPSHOT)["RNG_STATES"]
    assert all(cuda is not None for _, cuda in rng), "the CUDA generator's state (dropout on the GPU) is saved"
    # the snapshot is loaded onto the GPU (map_location): its generator states must still go back in
    resumed = run(torchrun("gpt.py", 3, 1, "--precision", "fp16", "--grad_accum", K, nproc=nproc), cwd=tmp_path,
                  gpu=True, timeout=300)
    assert "resuming from epoch 2" in resumed.output and sorted(resumed.losses) == [2], resumed.output
