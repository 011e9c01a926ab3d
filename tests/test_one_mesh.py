"""Step 11, one_mesh.py: pipeline stages, FSDP and tensor parallelism with sequence parallelism on one mesh of 8 CPU
ranks (pp 2 x dp 2 x tp 2) train exactly what one process trains (every epoch's loss and the final weights), from one
process's very initial weights (a seed checkpoint each rank reads its shards of, the model built on the meta device);
activation checkpointing and asynchronous snapshots change no number; a worker killed while an asynchronous save is
being written resumes from the last whole snapshot, never from the one cut short; the snapshot resumes on 4 ranks and
on 1; the whole model is exported to one plain file; bad input stops with one line.

The jobs train the CPU-size GPT (2 blocks: 4 stages embed | block0 | block1 | head, two per pipeline rank) on a short
excerpt of the help pages: 64 training sequences of 64 characters, batches of 8 (4 per dp rank, 2 micro-batches), so
8 optimizer steps an epoch, fp32 and dropout 0. The 8-rank jobs are two (8 processes on 2 cores: ~30 s each): the
plain one, shared with notebooks/11_one_mesh.ipynb, and the one with activation checkpointing and asynchronous saves,
killed in the middle of a save; then the 4-rank and the 1-process resumes, and 8 spawned processes that build the model
on the meta device.
"""
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from expect import (assert_a_peer_gone_is_one_line_a_rank, assert_bitwise_equal, assert_only_own_lines, farthest,
                    rank_records, sharded_snapshot, stopped_as_rank_0)
from harness.jobs import free_port, output, run, shared_file, spawned_result, start, torchrun, torchrun_node
from tools.memory_plan import Layout, check, compare, config_of
from harness.one_process import train_gpt
from tools.seed_checkpoint import seed_checkpoint_beside
from utils import SEED, make_workload
from utils.snapshot_reader import load_seed_checkpoint
from utils.gpt import help_pages
from utils.metrics import RUN_DIR_VARIABLE

B, EPOCHS, STEPS = 8, 3, 8  # sequences per batch (all dp ranks together), epochs, optimizer steps an epoch
SNAPSHOT = "mesh_snapshot"
# Equal up to float rounding: one process sums the whole batch's gradients at once; the mesh sums each tp rank's
# part of a matrix product, each micro-batch's gradients, and the dp ranks' shards in other orders. Adam's division by
# the gradients' running magnitude magnifies the difference in a few weights. Measured here (torch 2.14.1, x86): every
# epoch's loss within 4.3e-6 (float32 sums of the ranks' losses), the weights within 6.2e-5 after 24 steps, 7.6e-5 after
# the 4 ranks' epoch and 6.8e-5 after the one process's; one process training other batches (4 a step) ends 0.15 away.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 2e-4


def one_mesh(folder, epochs, text, *args, nproc=8, batch_size=B // 2, seed=False, **options):
    """A finished job of one_mesh.py in `folder` (the CPU GPT, dropout 0), a snapshot every epoch; per-rank metrics in
    its runs/. Its initial weights, one process's: drawn by every rank, or read from a seed checkpoint (`seed`). A job
    that kills a worker may start again once."""
    restarts = ["--max_restarts=1"] if "kill_at" in options else []
    seeded = ["--seed_checkpoint", seed_checkpoint_beside(text)] if seed else []
    return run(torchrun("one_mesh.py", epochs, 1, "--workload", "gpt-cpu", "--text", text, "--dropout", 0,
                        "--batch_size", batch_size, *args, *seeded, nproc=nproc, launcher_args=restarts), cwd=folder,
               env={RUN_DIR_VARIABLE: "runs"}, timeout=300, **options)


@pytest.fixture(scope="module")
def mesh8(tmp_path_factory, text):
    """pp 2 x dp 2 x tp 2 on 8 ranks, 2 micro-batches of 2 sequences. notebooks/11_one_mesh.ipynb runs the same job:
    shared, it runs once in a test session."""
    return one_mesh(tmp_path_factory.mktemp("mesh8"), EPOCHS, text, "--pp", 2, "--tp", 2, "--microbatches", 2,
                    shared=True)


@pytest.fixture(scope="module")
def checkpointed_and_killed(tmp_path_factory, text):
    """The same mesh with activation checkpointing and asynchronous snapshots, from the seed checkpoint instead of
    each rank's draws, each rank's writes of a save slowed by 2 s: rank 5 SIGKILLs itself as it begins epoch 2, while
    the snapshot of epoch 1 is being written; torchrun starts the eight again."""
    return one_mesh(tmp_path_factory.mktemp("killed"), EPOCHS, text, "--pp", 2, "--tp", 2, "--microbatches", 2,
                    "--checkpoint_activations", "--async_save", seed=True, kill_at=(0, 5, 2), slow_save=2)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, text, mesh8):
    """mesh8's snapshot (3 epochs) resumed on 4 ranks (pp 2 x tp 2, all 8 sequences on the one dp rank) for a fourth
    epoch; that snapshot resumed by one process holding the whole model (pp 1, tp 1: its two stages on the one rank)
    for a fifth: (the 4 ranks' job, the one process's job)."""
    four, alone = tmp_path_factory.mktemp("four"), tmp_path_factory.mktemp("alone")
    shutil.copytree(mesh8.cwd / SNAPSHOT, four / SNAPSHOT)
    four = one_mesh(four, EPOCHS + 1, text, "--pp", 2, "--tp", 2, "--microbatches", 2, nproc=4, batch_size=B)
    shutil.copytree(four.cwd / SNAPSHOT, alone / SNAPSHOT)
    alone = one_mesh(alone, EPOCHS + 2, text, "--pp", 1, "--tp", 1, "--microbatches", 2, nproc=1, batch_size=B)
    return four, alone


@pytest.fixture(scope="module")
def reference(text):
    """One process, batches of 8: 3 epochs, then 2 more at the schedule's floor; and one that trains other batches."""
    return dict(train_gpt(text, B, EPOCHS + 2, EPOCHS, drop_last=True),
                other_batches=train_gpt(text, B // 2, EPOCHS, drop_last=True))


def weights(job):
    """The whole model's weights from the job's snapshot, every rank's shards put together."""
    return {name: value for name, value in sharded_snapshot(job.cwd / SNAPSHOT)["MODEL_STATE"].items()
            if isinstance(value, torch.Tensor)}


def losses(job):
    """Each epoch's mean loss from the per-rank metrics: the last stage's first tp rank of each pipeline counts its
    samples (the other ranks report none)."""
    records = rank_records(job)
    return {epoch: sum(r["loss"] * r["samples"] for r in ranks.values()) / sum(r["samples"] for r in ranks.values())
            for epoch, ranks in sorted(records.items())}


# --- one mesh, one model ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_pp_dp_tp_on_8_ranks_trains_what_one_process_does(mesh8, reference):
    """Every epoch's loss and the final weights within the tolerances, where one process training other batches ends
    far outside them; rank 0's printed loss is the mean over the pipelines."""
    assert losses(mesh8) == pytest.approx({e: reference["losses"][e] for e in range(EPOCHS)}, abs=LOSS_TOLERANCE)
    assert farthest(weights(mesh8), reference["weights"][EPOCHS]) <= WEIGHT_TOLERANCE
    assert farthest(weights(mesh8), reference["other_batches"]["weights"][EPOCHS]) > 100 * WEIGHT_TOLERANCE, \
        "the tolerance tells training on these batches from training on others"
    printed = output.epoch_losses(mesh8.output)
    assert printed == pytest.approx({e: reference["losses"][e] for e in range(EPOCHS)}, abs=1e-4), printed
    assert_only_own_lines(mesh8)


@pytest.mark.slow
def test_each_rank_holds_two_stages_its_tp_slice_and_its_dp_shard(mesh8):
    """rank = pp x 4 + dp x 2 + tp: pipeline rank 0 holds stages 0 and 2 (the embedding, block 1), pipeline rank 1
    stages 1 and 3 (block 0, the head), so the samples are counted by ranks 4 and 6 (the head's first tp rank in each
    dp group). Over the 8 ranks every weight is held once, but for what tp replicates (the norms, which sequence
    parallelism runs on each rank's positions, and the biases added after a row-wise split): once per tp rank."""
    records = rank_records(mesh8)[0]
    assert sorted(rank for rank, record in records.items() if record["samples"]) == [4, 6]
    whole = weights(mesh8)
    replicated = sum(value.numel() * 4 for name, value in whole.items() if "norm" in name or "proj.bias" in name)
    held = sum(record["params"] for record in records.values())
    assert held == sum(value.numel() * 4 for value in whole.values()) + replicated, "tp = 2: replicated twice"
    assert all(records[rank]["grads"] == records[rank]["params"] for rank in range(8)), "a gradient per weight shard"
    assert all(records[rank]["optim"] > 2 * records[rank]["params"] for rank in range(8)), "Adam's two moments"


@pytest.mark.slow
def test_activation_checkpointing_and_asynchronous_saves_change_no_number(mesh8, checkpointed_and_killed):
    """Recomputing each block in backward computes what was kept, bit for bit; the snapshots written in a thread hold
    what the synchronous ones hold; the seed checkpoint holds what every rank draws; and a kill and a resume in between
    change nothing either."""
    assert losses(checkpointed_and_killed) == losses(mesh8)
    assert farthest(weights(checkpointed_and_killed), weights(mesh8)) == 0


@pytest.mark.slow
def test_a_kill_during_an_asynchronous_save_resumes_from_the_last_whole_snapshot(checkpointed_and_killed):
    """Rank 5 died while the snapshot of epoch 1 was being written (its folder there, its metadata not yet): the
    snapshot path still pointed to epoch 0's, whole, and the eight resumed from it, at epoch 1; the folder cut short
    was never made the last one (the test above: the end is the plain job's, bit for bit)."""
    job = checkpointed_and_killed
    assert job.resumes == {1: 1}, job.output
    assert_a_peer_gone_is_one_line_a_rank(job)
    assert output.epoch_losses(job.output).keys() == {0, 1, 2}
    assert list(job.cwd.glob(f"{SNAPSHOT}*.tmp")) == [], "the resumed job wrote epoch 1's snapshot again, whole"


@pytest.mark.slow
def test_ctrl_c_during_an_asynchronous_save_removes_the_folder_being_written_and_keeps_the_last_snapshot(tmp_path,
                                                                                                        text):
    """Ctrl-C as a terminal sends it (SIGINT to torchrun's process group) while a thread writes a snapshot in the
    background (every rank's writes slowed by 3 s): every worker stops at once with one line, and the folder of the
    save cut short is gone. It used to stay (mesh_snapshot.<run id>.<epoch>.tmp, one more at every Ctrl-C): the save's
    temporary was known to the Ctrl-C handler only once the training waited for it."""
    command = torchrun("one_mesh.py", 30, 1, "--workload", "gpt-cpu", "--text", text, "--dropout", 0, "--batch_size",
                       8, "--pp", 2, "--tp", 1, "--microbatches", 2, "--async_save")
    with start(command, cwd=tmp_path, slow_save=3) as job:
        job.wait_for(output.SAVED, timeout=120)  # epoch 0's snapshot is whole
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f"{SNAPSHOT}.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.02)  # the next one is being written in the background
        writing = list(tmp_path.glob(f"{SNAPSHOT}.*.tmp"))
        before = len(job.output)
        os.killpg(job.procs[0].pid, signal.SIGINT)
        interrupted = time.monotonic()
        [code] = job.wait(timeout=60)
        took = time.monotonic() - interrupted
    assert writing, "the interrupt came while no snapshot was being written"
    assert code not in (0, None) and took < 15, (code, took, job.output[-3000:])
    assert output.errors(job.output[before:]) == [
        "error: stopped by SIGINT (Ctrl-C), with every worker of this node; the last snapshot saved is kept, and the "
        "same command resumes from it"], job.output[before:]
    assert list(tmp_path.glob(f"{SNAPSHOT}*.tmp")) == [], "the folder of the save cut short is removed"
    assert sharded_snapshot(tmp_path / SNAPSHOT)["EPOCHS_RUN"] >= 1, "the last whole snapshot stays"


@pytest.mark.slow
def test_the_8_rank_snapshot_resumes_on_4_ranks_and_on_1_as_one_process_trains(resumed, reference):
    """The snapshot holds the whole model under its own names, and the optimizer's state weight by weight: 4 ranks
    (pp 2 x tp 2) go on from it, then one process holding everything; their epochs are the one-process epochs."""
    for job, epoch in zip(resumed, (EPOCHS, EPOCHS + 1)):
        assert output.resumes(job.output) == {0: epoch}, job.output
        assert losses(job)[epoch] == pytest.approx(reference["losses"][epoch], abs=LOSS_TOLERANCE)
        assert farthest(weights(job), reference["weights"][epoch + 1]) <= WEIGHT_TOLERANCE


@pytest.mark.slow
def test_the_whole_model_is_evaluated_exported_to_one_plain_file_and_writes_a_sample(mesh8, reference, text):
    """Every rank's shards gathered into the GPT: its held-out loss is one process's, the file mesh_model_full.pt loads
    into a fresh GPT without torch.distributed and holds the snapshot's weights, and rank 0 prints a sample."""
    held_out = output.held_out(mesh8.output)
    assert held_out["samples"] == 7 and held_out["loss"] == pytest.approx(reference["held_out"], abs=1e-4)
    exported = torch.load(mesh8.cwd / "mesh_model_full.pt", weights_only=False)
    model = make_workload("gpt-cpu", text=str(text)).model
    model.load_state_dict(exported)
    assert farthest({k: v for k, v in exported.items() if isinstance(v, torch.Tensor)}, weights(mesh8)) == 0
    [(steps, sample)] = output.samples(mesh8.output)
    assert steps == EPOCHS * STEPS and len(sample) >= 190, sample


# --- the memory plan against what each rank measured ------------------------------------------------------------------

# The layout of each job above, as tools/memory_plan.py describes one.
LAYOUTS = {"mesh8": Layout(pp=2, dp=2, tp=2, batch_size=4, microbatches=2),
           "checkpointed_and_killed": Layout(pp=2, dp=2, tp=2, batch_size=4, microbatches=2,
                                             checkpoint_activations=True),
           "four": Layout(pp=2, dp=1, tp=2, batch_size=8, microbatches=2),
           "alone": Layout(pp=1, dp=1, tp=1, batch_size=8, microbatches=2),
           "two_nodes": Layout(pp=2, dp=1, tp=2, batch_size=16, microbatches=4, precision="bf16",
                               checkpoint_activations=True)}


@pytest.mark.slow
@pytest.mark.parametrize("job_name", LAYOUTS)
def test_the_memory_plan_is_what_every_rank_of_every_layout_measured(request, job_name, text):
    """Each rank's weights, gradients and Adam's state (its local shards, to the byte) and the activations autograd
    kept in its first step (within memory_plan.ACTIVATION_TOLERANCE), as the plan computes them from the shapes and
    the layout alone. The two-node job's activations are left out: its recorder counts each stage's forward itself
    (record=True, for the nodes), and the innermost hooks are the only ones torch calls."""
    job = {"four": lambda: request.getfixturevalue("resumed")[0],
           "alone": lambda: request.getfixturevalue("resumed")[1]}.get(job_name,
                                                                      lambda: request.getfixturevalue(job_name))()
    by_epoch = rank_records(job)
    records = by_epoch[min(by_epoch)]
    pages = text if job_name != "two_nodes" else help_40k()
    rows = compare(records, config_of("cpu", str(pages)), LAYOUTS[job_name])
    assert len(rows) == 4 * len(records) == 4 * LAYOUTS[job_name].pp * LAYOUTS[job_name].dp * LAYOUTS[job_name].tp
    off = [row for row in check(records, config_of("cpu", str(pages)), LAYOUTS[job_name])
           if not (job_name == "two_nodes" and row[1] == "activation_bytes")]
    assert off == [], off


# --- as it is run: two nodes, bf16, dropout ---------------------------------------------------------------------------

# The job as practitioners run it: bf16, dropout 0.1, 2 epochs of the first 40,000 characters, pp 2 x tp 2.
AS_RUN = ("--workload", "gpt-cpu", "--dropout", 0.1, "--batch_size", 16, "--precision", "bf16", "--pp", 2, "--tp", 2)


def help_40k():
    return shared_file("help_40k.txt", help_pages()[:40_000])


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """2 nodes of 2 processes: a tp group on each node, the pipeline across them; activation checkpointing."""
    folder = tmp_path_factory.mktemp("two_nodes")
    node = torchrun_node("one_mesh.py", 2, 1, "--text", help_40k(), *AS_RUN, "--checkpoint_activations", nproc=2,
                         endpoint=f"127.0.0.1:{free_port()}", run_id=folder.name)
    return run(node, node, cwd=folder, env={RUN_DIR_VARIABLE: "runs"}, record=True, timeout=300)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The same job on one node of 4 processes, without activation checkpointing."""
    return run(torchrun("one_mesh.py", 2, 1, "--text", help_40k(), *AS_RUN, nproc=4),
               cwd=tmp_path_factory.mktemp("one_node"), timeout=300)


@pytest.mark.slow
def test_on_two_nodes_in_bf16_with_dropout_the_gpt_learns_with_tp_inside_a_node_and_pp_across(two_nodes):
    """The regime people run: the loss falls epoch after epoch and the held-out loss is well below a uniform guess's
    (ln of ~90 characters: 4.5); rank 0 prints a sample. The ranks of a tp group, which all-gather and reduce-scatter
    in every block, share a node; the pipeline's one activation per micro-batch is what crosses between them."""
    losses = output.epoch_losses(two_nodes.output)
    assert losses[1] < losses[0] < 4.5 and output.held_out(two_nodes.output)["loss"] < 3.0, two_nodes.output
    rows = {row["rank"]: row for row in two_nodes.samples if row["epoch"] == 0}
    node_of = {rank: row["node"] for rank, row in rows.items()}
    assert node_of[0] == node_of[1] != node_of[2] == node_of[3], node_of
    assert len(output.samples(two_nodes.output)) == 1
    assert_only_own_lines(two_nodes)


@pytest.mark.slow
def test_two_nodes_with_checkpointed_activations_train_what_one_node_without_them_trains_bit_for_bit(two_nodes,
                                                                                                   one_node):
    """The two-node job and the same ranks on one node, where the second recomputes nothing: every epoch's loss, the
    held-out loss and the snapshot's every weight and optimizer state are equal, bit for bit, with dropout 0.1 and
    bf16. The ranks draw the same dropout masks wherever they run (seeded by the epoch and the global rank), and the
    recomputation of a checkpointed block draws again the masks its forward drew (torch.utils.checkpoint puts the
    random state back first)."""
    assert output.epoch_losses(two_nodes.output) == output.epoch_losses(one_node.output), one_node.output
    assert output.held_out(two_nodes.output) == output.held_out(one_node.output)
    assert_bitwise_equal(sharded_snapshot(two_nodes.cwd / SNAPSHOT), sharded_snapshot(one_node.cwd / SNAPSHOT))


# --- the model built on the meta device -------------------------------------------------------------------------------

def meta_worker(rank, port, text, seed, folder, result_path):
    """One of 8 ranks (pp 2 x dp 2 x tp 2): one_mesh.py's own model building (on meta, parallelized, cut, sharded,
    given memory, drawn), the bytes this rank holds, and the model exported to one file (with what it received and
    the most whole weights it held at once, beyond the one in hand); then the seed checkpoint read into its shards,
    and the model reassembled on every rank (step 8's route)."""
    import argparse
    import weakref

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import one_mesh
    from utils.pipeline import exported, reassembled

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=8)
    torch.set_num_threads(1)
    args = argparse.Namespace(precision="fp32", checkpoint_activations=False)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    model = make_workload("gpt-cpu", text=text, dropout=0, device="meta").model
    model, _ = one_mesh.parallelize(model, mesh, args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().fill_(float("nan"))  # what memory given after the meta device may hold
    torch.manual_seed(rank)  # a generator each rank has moved on its own way: the draws must not depend on it
    model.init_weights(seed=SEED)
    held = sum(param.to_local().numel() for param in model.parameters())

    # Every whole weight the export makes (gathered from shards, or received), followed until it is let go.
    alive, most, received = [], [0], [0]

    def whole(tensor):
        alive[:] = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(alive))
        alive.append(weakref.ref(tensor))
        return tensor

    def counted_recv(tensor, *rest, **options):
        received[0] += tensor.numel() * tensor.element_size()
        return recv(whole(tensor), *rest, **options)

    recv, full_tensor = dist.recv, DTensor.full_tensor
    dist.recv, DTensor.full_tensor = counted_recv, lambda self, *rest, **options: whole(full_tensor(self, *rest,
                                                                                                    **options))
    exported(model, f"{folder}/model_full.pt")
    dist.recv, DTensor.full_tensor = recv, full_tensor
    dist.barrier()
    drawn = torch.load(f"{folder}/model_full.pt", weights_only=True)

    weights = get_model_state_dict(model)
    dcp.load({"MODEL_STATE": weights}, checkpoint_id=seed)
    set_model_state_dict(model, weights)
    read = reassembled(model).state_dict()
    expected = make_workload("gpt-cpu", text=text, dropout=0).model.state_dict()

    def farthest_from_one_process(whole):
        return max((whole[name] - value).abs().max().item() for name, value in expected.items()
                   if isinstance(value, torch.Tensor))

    result = dict(held=held, whole=sum(value.numel() for value in expected.values() if hasattr(value, "numel")),
                  drawn=farthest_from_one_process(drawn), read=farthest_from_one_process(read), most_held=most[0],
                  received=received[0])
    results = [None] * 8
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(result_path, "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


@pytest.mark.slow
def test_on_the_meta_device_no_rank_holds_the_model_and_each_draws_its_part_of_one_process_s_weights(text, tmp_path):
    """Built on meta and given memory shard by shard, each of the 8 ranks holds less than a third of the weights. Its
    draws, exported, are one process's initial model, bit for bit (every weight drawn whole and each rank's shard of
    it kept; the norms' gains and the biases set: memory given after the meta device holds whatever was there), and
    so is the seed checkpoint read into the shards and reassembled. No rank draws from a DTensor's random-number
    tracker, which on GPUs starts every rank at rank 0's state.

    The export: rank 0 receives each weight it does not hold once, the layers of the other pipeline rank (gathering
    every rank's state dict on every rank gave it 4 times the model), and no rank holds a whole weight while it makes
    the next one whole: not rank 0, which writes each to disk as it comes, nor the ranks that gather their shards."""
    results = spawned_result(meta_worker, (free_port(), str(text), str(seed_checkpoint_beside(text)), str(tmp_path)),
                             8, 180, "the meta-device workers")
    for rank, result in enumerate(results):
        assert result["held"] < result["whole"] / 3, (rank, result)
        assert result["drawn"] == 0 and result["read"] == 0, (rank, result)
        assert result["most_held"] == 0, (rank, result)
    other_stages = make_workload("gpt-cpu", text=str(text), dropout=0).model.state_dict()
    other_stages = sum(value.numel() * value.element_size() for name, value in other_stages.items()
                       if name.startswith(("block0.", "head.")))  # pipeline rank 1's layers
    assert results[0]["received"] == other_stages and all(result["received"] == 0 for result in results[1:])


# --- bad input --------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_this_steps_snapshot_folder_given_to_step_12_is_refused_in_one_line(monkeypatch, mesh8):
    """The natural mistake of a learner who goes on to step 12: its --snapshot_path set to step 11's snapshot folder.
    long_run.py took it for a folder of snapshots, found none of its own, trained from scratch and wrote step-*
    folders inside it; now one line before its process group forms, and the folder is left as it was."""
    from tools.prepare_data import short_help_pages

    folder = mesh8.cwd / SNAPSHOT
    before = sorted(path.name for path in folder.iterdir())
    monkeypatch.chdir(mesh8.cwd)
    stop = stopped_as_rank_0(monkeypatch, "long_run.py", 8, "--data", short_help_pages(), "--workload", "gpt-cpu",
                             "--global_batch", 16, "--microbatches", 2, "--snapshot_path", SNAPSHOT)
    assert str(stop) == ("error: --snapshot_path mesh_snapshot is a snapshot itself (it holds a .metadata: step 11's "
                         "snapshot folder, or one of a long run's step-<steps>/), not a folder of them: give the long "
                         "run a folder of its own, e.g. the default long_snapshots; mesh_snapshot is left as it is")
    assert sorted(path.name for path in folder.iterdir()) == before


def run_main(monkeypatch, world_size, *args):
    """one_mesh.py's checks before its process group, in this process (expect.stopped_as_rank_0)."""
    return stopped_as_rank_0(monkeypatch, "one_mesh.py", world_size, *args)


@pytest.mark.parametrize("world_size, args, message", [
    (6, ["--pp", 2, "--tp", 2], "error: --pp 2 x --tp 2 = 4 does not divide the 6 processes: they form grids of "
                                "pp x tp, dp of them"),
    (4, ["--pp", 4, "--tp", 1], "error: --pp 4 makes 8 stages, two per rank, but the GPT has 4 layers (its blocks, "
                                "the embedding and the head): each stage needs one at least; lower --pp"),
    (3, ["--pp", 1, "--tp", 3], "error: --tp 3 must divide the attention heads (4) and the context (64): each tp rank "
                                "computes heads/tp heads, and holds context/tp positions between the blocks"),
    (4, ["--pp", 2, "--microbatches", 3], "error: --microbatches 3 must divide --batch_size 32 and be a multiple of "
                                          "--pp 2: the micro-batches have one size, and go through the pipeline in "
                                          "rounds of pp"),
])
def test_a_mesh_that_cannot_be_built_stops_with_one_line_before_the_process_group(monkeypatch, tmp_path, world_size,
                                                                                  args, message):
    monkeypatch.chdir(tmp_path)
    assert str(run_main(monkeypatch, world_size, "--workload", "gpt-cpu", *args)) == message
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


@pytest.mark.parametrize("version, refused", [("2.11.0", True), ("2.13.1", True), ("2.14.1", False)])
def test_pp_1_on_cpu_processes_with_a_torch_that_sends_a_rank_to_itself_stops_with_one_line(monkeypatch, version,
                                                                                         refused):
    """--pp 1 on gloo: torch 2.11's pipelining sends between the rank's own two stages, which gloo cannot (seen on
    torch 2.11 with one process and with two: "Pair is not connected"); 2.14 passes it on in memory (the jobs here).
    The check one_mesh.py makes before its process group (require_mesh_fits), with the torch of each version."""
    import argparse

    from utils.pipeline import require_mesh_fits

    monkeypatch.setattr(torch, "__version__", version)
    args = argparse.Namespace(workload="gpt-cpu", pp=1, tp=1, microbatches=2, batch_size=8)
    if not refused:
        require_mesh_fits(args, 2)
        return
    with pytest.raises(SystemExit) as stop:
        require_mesh_fits(args, 2)
    assert str(stop.value) == (f"error: --pp 1 puts both of a rank's stages on that rank, and the pipelining of torch "
                               f"{version} sends between them over gloo, which cannot send to itself: use --pp 2 or "
                               "more on CPU processes, or torch 2.14 or newer")


def test_a_seed_checkpoint_that_is_not_there_stops_with_one_line_before_anything_starts(monkeypatch, capsys,
                                                                                     tmp_path):
    assert run_main(monkeypatch, 8, "--seed_checkpoint", tmp_path / "seed").code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"one_mesh.py: error: argument --seed_checkpoint: {tmp_path / 'seed'} holds no checkpoint: write one first, "
        f"e.g. `python tools/seed_checkpoint.py {tmp_path / 'seed'}` with the step's --workload and --text")


def test_a_seed_checkpoint_of_another_text_stops_with_one_line(tmp_path, text):
    """The seed of the help pages' excerpt read into a GPT of another text (another vocabulary, another identity)."""
    other = tmp_path / "other.txt"
    other.write_text("a few other words, " * 200)
    model = make_workload("gpt-cpu", text=str(other)).model
    with pytest.raises(SystemExit) as stop:
        load_seed_checkpoint(model, str(seed_checkpoint_beside(text)))
    assert str(stop.value).startswith(f"error: cannot start from --seed_checkpoint {seed_checkpoint_beside(text)} (")
    assert str(stop.value).endswith("write it again with tools/seed_checkpoint.py, with the step's --workload and "
                                    "--text") and "\n" not in str(stop.value)


@pytest.mark.slow
def test_a_snapshot_of_another_text_of_the_same_characters_is_refused_with_one_line_that_names_both(tmp_path, text,
                                                                                                  mesh8):
    """The 8 ranks' snapshot resumed on the excerpt written backwards (the same characters, another text): the weights
    load, and DCP wrote the snapshot's identity of its text into the model's own, so the check compared the snapshot
    with itself and it trained on. One line naming both texts; no epoch trained."""
    backwards = tmp_path / "backwards.txt"
    backwards.write_text(Path(text).read_text()[::-1])
    shutil.copytree(mesh8.cwd / SNAPSHOT, tmp_path / SNAPSHOT)
    job = one_mesh(tmp_path, EPOCHS + 1, backwards, "--pp", 1, "--tp", 1, "--microbatches", 2, nproc=1, batch_size=B,
                   check=False)
    assert job.returncode not in (0, None), job.output[-3000:]
    assert re.fullmatch(rf"error: cannot resume from {SNAPSHOT} \(ValueError: it holds a GPT of another text "
                        rf"\({re.escape(Path(text).name)}, [\d,]+ characters\) than this run's \(backwards\.txt, "
                        r"[\d,]+ characters\): [^\n]+\); it is left in place: move it away to start anew",
                        "\n".join(output.errors(job.output))), job.output[-3000:]
    assert not job.losses, "it trained on"


def test_the_mixture_of_experts_is_refused_with_one_line(monkeypatch):
    assert str(run_main(monkeypatch, 8, "--workload", "gpt-moe-cpu")).startswith(
        "error: --workload gpt-moe-cpu is the mixture-of-experts GPT: expert_parallel.py (step 10) trains it")


# --- on GPUs ----------------------------------------------------------------------------------------------------------

# One process's losses on the CPU against the same job on GPUs: float32 sums in another order (cuBLAS's). Measured on
# one H200 (torch 2.11, CUDA 13): every epoch's loss within 1.4e-6, the held-out loss within 1.0e-5.
GPU_LOSS_TOLERANCE = 1e-4


@pytest.mark.gpu
def test_on_gpus_the_mesh_starts_from_and_trains_what_one_process_trains_on_the_cpu(tmp_path, text, reference):
    """fp32, dropout 0, the CPU size on the excerpt, with no seed checkpoint: every rank draws its part of one
    process's weights (drawn on the CPU, cut on the GPU: no DTensor random-number tracker, which on CUDA starts every
    rank at rank 0's state). On 4 GPUs or more pp 2 x tp 2 (x dp where 8 fit), on fewer 1 x 1 x 1 (its two stages
    on the one rank). Every epoch's loss and the held-out loss are one process's on the CPU, within
    GPU_LOSS_TOLERANCE, which one process on other batches is far outside."""
    gpus = torch.cuda.device_count()
    pp, tp, nproc = (2, 2, 8 if gpus >= 8 else 4) if gpus >= 4 else (1, 1, 1)
    dp = nproc // (pp * tp)
    job = one_mesh(tmp_path, EPOCHS, text, "--pp", pp, "--tp", tp, "--microbatches", 2, nproc=nproc,
                   batch_size=B // dp, gpu=True)
    expected, other = reference["losses"], reference["other_batches"]["losses"]
    assert losses(job) == pytest.approx({e: expected[e] for e in range(EPOCHS)}, abs=GPU_LOSS_TOLERANCE)
    assert max(abs(other[e] - expected[e]) for e in range(EPOCHS)) > 10 * GPU_LOSS_TOLERANCE
    print(f"largest difference from one process on the CPU: every epoch's loss "
          f"{max(abs(losses(job)[e] - expected[e]) for e in range(EPOCHS)):.2e}, the held-out loss "
          f"{abs(output.held_out(job.output)['loss'] - reference['held_out']):.2e}")
    assert output.held_out(job.output)["loss"] == pytest.approx(reference["held_out"], abs=GPU_LOSS_TOLERANCE)
    assert f"[rank 0/{nproc} | local 0 | cuda:0]" in job.output, job.output


@pytest.mark.gpu
def test_on_a_gpu_the_gpu_size_trains_on_the_mesh_in_bf16_with_checkpointed_activations(tmp_path):
    """The GPU size (6 blocks, dropout 0.2) on the help pages, FSDP's bf16, activation checkpointing, over NCCL: every
    GPU there is as pp x dp x tp (one GPU: 1 x 1 x 1, its two stages on the one rank). It learns."""
    gpus = torch.cuda.device_count()
    pp, tp = (2, 2) if gpus >= 4 else (1, 1)
    job = run(torchrun("one_mesh.py", 2, 2, "--pp", pp, "--tp", tp, "--precision", "bf16",
                       "--checkpoint_activations", nproc=gpus if gpus >= 4 else 1), cwd=tmp_path, gpu=True,
              timeout=600)
    assert job.losses[1] < job.losses[0] and "| local 0 | cuda:0]" in job.output, job.output
