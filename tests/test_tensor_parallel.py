"""Step 7, tensor_parallel.py: tensor parallelism (and 2D, FSDP x TP) trains what one process trains, up to float
rounding; the ranks of a tp group take the same batches and the dp groups disjoint ones (recorded); each rank holds
1/tp of every split matrix; a killed worker resumes under torchrun, and a snapshot resumes on another layout; bad
input stops with one line.

Every job trains the CPU-size GPT on a short excerpt of the help pages ($TUTORIAL_GPT_TEXT): 64 training blocks of
64 characters, so a global batch of 8 sequences makes 8 optimizer steps an epoch, with dropout 0. One process
computes the reference here, in this process: fsdp.py's loop (AdamW, no schedule) over the samples in the order a
DistributedSampler over the dp ranks deals them (dp rank r gets shuffled positions r, r+2...: one batch of 8 holds
exactly the 2 dp ranks' batches of 4)."""
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from tools.jobs import output, run, script, shared_file, torchrun
from utils import evaluate, make_workload, require_tp_fits
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, CausalSelfAttention, help_pages

TEXT_CHARS = 4600  # 90% to train on: 64 blocks of 64 (+1) characters; 7 blocks held out
GLOBAL_BATCH = 8  # sequences per optimizer step, all dp ranks together
EPOCHS = 2
# Equal up to float rounding, which Adam magnifies (it divides each step by the gradients' running magnitude; lr 6e-3):
# measured here, the recorded losses within 1.8e-5 of one process's and the weights within 9.1e-5 after 16 to 24
# steps, where one process training other batches (4 per step) ends 0.17 away.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 5e-5, 3e-4


@pytest.fixture(scope="module")
def text():
    return shared_file("help_excerpt.txt", help_pages()[:TEXT_CHARS])  # named by its content: shared jobs match


def exact(text):
    """The jobs' environment: the short text, dropout 0."""
    return {TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0}


def built(text):
    return make_workload("gpt-cpu", text=str(text), dropout=0)


def train_in_one_process(text, batch_size, epochs):
    """fsdp.py's loop in one process: ({epoch: mean loss}, {epochs done: weights})."""
    workload = built(text)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the jobs run (2 threads on a busy 2-core machine spin-wait)
    loader = DataLoader(workload.train_set, batch_size=batch_size,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    losses, weights = {}, {}
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        summed = 0.0
        for source, targets in loader:
            workload.optimizer.zero_grad(set_to_none=True)
            loss = workload.loss_fn(workload.model(source), targets)
            loss.backward()
            workload.optimizer.step()
            summed += loss.item() * len(source)
        losses[epoch] = summed / len(loader.sampler)
        weights[epoch + 1] = {name: tensor.clone() for name, tensor in workload.model.state_dict().items()
                              if isinstance(tensor, torch.Tensor)}  # not the text it learns (_extra_state)
    torch.set_num_threads(threads)
    return losses, weights


@pytest.fixture(scope="module")
def reference(text):
    """One process, batch 8, 3 epochs; and the weights of one that trains other batches (4 per step) for 2."""
    losses, weights = train_in_one_process(text, GLOBAL_BATCH, EPOCHS + 1)
    return losses, weights, train_in_one_process(text, GLOBAL_BATCH // 2, EPOCHS)[1][EPOCHS]


def job_in(folder, *args, nproc, **options):
    """tensor_parallel.py run by torchrun in `folder` (its snapshot and model_full.pt land there)."""
    folder.mkdir(exist_ok=True)
    job = run(torchrun("tensor_parallel.py", *args, "--workload", "gpt-cpu", nproc=nproc,
                       launcher_args=options.pop("launcher_args", ())), cwd=folder, timeout=240, **options)
    return job


@pytest.fixture(scope="module")
def two_d(tmp_path_factory, text):
    """dp 2 x tp 2 on 4 ranks, batch 4 per dp rank, 2 epochs, a snapshot after each; --verbose, recorded.
    notebooks/07_tensor_parallel.ipynb runs the same job: shared, it runs once in a test session."""
    return job_in(tmp_path_factory.mktemp("two_d"), EPOCHS, 1, "--tp", 2, "--batch_size", GLOBAL_BATCH // 2,
                  "--verbose", nproc=4, env=exact(text), record=True, shared=True)


@pytest.fixture(scope="module")
def killed(tmp_path_factory, text):
    """tp 2 on 2 ranks (TP alone), batch 8, 2 epochs; rank 1 SIGKILLs itself as it begins epoch 1 (after the
    snapshot of epoch 0), torchrun restarts both workers, and they resume. Recorded."""
    return job_in(tmp_path_factory.mktemp("killed"), EPOCHS, 1, "--tp", 2, "--batch_size", GLOBAL_BATCH, nproc=2,
                  env=exact(text), record=True, kill_at=(0, 1, 1), launcher_args=["--max_restarts=1"])


@pytest.fixture(scope="module")
def alone(tmp_path_factory, two_d, text):
    """The dp 2 x tp 2 snapshot (2 epochs) resumed by one process with --tp 1 (FSDP alone, over one rank), batch 8,
    for a third epoch. Recorded."""
    folder = tmp_path_factory.mktemp("alone")
    shutil.copytree(two_d.cwd / "snapshot", folder / "snapshot")
    return job_in(folder, EPOCHS + 1, 1, "--tp", 1, "--batch_size", GLOBAL_BATCH, nproc=1, env=exact(text),
                  record=True)


def recorded_losses(job):
    """{epoch: the mean loss over every sample of the epoch}, each rank's own loss as the recorder measured it (all
    digits, not the 4 printed), averaged over the dp ranks (a tp group's ranks share one batch, so one loss)."""
    by_epoch = {}
    for row in job.samples:
        by_epoch.setdefault(row["epoch"], {})[row["rank"]] = row
    return {epoch: sum(row["loss"] for row in rows.values()) / len(rows) for epoch, rows in by_epoch.items()}


def final_weights(job):
    saved = torch.load(job.cwd / "model_full.pt", map_location="cpu", weights_only=True)
    return {name: tensor for name, tensor in saved.items() if isinstance(tensor, torch.Tensor)}


def assert_same_weights(actual, expected):
    """Every weight within WEIGHT_TOLERANCE, but the key biases. Their true gradient is 0 (a query's scores against
    every key shift by the same q.b_k, which softmax ignores), so what moves them is rounding noise, which Adam turns
    into steps of its own: they only have to stay far below a learned bias on both sides (measured: 4.5e-4 at most,
    where the query biases reach 6e-2)."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        if name.endswith("attention.k.bias"):
            assert actual[name].abs().max() < 2e-3 and tensor.abs().max() < 2e-3, name
            continue
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=WEIGHT_TOLERANCE, msg=name)


# --- equal to one process ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_dp2_x_tp2_on_4_ranks_trains_what_one_process_does_with_twice_the_batch(two_d, reference):
    losses, weights, other_batches = reference
    assert recorded_losses(two_d) == pytest.approx({e: losses[e] for e in range(EPOCHS)}, abs=LOSS_TOLERANCE)
    assert two_d.losses == pytest.approx({e: losses[e] for e in range(EPOCHS)}, abs=1e-4)  # printed: 4 decimals
    assert_same_weights(final_weights(two_d), weights[EPOCHS])
    assert max((final_weights(two_d)[name] - tensor).abs().max() for name, tensor in other_batches.items()) > \
        100 * WEIGHT_TOLERANCE, "the tolerance tells training on these batches from training on others"


@pytest.mark.slow
def test_tp2_alone_trains_what_one_process_does_and_a_killed_worker_resumes_under_torchrun(killed, reference):
    losses, weights, _ = reference
    assert killed.resumes == {1: 1}, killed.output  # restart 1 resumed from the snapshot of epoch 0
    assert [(row["restart"], row["epoch"]) for row in killed.samples if row["rank"] == 0] == [(0, 0), (1, 1)]
    assert recorded_losses(killed) == pytest.approx({e: losses[e] for e in range(EPOCHS)}, abs=LOSS_TOLERANCE)
    assert_same_weights(final_weights(killed), weights[EPOCHS])


@pytest.mark.slow
def test_a_dp2_x_tp2_snapshot_resumes_in_one_process_with_tp1_as_one_process_trains(alone, reference):
    """DCP reshards: the 4 ranks' shards load into one process's whole matrices, and training goes on exactly."""
    losses, weights, _ = reference
    assert alone.resumes == {0: EPOCHS} and sorted(alone.losses) == [EPOCHS], alone.output
    assert recorded_losses(alone) == pytest.approx({EPOCHS: losses[EPOCHS]}, abs=LOSS_TOLERANCE)
    assert_same_weights(final_weights(alone), weights[EPOCHS + 1])


# --- who trains on what, who holds what -------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_ranks_of_a_tp_group_train_on_the_same_batches_and_the_dp_groups_on_disjoint_halves(two_d):
    rows = two_d.samples
    assert sorted((row["rank"], row["mesh"]["dp"], row["mesh"]["tp"]) for row in rows if row["epoch"] == 0) == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], "ranks 0, 1 form a tp group; ranks 2, 3 the other"
    for epoch in range(EPOCHS):
        by_dp = {}
        for row in (row for row in rows if row["epoch"] == epoch):
            by_dp.setdefault(row["mesh"]["dp"], []).append(row["indices"])
        for dp, shares in by_dp.items():
            assert len(shares) == 2 and shares[0] == shares[1], f"epoch {epoch}: tp group {dp} got different batches"
        halves = [set(shares[0]) for shares in by_dp.values()]
        assert [len(half) for half in halves] == [32, 32] and not halves[0] & halves[1], f"epoch {epoch}"
        assert halves[0] | halves[1] == set(range(64))
    orders = [tuple(row["indices"]) for row in rows if row["rank"] == 0]
    assert orders[0] != orders[1], "set_epoch reshuffles"


@pytest.mark.slow
def test_verbose_shows_each_rank_holding_half_of_every_split_matrix_and_a_quarter_stored(two_d, text):
    """tp 2: q, k, v and the MLP's first matrix lose half their output rows, the two matrices after them half their
    input columns; FSDP then stores half of each slice's rows on each dp rank."""
    rows = output.slices(two_d.output)
    matrices = ["attention.q.weight", "attention.k.weight", "attention.v.weight", "attention.proj.weight",
                "mlp.fc.weight", "mlp.proj.weight"]
    assert [(row["rank"], row["dp"], row["tp"], row["matrix"]) for row in rows] == [
        (rank, rank // 2, rank % 2, name) for rank in range(4) for name in matrices]
    for row in rows:
        (out_features, in_features), where = row["full"], (row["rank"], row["matrix"])
        split_rows = row["matrix"].split(".")[1] in ("q", "k", "v", "fc")
        assert row["tp_slice"] == ((out_features // 2, in_features) if split_rows else
                                   (out_features, in_features // 2)), where
        assert row["stored"] == (row["tp_slice"][0] // 2, row["tp_slice"][1]), where
        assert row["KiB"] == pytest.approx(row["stored"][0] * row["stored"][1] * 4 / 1024), where
    full = sum(p.numel() * 4 for p in built(text).model.parameters()) / 2**20
    for row in output.memory_tables(two_d.output)["end"]:  # the blocks: a quarter each; embedding, head: a half
        assert full / 4 < row["params MiB"] < full / 3, (row, full)


@pytest.mark.slow
def test_every_rank_writes_its_shards_and_rank_0_a_full_model_that_a_plain_gpt_loads(two_d, text):
    folder = two_d.cwd
    assert sorted(path.name for path in (folder / "snapshot").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    dcp_to_torch_save(folder / "snapshot", folder / "gathered.pt")  # the snapshot, put together offline
    snapshot = torch.load(folder / "gathered.pt", weights_only=False)
    exported = torch.load(folder / "model_full.pt", map_location="cpu", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == EPOCHS and exported.keys() == snapshot["MODEL_STATE"].keys()
    for name, tensor in final_weights(two_d).items():
        assert torch.equal(tensor, snapshot["MODEL_STATE"][name]), name
    workload = built(text)
    workload.model.load_state_dict(exported)  # no process group anywhere; the same text (its _extra_state)
    loss = evaluate(workload.model, workload.eval_set, workload.loss_fn, torch.device("cpu"))["loss"]
    assert loss == pytest.approx(output.held_out(two_d.output)["loss"], abs=1e-4)


# --- the model splits -------------------------------------------------------------------------------------------------

def test_attention_split_megatron_style_by_hand_sums_to_the_whole(text):
    """No process group: the GPT's attention given half of q, k and v's output rows and of proj's input columns
    computes half the heads, from the shapes alone; the two halves' outputs (before proj's bias) add up to the
    unsplit attention's. This is what ColwiseParallel and RowwiseParallel do across two ranks."""
    model = built(text).model
    attention, width = model.block0.attention.eval(), model.config.n_embd

    def linear(weight, bias=None):
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight.data.copy_(weight)
        if bias is not None:
            layer.bias.data.copy_(bias)
        return layer

    x = torch.randn(2, 16, width, generator=torch.Generator().manual_seed(0))
    outputs = []
    with torch.no_grad():
        for part in (slice(0, width // 2), slice(width // 2, width)):  # rank 0's heads, then rank 1's
            half = CausalSelfAttention(model.config).eval()
            for name in ("q", "k", "v"):
                layer = getattr(attention, name)
                setattr(half, name, linear(layer.weight[part], layer.bias[part]))  # column-wise: output rows
            half.proj = linear(attention.proj.weight[:, part])  # row-wise: input columns; the bias is added once
            outputs.append(half(x))
        torch.testing.assert_close(outputs[0] + outputs[1] + attention.proj.bias, attention(x), rtol=1e-5,
                                   atol=1e-6)


# --- precision, bad input ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_on_the_cpu_tracks_fp32(tmp_path, text, reference):
    """One process, --tp 1, one epoch in bf16 (FSDP's MixedPrecisionPolicy: bf16 compute, fp32 shards)."""
    job = job_in(tmp_path / "bf16", 1, 1, "--tp", 1, "--batch_size", GLOBAL_BATCH, "--precision", "bf16", nproc=1,
                 env=exact(text))
    assert job.losses[0] == pytest.approx(reference[0][0], abs=0.02), job.output


@pytest.mark.slow
def test_tp_that_does_not_divide_the_processes_stops_every_rank_with_one_line(tmp_path, text):
    """1 process, --tp 2: the worker stops with one line before any training (torchrun then reports it failed)."""
    job = job_in(tmp_path / "bad", 1, 1, "--tp", 2, nproc=1, env=exact(text), check=False)
    assert job.returncode not in (0, None) and "[rank0]:" not in job.output, job.output  # no worker traceback
    assert job.errors == ["error: --tp 2 must divide the number of processes (1) and of attention heads (4): the "
                          "processes form groups of 2, and each group splits every block's heads evenly"], job.output
    assert not (tmp_path / "bad" / "snapshot").exists()


def test_heads_that_do_not_divide_by_tp_are_refused():
    with pytest.raises(SystemExit) as stop:
        require_tp_fits(3, 6, 4)
    assert str(stop.value).startswith("error: --tp 3 must divide the number of processes (6) and of attention heads "
                                      "(4)")
    require_tp_fits(2, 4, 6)  # 2 groups of 2, 3 heads each


@pytest.mark.parametrize("option, value", [("--workload", "wide"), ("--precision", "fp16"), ("--tp", "0")])
def test_an_option_it_cannot_run_stops_with_one_line_before_anything_starts(monkeypatch, capsys, option, value):
    """Tensor parallelism splits the GPT's blocks, so no other workload; fp16 would need a gradient scaler."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["tensor_parallel.py", "2", "1", option, value])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script("tensor_parallel.py"), run_name="__main__")
    assert stop.value.code == 2
    assert re.search(rf"tensor_parallel.py: error: argument {option}: ", capsys.readouterr().err.splitlines()[-1])


# --- GPUs -------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_bf16_tensor_parallelism_trains_on_the_gpus_there_are(tmp_path):
    """The GPU-size GPT (6 heads) on the help pages: tp 2 on 2 or more GPUs (dp the rest), bf16."""
    count = torch.cuda.device_count()
    nproc = 4 if count >= 4 else 2 if count >= 2 else 1  # the GPU size's 6 heads split over 2
    tp = 2 if nproc >= 2 else 1
    job = run(torchrun("tensor_parallel.py", 2, 2, "--tp", tp, "--precision", "bf16", "--verbose", nproc=nproc),
              cwd=tmp_path, gpu=True, timeout=600)
    assert job.losses[1] < job.losses[0] and "| cuda:0]" in job.output, job.output
    rows = output.slices(job.output)
    assert len(rows) == 6 * nproc, job.output
    for row in rows:
        assert row["tp_slice"][0] * row["tp_slice"][1] * tp == row["full"][0] * row["full"][1], row
