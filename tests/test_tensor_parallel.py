"""Step 7, tensor_parallel.py: tensor parallelism (and 2D, FSDP x TP) trains what one process trains, up to float
rounding; the ranks of a tp group take the same batches and the dp groups disjoint ones (recorded); each rank holds
1/tp of every split matrix; a snapshot resumes on another layout but not in another step; on two nodes, with dropout and bf16, tp stays inside a node, the tp group's copies of what it holds
whole stay equal, every rank draws its own masks where it should, and a killed worker resumes to the same end bit for
bit; bad input stops with one line.

The exact jobs train the CPU-size GPT on a short excerpt of the help pages ($TUTORIAL_GPT_TEXT): 64 training blocks
of 64 characters, so a global batch of 8 sequences makes 8 optimizer steps an epoch, with dropout 0. One process
computes the reference here, in this process: fsdp.py's loop (AdamW, no schedule) over the samples in the order a
DistributedSampler over the dp ranks deals them (dp rank r gets shuffled positions r, r+2...: one batch of 8 holds
exactly the 2 dp ranks' batches of 4)."""
import re
import shutil

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from expect import assert_bitwise_equal, sharded_snapshot, stopped_as_rank_0
from tools import figures
from harness.jobs import free_port, output, run, torchrun, torchrun_node
from utils import evaluate, make_workload, require_written_by
from utils.snapshot_reader import SnapshotReader
from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, CausalSelfAttention

GLOBAL_BATCH = 8  # sequences per optimizer step, all dp ranks together
EPOCHS = 2
# Equal up to float rounding, which Adam magnifies (it divides each step by the gradients' running magnitude; lr 6e-3):
# measured here, the recorded losses within 1.8e-5 of one process's and the weights within 9.1e-5 after 16 to 24
# steps, where one process training other batches (4 per step) ends 0.17 away.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 5e-5, 3e-4


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
    """tensor_parallel.py run by torchrun in `folder` (its tp_snapshot/ and tp_model_full.pt land there)."""
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
def tp_alone(tmp_path_factory, text):
    """tp 2 on 2 ranks (TP alone), batch 8, 2 epochs. Recorded."""
    return job_in(tmp_path_factory.mktemp("tp_alone"), EPOCHS, 1, "--tp", 2, "--batch_size", GLOBAL_BATCH, nproc=2,
                  env=exact(text), record=True)


@pytest.fixture(scope="module")
def alone(tmp_path_factory, two_d, text):
    """The dp 2 x tp 2 snapshot (2 epochs) resumed by one process with --tp 1 (FSDP alone, over one rank), batch 8,
    for a third epoch. Recorded."""
    folder = tmp_path_factory.mktemp("alone")
    shutil.copytree(two_d.cwd / "tp_snapshot", folder / "tp_snapshot")
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
    saved = torch.load(job.cwd / "tp_model_full.pt", map_location="cpu", weights_only=True)
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
def test_tp2_alone_trains_what_one_process_does(tp_alone, reference):
    losses, weights, _ = reference
    assert recorded_losses(tp_alone) == pytest.approx({e: losses[e] for e in range(EPOCHS)}, abs=LOSS_TOLERANCE)
    assert_same_weights(final_weights(tp_alone), weights[EPOCHS])


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
def test_the_pages_figure_is_drawn_from_this_job_with_each_ranks_block_of_every_matrix(two_d, tmp_path):
    """docs/tensor-parallel.md's figure (`python tools/figures.py tensor-parallel`) runs the very job of the tests
    above (in a test session the same shared run: drawing it costs a second) and draws what the job's snapshot says
    each rank holds: the tp slice (rows for q and fc, columns for proj), then FSDP's half of it over dp."""
    facts = figures.draw("tensor-parallel", tmp_path, work=tmp_path / "work")
    assert (tmp_path / "tensor-parallel.png").stat().st_size > 20_000
    assert facts["mesh"] == {rank: {"dp": rank // 2, "tp": rank % 2} for rank in range(4)}
    for matrix, (shape, pieces) in facts["held"].items():
        by_rows = matrix.split(".")[1] in ("q", "fc")
        slice_shape = (shape[0] // 2, shape[1]) if by_rows else (shape[0], shape[1] // 2)
        for rank, offsets, sizes in pieces:
            dp, tp = rank // 2, rank % 2
            tp_offset = (tp * slice_shape[0], 0) if by_rows else (0, tp * slice_shape[1])
            assert sizes == (slice_shape[0] // 2, slice_shape[1]), (matrix, rank)
            assert offsets == (tp_offset[0] + dp * sizes[0], tp_offset[1]), (matrix, rank)
        assert sorted(rank for rank, _, _ in pieces) == [0, 1, 2, 3], matrix


@pytest.mark.slow
def test_every_rank_writes_its_shards_and_rank_0_a_full_model_that_a_plain_gpt_loads(two_d, text):
    """The full model is gathered in the order each weight was split (dp, then tp): torch has nothing to warn about
    (in one redistribution, every rank warned that it cannot merge the two all-gathers)."""
    assert "While redistributing" not in two_d.output and "sequential all_gather" not in two_d.output
    folder = two_d.cwd
    assert sorted(path.name for path in (folder / "tp_snapshot").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    snapshot = sharded_snapshot(folder / "tp_snapshot")  # the snapshot, put together offline
    exported = torch.load(folder / "tp_model_full.pt", map_location="cpu", weights_only=True)
    assert (snapshot["EPOCHS_RUN"], snapshot["STEP"]) == (EPOCHS, "tensor_parallel.py")
    assert exported.keys() == snapshot["MODEL_STATE"].keys()
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
def test_bf16_tensor_parallelism_on_the_cpu_tracks_fp32(tmp_path, text, reference):
    """tp 2 on 2 ranks, one epoch in bf16 (FSDP's MixedPrecisionPolicy: bf16 compute, fp32 shards and gradient
    reduction): the loss within 0.02 of one process's in fp32 (measured: 1e-3)."""
    job = job_in(tmp_path / "bf16", 1, 1, "--tp", 2, "--batch_size", GLOBAL_BATCH, "--precision", "bf16", nproc=2,
                 env=exact(text))
    assert job.losses[0] == pytest.approx(reference[0][0], abs=0.02), job.output


def run_main(monkeypatch, world_size, *args):
    """tensor_parallel.py's checks before its process group, in this process (expect.stopped_as_rank_0)."""
    return stopped_as_rank_0(monkeypatch, "tensor_parallel.py", world_size, *args)


@pytest.mark.parametrize("world_size, args, message", [
    (1, ["--tp", 2], "error: --tp 2 must divide the number of processes (1) and of attention heads (4): the processes "
                     "form groups of 2, and each group splits every block's heads evenly"),
    (6, ["--tp", 3, "--workload", "gpt-cpu"], "error: --tp 3 must divide the number of processes (6) and of attention "
                                              "heads (4): the processes form groups of 3, and each group splits every "
                                              "block's heads evenly"),
])
def test_a_tp_that_cannot_split_the_job_stops_with_one_line_before_the_process_group(monkeypatch, tmp_path,
                                                                                     world_size, args, message):
    monkeypatch.chdir(tmp_path)
    assert str(run_main(monkeypatch, world_size, *args)) == message
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


@pytest.mark.parametrize("option, value", [("--workload", "wide"), ("--precision", "fp16"), ("--tp", "0")])
def test_an_option_it_cannot_run_stops_with_one_line_before_anything_starts(monkeypatch, capsys, option, value):
    """Tensor parallelism splits the GPT's blocks, so no other workload; fp16 would need a gradient scaler."""
    assert run_main(monkeypatch, 2, option, value).code == 2
    assert re.search(rf"tensor_parallel.py: error: argument {option}: ", capsys.readouterr().err.splitlines()[-1])


# --- a snapshot of another step ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_step_5s_snapshot_of_the_same_gpt_is_refused_with_one_line_and_left_as_it_was(tmp_path, text):
    """fsdp.py trains the GPT and saves snapshot/ and model_full.pt; tensor_parallel.py pointed at that snapshot stops
    every rank with one line that says whose it is, before training, and changes none of step 5's files. (By default
    the two steps do not meet at all: step 7 writes tp_snapshot/ and tp_model_full.pt.)"""
    run(torchrun("fsdp.py", 1, 1, "--workload", "gpt-cpu", nproc=1), cwd=tmp_path, env=exact(text), timeout=120)
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    job = job_in(tmp_path, 2, 1, "--tp", 1, "--snapshot_path", "snapshot", nproc=1, env=exact(text), check=False)
    assert job.returncode not in (0, None) and "[rank0]:" not in job.output, job.output
    assert job.errors == ["error: snapshot holds fsdp.py's snapshot after 1 epoch, not tensor_parallel.py's: give "
                          "this run its own --snapshot_path, or move snapshot away to start anew; it is left in "
                          "place"], job.output
    assert "epoch 1 |" not in job.output
    after = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file() and path.suffix != ".log"}
    assert after == {path: data for path, data in before.items() if path.suffix != ".log"}


def test_a_snapshot_names_the_step_that_saved_it_and_another_steps_is_refused(tmp_path):
    """require_written_by reads a sharded snapshot's STEP and EPOCHS_RUN (here without a process group, as DCP allows
    in one process): the step's own passes; another step's, or one that names none, stops with one line."""
    import torch.distributed.checkpoint as dcp

    for name, state in (("fsdp", dict(STEP="fsdp.py", EPOCHS_RUN=3)), ("older", dict(EPOCHS_RUN=1)),
                        ("own", dict(STEP="tensor_parallel.py", EPOCHS_RUN=2))):
        dcp.save(dict(MODEL_STATE={"w": torch.zeros(2)}, **state), checkpoint_id=tmp_path / name)
    require_written_by("tensor_parallel.py", tmp_path / "own", SnapshotReader(tmp_path / "own"))
    for name, holds in (("fsdp", "fsdp.py's snapshot after 3 epochs"),
                        ("older", "a snapshot that names no step (an older one) after 1 epoch")):
        with pytest.raises(SystemExit) as stop:
            require_written_by("tensor_parallel.py", tmp_path / name, SnapshotReader(tmp_path / name))
        assert str(stop.value) == (f"error: {tmp_path / name} holds {holds}, not tensor_parallel.py's: give this run "
                                   f"its own --snapshot_path, or move {tmp_path / name} away to start anew; it is "
                                   "left in place")


# --- as practitioners run it: two nodes, dropout, bf16 ----------------------------------------------------------------

def on_two_nodes(folder, text, **options):
    """tensor_parallel.py on two torchrun nodes of 2 processes each, meeting on loopback, both in `folder` (as on a
    shared file system): --tp 2 (a tp group per node, FSDP across them), dropout 0.2, bf16, batches of 4 per dp rank,
    2 epochs and a snapshot after each. Recorded."""
    node = torchrun_node("tensor_parallel.py", 2, 1, "--workload", "gpt-cpu", "--tp", 2, "--batch_size", 4,
                         "--precision", "bf16", nproc=2, endpoint=f"127.0.0.1:{free_port()}", run_id=folder.name,
                         launcher_args=["--max_restarts=1"])
    return run(node, node, cwd=folder, env={TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0.2}, record=True, timeout=240,
               **options)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, text):
    """The job on two nodes, uninterrupted; and the same job with rank 3 SIGKILLed as it begins epoch 1 (the second
    and last): the torchruns of both nodes start their workers again, and they resume from the snapshot of epoch 0."""
    return (on_two_nodes(tmp_path_factory.mktemp("two_nodes"), text),
            on_two_nodes(tmp_path_factory.mktemp("two_nodes_killed"), text, kill_at=(0, 3, 1)))


@pytest.mark.slow
def test_on_two_nodes_a_tp_group_is_a_node_and_with_dropout_its_copies_stay_equal_its_heads_masks_apart(two_nodes):
    """tp innermost: ranks 0, 1 form a tp group on one node, ranks 2, 3 on the other; FSDP's dp groups cross them.
    Dropout (recorded: the generator state each mask was drawn from, every epoch): the ranks of a tp group draw the same
    masks on the activations they all hold (else their copies would drift apart), the dp ranks other ones, and every
    rank its own on its own heads' attention weights; and what a tp group holds whole (the norms, the embedding, the
    head, FSDP's shards of them) stays equal on its ranks, epoch after epoch. FSDP reduce-scatters the gradients in
    fp32 though it computes in bf16."""
    whole, _ = two_nodes
    rows = [row for row in whole.samples if row["restart"] == 0]
    layout = {row["rank"]: (row["node"], row["mesh"]["dp"], row["mesh"]["tp"]) for row in rows}
    assert {rank: (dp, tp) for rank, (_, dp, tp) in layout.items()} == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert layout[0][0] == layout[1][0] != layout[2][0] == layout[3][0], layout
    for epoch in range(2):
        by_rank = {row["rank"]: row for row in rows if row["epoch"] == epoch}
        dropout = {rank: row["draws"]["dropout"] for rank, row in by_rank.items()}
        assert dropout[0] == dropout[1] != dropout[2] == dropout[3], f"epoch {epoch}: {dropout}"
        heads = [row["draws"]["attention"] for row in by_rank.values()]
        assert len(set(heads)) == 4, f"epoch {epoch}: two ranks drew the same masks for their heads"
        held_whole = {rank: row["whole_along_tp"] for rank, row in by_rank.items()}
        assert held_whole[0] == held_whole[1] and held_whole[2] == held_whole[3], f"epoch {epoch}: {held_whole}"
        reduced = {rank: row["reduce_scatter_dtypes"] for rank, row in by_rank.items()}
        assert reduced == {rank: ["float32"] for rank in range(4)}, f"epoch {epoch}: {reduced}"


@pytest.mark.slow
def test_on_two_nodes_with_dropout_and_bf16_it_learns_and_a_killed_worker_resumes_to_the_same_end_bit_for_bit(
        two_nodes):
    """The loss falls; after the kill every rank resumes from epoch 1, and the snapshot after the last epoch and the
    exported model are the uninterrupted job's, bit for bit: a resumed epoch draws the masks it drew the first time
    (seeded by the epoch and the rank's place in the mesh)."""
    whole, killed = two_nodes
    losses = whole.losses
    assert sorted(losses) == [0, 1] and losses[1] < losses[0], whole.output
    assert killed.ok and any(row["restart"] == 1 for row in killed.samples), killed.output
    assert sorted(re.findall(r"\[rank (\d)/4[^\]]*\] resuming from epoch 1", killed.output)) == ["0", "1", "2", "3"]
    assert_bitwise_equal(sharded_snapshot(killed.cwd / "tp_snapshot"), sharded_snapshot(whole.cwd / "tp_snapshot"))
    assert (killed.cwd / "tp_model_full.pt").read_bytes() == (whole.cwd / "tp_model_full.pt").read_bytes()


# --- GPUs -------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_bf16_tensor_parallelism_trains_on_the_gpus_there_are(tmp_path):
    """The GPU-size GPT (8 heads) on the help pages: tp 2 on 2 or more GPUs (dp the rest), bf16."""
    count = torch.cuda.device_count()
    nproc = 4 if count >= 4 else 2 if count >= 2 else 1
    tp = 2 if nproc >= 2 else 1
    job = run(torchrun("tensor_parallel.py", 2, 2, "--tp", tp, "--precision", "bf16", "--verbose", nproc=nproc),
              cwd=tmp_path, gpu=True, timeout=600)
    assert job.losses[1] < job.losses[0] and "| cuda:0]" in job.output, job.output
    rows = output.slices(job.output)
    assert len(rows) == 6 * nproc, job.output
    for row in rows:
        assert row["tp_slice"][0] * row["tp_slice"][1] * tp == row["full"][0] * row["full"][1], row
