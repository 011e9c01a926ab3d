"""The GPU proof (benchmarks/gpu_proof.py) where there is no GPU: its plan (the parts' budgets add up to less than eight
minutes, every GPU command the pages show has a run that stands for it and every run a command, a command added
without a run is caught, the tests marked gpu are all in it), its arithmetic against hand computations (a tiny GPT's
FLOPs, the MFU, the bare loop's tokens/s on a clock the test holds), its one line without a GPU, a part that runs over
its budget, and its measuring parts run end to end on CPU processes. Its figures are a GPU's business."""
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_proof
from tools import memory_plan
from harness.jobs import PYTHON, shared_file
from harness.shown_commands import gpu_commands
from utils.gpt import GPT, GPTConfig, flops_per_token, help_pages, make_optimizer, next_token_loss, text_needed

# A GPT small enough to count by hand: 1 block, 4 wide, 1 head, a context of 2, 3 characters.
TINY = GPTConfig(n_layer=1, n_head=1, n_embd=4, context=2, dropout=0.0, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1,
                 vocab_size=3)


# --- the plan -------------------------------------------------------------------------------------------------------

def test_the_parts_and_their_caps_fit_in_eight_minutes():
    budgets = {part.name: part.budget for part in gpu_proof.PARTS}
    assert list(budgets) == ["gpt", "mesh", "commands", "tests"]
    assert sum(budgets.values()) + gpu_proof.SETTING_UP <= gpu_proof.WALL == 480, budgets
    # a job's cap never exceeds its part's budget: it would not be the bound
    assert gpu_proof.STEP_CAP + gpu_proof.BARE_CAP <= budgets["gpt"] and gpu_proof.MESH_CAP <= budgets["mesh"]
    assert max(run.cap for run in gpu_proof.RUNS) <= budgets["commands"] and gpu_proof.TEST_CAP <= budgets["tests"]


def test_the_dry_run_prints_each_part_its_budget_and_what_stands_for_every_gpu_command(capsys):
    gpu_proof.main(["--dry_run", "--gpus", "8"])
    printed = capsys.readouterr().out
    assert printed.startswith("The GPU proof on a machine of 8 GPUs: 4 parts, 440 s, and 30 s to set up and report, "
                              "of the 480 s it may take."), printed
    for part in gpu_proof.PARTS:
        assert f"\n{part.name:<9} {part.budget:>4} s  {part.what}\n" in printed
    for where, command in gpu_commands():
        assert f"  {where}: `{command}`\n      -> " in printed
    assert "NONE" not in printed
    assert "one_mesh.py 3 3 --pp 2 --tp 4 --precision bf16 --batch_size 32 --microbatches 4" in printed
    assert "tests/test_gpu.py::test_single_gpu_trains_on_cuda" in printed


def test_every_gpu_command_the_pages_show_has_a_run_and_every_run_a_command():
    commands = gpu_commands()
    assert len(commands) >= 40, commands  # README's GPU column, docs/*.md, the steps' docstrings
    assert gpu_proof.uncovered(commands) == []
    assert gpu_proof.stale(commands) == []
    # each of the README's steps, 1 to 13 but 4 (one torchrun per node: its page's commands), has a GPU command
    readme = {gpu_proof.covering()[gpu_proof.key(command)].name.split(":")[0] for where, command in commands
              if where == "README.md"}
    assert readme == {f"step {n}" for n in range(1, 14) if n != 4}, readme


def test_a_gpu_command_added_to_a_page_without_a_run_is_caught(monkeypatch, capsys):
    added = ("README.md", "... --nproc_per_node=gpu tensor_parallel.py 10 2 --tp 4 --precision bf16")
    assert gpu_proof.uncovered(gpu_commands() + [added]) == [added]
    monkeypatch.setattr(gpu_proof, "gpu_commands", lambda: gpu_commands() + [added])
    with pytest.raises(SystemExit) as stop:
        gpu_proof.main(["--dry_run"])
    assert str(stop.value) == ("error: 1 GPU command(s) the pages show have no run in benchmarks/gpu_proof.py's RUNS, "
                               f"the first: README.md: `{added[1]}`")
    assert f"README.md: `{added[1]}`\n      -> NONE: add a run to RUNS" in capsys.readouterr().out


def test_a_run_is_left_out_where_the_gpus_or_a_module_are_missing():
    runs = {run.name: run for run in gpu_proof.RUNS}
    assert gpu_proof.left_out(runs["step 6: bf16, compiled"], 1, {}) is None
    assert gpu_proof.left_out(runs["step 7: tp 2"], 1, {}) == "needs a multiple of 2 GPUs; this machine has 1"
    assert gpu_proof.left_out(runs["step 7: tp 2"], 4, {}) is None
    assert gpu_proof.left_out(runs["step 4: two nodes"], 3, {}) == ("needs a multiple of 2 GPUs, shared by 2 nodes; "
                                                                    "this machine has 3")
    assert gpu_proof.left_out(runs["step 12: pp 2 x tp 4"], 8, {"tensorboard": "..."}) == (
        "needs tensorboard, which this Python lacks")
    assert gpu_proof.halves(8, 2) == ["0,1,2,3", "4,5,6,7"]


@pytest.mark.parametrize("gpus, layout", [(1, (1, 1)), (2, (2, 1)), (3, (1, 1)), (4, (2, 2)), (6, (2, 1)),
                                          (8, (2, 4)), (16, (2, 4))])
def test_step_11_is_measured_on_the_largest_layout_that_divides_the_gpus(gpus, layout):
    assert gpu_proof.mesh_layout(gpus) == layout


def test_every_test_marked_gpu_is_found(tmp_path):
    (tmp_path / "test_whole.py").write_text("import pytest\npytestmark = [pytest.mark.gpu]\n\n"
                                            "def test_a():\n    pass\n\ndef helper():\n    pass\n")
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_b():\n    pass\n\n@pytest.mark.slow\ndef test_c():\n    pass\n\n"
        "@pytest.mark.gpu\n@pytest.mark.skipif(True, reason='2 GPUs')\ndef test_d():\n    pass\n\n"
        "@pytest.mark.gpus\ndef test_e():\n    pass\n")
    folder = tmp_path.name
    assert gpu_proof.gpu_tests(tmp_path) == [f"{folder}/test_some.py::test_b", f"{folder}/test_some.py::test_d",
                                             f"{folder}/test_whole.py::test_a"]
    found = gpu_proof.gpu_tests()
    assert {f"tests/test_gpu.py::{name}" for name in ("test_single_gpu_trains_on_cuda",
                                                       "test_multinode_as_two_nodes_with_one_gpu_each")} <= set(found)
    marked = {path.name for path in Path(gpu_proof.REPO, "tests").glob("test_*.py")
              if "pytest.mark.gpu" in path.read_text() and path.name != "test_gpu_proof.py"}
    assert {name.split("::")[0].split("/")[1] for name in found} == marked


def test_a_tests_result_is_read_from_its_junit_file(tmp_path):
    def junit(case):
        path = tmp_path / "junit.xml"
        path.write_text(f'<testsuites><testsuite><testcase name="t" time="12.34">{case}</testcase></testsuite>'
                        "</testsuites>")
        return gpu_proof.junit_result(path)

    assert junit("") == dict(status="passed", seconds=12.3)
    assert junit('<failure message="AssertionError: 1 != 2&#10;more">...</failure>') == dict(
        status="failed", seconds=12.3, why="AssertionError: 1 != 2")
    assert junit('<skipped message="needs 2 GPUs" />') == dict(status="skipped", seconds=12.3, why="needs 2 GPUs")
    assert gpu_proof.junit_result(tmp_path / "none.xml") is None


def test_without_a_gpu_it_stops_with_one_line_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit) as stop:
        gpu_proof.main(["--out", str(tmp_path / "report")])
    assert str(stop.value) == (f"error: no CUDA GPU here (torch {torch.__version__} sees none): the GPU proof runs on "
                               "a machine with one; --dry_run prints what it would run")
    assert not (tmp_path / "report").exists()


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_gpu_proof_installs_nothing_and_runs_on_the_python_there_is(tmp_path):
    """A GPU machine lent for minutes has its own torch and may reach no registry: no .venv built, no pip."""
    def made(*variables):
        # --no-print-directory: under `make test` this make is a sub-make, which would name its folder around the lines
        return subprocess.run(["make", "--no-print-directory", "-n", "-B", "gpu-proof", *variables], cwd=gpu_proof.REPO,
                              capture_output=True, text=True, check=True).stdout

    assert made(f"PY={tmp_path}/none", "PYTHON=python3") == "python3 benchmarks/gpu_proof.py \n"
    assert made(f"PY={tmp_path}/none", "OUT=here") == "python3 benchmarks/gpu_proof.py --out here\n"


# --- its arithmetic -------------------------------------------------------------------------------------------------

def test_a_tiny_gpts_flops_are_those_counted_by_hand():
    # The weights that multiply (no embedding): the block's two norms 2 x (4 + 4); q, k, v and proj 4 x (4 x 4 + 4);
    # the MLP 4 x 16 + 16 and 16 x 4 + 4; the head's norm 4 + 4 and its 4 x 3 matrix without bias.
    weights = 16 + 4 * 20 + 80 + 68 + 8 + 12
    assert weights == 264
    model = GPT(TINY, "abc")
    assert sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed")) == weights
    # 6 FLOPs a weight a token (a multiply-add is 2, backward twice forward), and attention's 12 L C T = 12 x 1 x 4 x 2.
    assert flops_per_token(model) == 6 * 264 + 96 == 1680
    assert gpu_proof.flops_figures(TINY) == dict(flops_per_token=1680, weights=264, attention=96,
                                                 formula="6 N + 12 L C T = 6 x 264 + 12 x 1 x 4 x 2 = 1,680")


def test_the_mfu_is_the_flops_the_tokens_need_over_the_peak():
    # 1,680 FLOPs a token at a million tokens/s: 1.68e9 FLOP/s, of a 1e12 peak; of two devices' peak, half that
    assert gpu_proof.utilisation(1680, 1e6, 1e12) == pytest.approx(1.68e-3)
    assert gpu_proof.utilisation(1680, 1e6, 1e12, devices=2) == pytest.approx(0.84e-3)
    assert gpu_proof.utilisation(1680, 1e6, None) is None and gpu_proof.utilisation(1680, None, 1e12) is None


def test_the_bare_loop_trains_and_times_its_steps_after_the_warm_up():
    torch.manual_seed(0)
    model = GPT(TINY, "abc")
    optimizer = make_optimizer(model, TINY)
    ids = torch.randint(0, 3, (4, 3, 3))  # 4 batches of 3 sequences of context + 1 tokens
    batches = [(batch[:, :-1], batch[:, 1:]) for batch in ids]
    before = [p.detach().clone() for p in model.parameters()]
    steps_taken = []

    def clock():
        """10.0 as the timed steps begin, 12.5 as they end (2.5 s), noting the optimizer steps taken at each reading."""
        steps_taken.append(max((state["step"].item() for state in optimizer.state.values()), default=0))
        return [10.0, 12.5][len(steps_taken) - 1]

    result = gpu_proof.bare_loop(model, optimizer, next_token_loss, batches, steps=5, warmup=2, dtype=torch.bfloat16,
                                 clock=clock)
    # 5 timed steps of 3 sequences of 2 tokens in 2.5 s, the clock read after the 2 warm-up steps and after the 5
    assert result["tokens"] == 5 * 3 * 2 and result["seconds"] == 2.5 and result["tokens_per_s"] == 30 / 2.5
    assert steps_taken == [2, 7]
    # AdamW stepped 2 + 5 times, every weight moved
    assert {state["step"].item() for state in optimizer.state.values()} == {7}
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert math.isfinite(result["first_loss"]) and math.isfinite(result["last_loss"])


# --- bounded, on CPU processes --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_part_over_its_budget_is_stopped_and_the_next_part_still_runs(tmp_path, monkeypatch):
    """Two made-up parts: the first's job sleeps past its 3 s budget, with a second job waiting behind it (a job is
    started with 1 s left at least, here); the second part's job prints a line. The report is written after each."""
    monkeypatch.setattr(gpu_proof, "TOO_LATE", 1)
    def sleeper(proof, deadline):
        sleep = [PYTHON, "-c", "import time; time.sleep(60)", str(tmp_path)]
        # what a stopped job measured is read (here made up), but it stays stopped
        tasks = [gpu_proof.Task(name, [sleep], 100, dict(cwd=tmp_path / name),
                                read=lambda job: dict(status="failed", why="no figures", figure=1))
                 for name in ("sleeps", "waits")]
        return dict(jobs=gpu_proof.run_tasks(tasks, deadline, 1, proof))

    def printer(proof, deadline):
        task = gpu_proof.Task("prints", [[PYTHON, "-c", "print('here')"]], 30, dict(cwd=tmp_path / "prints"))
        return dict(jobs=gpu_proof.run_tasks([task], deadline, 1, proof))

    proof = gpu_proof.Proof("cpu", 0, tmp_path / "report", tmp_path / "work")
    proof.out.mkdir()
    parts = [gpu_proof.Part("slow", 3, "sleeps"), gpu_proof.Part("quick", 30, "prints")]
    machine = dict(device="cpu", gpus=0, torch="t", cuda=None, python="p", cpu_cores=2, load_average=[1.0])
    report = dict(_began=gpu_proof.time.monotonic(), parts={}, machine=machine, started="now", missing={},
                  peak_tflops=None, peak_source="none")
    gpu_proof.run_parts(parts, proof, report, functions=dict(slow=sleeper, quick=printer))
    written = json.loads((proof.out / "report.json").read_text())
    slow, quick = written["parts"]["slow"], written["parts"]["quick"]
    assert slow["status"] == "over budget" and slow["seconds"] < 10, slow
    assert [(job["name"], job["status"]) for job in slow["jobs"]] == [("sleeps", "stopped"), ("waits", "not run")]
    assert slow["jobs"][0]["why"].endswith("s, its part's budget") and slow["jobs"][1]["why"] == gpu_proof.BUDGET_SPENT
    assert slow["jobs"][0]["figure"] == 1
    assert (proof.out / slow["jobs"][0]["log"]).exists()  # the stopped job's log, kept
    assert quick["status"] == "done" and quick["jobs"][0]["status"] == "passed", quick
    assert "| sleeps | stopped |" in (proof.out / "README.md").read_text()
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout == b""  # nothing left running


@pytest.mark.slow
@pytest.mark.timeout(600)  # two processes that import torch, which on a busy 2-core machine takes minutes
def test_the_commands_and_tests_parts_run_their_jobs_and_read_their_results(tmp_path, monkeypatch):
    """Here, without a GPU: the commands part with two runs, step 1 (its GPU command runs on the CPU where there is no
    GPU) and step 7's tp 2 (left out on one GPU); the tests part with one test marked gpu, in a pytest process of its
    own, without the project's addopts, which tests/conftest.py skips here: its JUnit file read."""
    proof = gpu_proof.Proof("cuda", 1, tmp_path / "report", tmp_path / "work", missing=gpu_proof.missing_modules(),
                            scale=gpu_proof.CPU_SCALE)
    runs = {run.name: run for run in gpu_proof.RUNS}
    monkeypatch.setattr(gpu_proof, "RUNS", [runs["step 1"], runs["step 7: tp 2"]])
    deadline = gpu_proof.time.monotonic() + 540  # both parts, within the test's 600 s
    ran, left_out = gpu_proof.part_commands(proof, deadline)["jobs"]
    why = "needs a multiple of 2 GPUs; this machine has 1"
    assert left_out == dict(name="step 7: tp 2", status="left out", why=why,
                            stands_for=["tensor_parallel.py --tp 2 --precision bf16"])
    assert ran["status"] == "passed" and ran["command"] == "python single_gpu.py 2 1", ran
    assert ran["stands_for"] == ["single_gpu.py"]
    monkeypatch.setattr(gpu_proof, "gpu_tests", lambda: ["tests/test_gpu.py::test_single_gpu_trains_on_cuda"])
    [test] = gpu_proof.part_tests(proof, deadline)["jobs"]
    assert test["status"] == "skipped" and test["why"] == "needs CUDA: no GPU on this machine", test
    assert test["command"].startswith("python -m pytest tests/test_gpu.py::test_single_gpu_trains_on_cuda -q -rA "
                                      "-o addopts= -p no:cacheprovider --junitxml="), test


# The proof bounds its CPU processes itself: its two parts' budgets, CPU_SCALE times a GPU's (on a busy 2-core machine
# the wall time is several times the CPU time).
MEASURING = sum(part.budget for part in gpu_proof.PARTS if part.name in ("gpt", "mesh")) * gpu_proof.CPU_SCALE


@pytest.mark.slow
@pytest.mark.timeout(MEASURING + 60)
def test_the_measuring_parts_run_on_cpu_processes_and_report_their_figures(tmp_path, capsys):
    """--device cpu: gpt.py and the bare loop, step 11 on one process, at the CPU size in fp32 on the shortest text it
    takes (42 sequences), with a peak of 1 TFLOP/s given: the figures the report holds are the arithmetic of what the
    jobs printed and recorded."""
    text = shared_file("shortest_text.txt", help_pages()[:text_needed(64) + 400])
    out = tmp_path / "report"
    gpu_proof.main(["--device", "cpu", "--text", str(text), "--out", str(out), "--peak_tflops", "1"])
    assert capsys.readouterr().out.endswith(f"report: {out / 'README.md'} and {out / 'report.json'} "
                                            f"({json.loads((out / 'report.json').read_text())['seconds']:.0f} s)\n")
    report = json.loads((out / "report.json").read_text())
    assert list(report["parts"]) == ["gpt", "mesh"] and report["peak_source"] == "--peak_tflops"
    gpt, mesh = report["parts"]["gpt"], report["parts"]["mesh"]
    assert gpt["status"] == "done" and [job["status"] for job in gpt["jobs"]] == ["passed", "passed"], gpt
    figures = gpt["figures"]
    config = memory_plan.config_of("cpu", text)
    step, bare = figures["step"]["tokens_per_s"], figures["bare"]["tokens_per_s"]
    assert step > 0 and bare > 0 and figures["ratio"] == pytest.approx(step / bare)
    assert figures["flops_per_token"] == flops_per_token(config) == gpt["jobs"][1]["bare_loop"]["flops_per_token"]
    assert figures["step"]["mfu"] == pytest.approx(flops_per_token(config) * step / 1e12)
    assert step == gpt["jobs"][0]["epochs"]["1"]  # the one epoch after the first
    assert mesh["status"] == "done" and mesh["jobs"][0]["status"] == "passed", mesh
    [rank] = mesh["figures"]["memory"]
    planned = memory_plan.plan(config, memory_plan.Layout(1, 1, 1, 4, 2, "fp32"), device="cpu")[0]
    assert rank["planned"] == planned["total"] and rank["measured"] > 0, rank
    # the step's count of what autograd keeps, against the plan's: within the plan's own tolerance
    assert rank["activations_measured"] == pytest.approx(planned["act_step"], rel=memory_plan.ACTIVATION_TOLERANCE)
    assert mesh["figures"]["mfu"] == pytest.approx(flops_per_token(config) * mesh["figures"]["tokens_per_s"] / 1e12)
    page = (out / "README.md").read_text()
    assert f"gpt.py reaches {figures['ratio']:.2f}x the bare loop's tokens/s." in page
    assert "| 0 | 0, 0, 0 |" in page
