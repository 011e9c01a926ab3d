"""Every step, run the way a learner first runs it: by `make demo` (tools/demo.py), with the job runner's recorder
on. Each exits 0, its loss falls, exactly one process writes its file, the file loads into a fresh model, and the
demo sums the losses up and narrates a worker killed and the job resuming, and a replica group killed while the other
trains on; and it plans one rank of a 1,024-GPU job (step 14) and sums the plan up. Then what runs of the steps show: the samples each rank really trained on, the per-rank metrics, a rerun
that resumes where the last one stopped, and nodes that refuse to train out of step.

And what DDP's gradient averaging means, on the demo's own run: 2 processes with batch b take exactly the steps
that 1 process takes with batch 2b over the same samples.

The runs are started once for this module (each a few seconds of CPU, most of it `import torch`)."""
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import single_gpu
import tools.demo as demo
from expect import assert_learned, assert_loads_into_fresh_model, assert_one_writer
from tools import plot_metrics
from tools.jobs import free_port, output, run, saved_name, start, torchrun, torchrun_node
from utils import make_workload
from utils.gpt import TEXT_VARIABLE, help_pages

EPOCHS, SAVE_EVERY = 4, 2
# The first test of this module starts the demo (sixteen jobs, each bounded by the demo's --timeout below, its own
# default): its bound is theirs, not the 600 s that pytest.ini gives one test. At a load of 12, step 4's two nodes ran
# past 120 s.
DEMO_TIMEOUT = 300
pytestmark = pytest.mark.timeout(16 * DEMO_TIMEOUT)
DATASET_SIZE = 2048  # the synthetic workload's training set


SHARED_STEPS = ("single_gpu.py", "multigpu.py")  # notebooks 01 and 02 run the demo's steps 1 and 2 as it does


def demo_job(*commands, **options):
    """The demo's run(), every job recorded. Steps 1 and 2 are shared (notebooks 01 and 02 ask for the same
    commands and options): in a test session each runs once, in a folder of the session's (job.cwd) instead of the
    demo's."""
    shared = Path(commands[0][1]).name in SHARED_STEPS
    return run(*commands, record=True, shared=shared, **options)


def demo_started_job(*commands, **options):
    """The demo's start() (step 13's job, which it follows and kills a worker of while it runs), recorded too."""
    return start(*commands, record=True, **options)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`make demo` with 4 epochs per step, every job recorded: {script: job}, the fault demo's job, the printout, and
    the folder the steps ran in (steps 1 and 2: their job.cwd, see demo_job)."""
    printed, run_dir = io.StringIO(), tmp_path_factory.mktemp("demo")
    gpt_text = tmp_path_factory.mktemp("gpt_text") / "help_excerpt.txt"
    gpt_text.write_text(help_pages()[:8000])
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(demo, "RUN_DIR", run_dir)
        patch.setattr(demo, "EPOCHS", EPOCHS)
        patch.setattr(demo, "SAVE_EVERY", SAVE_EVERY)
        patch.setattr(demo, "run", demo_job)
        patch.setattr(demo, "start", demo_started_job)
        patch.setattr("sys.argv", ["demo.py", "--timeout", str(DEMO_TIMEOUT)])
        patch.setenv(TEXT_VARIABLE, str(gpt_text))  # the GPT step on a short excerpt: 2 optimizer steps an epoch
        jobs, fault = demo.main()
    return dict(jobs=jobs, fault=fault, printed=printed.getvalue(), run_dir=run_dir)


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory):
    """multigpu_torchrun.py run twice in one folder: 2 epochs (a snapshot after each), then the same command for 4
    epochs, which resumes. Per-rank metrics on (runs/), every torch.save and every rank's samples recorded."""
    workdir = tmp_path_factory.mktemp("torchrun")
    env = {"TUTORIAL_RUN_DIR": workdir / "runs"}
    first = run(torchrun("multigpu_torchrun.py", 2, 1), cwd=workdir, env=env, record=True, logs=workdir / "first")
    resumed = run(torchrun("multigpu_torchrun.py", 4, 1), cwd=workdir, env=env, record=True,
                  logs=workdir / "resumed")
    return dict(workdir=workdir, first=first, resumed=resumed)


# --- every step, as `make demo` runs it ------------------------------------------------------------------------------

@pytest.mark.slow
def test_single_gpu_trains_on_the_cpu_and_saves_a_checkpoint(demo_run):
    job = demo_run["jobs"]["single_gpu.py"]
    assert job.output.startswith("Training on cpu (no CUDA device found)\n"), job.output
    assert_learned(job.output, EPOCHS)
    assert output.held_out(job.output)["samples"] == 512
    assert_one_writer(job.writes, job.cwd / "checkpoint.pt")
    assert_loads_into_fresh_model(job.cwd / "checkpoint.pt")


@pytest.mark.slow
def test_multigpu_spawns_two_gloo_processes_with_one_writer(demo_run):
    job = demo_run["jobs"]["multigpu.py"]
    assert job.output.startswith("2 processes on gloo (no CUDA)\n"), job.output
    assert {match["rank"] for match in output.EPOCH.finditer(job.output)} == {"0"}, "only rank 0 reports"
    assert_learned(job.output, EPOCHS)
    assert sorted({row["rank"] for row in job.samples}) == [0, 1], "two ranks trained"
    assert_one_writer(job.writes, job.cwd / "checkpoint.pt")
    assert_loads_into_fresh_model(job.cwd / "checkpoint.pt")


@pytest.mark.slow
def test_torchrun_step_trains_and_snapshots_with_one_writer(demo_run):
    job = demo_run["jobs"]["multigpu_torchrun.py"]
    assert_learned(job.output, EPOCHS)
    assert "[rank 0/2 | cpu] epoch 1 | snapshot saved to snapshot.pt" in job.output
    assert_one_writer(job.writes, demo_run["run_dir"] / "snapshot.pt")
    assert_loads_into_fresh_model(demo_run["run_dir"] / "snapshot.pt", key="MODEL_STATE")


@pytest.mark.slow
def test_multinode_runs_as_two_nodes_on_localhost_with_one_writer(demo_run):
    job = demo_run["jobs"]["multinode.py"]
    assert_learned(job.output, EPOCHS)
    reporting = [node for node in range(2) if "epoch 0 |" in job.node_output(node)]
    assert len(reporting) == 1, "only global rank 0, on one of the nodes, reports"
    assert "[rank 0/2 | local 0 | cpu] epoch 0 |" in job.output
    assert sorted({row["rank"] for row in job.samples}) == [0, 1]
    assert_one_writer(job.writes, demo_run["run_dir"] / "snapshot.pt")  # step 3's was removed before this job
    assert_loads_into_fresh_model(demo_run["run_dir"] / "snapshot.pt", key="MODEL_STATE")


@pytest.mark.slow
def test_fsdp_trains_with_every_rank_writing_its_shards_and_rank_0_the_full_model(demo_run):
    job = demo_run["jobs"]["fsdp.py"]
    assert_learned(job.output, EPOCHS)
    assert "[rank 0/2 | local 0 | cpu] epoch 3 | snapshot saved to snapshot" in job.output
    assert sorted(path.name for path in (demo_run["run_dir"] / "snapshot").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"], "every rank wrote its shards"
    assert [rank for _, rank, _ in job.writes] == [0], "torch.save only for the gathered model, once, by rank 0"
    assert_loads_into_fresh_model(demo_run["run_dir"] / "model_full.pt")


@pytest.mark.slow
def test_the_demo_sums_up_every_step_and_narrates_the_fault(demo_run):
    fault, summary = demo_run["fault"], demo_run["printed"].split("=== Summary")[1]
    for step in ("single_gpu.py", "multigpu.py", "multigpu_torchrun.py", "multinode.py", "fsdp.py"):
        falls = re.search(rf"^{re.escape(step)} +loss ([\d.]+) \(epoch 0\) -> ([\d.]+) \(epoch 3\)$", summary, re.M)
        assert falls and float(falls[2]) < 0.5 * float(falls[1]), summary
    # torchrun's banner about OMP_NUM_THREADS is explained once and never shown in the steps' lines.
    steps_shown = demo_run["printed"].split("=== Step 3 under fire")[0]
    assert "Setting OMP_NUM_THREADS" not in steps_shown, steps_shown
    assert steps_shown.count("torchrun's banner about OMP_NUM_THREADS, left out here and below") == 1, steps_shown
    # Steps 2 to 5 compute the same thing on 2 CPU ranks, and the demo says so: its best lesson, said.
    assert "Steps 2 to 5 end at the same loss (" in summary and "not what they compute." in summary, summary
    # Steps 7 to 11 learning over several lines: each printed an epoch line a short epoch, and its loss fell at every
    # one; the summary shows them all, and the held-out loss of the weights it ended with.
    for step in demo.CHARS:
        losses = demo_run["jobs"][step].losses
        assert sorted(losses) == list(range(demo.MESH_EPOCHS)), (step, losses)
        assert all(losses[epoch + 1] < losses[epoch] for epoch in range(demo.MESH_EPOCHS - 1)), (step, losses)
        falling = re.escape(" -> ".join(f"{losses[epoch]:.4f}" for epoch in range(demo.MESH_EPOCHS)))
        shown = re.search(rf"^{re.escape(step)} +loss {falling} \(epochs 0 to {demo.MESH_EPOCHS - 1}\); held-out "
                          r"([\d.]+) after them$", summary, re.M)
        assert shown, summary
    assert fault.ok, fault.output
    assert re.search(r">>> SIGKILL -> rank 1 \(pid \d+\), from outside, after epoch 4", fault.output), fault.output
    # torchrun reports the killed rank 1 (-9), or rank 0 if it saw its peer vanish first: its one line and exit 1 (or
    # gloo's abort, -6, when a thread of gloo's saw it).
    noticed = r"torchrun: failed \(exitcode: (?:-9\) local_rank: 1|(?:1|-6)\) local_rank: 0)"
    assert re.search(noticed, fault.output), fault.output
    assert re.search(r">>> rank \d reloaded the snapshot: resuming from epoch 4 \(restart 1\)", fault.output)
    assert ">>> the job finished (exit 0): 8 epochs in all, one worker killed on the way" in fault.output


@pytest.mark.slow
def test_the_demo_plans_a_rank_of_a_1024_gpu_job_and_sums_it_up_in_figures_that_are_the_plans(demo_run):
    """Step 14 in the demo: the planner's own report of rank 0 of 1,024 (the 1B GPT as step 7 lays it out), then a
    summary line whose figures are not zero and are those of the plan it wrote: the state the rank holds in MiB, its
    peak in GiB under an H100's memory, and the GiB it sends over NVLink (tp) and over the network (dp)."""
    job, printed = demo_run["jobs"]["plan_at_scale.py"], demo_run["printed"]
    assert job.ok, job.output
    assert "1,024 ranks as tensor_parallel.py (step 7: FSDP over dp x tensor parallelism over tp) lays them out: " \
           "dp 128 x tp 8" in printed, printed
    summary = printed.split("=== Summary")[1]
    line = re.search(r"^plan_at_scale\.py +rank 0 of a 1,024-GPU job of the 1b GPT, laid out by tensor_parallel\.py's "
                     r"own code \(dp 128 x tp 8\) and traced in this one process in \d+ s: it holds ([\d.]+) MiB of "
                     r"weights, gradients and AdamW, peaks at ([\d.]+) GiB \(an H100 has 79\.6\), and sends ([\d.]+) "
                     r"GiB over NVLink \(tp\) and ([\d.]+) GiB over the network \(dp\) a step$", summary, re.M)
    assert line, summary
    held, peak, nvlink, network = map(float, line.groups())
    [rank] = json.loads((job.cwd / "plan.json").read_text())["plans"]
    sent = {group: bytes_ / 2**30 for group, bytes_ in rank["estimate"]["sent"].items()}
    assert min(held, peak, nvlink, network) > 0, line[0]
    assert held == round((rank["params"] + rank["grads"] + rank["optim"]) / 2**20, 1), line[0]
    assert (peak, nvlink, network) == (round(rank["peak"] / 2**30, 2), round(sent["tp"], 2), round(sent["dp"], 2))
    assert peak < 79.6, "the 1B GPT's rank fits an H100"


@pytest.mark.slow
def test_the_demo_trains_the_gpt_with_accumulation_and_shows_its_sample(demo_run):
    job = demo_run["jobs"]["gpt.py"]
    assert job.ok and sorted(job.losses) == list(range(demo.GPT_EPOCHS)), job.output
    [(steps, sample)] = output.samples(job.output)
    assert f"What the GPT writes after {steps} optimizer steps:\n{sample}" in demo_run["printed"]
    assert_one_writer(job.writes, demo_run["run_dir"] / "gpt_snapshot.pt")


@pytest.mark.slow
def test_the_demo_trains_the_gpt_on_a_dp2_x_tp2_mesh_with_every_rank_writing_its_shards(demo_run):
    """Step 7 in the folder where step 5 ran, with files of its own: step 5's snapshot/ and model_full.pt stay."""
    job, folder = demo_run["jobs"]["tensor_parallel.py"], demo_run["run_dir"]
    assert job.ok and sorted(job.losses) == list(range(demo.MESH_EPOCHS)), job.output
    assert "[rank 0/4 | local 0 | cpu] epoch 1 | snapshot saved to tp_snapshot" in job.output
    assert "resuming" not in job.output, "step 7 must not take step 5's snapshot for its own"
    assert sorted(path.name for path in (folder / "tp_snapshot").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"], "every rank wrote its shards"
    assert job.writes == [(job.writes[0][0], 0, str(folder / "tp_model_full.pt"))], job.writes
    assert {row["rank"]: row["mesh"] for row in job.samples if row["epoch"] == 0} == {
        0: {"dp": 0, "tp": 0}, 1: {"dp": 0, "tp": 1}, 2: {"dp": 1, "tp": 0}, 3: {"dp": 1, "tp": 1}}


@pytest.mark.slow
def test_the_demo_trains_the_gpt_in_two_pipeline_stages_saving_one_snapshot_of_the_model(demo_run):
    job = demo_run["jobs"]["pipeline_parallel.py"]
    assert job.ok and sorted(job.losses) == list(range(demo.MESH_EPOCHS)) and output.samples(job.output), job.output
    assert sorted(path.name for path in (demo_run["run_dir"] / "pp_snapshot").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"], "each stage wrote its part"
    assert job.writes == [], "no torch.save: the snapshot is sharded"


@pytest.mark.slow
def test_the_demo_trains_the_gpt_with_each_sequence_split_over_two_ranks(demo_run):
    """Step 9: a cp group of both ranks (one dp group), rank 0 alone writing the snapshot of the whole model."""
    job = demo_run["jobs"]["context_parallel.py"]
    assert job.ok and sorted(job.losses) == list(range(demo.MESH_EPOCHS)) and output.samples(job.output), job.output
    assert [(rank, saved_name(path)) for _, rank, path in job.writes] == [(0, "cp_snapshot.pt")], job.writes
    assert {row["rank"]: row["mesh"] for row in job.samples if row["epoch"] == 0} == {
        0: {"dp": 0, "cp": 0}, 1: {"dp": 0, "cp": 1}}
    assert len({tuple(row["indices"]) for row in job.samples if row["epoch"] == 0}) == 1, "both read the same sequences"


@pytest.mark.slow
def test_the_demo_trains_the_mixture_of_experts_with_its_experts_split_over_two_ranks(demo_run):
    """Step 10: an ep group of both ranks (one dp group), each with its own samples and half of every layer's experts,
    the tokens sent between them; every rank writes its part of the sharded snapshot."""
    job = demo_run["jobs"]["expert_parallel.py"]
    assert job.ok and sorted(job.losses) == list(range(demo.MESH_EPOCHS)) and output.samples(job.output), job.output
    moved = re.search(r"epoch 0 \| steps \d+ \| loss [\d.]+ \| .* \| all-to-all ([\d.]+) MiB/step", job.output)
    assert moved and float(moved[1]) > 0, job.output
    assert sorted(path.name for path in (demo_run["run_dir"] / "ep_snapshot").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"], "every rank wrote its part"
    assert job.writes == [], "no torch.save: the snapshot is sharded"
    epoch_0 = {row["rank"]: row for row in job.samples if row["epoch"] == 0}
    assert {rank: row["mesh"] for rank, row in epoch_0.items()} == {0: {"dp": 0, "ep": 0}, 1: {"dp": 0, "ep": 1}}
    assert not set(epoch_0[0]["indices"]) & set(epoch_0[1]["indices"]), "ep ranks train on samples of their own"


@pytest.mark.slow
def test_the_demo_trains_the_gpt_on_a_pp2_x_tp2_mesh_with_two_stages_a_rank(demo_run):
    """Step 11 on 4 ranks, pp 2 x dp 1 x tp 2: rank = 2 pp + tp; pipeline rank 0 runs stages 0 and 2, pipeline rank 1
    stages 1 and 3 (recorded pass by pass); all four read the same batches (one dp rank); every rank writes its shards
    of the snapshot, rank 0 alone the whole model's plain file."""
    job, folder = demo_run["jobs"]["one_mesh.py"], demo_run["run_dir"]
    assert job.ok and sorted(job.losses) == list(range(demo.MESH_EPOCHS)) and output.samples(job.output), job.output
    epoch_0 = {row["rank"]: row for row in job.samples if row["epoch"] == 0}
    assert {rank: row["mesh"] for rank, row in epoch_0.items()} == {
        0: {"pp": 0, "dp": 0, "tp": 0}, 1: {"pp": 0, "dp": 0, "tp": 1},
        2: {"pp": 1, "dp": 0, "tp": 0}, 3: {"pp": 1, "dp": 0, "tp": 1}}
    assert len({tuple(row["indices"]) for row in epoch_0.values()}) == 1, "one dp rank: the same batches on all four"
    stages = {}
    for record in job.records("pipeline.jsonl"):
        stages.setdefault(record["rank"], set()).add(record["stage"])
    assert stages == {0: {0, 2}, 1: {0, 2}, 2: {1, 3}, 3: {1, 3}}, stages
    assert sorted(path.name for path in (folder / "mesh_snapshot").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"], "every rank wrote its shards"
    # Rank 0 alone writes: each weight to a file of its own as it arrives, then the whole model from those; of them,
    # the whole model's file alone is left.
    assert {rank for _, rank, _ in job.writes} == {0}, job.writes
    assert (folder / "mesh_model_full.pt").exists() and not list(folder.glob("mesh_model_full.pt.*")), job.writes


@pytest.mark.slow
def test_the_demo_runs_the_long_run_on_token_files_it_wrote_first(demo_run):
    """Step 12 on step 11's 4 ranks: the token files written by tools/prepare_data.py in the demo's folder, 24 steps
    of 16 sequences whose loss falls, a line every 6 steps, the held-out loss at steps 0, 12 and 24, two snapshots
    (steps 12 and 24) in long_snapshots/, TensorBoard's event file, the summary's line in steps."""
    job, folder = demo_run["jobs"]["long_run.py"], demo_run["run_dir"]
    lines, held_out = output.step_lines(job.output), output.held_out_losses(job.output)
    assert job.ok and sorted(lines) == [6, 12, 18, 24] and lines[24]["loss"] < lines[6]["loss"], job.output
    assert [step for step, _ in held_out] == [0, 12, 24] and held_out[2][1] < 0.75 * held_out[0][1], job.output
    assert (folder / "data" / "help-short" / "meta.json").exists()
    assert sorted(path.name for path in (folder / "long_snapshots").iterdir()) == ["step-00000012", "step-00000024"]
    assert list((folder / "runs" / "long_run").glob("events.out.tfevents.*")), "no TensorBoard event file"
    summary = demo_run["printed"].split("=== Summary")[1]
    assert re.search(r"^long_run\.py +loss [\d.]+ \(step 6\) -> [\d.]+ \(step 24\); held-out [\d.]+ \(step 0\) -> "
                     r"[\d.]+ \(step 24\)$", summary, re.M), summary


def replica_job(demo_run):
    """Step 13's job in the demo, which the demo stopped itself once group 1 was back: its lines of each group in the
    order they were read ({node: [(second, match)]}, group g on node g + 1), the step group 1 printed last before the
    kill, the step it healed at after it, and the steps each group committed."""
    job = demo_run["jobs"]["fault_tolerant.py"]
    notes = [(index, line) for index, (_, node, line) in enumerate(job.timeline) if node is None]
    assert [re.sub(r"\d+", "N", line) for _, line in notes] == [
        "SIGKILL to rank N (pid N)", "the demo stops the job, N steps after group N's heal"], notes
    kill = notes[0][0]
    lines = {node: [(seconds, match) for seconds, where, line in job.timeline if where == node
                    for match in [output.GROUP_STEP.search(line)] if match] for node in (1, 2)}
    killed_at = [int(match["step"]) for _, node, line in job.timeline[:kill] if node == 2
                 for match in [output.GROUP_STEP.search(line)] if match][-1]
    back = [int(match["step"]) for _, node, line in job.timeline[kill:] if node == 2
            for match in [output.HEALED.search(line)] if match]
    assert len(back) == 1, job.output[-4000:]
    return job, lines, killed_at, back[0], output.group_steps(job.output)


@pytest.mark.slow
def test_the_demo_kills_a_replica_group_and_the_other_trains_on_unbroken(demo_run):
    """Step 13: once group 1 printed a step from FT_KILL_AFTER on with both groups in it, its rank 0 is SIGKILLed from
    outside and its torchrun says so and starts it again; group 0's torchrun never reports a failure. Group 0 commits
    every step from its first to the last before the demo's stop, each once and in order across the kill, some of them
    alone, doing at most the one the kill failed again; it never waits longer than the lighthouse's heartbeat timeout
    (2 s) and a quorum: 10 s is the bound, as in tests/test_fault_tolerant.py."""
    job, lines, killed_at, back, _ = replica_job(demo_run)
    survivor = [int(match["step"]) for _, match in lines[1]]
    assert killed_at >= demo.FT_KILL_AFTER and survivor == list(range(survivor[0], survivor[-1] + 1)), survivor[:12]
    # The demo stops the job once group 1 printed step back + FT_STOP_AFTER: group 0's line of it may come just after.
    assert survivor[0] <= killed_at and survivor[-1] >= back + demo.FT_STOP_AFTER - 1, (survivor[0], survivor[-1])
    alone = [int(match["step"]) for _, match in lines[1] if killed_at < int(match["step"]) < back and
             match["participants"] == "1"]
    assert alone, "group 0 never trained alone after the kill"
    waits = [later - earlier for (earlier, _), (later, _) in zip(lines[1], lines[1][1:])]
    assert max(waits) < 10, f"group 0 stood still {max(waits):.1f} s"
    assert len(output.NOT_COMMITTED.findall(job.node_output(1))) <= 1
    assert re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: 0", job.node_output(2)) == ["-9"], job.node_output(2)
    assert "failed (exitcode" not in job.node_output(1), job.node_output(1)


@pytest.mark.slow
def test_the_demos_killed_group_heals_from_the_survivor_and_equals_it_from_its_first_step_back(demo_run):
    """Group 1, started again by its torchrun, has nothing on disk (the groups save only after their last epoch, which
    the demo never reaches): it takes group 0's state at the step the job is at, and from that step on prints group
    0's weights at every step, FT_STOP_AFTER of them and more."""
    job, lines, killed_at, back, _ = replica_job(demo_run)
    text = job.node_output(2)
    assert back > killed_at and f"healed at step {back} from a healthy group, not from disk" in text, text[-2000:]
    assert "resuming from epoch" not in text and job.writes == [], job.writes
    assert not list((demo_run["run_dir"] / "fault_tolerant").glob("snapshot*")), "a snapshot was written"
    survivor = {int(match["step"]): match["weights"] for _, match in lines[1]}
    healed = max(seconds for seconds, node, line in job.timeline if node == 2 and output.HEALED.search(line))
    returned = [(int(match["step"]), match["weights"]) for seconds, match in lines[2] if seconds >= healed]
    assert [step for step, _ in returned] == list(range(back, back + len(returned))), returned[:3]
    assert len(returned) > demo.FT_STOP_AFTER, len(returned)
    assert all(weights == survivor[step] for step, weights in returned if step in survivor), "the weights differ"
    assert sum(step in survivor for step, _ in returned) >= len(returned) - 1, "group 0 stopped first"


@pytest.mark.slow
def test_the_demos_replica_groups_learn(demo_run):
    """The loss of a step's batch (both groups' 64 samples) falls from step 0's to under half of it by the last step
    both groups printed before the stop (measured about 1.2, then under 0.1)."""
    *_, steps = replica_job(demo_run)
    started = (steps[0].get(0) or steps[1][0])["loss"]  # step 0: the group that began first printed it
    last = max(set(steps[0]) & set(steps[1]))
    assert steps[0][last]["loss"] < 0.5 * started, (started, last, steps[0][last])


@pytest.mark.slow
def test_the_demo_shows_step_13_short_narrated_and_sums_it_up(demo_run):
    """What the demo prints of step 13: the lighthouse's command and one torchrun per group as a learner types them, the
    kill, the return, the stop and the end told in `>>>` lines, a few dozen lines in all where the groups printed
    hundreds; and its summary line, whose figures are the job's."""
    job, lines, killed_at, back, steps = replica_job(demo_run)
    printed = demo_run["printed"]
    section = printed.split("=== Step 13")[1].split("\n=== ")[0]
    commands = [line for line in section.splitlines() if line.startswith("$ ")]
    assert re.fullmatch(r"\$ RUST_LOG=warn torchft_lighthouse --min_replicas 1 --bind 127\.0\.0\.1:(\d+) .*",
                        commands[0]), commands
    port = re.search(r":(\d+) ", commands[0])[1]
    assert commands[1:] == [
        f"$ torchrun --standalone --nproc_per_node=1 --max_restarts=1 fault_tolerant.py {demo.FT_EPOCHS} "
        f"{demo.FT_EPOCHS} --group {group} --groups 2 --lighthouse http://127.0.0.1:{port}" for group in (0, 1)]
    assert re.search(rf"^>>> SIGKILL -> group 1's rank 0 \(pid \d+\), from outside, after its step {killed_at}: ",
                     section, re.M), section
    assert f">>> group 1 is back: torchrun started it again, and it took group 0's weights and optimizer state at " \
           f"step {back} over the network (it had saved no snapshot yet)" in section, section
    last = max(set(steps[0]) & set(steps[1]))
    assert f">>> the demo stops the job: group 1 has trained {last - back} steps with group 0 since its heal" in section
    assert re.search(rf"^>>> group 0 never stopped: steps \d+ to {max(steps[0])}, \d+ of them alone after the kill, "
                     rf"[01] done again; at step {last} both groups hold the same weights$", section, re.M), section
    for node in (1, 2):  # each group's last step is shown, the steps left out before it counted
        assert lines[node][-1][1][0] in section, (lines[node][-1][1][0], section)
    assert re.search(r"^   \.\.\. \d+ more step\(s\) of group 0, participants 2$", section, re.M), section
    assert len(section.splitlines()) < 45 < len(output.GROUP_STEP.findall(job.output)), section
    summary = printed.split("=== Summary")[1]
    started, final = steps[0].get(0) or steps[1][0], steps[0][last]
    alone = sum(line["participants"] == 1 for step, line in steps[0].items() if step > killed_at)
    assert re.search(rf"^fault_tolerant\.py +loss {started['loss']:.4f} \(step 0\) -> {final['loss']:.4f} \(step "
                     rf"{last}\); group 0 never stopped \({alone} steps alone\), group 1 healed at step {back}; both "
                     rf"at weights {final['weights']} when the demo stopped the job$", summary, re.M), summary


# --- what DDP's gradient averaging means ----------------------------------------------------------------------------

def train_in_one_process(batch_size, epochs=EPOCHS):
    """single_gpu.py's Trainer, fed in the order a 2-rank DistributedSampler deals the samples out: rank r gets
    shuffled positions r, r+2, r+4..., so one 2b batch holds exactly the two ranks' b batches."""
    workload = make_workload()
    loader = DataLoader(workload.train_set, batch_size=batch_size,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    trainer = single_gpu.Trainer(workload.model, loader, workload.optimizer, workload.loss_fn,
                                 torch.device("cpu"), save_every=epochs)
    with contextlib.redirect_stdout(io.StringIO()):
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)  # the same shuffle the 2 ranks share in this epoch
            trainer._run_epoch(epoch)
    return trainer.model.state_dict()


@pytest.mark.slow
def test_two_ranks_with_batch_b_end_with_the_weights_of_one_process_with_batch_2b(demo_run):
    """The demo's multigpu.py: 2 gloo ranks, batch 32 each, 4 epochs; its checkpoint.pt holds the final weights."""
    two_ranks = torch.load(demo_run["jobs"]["multigpu.py"].cwd / "checkpoint.pt", weights_only=True)
    reference = train_in_one_process(2 * 32)
    assert two_ranks.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(two_ranks[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    alone = train_in_one_process(32)  # not a coincidence of training long enough: batch b alone ends elsewhere
    assert max((two_ranks[name] - tensor).abs().max().item() for name, tensor in alone.items()) > 1e-2


# --- what each rank trained on ---------------------------------------------------------------------------------------

def by_epoch(samples):
    """{epoch: {rank: indices}} of a recorded job."""
    epochs = {}
    for row in samples:
        epochs.setdefault(row["epoch"], {})[row["rank"]] = row["indices"]
    return epochs


@pytest.mark.slow
def test_two_ranks_train_on_disjoint_halves_that_cover_the_data_every_epoch(torchrun_jobs):
    epochs = by_epoch(torchrun_jobs["first"].samples + torchrun_jobs["resumed"].samples)
    assert sorted(epochs) == [0, 1, 2, 3]
    for epoch, shares in epochs.items():
        assert sorted(shares) == [0, 1]
        assert [len(indices) for indices in shares.values()] == [DATASET_SIZE // 2] * 2, epoch
        assert not set(shares[0]) & set(shares[1]), f"epoch {epoch}: a sample trained on by both ranks"
        assert set(shares[0]) | set(shares[1]) == set(range(DATASET_SIZE)), f"epoch {epoch}: samples left out"


@pytest.mark.slow
def test_set_epoch_gives_every_epoch_a_new_order_also_after_a_resume(torchrun_jobs):
    """Epochs 2 and 3 ran in a new job that resumed from the snapshot: the order depends on the epoch alone."""
    epochs = by_epoch(torchrun_jobs["first"].samples + torchrun_jobs["resumed"].samples)
    for rank in (0, 1):
        orders = [tuple(epochs[epoch][rank]) for epoch in sorted(epochs)]
        assert len(set(orders)) == len(orders), f"rank {rank} repeated an epoch's order"


# --- per-rank metrics (TUTORIAL_RUN_DIR) -----------------------------------------------------------------------------

@pytest.mark.slow
def test_each_rank_writes_its_own_metrics_file_one_line_per_epoch_and_a_resumed_run_appends(torchrun_jobs):
    run_dir = torchrun_jobs["workdir"] / "runs"
    assert sorted(path.name for path in run_dir.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    runs = plot_metrics.read_run(run_dir)
    steps_per_epoch = DATASET_SIZE // 2 // 32  # half the data per rank, batch 32
    fields = {"rank", "world_size", "epoch", "step", "loss", "samples", "seconds", "samples_per_s", "time", "memory_peak"}
    for rank, records in runs.items():
        assert [r["epoch"] for r in records] == [0, 1, 2, 3], "epochs 2 and 3 appended by the rerun"
        for r in records:
            assert set(r) == fields
            assert (r["rank"], r["world_size"], r["samples"]) == (rank, 2, 1024)  # this rank's share, not 2048
            assert r["step"] == (r["epoch"] + 1) * steps_per_epoch
            assert r["samples_per_s"] == pytest.approx(r["samples"] / r["seconds"])
            assert r["memory_peak"] > 0  # on a CPU the process's peak resident memory (utils.metrics)


@pytest.mark.slow
def test_the_logged_loss_is_each_ranks_own_and_they_average_to_the_printed_one(torchrun_jobs):
    printed = output.epoch_losses(torchrun_jobs["first"].output + torchrun_jobs["resumed"].output)
    runs = plot_metrics.read_run(torchrun_jobs["workdir"] / "runs")
    for epoch in range(4):
        rank0, rank1 = runs[0][epoch], runs[1][epoch]
        assert rank0["loss"] != rank1["loss"]  # different data, different mean loss: not a shared, reduced number
        mean = (rank0["loss"] * rank0["samples"] + rank1["loss"] * rank1["samples"]) / (2 * 1024)
        assert mean == pytest.approx(printed[epoch], abs=1e-4)  # printed with 4 decimals


@pytest.mark.slow
def test_the_plot_tool_draws_a_run_to_a_png(torchrun_jobs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "plot.png"
    monkeypatch.setattr("sys.argv", ["plot_metrics.py", str(torchrun_jobs["workdir"] / "runs"), "-o", str(out)])
    plot_metrics.main()
    assert "2 ranks, 4 epochs" in capsys.readouterr().out
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and out.stat().st_size > 10_000


# --- a rerun resumes; nodes that do not share the snapshot refuse -----------------------------------------------------

@pytest.mark.slow
def test_a_rerun_resumes_after_the_last_completed_epoch(torchrun_jobs):
    first, resumed = torchrun_jobs["first"], torchrun_jobs["resumed"]
    assert_one_writer(first.writes, torchrun_jobs["workdir"] / "snapshot.pt")
    assert output.resumes(resumed.output) == {0: 2}, resumed.output  # restart 0: a new job, not a torchrun restart
    assert "[rank 1/2 | cpu] resuming from epoch 2, restart 0" in resumed.output  # every rank loads it
    assert sorted(resumed.losses) == [2, 3], "epochs 0 and 1 were done already: none is repeated"
    assert resumed.losses[3] < first.losses[1], "it goes on from the trained weights"
    snapshot = torch.load(torchrun_jobs["workdir"] / "snapshot.pt", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == 4


@pytest.mark.slow
def test_nodes_that_see_different_snapshots_refuse_to_train(tmp_path, torchrun_jobs):
    """Each node reads the snapshot path on its own disk. Node 0 finds a snapshot (4 epochs done), node 1 finds
    none: instead of training mismatched replicas, both stop and say the path must be on shared storage."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for disk in disks:
        disk.mkdir()
    snapshot = torch.load(torchrun_jobs["workdir"] / "snapshot.pt", weights_only=True)
    snapshot["STEP"] = "multinode.py"  # step 3's snapshot as step 4 writes it: the same model and keys
    torch.save(snapshot, disks[0] / "snapshot.pt")
    before = (disks[0] / "snapshot.pt").read_bytes()
    node = torchrun_node("multinode.py", EPOCHS + 2, 1, endpoint=f"127.0.0.1:{free_port()}")
    with start(node, node, cwd=disks, logs=tmp_path, record=True) as job:
        codes = job.wait(timeout=120)
    assert None not in codes and codes[0] != 0 and codes[1] != 0, job.output
    assert "error: ranks resume from different epochs (0 to 4): put --snapshot_path on storage that every node " \
           "shares" in job.errors, job.output
    assert not job.samples, "no rank trained"
    assert (disks[0] / "snapshot.pt").read_bytes() == before and not (disks[1] / "snapshot.pt").exists()



@pytest.mark.slow
def test_no_step_sends_a_pickle_of_its_own_only_torchs_checkpoint_does(demo_run):
    """An object collective pickles what it sends, and a process that joined the job's process group could make
    every rank run code by sending one (docs/multinode.md's trust boundary). No step calls one of its own: the
    random states, the arguments and the --verbose tables go as bytes (utils/collectives.py), the whole model as
    tensors. What calls them is torch's own code: DCP exchanges its plans so, in the steps that save sharded
    snapshots, and the steps cannot change that (recorded, with each call's caller)."""
    from tools.jobs import REPO

    called = {script: job.records("objects.jsonl") for script, job in demo_run["jobs"].items()}
    ours = {script: rows for script, rows in called.items()
            if any(row["caller"][0].startswith(str(REPO)) and "site-packages" not in row["caller"][0] for row in rows)}
    assert ours == {}, ours
    assert {row["caller"][0].split("site-packages/")[-1].split("/")[2] for rows in called.values() for row in rows} \
        <= {"checkpoint"}, called
