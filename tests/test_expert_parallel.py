"""Step 10, expert_parallel.py: the mixture-of-experts GPT with its experts split over the ranks of an ep group trains
exactly what one process trains (every epoch's loss and the final weights), top-1 and top-2, on 2 ranks and on dp 2 x
ep 2; one MoE layer alone, its tokens dispatched by all-to-all, equals the layer computed whole, outputs and
gradients, also when an expert gets no token; a worker SIGKILLed mid-run resumes to the same end; an --ep 2 snapshot
resumes with --ep 1 and on 4 ranks of 2 nodes; with the aux loss the experts' loads stay near even, without it they
drift; bad input stops with one line.

The exact jobs train the CPU-size MoE GPT (4 experts a layer) on a short excerpt of the help pages (`--text`): 64
training sequences, 8 per optimizer step (all ranks together), so 8 steps an epoch, fp32 and dropout 0, the aux loss
weighted 0.01 (its load counted over the whole batch: one process's). The jobs: --ep 2 top-2 on 2 ranks; --ep 2 x dp 2
top-1 on 4 ranks, rank 3 SIGKILLed as it begins epoch 1; the first job's snapshot resumed by one process (--ep 1) and
by 2 nodes of 2 processes (--ep 2 x dp 2) for a third epoch. The loads: two jobs on the whole help pages, top-1, bf16
and dropout 0.1, with and without the aux loss (notebook 10 plots them). The layer alone: one spawn of 4 processes."""
import json
import re

import pytest
import torch
import torch.distributed as dist
from expect import epoch_losses, farthest, rank_records, sharded_snapshot, stopped_as_rank_0
from tools.jobs import free_port, output, run, shared_file, spawned_result, torchrun, torchrun_node
from tools.one_process import tensors, train_gpt
from utils import evaluate, make_workload
from utils.gpt import GPTConfig, help_pages
from utils.metrics import RUN_DIR_VARIABLE
from utils.moe import MoE, split_experts

B, EPOCHS, STEPS = 8, 2, 8  # sequences per optimizer step (all ranks together), epochs, steps an epoch
SNAPSHOT = "ep_snapshot"
# Equal up to float rounding: a rank's experts take the tokens of every rank of its group in another order than one
# process's, and the combination adds each token's top-k outputs in another order; Adam magnifies the rounding in a
# few weights. Measured here (torch 2.14.1, x86): every epoch's loss within 1.8e-7, the weights within 4.5e-5 (all
# four jobs); one process training other batches (4 per step) ends 0.123 away.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 2e-4


def expert_parallel(folder, text, epochs, *args, nproc=2, batch_size=B // 2, **options):
    """A finished job of expert_parallel.py in `folder` (the CPU-size MoE GPT, dropout 0), a snapshot after every
    epoch; per-rank metrics in its runs/."""
    command = torchrun("expert_parallel.py", epochs, 1, "--workload", "gpt-moe-cpu", "--text", text, "--dropout", 0,
                       "--batch_size", batch_size, *args, nproc=nproc, launcher_args=["--max_restarts=1"])
    return run(command, cwd=folder, env={RUN_DIR_VARIABLE: "runs"}, timeout=240, **options)


@pytest.fixture(scope="module")
def top2_on_two(tmp_path_factory, text):
    """--ep 2 on 2 ranks, top-2: each rank holds 2 of a layer's 4 experts and its own 4 sequences of a step.
    notebooks/10_expert_parallel.ipynb runs the same job: shared, it runs once in a test session."""
    return expert_parallel(tmp_path_factory.mktemp("top2"), text, EPOCHS, "--ep", 2, "--top_k", 2, shared=True)


@pytest.fixture(scope="module")
def top1_on_four_killed(tmp_path_factory, text):
    """--ep 2 x dp 2 on 4 ranks, top-1, 2 sequences a rank; rank 3 SIGKILLs itself as it begins epoch 1: torchrun
    starts the four again, and they resume from the snapshot of epoch 0."""
    return expert_parallel(tmp_path_factory.mktemp("top1"), text, EPOCHS, "--ep", 2, "--top_k", 1, nproc=4,
                           batch_size=B // 4, record=True, kill_at=(0, 3, 1))


def copy_snapshot(job, folder):
    (folder / SNAPSHOT).mkdir()
    for part in (job.cwd / SNAPSHOT).iterdir():
        (folder / SNAPSHOT / part.name).write_bytes(part.read_bytes())


@pytest.fixture(scope="module")
def alone(tmp_path_factory, text, top2_on_two):
    """The top-2 job's snapshot (--ep 2, 2 epochs) resumed by one process holding every expert (--ep 1), a third
    epoch."""
    folder = tmp_path_factory.mktemp("alone")
    copy_snapshot(top2_on_two, folder)
    return expert_parallel(folder, text, EPOCHS + 1, "--ep", 1, "--top_k", 2, nproc=1, batch_size=B)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, text, top2_on_two):
    """The same snapshot resumed by 2 nodes of 2 processes, --ep 2 x dp 2 (2 sequences a rank), a third epoch."""
    folder = tmp_path_factory.mktemp("two_nodes")
    copy_snapshot(top2_on_two, folder)
    node = torchrun_node("expert_parallel.py", EPOCHS + 1, 1, "--workload", "gpt-moe-cpu", "--text", text,
                         "--dropout", 0, "--batch_size", B // 4, "--ep", 2, "--top_k", 2, nproc=2,
                         endpoint=f"127.0.0.1:{free_port()}", run_id=folder.name)
    return run(node, node, cwd=folder, env={RUN_DIR_VARIABLE: "runs"}, record=True, timeout=240)


@pytest.fixture(scope="module")
def reference(text):
    """One process holding every expert, batches of 8, top-2 for 3 epochs (the schedule of 2) and top-1 for 2; and
    one that trains other batches (4 per step)."""
    options = dict(context=64, workload="gpt-moe-cpu", aux_weight=0.01)
    return dict(top2=train_gpt(text, B, EPOCHS + 1, EPOCHS, top_k=2, **options),
                top1=train_gpt(text, B, EPOCHS, top_k=1, **options),
                other_batches=train_gpt(text, B // 2, EPOCHS, top_k=2, **options))


def weights(job):
    """The whole model's weights from the job's snapshot, every rank's experts put together."""
    return tensors(sharded_snapshot(job.cwd / SNAPSHOT)["MODEL_STATE"])


# --- experts spread over the ranks are one model ----------------------------------------------------------------------

@pytest.mark.slow
def test_the_ep_jobs_train_what_one_process_does(top2_on_two, top1_on_four_killed, reference):
    """--ep 2 top-2 on 2 ranks, and --ep 2 x dp 2 top-1 on 4 (killed and resumed): every epoch's loss and the final
    weights within the tolerances, where one process training other batches ends far outside them."""
    for job, expected in ((top2_on_two, reference["top2"]), (top1_on_four_killed, reference["top1"])):
        assert epoch_losses(job) == pytest.approx({e: expected["losses"][e] for e in range(EPOCHS)},
                                                  abs=LOSS_TOLERANCE), job.cwd
        assert farthest(weights(job), expected["weights"][EPOCHS]) <= WEIGHT_TOLERANCE, job.cwd
    assert farthest(weights(top2_on_two), reference["other_batches"]["weights"][EPOCHS]) > 100 * WEIGHT_TOLERANCE, \
        "the tolerance tells training on these batches from training on others"
    printed = output.epoch_losses(top2_on_two.output)  # rank 0's line: the mean over all ranks, not its own tokens'
    assert printed == pytest.approx({e: reference["top2"]["losses"][e] for e in range(EPOCHS)}, abs=1e-4), printed


@pytest.mark.slow
def test_each_rank_holds_its_experts_and_every_rank_reads_its_own_sequences(top1_on_four_killed):
    """rank = d x ep + e; the snapshot holds all 4 experts of both layers, and the sampler splits the data over all
    4 ranks: a rank's tokens travel to the experts of the other rank of its ep group."""
    rows = {row["rank"]: row for row in top1_on_four_killed.samples if row["epoch"] == 0}
    assert {rank: row["mesh"] for rank, row in rows.items()} == {
        0: {"dp": 0, "ep": 0}, 1: {"dp": 0, "ep": 1}, 2: {"dp": 1, "ep": 0}, 3: {"dp": 1, "ep": 1}}
    indices = [set(rows[rank]["indices"]) for rank in range(4)]
    assert sum(map(len, indices)) == 64 and len(set.union(*indices)) == 64, "each sequence read by one rank"
    experts = {name.split(".")[3] for name in weights(top1_on_four_killed) if ".experts." in name}
    assert experts == {"0", "1", "2", "3"}


@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_last_snapshot_to_the_same_end(top1_on_four_killed):
    """Rank 3 died as it began epoch 1; torchrun started all four again, they resumed from epoch 0's snapshot, and the
    end is the one-process end (the test above)."""
    job = top1_on_four_killed
    assert job.resumes == {1: 1}, job.output
    assert sorted(epoch_losses(job)) == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("job_name", ["alone", "two_nodes"])
def test_an_ep_2_snapshot_resumes_with_ep_1_and_on_two_nodes_as_one_process_trains(request, job_name, reference):
    """The snapshot holds every expert under the whole model's names: one process holding all of them goes on from
    it, and so do 4 ranks on 2 nodes (an ep group on each node); their third epoch is the one-process third epoch."""
    job = request.getfixturevalue(job_name)
    assert output.resumes(job.output) == {0: EPOCHS}, job.output
    assert epoch_losses(job)[EPOCHS] == pytest.approx(reference["top2"]["losses"][EPOCHS], abs=LOSS_TOLERANCE)
    assert farthest(weights(job), reference["top2"]["weights"][EPOCHS + 1]) <= WEIGHT_TOLERANCE
    if job_name == "two_nodes":
        rows = {row["rank"]: row for row in job.samples if row["epoch"] == EPOCHS}
        node_of = {rank: row["node"] for rank, row in rows.items()}
        assert node_of[0] == node_of[1] != node_of[2] == node_of[3], node_of  # the all-to-alls stay in a node


@pytest.mark.slow
def test_the_whole_model_is_evaluated_and_writes_a_sample(top2_on_two, reference):
    """The held-out loss, each rank scoring its share through the experts of the others, is one process's; every rank
    samples the same characters, rank 0 prints them."""
    held_out = output.held_out(top2_on_two.output)
    assert held_out["samples"] == 7 and held_out["loss"] == pytest.approx(reference["top2"]["held_out"], abs=1e-4)
    [(steps, sample)] = output.samples(top2_on_two.output)
    assert steps == EPOCHS * STEPS and len(sample) >= 190, sample


@pytest.mark.slow
def test_the_metrics_count_each_experts_tokens_and_the_bytes_the_all_to_alls_moved(top2_on_two):
    """Each forward's tokens per expert, over the whole batch (the same on both ranks): 2 layers x 4 experts, 8
    sequences of 64 tokens x top-2 = 1024 assignments a layer. Each rank's all-to-alls moved bytes to the other."""
    records = rank_records(top2_on_two)[0]
    tokens = torch.tensor(records[0]["expert_tokens"])
    assert tokens.shape == (STEPS, 2, 4) and (tokens.sum(-1) == B * 64 * 2).all(), tokens
    assert records[1]["expert_tokens"] == records[0]["expert_tokens"]
    assert all(record["all_to_all_bytes"] > 0 and record["dropped"] == 0 for record in records.values())


# --- the layer alone --------------------------------------------------------------------------------------------------

def layer_worker(rank, port, result_path):
    """One of 4 processes: one MoE layer (4 experts, top-1 and top-2, float64), a router skewed so that expert 0 takes
    most tokens and expert 3 none, each rank its own tokens. The layer split over all 4 ranks (an expert each) and over
    two groups of 2 (ranks 0-1, 2-3; 2 experts each), against the whole layer on every rank: the largest difference of
    outputs, token gradients, router gradients and expert gradients (summed over the group's tokens)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for name, group, top_k in [("ep 4, top-2", dist.group.WORLD, 2), ("ep 2, top-2", pairs[rank // 2], 2),
                               ("ep 4, top-1", dist.group.WORLD, 1)]:
        config = GPTConfig(n_layer=1, n_head=1, n_embd=8, context=8, dropout=0.0, lr=0, betas=(0, 0),
                           weight_decay=0, experts=4, top_k=top_k)
        torch.manual_seed(0)  # the same layer on every rank
        whole = MoE(config).double()
        with torch.no_grad():  # feature 0 is 1 for every token: the router's column 0 is a bias
            whole.router.weight[:, 0] = torch.tensor([2.0, 0.0, 0.0, -100.0])
        split = MoE(config).double()
        split.load_state_dict(whole.state_dict())
        split_experts(torch.nn.Sequential(split), group, batch_group=group)
        torch.manual_seed(1 + rank)  # each rank its own tokens
        x = torch.randn(3, 8, 8, dtype=torch.float64)
        x[..., 0] = 1.0
        grad_out = torch.randn_like(x)
        expected_x, actual_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, actual = whole(expected_x), split(actual_x)
        expected.backward(grad_out)
        actual.backward(grad_out)
        errors = [(actual - expected).abs().max(), (actual_x.grad - expected_x.grad).abs().max(),
                  (split.router.weight.grad - whole.router.weight.grad).abs().max()]
        for number, expert in whole.experts.items():  # the whole layer's gradients, summed over the group's ranks
            for weight, full in expert.named_parameters():
                summed = full.grad.clone()
                dist.all_reduce(summed, group=group)
                if number in split.experts:
                    errors.append((split.experts[number].get_parameter(weight).grad - summed).abs().max())
        load = whole.stats["tokens"][0]
        worst = torch.stack(errors).float()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[name] = dict(errors=worst.tolist(), load=load.tolist(), held=list(split.experts))
    if rank == 0:
        with open(result_path, "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_dispatch_computes_the_whole_layer_and_its_gradients_with_uneven_splits():
    """Random tokens, float64: each rank's outputs, the gradients of its tokens and of the router equal the whole
    layer's; each held expert's gradients equal the whole layer's summed over the ranks whose tokens it took. The splits
    are uneven: expert 0 takes most of the tokens, expert 3 none (and its rank sends and computes nothing for it)."""
    results = spawned_result(layer_worker, (free_port(),), 4, 120, "the MoE layer workers")
    assert set(results) == {"ep 4, top-2", "ep 2, top-2", "ep 4, top-1"}
    for name, result in results.items():
        assert max(result["errors"]) < 1e-12, (name, result)
        load = result["load"]
        assert load[3] == 0 and load[0] > sum(load) / 4, (name, load)
    assert results["ep 4, top-2"]["held"] == ["0"] and results["ep 2, top-2"]["held"] == ["0", "1"]


# --- the load, with and without the aux loss --------------------------------------------------------------------------

def load_job(tmp_path_factory, aux_weight):
    """The first 240,000 characters of the help pages, one epoch (106 steps of 2 x 16 sequences), top-1, --ep 2, bf16
    and dropout 0.1: the regime the step is run in. notebooks/10_expert_parallel.ipynb runs the same two jobs."""
    text = shared_file("help_240k.txt", help_pages()[:240_000])
    command = torchrun("expert_parallel.py", 1, 1, "--workload", "gpt-moe-cpu", "--text", text, "--batch_size", 16,
                       "--ep", 2, "--top_k", 1, "--aux_weight", aux_weight, "--precision", "bf16", "--dropout", 0.1,
                       nproc=2)
    return run(command, cwd=tmp_path_factory.mktemp(f"aux{aux_weight}"), env={RUN_DIR_VARIABLE: "runs"}, timeout=240,
               shared=True)


def busiest_share(job):
    """Per layer, the busiest expert's tokens over an even share, averaged over the epoch's last 20 steps."""
    tokens = torch.tensor(rank_records(job)[0][0]["expert_tokens"], dtype=torch.float64)[-20:]
    return (tokens.amax(-1) / tokens.mean(-1)).mean(0).tolist()


@pytest.mark.slow
def test_with_the_aux_loss_the_loads_stay_near_even_and_without_it_they_drift(tmp_path_factory):
    """Measured (torch 2.14.1, x86): the busiest expert over its even share, last 20 steps, layers 0 and 1: 1.90 and
    3.57 without the aux loss, 1.11 and 1.33 with it. Both models learn (bf16, dropout): held-out 2.79 and 2.77, below
    0.7 of the untrained model's."""
    balanced, free = load_job(tmp_path_factory, 0.01), load_job(tmp_path_factory, 0)
    with_aux, without_aux = busiest_share(balanced), busiest_share(free)
    assert max(with_aux) < 1.9, with_aux
    assert max(without_aux) > 2.0 and sum(without_aux) > 1.25 * sum(with_aux), (with_aux, without_aux)
    untrained = make_workload("gpt-moe-cpu", text=shared_file("help_240k.txt", help_pages()[:240_000]))
    before = evaluate(untrained.model, untrained.eval_set, untrained.loss_fn, torch.device("cpu"))["loss"]
    for job in (balanced, free):
        assert output.held_out(job.output)["loss"] < 0.7 * before, (before, job.output)


# --- bad input --------------------------------------------------------------------------------------------------------

def run_main(monkeypatch, world_size, *args):
    """expert_parallel.py's checks before its process group, in this process (expect.stopped_as_rank_0)."""
    return stopped_as_rank_0(monkeypatch, "expert_parallel.py", world_size, *args)


@pytest.mark.parametrize("world_size, args, message", [
    (4, ["--ep", 3], "error: --ep 3 must divide the number of processes (4) and of experts (4): the processes form "
                     "groups of 3, each holding 4/3 of every layer's experts"),
    (8, ["--ep", 8], "error: --ep 8 must divide the number of processes (8) and of experts (4): the processes form "
                     "groups of 8, each holding 4/8 of every layer's experts"),
    (2, ["--top_k", 5], "error: --top_k 5 is more than the 4 experts a token can go to"),
])
def test_an_ep_or_top_k_that_cannot_split_the_job_stops_with_one_line_before_the_process_group(monkeypatch, tmp_path,
                                                                                               world_size, args,
                                                                                               message):
    monkeypatch.chdir(tmp_path)
    assert str(run_main(monkeypatch, world_size, "--workload", "gpt-moe-cpu", *args)) == message
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


@pytest.mark.parametrize("option, value", [("--workload", "gpt-cpu"), ("--ep", "0"), ("--top_k", "0"),
                                           ("--precision", "fp16"), ("--aux_weight", "-0.01"),
                                           ("--capacity_factor", "-1"), ("--aux_weight", "inf")])
def test_an_option_it_cannot_run_stops_with_one_line_before_anything_starts(monkeypatch, capsys, option, value):
    """Expert parallelism splits the MoE GPT's experts, so no other workload; fp16's loss scaler would skip a step on a
    rank whose experts overflowed while the others take it."""
    assert run_main(monkeypatch, 2, option, value).code == 2
    assert re.search(rf"expert_parallel.py: error: argument {option}: ", capsys.readouterr().err.splitlines()[-1])


@pytest.mark.parametrize("step", ["gpt.py", "tensor_parallel.py", "pipeline_parallel.py", "context_parallel.py"])
def test_the_dense_gpt_steps_refuse_the_mixture_of_experts_with_one_line(monkeypatch, step):
    """Their loop has no load-balancing loss (and step 7's plan no experts): they point to step 10."""
    assert str(stopped_as_rank_0(monkeypatch, step, 2, "--workload", "gpt-moe-cpu")) == (
        "error: --workload gpt-moe-cpu is the mixture-of-experts GPT: expert_parallel.py (step 10) trains it, with the "
        "load-balancing loss its routers need")


# --- on GPUs ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_on_gpus_the_gpu_size_trains_its_experts_in_bf16_over_nccl(tmp_path):
    """The GPU size (8 experts a layer, dropout 0.2) on the help pages, bf16 autocast, the all-to-alls by NCCL over 2
    GPUs (--ep 2); on one GPU, --ep 1: the same code, the all-to-alls within the one rank. It learns."""
    ep = 2 if torch.cuda.device_count() >= 2 else 1
    job = run(torchrun("expert_parallel.py", 2, 2, "--ep", ep, "--precision", "bf16", nproc=ep),
              cwd=tmp_path, gpu=True, timeout=600)
    assert job.losses[1] < job.losses[0] and f"[rank 0/{ep} | local 0 | cuda:0]" in job.output, job.output
