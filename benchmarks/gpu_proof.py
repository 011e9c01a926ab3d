"""The GPU proof: on a machine with CUDA GPUs, everything the tutorial's GPU paths promise, run and measured by one
command in under eight minutes, into one report (markdown and JSON).

    make gpu-proof                                       # python benchmarks/gpu_proof.py; OUT=DIR: the report's folder
    python benchmarks/gpu_proof.py --out DIR             # default benchmarks/results/gpu-proof-DEVICE-DATE-TIME/
    python benchmarks/gpu_proof.py --dry_run [--gpus 8]  # the plan: its parts, their budgets, what each runs
    python benchmarks/gpu_proof.py --only gpt,mesh       # some of the parts (a rerun)
    python benchmarks/gpu_proof.py --peak_tflops 989     # the GPU's dense bf16 peak, where the table lacks its name

The parts, in this order, each within its budget (PARTS; they add up to less than eight minutes with SETTING_UP). A
job still running when its own cap or its part's budget is spent is stopped and reported as stopped; the parts after
it still run, and the report is written again after each part.

  gpt       step 6's GPT at its GPU size on one GPU, bf16, --compile: tokens/s of gpt.py's own loop (its epochs after
            the first, which compiles) against bare_loop below, written here: the same model, batch and precision with
            nothing around them (no DDP, no data loader, no clipping, no schedule, no snapshot); the ratio; the MFU of
            each
  mesh      step 11 (one_mesh.py) on every GPU there is, bf16, as the largest of pp 2 x tp 4, 2 x 2, 2 x 1, 1 x 1
            that divides them (dp the rest): tokens/s, MFU, and each rank's peak memory (the CUDA allocator's, which
            utils/metrics.py records) against tools/memory_plan.py's plan for that layout
  commands  every GPU command the pages show (harness/shown_commands.py), by the run of RUNS that stands for it, at a
            short length, two at a time; a layout that needs more GPUs than there are, or a module that is missing,
            is left out with the reason
  tests     every test marked gpu, each in a pytest process of its own, two at a time, bounded

MFU, model-FLOPs utilisation: the FLOPs a trained token costs (utils/gpt.py's flops_per_token: 6 N + 12 L C T, N the
weights that multiply activations, 6 FLOPs each per token forward and backward; 12 L C T attention's two products over
a context of T tokens, C wide, in L blocks; PaLM's count, as nanoGPT's), times the tokens/s, over the peak FLOP/s of
the GPUs that trained them: dense bf16, looked up by the GPU's name in utils/loop.py's PEAK_BF16_FLOPS (NVIDIA's
datasheets, each source said there: H100 SXM and PCIe, H200, A100...), or --peak_tflops.

Nothing is installed: it runs on the Python it is started with (a GPU machine's own torch, 2.6 or newer) and says
which optional packages are missing and what that leaves out. Jobs run through harness/jobs; their folders are
temporary, and the logs of the jobs that failed or were stopped are kept beside the report. Without a GPU it stops
with one line. --device cpu (for the tests alone) runs the measuring parts on CPU processes at the CPU size.
"""
import argparse
import ast
import dataclasses
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/gpu_proof.py` from anywhere

import torch  # noqa: E402

from tools import memory_plan  # noqa: E402
from harness.jobs import (PYTHON, free_port, lighthouse, output, python, replica_groups, shown, start,  # noqa: E402
                        torchrun, torchrun_node)
from harness.shown_commands import gpu_commands, key  # noqa: E402
from utils.gpt import flops_per_token  # noqa: E402
from utils.loop import PEAK_VARIABLE, peak_flops  # noqa: E402

WALL = 8 * 60  # the whole proof, at most
SETTING_UP = 30  # what is not a part: starting, importing torch, the GPU's name, writing the report


@dataclasses.dataclass(frozen=True)
class Part:
    """A part of the proof: its name (for --only), the wall time it may take, what it does (one line)."""
    name: str
    budget: int  # seconds of wall time, at most
    what: str


PARTS = [
    Part("gpt", 130, "step 6's GPT at its GPU size, bf16, --compile: gpt.py's loop against a bare loop, tokens/s, MFU"),
    Part("mesh", 60, "step 11 on every GPU, bf16: tokens/s, MFU, each rank's peak memory against the memory plan"),
    Part("commands", 100, "every GPU command the pages show, at a short length, two at a time"),
    Part("tests", 150, "every test marked gpu, one pytest process each, two at a time"),
]
BUDGET_SPENT = "its part's budget was spent"
TOO_LATE = 5  # seconds: a job that would have fewer than these left of its part's budget is not started
PARALLEL = 2  # jobs at once in the commands and tests parts: they check, they do not time
STEP_CAP, BARE_CAP = 80, 50  # the gpt part's two jobs: gpt.py's run (it compiles twice: training, then evaluation)
MESH_CAP = 60  # the mesh part's one job
TEST_CAP = 120  # a test marked gpu, at most
CPU_SCALE = 4  # --device cpu (tests): CPU processes on a busy machine get this many times the budgets
# Step 6 measured: epochs of gpt.py (the first compiles and is left out), and the bare loop's steps.
GPT_EPOCHS, BARE_STEPS, BARE_WARMUP = 4, 60, 8
MESH_EPOCHS = 3  # step 11 measured (the first is left out)
# The modules beyond torch that a part needs, and what is left out without them.
OPTIONAL = {"pytest": "the tests marked gpu", "pytest_timeout": "nothing: each test's own process is bounded",
            "tensorboard": "step 12 (long_run.py writes TensorBoard's events) and its test",
            "numpy": "step 12's token files (tools/prepare_data.py)", "torchft": "step 13 (fault_tolerant.py)",
            "matplotlib": "nothing here (the pictures of tools/ and the notebooks)"}


# ------------------------------------------------------------------------------------------------- the commands part

@dataclasses.dataclass(frozen=True)
class Run:
    """What the commands part runs for the GPU commands in `shows` (their key(): script, options, nodes): the first
    one's script and options, at the length `length` (TOTAL_EPOCHS SAVE_EVERY, or steps), with `extra` options, on
    every GPU of the machine: as one node, or as its `nodes` nodes of an equal share each (CUDA_VISIBLE_DEVICES), or
    with `groups` replica groups under a lighthouse. It runs where the GPUs are a multiple of `gpus` (its layout's
    processes) and the modules in `needs` are installed."""
    name: str
    shows: tuple
    gpus: int = 1
    launcher: str = "torchrun"
    length: tuple = (2, 1)
    extra: tuple = ()
    needs: tuple = ()
    groups: int = 0
    cap: int = 45

    @property
    def script(self):
        return self.shows[0][0]

    @property
    def options(self):
        return tuple(self.shows[0][1].split())

    @property
    def nodes(self):
        return self.shows[0][2]


# The README's commands first (its table's GPU column), then the docs' and docstrings' other layouts and two-node jobs,
# which run as two nodes on this machine: when the budget runs out, the front page's have run.
RUNS = [
    Run("step 1", (("single_gpu.py", "", 1),), launcher="python"),
    Run("step 2: DDP, every GPU", (("multigpu.py", "", 1),), launcher="python"),
    Run("step 3: torchrun, every GPU", (("multigpu_torchrun.py", "", 1),)),
    Run("step 5: FSDP in bf16", (("fsdp.py", "--bf16", 1),)),
    Run("step 6: bf16, compiled", (("gpt.py", "--precision bf16 --compile", 1),), cap=75),
    Run("step 7: tp 2", (("tensor_parallel.py", "--tp 2 --precision bf16", 1),), gpus=2),
    Run("step 8: pp 2", (("pipeline_parallel.py", "--pp 2 --precision bf16", 1),), gpus=2),
    Run("step 9: cp 8", (("context_parallel.py", "--cp 8 --context 4096 --precision bf16", 1),), gpus=8),
    Run("step 10: ep 8", (("expert_parallel.py", "--ep 8 --precision bf16", 1),), gpus=8),
    Run("step 11: pp 2 x tp 4", (("one_mesh.py", "--pp 2 --tp 4 --precision bf16", 1),), gpus=8),
    Run("step 12: pp 2 x tp 4", (("long_run.py", "--data data/help-gpu --pp 2 --tp 4 --precision bf16", 1),),
        gpus=8, length=(20, 10), extra=("--log_every", "10"), needs=("tensorboard", "numpy")),
    Run("step 13: two replica groups", (
        ("fault_tolerant.py", "--group 0 --groups 2 --lighthouse http://127.0.0.1:29510", 1),
        ("fault_tolerant.py", "--group 0 --groups 2 --lighthouse http://LIGHTHOUSE:29510", 1),
        ("fault_tolerant.py", "--group 1 --groups 2 --lighthouse http://LIGHTHOUSE:29510", 1)),
        gpus=2, groups=2, needs=("torchft",)),
    Run("step 11: pp 2 x tp 4, activations checkpointed",
        (("one_mesh.py", "--pp 2 --tp 4 --precision bf16 --checkpoint_activations", 1),), gpus=8),
    Run("step 4: two nodes", (("multinode.py", "", 2),), gpus=2),
    Run("step 5: two nodes, the wide workload", (("fsdp.py", "--workload wide --verbose", 2),), gpus=2),
    Run("step 6: two nodes", (("gpt.py", "--precision bf16 --compile", 2),), gpus=2, cap=75),
    Run("step 7: tp 8 over two nodes", (("tensor_parallel.py", "--tp 8 --precision bf16", 2),
                                        ("tensor_parallel.py", "--tp 8 --verbose", 2)), gpus=8),
    Run("step 8: two nodes", (("pipeline_parallel.py", "--pp 2 --precision bf16 --microbatches 8", 2),
                              ("pipeline_parallel.py", "--pp 2", 2)), gpus=2),
    Run("step 9: cp 2 over two nodes", (("context_parallel.py", "--cp 2 --context 1024", 2),), gpus=2),
    Run("step 9: cp 8 over two nodes", (("context_parallel.py", "--cp 8 --context 4096 --precision bf16", 2),),
        gpus=8),
    Run("step 10: ep 8 over two nodes", (("expert_parallel.py", "--ep 8 --precision bf16", 2),), gpus=8),
    Run("step 11: pp 2 x tp 8 over two nodes", (("one_mesh.py", "--pp 2 --tp 8 --precision bf16", 2),
                                                ("one_mesh.py", "--pp 2 --tp 8", 2)), gpus=16),
    Run("step 12: pp 2 x tp 8 over two nodes", (
        ("long_run.py", "--data data/help-gpu --pp 2 --tp 8 --precision bf16 --async_save", 2),
        ("long_run.py", "--pp 2 --tp 8", 2)), gpus=16, length=(20, 10), extra=("--log_every", "10"),
        needs=("tensorboard", "numpy")),
]


def covering(runs=RUNS):
    """{key: the run that stands for it} of every key a run shows."""
    return {shows: run for run in runs for shows in run.shows}


def uncovered(commands, runs=RUNS):
    """The (where, command) of `commands` (gpu_commands()) that no run of `runs` stands for."""
    covered = covering(runs)
    return [(where, command) for where, command in commands if key(command) not in covered]


def stale(commands, runs=RUNS):
    """The keys the runs stand for that none of `commands` shows any more."""
    shown_keys = {key(command) for _, command in commands}
    return [shows for shows in covering(runs) if shows not in shown_keys]


def left_out(run, gpus, missing):
    """Why `run` cannot run on a machine of `gpus` GPUs where the modules `missing` are not installed; None: it can."""
    lacking = [module for module in run.needs if module in missing]
    if lacking:
        return f"needs {' and '.join(lacking)}, which this Python lacks"
    if gpus == 0 or gpus % run.gpus or gpus % run.nodes:
        shares = f", shared by {run.nodes} nodes" if run.nodes > 1 else ""
        return f"needs a multiple of {run.gpus} GPUs{shares}; this machine has {gpus}"
    return None


def halves(gpus, parts):
    """CUDA_VISIBLE_DEVICES of each of `parts` nodes sharing `gpus` GPUs equally: ["0,1", "2,3"] for 4 and 2."""
    share = gpus // parts
    return [",".join(str(gpu) for gpu in range(part * share, (part + 1) * share)) for part in range(parts)]


def run_task(run, proof):
    """The Task that runs `run` on this machine, in a folder of its own."""
    folder = proof.work / "commands" / slug(run.name)
    options = [proof.data if value == "data/help-gpu" else value for value in run.options] + list(run.extra)
    arguments = [*run.length, *options]
    settings = dict(cwd=folder, gpu=True, logs=proof.work / "logs" / slug(run.name))
    if run.launcher == "python":
        commands = [python(run.script, *arguments)]
    elif run.groups:
        port = free_port()
        commands = [lighthouse(port, min_replicas=run.groups),
                    *replica_groups(run.script, *run.length, port=port, groups=run.groups, nproc="gpu")]
        settings.update(services=1, node_env=[{}] + [{"CUDA_VISIBLE_DEVICES": share}
                                                     for share in halves(proof.gpus, run.groups)])
    elif run.nodes > 1:
        endpoint = f"127.0.0.1:{free_port()}"
        commands = [torchrun_node(run.script, *arguments, nnodes=run.nodes, nproc="gpu", endpoint=endpoint)
                    for _ in range(run.nodes)]
        settings["node_env"] = [{"CUDA_VISIBLE_DEVICES": share} for share in halves(proof.gpus, run.nodes)]
    else:
        commands = [torchrun(run.script, *arguments, nproc="gpu")]
    return Task(run.name, commands, run.cap, settings)


def stand_for(run):
    """The commands `run` stands for, as `script options` (over N nodes)."""
    return [" ".join(filter(None, [script, options])) + (f" (over {nodes} nodes)" if nodes > 1 else "")
            for script, options, nodes in run.shows]


def part_commands(proof, deadline):
    # In RUNS' order: a run left out where it stands, the others' results once they ran, PARALLEL at a time.
    entries, tasks = [], []
    for run in RUNS:
        why = left_out(run, proof.gpus, proof.missing)
        if why is None and run.groups and not Path(lighthouse(0)[0]).exists():
            why = f"torchft's lighthouse is not beside this Python ({lighthouse(0)[0]})"
        if why:
            entries.append(dict(name=run.name, status="left out", why=why, stands_for=stand_for(run)))
        elif any(value == "data/help-gpu" for value in run.options) and not prepare_data(proof, deadline, entries):
            entries.append(dict(name=run.name, status="not run", why="its token files could not be prepared"))
        else:
            entries.append((len(tasks), run))
            tasks.append(run_task(run, proof))
    results = run_tasks(tasks, deadline, PARALLEL, proof)
    return dict(jobs=[dict(results[entry[0]], stands_for=stand_for(entry[1])) if isinstance(entry, tuple) else entry
                      for entry in entries])


def prepare_data(proof, deadline, jobs):
    """Step 12's token files of the GPU size, once (tools/prepare_data.py): whether they are there."""
    if not Path(proof.data).exists():
        command = python("tools/prepare_data.py", proof.data, "--workload", "gpt-gpu")
        jobs += run_tasks([Task("step 12's token files", [command], 30, dict(cwd=proof.work, gpu=True))], deadline, 1,
                          proof)
    return Path(proof.data, "meta.json").exists()


# ---------------------------------------------------------------------------------------------------- the tests part

def gpu_tests(folder=REPO / "tests"):
    """The node ids of the tests marked gpu, in file and line order: each test function decorated with
    @pytest.mark.gpu, and every test function of a module whose `pytestmark` holds pytest.mark.gpu."""
    marked = re.compile(r"\bpytest\.mark\.gpu\b")
    found = []
    for path in sorted(Path(folder).glob("test_*.py")):
        tree = ast.parse(path.read_text())
        whole_module = any(isinstance(node, ast.Assign) and "pytestmark" in map(ast.unparse, node.targets)
                           and marked.search(ast.unparse(node.value)) for node in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                if whole_module or any(marked.fullmatch(ast.unparse(mark)) for mark in node.decorator_list):
                    found.append(f"{Path(folder).name}/{path.name}::{node.name}")
    return found


def junit_result(path):
    """{status, seconds, why} of the one test a pytest run wrote to the JUnit XML file at `path` (None: no file)."""
    if not Path(path).exists():
        return None
    case = next(ElementTree.parse(path).getroot().iter("testcase"), None)
    if case is None:
        return dict(status="error", why="pytest collected no test (see its log)")
    result = dict(status="passed", seconds=round(float(case.get("time", 0)), 1))
    outcomes = {"failure": "failed", "error": "error", "skipped": "skipped"}
    for child in case:
        if child.tag in outcomes:
            message = (child.get("message") or "").strip()
            result.update(status=outcomes[child.tag], why=message.splitlines()[0][:300] if message else None)
    return result


def part_tests(proof, deadline):
    names = gpu_tests()
    if "pytest" in proof.missing:
        return dict(jobs=[dict(name=name, status="not run", why="pytest is not installed for this Python")
                          for name in names])
    tasks = []
    for name in names:
        report = proof.work / "junit" / f"{slug(name)}.xml"
        # Without the project's addopts: pytest-xdist, pytest-timeout and nbval may be missing here.
        command = [PYTHON, "-m", "pytest", name, "-q", "-rA", "-o", "addopts=", "-p", "no:cacheprovider",
                   f"--junitxml={report}"]
        # pytest-timeout, where there is one, fails the test a little before its process is stopped: its result and
        # traceback are written then.
        if "pytest_timeout" not in proof.missing:
            command.append(f"--timeout={TEST_CAP * proof.scale - 10}")

        def read(job, report=report):
            return junit_result(report) or {}

        # The CPU's cores shared by the tests that run at once (harness/jobs gives a job one thread): what a test
        # computes on the CPU in its own process (the references the GPU runs are compared with) takes less time.
        threads = {"OMP_NUM_THREADS": max(1, (os.cpu_count() or 1) // PARALLEL)}
        tasks.append(Task(name, [command], TEST_CAP, dict(cwd=REPO, gpu=True, env=threads,
                                                          logs=proof.work / "logs" / slug(name)), read=read))
    return dict(jobs=run_tasks(tasks, deadline, PARALLEL, proof))


# ------------------------------------------------------------------------------------------------ the measuring parts

def synchronize(device):
    """Wait for what the device was given: a GPU runs asynchronously, a clock read before it finished lies."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_loop(model, optimizer, loss_fn, batches, steps, warmup, dtype, clock=time.perf_counter):
    """The training loop at its barest: the forward under autocast to `dtype` (None: fp32), the loss, backward, the
    optimizer's step, the gradients dropped. `warmup` steps first (torch.compile builds its kernels in the first),
    then `steps` timed ones, on `batches` ((source, targets) already on the device, taken in turn). No DDP, no data
    loader, no gradient scaler, no clipping, no schedule, no snapshot: what the model and its optimizer cost.
    {tokens_per_s, seconds, steps, tokens, first_loss, last_loss} of the timed steps."""
    device = batches[0][0].device
    losses = []
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            began = clock()
        source, targets = batches[step % len(batches)]
        with torch.autocast(device.type, dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(model(source), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    seconds = clock() - began
    tokens = sum(batches[step % len(batches)][0].numel() for step in range(warmup, warmup + steps))
    return dict(tokens_per_s=tokens / seconds, seconds=seconds, steps=steps, tokens=tokens,
                first_loss=losses[warmup].item(), last_loss=losses[-1].item())


def bare_main(args):
    """The bare loop as a job of its own (the gpt part starts it): the GPT of --size on its text, --batch_size
    sequences a step, --precision, compiled with --compile; prints `bare loop: {JSON}`."""
    from utils import make_workload

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    workload = make_workload(f"gpt-{args.size}", text=args.text)
    model = workload.model.to(device)  # the same parameters: the optimizer made for them still holds them
    torch.manual_seed(1)  # dropout's masks, as gpt.py's rank 0 draws them
    sequences = workload.train_set[:args.batch_size * (args.steps + args.warmup)]
    batches = [(source.to(device), targets.to(device)) for source, targets in
               zip(sequences[0].split(args.batch_size), sequences[1].split(args.batch_size))
               if len(source) == args.batch_size]
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    compiled = torch.compile(model) if args.compile else model
    result = bare_loop(compiled, workload.optimizer, workload.loss_fn, batches, args.steps, args.warmup, dtype)
    print("bare loop: " + json.dumps(dict(result, flops_per_token=flops_per_token(model), batches=len(batches))))


def utilisation(flops, tokens_per_s, peak, devices=1):
    """Model-FLOPs utilisation: the FLOP/s that `tokens_per_s` (the whole job's) need at `flops` a token, over the peak
    FLOP/s of the `devices` that trained them; None where the peak or the tokens/s is unknown."""
    return None if peak is None or tokens_per_s is None else flops * tokens_per_s / (peak * devices)


def later_epochs(printed):
    """The median tokens/s of the epochs after the first in a step's output, and every epoch's: (median, {epoch:
    tokens/s}); (None, {...}) with fewer than two epochs."""
    rates = {epoch: rate for epoch, (rate, _, _) in sorted(output.throughputs(printed).items())}
    later = [rate for epoch, rate in rates.items() if epoch > min(rates)] if rates else []
    return (statistics.median(later) if later else None), rates


def flops_figures(config):
    """What a token costs the GPT of `config`, said as the report says it: {flops_per_token, weights (N), attention}."""
    attention = 12 * config.n_layer * config.n_embd * config.context
    flops = flops_per_token(config)
    return dict(flops_per_token=flops, weights=(flops - attention) // 6, attention=attention,
                formula=f"6 N + 12 L C T = 6 x {(flops - attention) // 6:,} + 12 x {config.n_layer} x "
                        f"{config.n_embd} x {config.context} = {flops:,}")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a measuring part runs at: the GPT's size, the sequences a step (a dp rank's), micro-batches, epochs and
    precision."""
    size: str
    batch_size: int
    microbatches: int
    epochs: int
    precision: str


# On CPU processes (the tests): the CPU size, small batches, 2 epochs, fp32 (bf16 is emulated, several times slower,
# on a CPU without AVX-512's bf16; the bare loop's bf16 runs in a test of its own).
def gpt_setting(proof):
    """Step 6 measured: its GPU size on a GPU, batches of 32 (gpt.py's own), GPT_EPOCHS epochs, bf16."""
    return Setting("cpu", 8, 1, 2, "fp32") if proof.device == "cpu" else Setting("gpu", 32, 1, GPT_EPOCHS, "bf16")


def gpt_commands(proof):
    """(gpt.py's command, the bare loop's): one process, bf16, --compile on a GPU (on CPU processes, the tests, not:
    it takes a minute to build there)."""
    setting, cpu = gpt_setting(proof), proof.device == "cpu"
    text = ["--text", proof.text] if cpu else []
    compiled = [] if cpu else ["--compile"]
    steps, warmup = (4, 1) if cpu else (BARE_STEPS, BARE_WARMUP)
    step = torchrun("gpt.py", setting.epochs, setting.epochs, "--workload", f"gpt-{setting.size}", "--precision",
                    setting.precision, "--batch_size", setting.batch_size, *compiled, *text, *proof.peak_option,
                    nproc=1)
    bare = python("benchmarks/gpu_proof.py", "--bare_loop", "--device", proof.device, "--size", setting.size,
                  "--batch_size", setting.batch_size, "--steps", steps, "--warmup", warmup, "--precision",
                  setting.precision, *compiled, *text)
    return step, bare


def part_gpt(proof, deadline):
    setting, step, bare = gpt_setting(proof), *gpt_commands(proof)
    config = memory_plan.config_of(setting.size, proof.text)

    def read_step(job):
        rate, rates = later_epochs(job.output)
        return dict(tokens_per_s=rate, epochs=rates)

    def read_bare(job):
        line = re.search(r"^bare loop: (\{.*\})$", job.output, re.M)
        if line is None:
            return dict(status="failed", why="it printed no figures")
        return dict(tokens_per_s=json.loads(line[1])["tokens_per_s"], bare_loop=json.loads(line[1]))

    options = dict(cwd=proof.work / "gpt", gpu=proof.device == "cuda")
    jobs = run_tasks([Task("gpt.py, its own loop", [step], STEP_CAP, options, read=read_step),
                      Task("the bare loop", [bare], BARE_CAP, options, read=read_bare)], deadline, 1, proof)
    figures = dict(size=setting.size, batch_size=setting.batch_size, context=config.context,
                   precision=setting.precision, compile=proof.device == "cuda", **flops_figures(config))
    for name, job in zip(("step", "bare"), jobs):
        rate = job.get("tokens_per_s")
        figures[name] = dict(tokens_per_s=rate, mfu=utilisation(flops_per_token(config), rate, proof.peak))
    if figures["step"]["tokens_per_s"] and figures["bare"]["tokens_per_s"]:
        figures["ratio"] = figures["step"]["tokens_per_s"] / figures["bare"]["tokens_per_s"]
    return dict(jobs=jobs, figures=figures)


def mesh_layout(gpus):
    """(pp, tp) of step 11 on `gpus` GPUs: the largest of pp 2 x tp 4, 2 x 2, 2 x 1 and 1 x 1 that divides them."""
    return next((pp, tp) for pp, tp in ((2, 4), (2, 2), (2, 1), (1, 1)) if gpus % (pp * tp) == 0)


def mesh_setting(proof):
    """Step 11 measured: one_mesh.py's own batch on a GPU (32 sequences a dp rank in 4 micro-batches), MESH_EPOCHS
    epochs, bf16; on CPU processes (the tests) as gpt_setting says."""
    return Setting("cpu", 4, 2, 2, "fp32") if proof.device == "cpu" else Setting("gpu", 32, 4, MESH_EPOCHS, "bf16")


def mesh_command(proof):
    """(one_mesh.py's command on every GPU, in bf16, its (pp, dp, tp)); on CPU processes, one process."""
    setting, processes = mesh_setting(proof), 1 if proof.device == "cpu" else proof.gpus
    pp, tp = mesh_layout(processes)
    text = ["--workload", f"gpt-{setting.size}", "--text", proof.text] if proof.device == "cpu" else []
    command = torchrun("one_mesh.py", setting.epochs, setting.epochs, "--pp", pp, "--tp", tp, "--precision",
                       setting.precision, "--batch_size", setting.batch_size, "--microbatches", setting.microbatches,
                       *text, *proof.peak_option, nproc=processes)
    return command, (pp, processes // (pp * tp), tp)


def part_mesh(proof, deadline):
    setting, (command, (pp, dp, tp)) = mesh_setting(proof), mesh_command(proof)
    folder = proof.work / "mesh"

    def read(job):
        rate, rates = later_epochs(job.output)
        records = {}
        for path in sorted((folder / "runs").glob("rank*.jsonl")):
            last = json.loads(path.read_text().splitlines()[-1])
            records[last["rank"]] = last
        return dict(tokens_per_s=rate, epochs=rates, records=records)

    options = dict(cwd=folder, gpu=proof.device == "cuda", env={"TUTORIAL_RUN_DIR": "runs"})
    [job] = run_tasks([Task("one_mesh.py", [command], MESH_CAP, options, read=read)], deadline, 1, proof)
    config = memory_plan.config_of(setting.size, proof.text)
    layout = memory_plan.Layout(pp, dp, tp, setting.batch_size, setting.microbatches, setting.precision)
    records = job.pop("records", {})
    memory = []
    for row in memory_plan.plan(config, layout, device=proof.device):
        record = records.get(row["rank"], {})
        memory.append(dict(rank=row["rank"], coordinates=row["coordinates"], measured=record.get("memory_peak"),
                           planned=row["total"], planned_with_temporaries=row["total"] + row["pass_temporaries"],
                           activations_measured=record.get("activation_bytes"), activations_planned=row["act_step"]))
    rate, processes = job.get("tokens_per_s"), pp * dp * tp
    figures = dict(layout=dict(pp=pp, dp=dp, tp=tp), size=setting.size, batch_size=setting.batch_size,
                   microbatches=setting.microbatches, precision=setting.precision, tokens_per_s=rate,
                   tokens_per_s_per_gpu=rate / processes if rate else None,
                   mfu=utilisation(flops_per_token(config), rate, proof.peak, processes), memory=memory,
                   **flops_figures(config))
    return dict(jobs=[job], figures=figures)


# ------------------------------------------------------------------------------------------------ running, bounded

@dataclasses.dataclass
class Task:
    """One job of a part (harness/jobs: a command per node) that may run `cap` seconds at most; `options`: the Job's
    (cwd, gpu, env, node_env, services...); `read(job)`: what the ended job tells, as a dict (a status or why in it
    replaces the exit code's, unless the job was stopped)."""
    name: str
    commands: list
    cap: float
    options: dict
    read: object = None


def run_tasks(tasks, deadline, parallel, proof):
    """Run the tasks `parallel` at a time, in order, each until it ends, its cap (times proof.scale) passes or the
    part's `deadline` (time.monotonic()) comes, when what still runs of it is stopped; a task that would start with
    less than TOO_LATE seconds left is not run. Their results (dicts: name, command, status, seconds...) in the tasks'
    order; the log of a job that failed or was stopped is kept in the report's folder."""
    results, running, waiting = [None] * len(tasks), [], list(enumerate(tasks))
    while waiting or running:
        while waiting and len(running) < parallel:
            index, task = waiting.pop(0)
            left = deadline - time.monotonic()
            if left < TOO_LATE:
                results[index] = dict(name=task.name, status="not run", why=BUDGET_SPENT)
                continue
            options = dict(task.options)
            options.setdefault("logs", proof.work / "logs" / slug(task.name))
            Path(options["cwd"]).mkdir(parents=True, exist_ok=True)
            cap = task.cap * proof.scale
            bound = (cap, "its cap") if cap <= left else (left, "its part's budget")
            running.append((index, task, start(*task.commands, **options), time.monotonic(), bound))
        for entry in list(running):
            index, task, job, began, bound = entry
            if job.running() and time.monotonic() - began < bound[0]:
                continue
            running.remove(entry)
            job.wait(0)  # stops whatever still runs
            results[index] = finished(task, job, time.monotonic() - began, bound, proof)
        time.sleep(0.05)
    return results


def finished(task, job, seconds, bound, proof):
    """The result of a task's ended job (see run_tasks); `bound`: (its seconds, which bound it was)."""
    result = dict(name=task.name, command=shown(job.commands[-1]), seconds=round(seconds, 1))
    if job.timed_out:
        result.update(status="stopped", why=f"still running at {bound[0]:.0f} s, {bound[1]}")
    elif job.ok:
        result["status"] = "passed"
    else:
        errors = output.errors(job.output)
        result.update(status="failed", why=f"exit codes {job.codes}" + (f": {errors[-1]}" if errors else ""))
    # What a stopped job did before its bound is read too (the epochs it measured), but it stays stopped.
    if task.read:
        told = task.read(job)
        if job.timed_out:
            told = {name: value for name, value in told.items() if name not in ("status", "why")}
        result.update(told)
    if result["status"] not in ("passed", "skipped"):
        logs = proof.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{slug(task.name)}.log").write_text(job.output[-30000:])
        result["log"] = f"logs/{slug(task.name)}.log"
    return result


def slug(text):
    """`text` as a file name: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:80]


PART_FUNCTIONS = {"gpt": part_gpt, "mesh": part_mesh, "commands": part_commands, "tests": part_tests}


def run_parts(parts, proof, report, functions=PART_FUNCTIONS):
    """Each part in turn, within its budget (times proof.scale); the report written after each. A part that fails
    (an exception of this script's) is reported as such, and the next runs."""
    for part in parts:
        budget = part.budget * proof.scale
        began = time.monotonic()
        print(f"{part.name}: {part.what} (at most {budget} s)", flush=True)
        try:
            result = functions[part.name](proof, began + budget)
        except Exception as error:  # a defect of this script's: said in the report, the other parts still run
            result = dict(jobs=[], error=f"{type(error).__name__}: {error}")
        seconds = time.monotonic() - began
        jobs = result.get("jobs", [])
        cut = any(job.get("why") == BUDGET_SPENT or (job.get("why") or "").endswith("its part's budget")
                  for job in jobs)
        status = "error" if "error" in result else "over budget" if cut or seconds > budget else "done"
        report["parts"][part.name] = dict(what=part.what, budget_s=budget, seconds=round(seconds, 1), status=status,
                                          **result)
        for job in jobs:
            print(f"  {job['status']:>9}  {job['name']}" + (f"  ({job['why']})" if job.get("why") else ""),
                  flush=True)
        write_report(report, proof.out)
    return report


# ------------------------------------------------------------------------------------------------------- the report

@dataclasses.dataclass
class Proof:
    """What the parts share: this machine's GPUs (device "cuda"), or CPU processes (device "cpu", the tests)."""
    device: str
    gpus: int
    out: Path
    work: Path
    peak: float = None
    peak_option: tuple = ()
    missing: dict = dataclasses.field(default_factory=dict)
    text: str = None
    scale: int = 1

    @property
    def data(self):
        """Step 12's token files of the GPU size, once for the proof's runs."""
        return str(self.work / "data" / "help-gpu")


def missing_modules():
    """{module: what is left out without it} of the OPTIONAL modules this Python lacks."""
    return {module: what for module, what in OPTIONAL.items() if importlib.util.find_spec(module) is None}


def machine(gpus):
    """The device, torch, CUDA, Python and CPU of this machine, and how busy it is."""
    facts = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                 cpu_cores=os.cpu_count(), load_average=list(os.getloadavg()), gpus=gpus, device="cpu")
    if gpus:
        properties = torch.cuda.get_device_properties(0)
        facts.update(device=torch.cuda.get_device_name(0), gpu_memory_gib=round(properties.total_memory / 2**30, 1),
                     capability=f"{properties.major}.{properties.minor}")
    return facts


def peak_of(args, gpus):
    """(the peak FLOP/s of one device, where the figure comes from): --peak_tflops, $TUTORIAL_PEAK_TFLOPS, else the
    datasheets' table by the GPU's name; (None, why) when unknown."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak_tflops"
    if os.environ.get(PEAK_VARIABLE):
        return peak_flops("cpu"), f"${PEAK_VARIABLE}"
    if gpus and peak_flops("cuda:0") is not None:
        return peak_flops("cuda:0"), "NVIDIA's datasheet, dense bf16 (utils/loop.py: PEAK_BF16_FLOPS)"
    return None, "unknown: this device is not in utils/loop.py's table (give --peak_tflops)"


def percent(value):
    return "n/a" if value is None else f"{value:.1%}"


def number(value):
    return "n/a" if value is None else f"{value:,.0f}"


def mib(value):
    return "n/a" if value is None else f"{value / 2**20:,.1f}"


def markdown(report):
    """The report as a page: the machine, then each part: its figures, and every job's result and time."""
    facts = report["machine"]
    lines = [f"# GPU proof: {facts['device']} x {facts['gpus']}, torch {facts['torch']}, CUDA {facts['cuda']}", "",
             f"`benchmarks/gpu_proof.py`, started {report['started']}, {report['seconds']:.0f} s in all; Python "
             f"{facts['python']}, {facts['cpu_cores']} CPU cores, load average {facts['load_average'][0]:.1f} at the "
             f"start. Peak of one device: {number(report['peak_tflops'])} TFLOP/s ({report['peak_source']}).", ""]
    if report["missing"]:
        lines += ["Not installed here: " + "; ".join(f"{module} ({what})" for module, what in
                                                      report["missing"].items()) + ".", ""]
    for name, part in report["parts"].items():
        lines += [f"## {name}: {part['what']}", "",
                  f"{part['status']}, {part['seconds']:.0f} s of its {part['budget_s']} s"
                  + (f": {part['error']}" if part.get("error") else "") + "."]
        if part.get("figures"):
            lines += [""] + FIGURES[name](part["figures"])
        if part.get("jobs"):
            lines += ["", "| job | result | s | why, or what it stands for |", "|---|---|---:|---|"]
            for job in part["jobs"]:
                seconds = f"{job['seconds']:.0f}" if job.get("seconds") is not None else ""
                said = job.get("why") or "; ".join(job.get("stands_for", []))
                said += f" ([log]({job['log']}))" if job.get("log") else ""
                lines.append(f"| {job['name']} | {job['status']} | {seconds} | {said.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def gpt_figures(gpt):
    """The gpt part's figures, as lines of the page."""
    return [f"The {gpt['size']} size, {gpt['batch_size']} sequences of {gpt['context']} tokens a step, "
            f"{gpt['precision']}" + (", compiled" if gpt["compile"] else "") + f", one device. FLOPs a token: "
            f"{gpt['formula']}.", "", "| loop | tokens/s | MFU |", "|---|---:|---:|",
            f"| gpt.py (DDP, data loader, clipping, schedule; its epochs after the first) | "
            f"{number(gpt['step']['tokens_per_s'])} | {percent(gpt['step']['mfu'])} |",
            f"| the bare loop (forward, backward, AdamW) | {number(gpt['bare']['tokens_per_s'])} | "
            f"{percent(gpt['bare']['mfu'])} |", "",
            f"gpt.py reaches {gpt['ratio']:.2f}x the bare loop's tokens/s." if gpt.get("ratio") else
            "No ratio: one of the two loops has no figure."]


def mesh_figures(mesh):
    """The mesh part's figures, as lines of the page."""
    layout = mesh["layout"]
    lines = [f"pp {layout['pp']} x dp {layout['dp']} x tp {layout['tp']}, the {mesh['size']} size, "
             f"{mesh['batch_size']} sequences a dp rank in {mesh['microbatches']} micro-batches, {mesh['precision']}: "
             f"{number(mesh['tokens_per_s'])} tokens/s ({number(mesh['tokens_per_s_per_gpu'])} a device), MFU "
             f"{percent(mesh['mfu'])}. FLOPs a token: {mesh['formula']}.", "",
             "Each rank's peak memory (MiB) against tools/memory_plan.py's plan: its total, and with the temporaries "
             "of a pass that the plan leaves to its margin.", "",
             "| rank | pp, dp, tp | measured | plan | plan + temporaries | measured / plan |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in mesh["memory"]:
        ratio = f"{row['measured'] / row['planned']:.2f}" if row["measured"] else "n/a"
        lines.append(f"| {row['rank']} | {', '.join(map(str, row['coordinates']))} | {mib(row['measured'])} | "
                     f"{mib(row['planned'])} | {mib(row['planned_with_temporaries'])} | {ratio} |")
    if mesh["size"] == "cpu":
        lines += ["", "On CPU processes the measured figure is the process's resident set, torch included: not the "
                      "plan's tensors."]
    return lines


FIGURES = {"gpt": gpt_figures, "mesh": mesh_figures}


def write_report(report, folder):
    """The report in `folder`: README.md, the page (a folder of the repository shows it first), and report.json (its
    entries whose names start with _ left out)."""
    report["seconds"] = round(time.monotonic() - report["_began"], 1)
    saved = {name: value for name, value in report.items() if not name.startswith("_")}
    (folder / "report.json").write_text(json.dumps(saved, indent=1, default=str) + "\n")
    (folder / "README.md").write_text(markdown(saved))


# --------------------------------------------------------------------------------------------------------- the plan

def dry_run(parts, gpus, missing):
    """Print the plan for a machine of `gpus` GPUs: each part, its budget and what it runs; each GPU command the pages
    show and the run that stands for it. Exit 1 if one has none."""
    total = sum(part.budget for part in parts)
    plural = "s" if gpus > 1 else ""
    print(f"The GPU proof on a machine of {gpus} GPU{plural}: {len(parts)} parts, {total} s, and {SETTING_UP} s to set "
          f"up and report, of the {WALL} s it may take.")
    if missing:
        print("Not installed here: " + "; ".join(f"{module} ({what})" for module, what in missing.items()))
    names = {part.name for part in parts}
    plan = Proof("cuda", gpus, Path("REPORT"), Path("WORK"), missing=missing)  # for the commands' sake
    for part in parts:
        print(f"\n{part.name:<9} {part.budget:>4} s  {part.what}")
        if part.name == "gpt":
            step, bare = gpt_commands(plan)
            print(f"  {shown(step)}  (at most {STEP_CAP} s)\n  {shown(bare)}  (at most {BARE_CAP} s)")
        if part.name == "mesh":
            command, (pp, dp, tp) = mesh_command(plan)
            print(f"  {shown(command)}  (at most {MESH_CAP} s), each rank's peak memory against\n"
                  f"  python tools/memory_plan.py --size gpu --pp {pp} --dp {dp} --tp {tp} --batch_size 32 "
                  "--microbatches 4 --precision bf16")
        if part.name == "commands":
            for run in RUNS:
                why = left_out(run, gpus, missing)
                commands = [] if why else run_task(run, plan).commands
                print(f"  {run.name}: " + (f"left out: {why}" if why else f"(at most {run.cap} s) "
                                            + "; ".join(shown(command) for command in commands)))
        if part.name == "tests":
            tests = gpu_tests()
            print(f"  {len(tests)} tests, each at most {TEST_CAP} s:")
            print("\n".join(f"  {name}" for name in tests))
    commands = gpu_commands()
    if "commands" in names:
        print("\nEvery GPU command the pages show, and the run that stands for it:")
        covered = covering()
        for where, command in commands:
            run = covered.get(key(command))
            print(f"  {where}: `{command}`\n      -> {run.name if run else 'NONE: add a run to RUNS'}")
    missed = uncovered(commands)
    if missed:
        sys.exit(f"error: {len(missed)} GPU command(s) the pages show have no run in benchmarks/gpu_proof.py's RUNS, "
                 f"the first: {missed[0][0]}: `{missed[0][1]}`")


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="The report's folder (default benchmarks/results/gpu-proof-DEVICE-DATE-TIME)")
    parser.add_argument("--dry_run", action="store_true", help="Print the plan and its budgets; run nothing")
    parser.add_argument("--gpus", type=int, help="With --dry_run: plan for this many GPUs (default: this machine's)")
    parser.add_argument("--only", help="Some of the parts, comma-separated: " + ", ".join(p.name for p in PARTS))
    parser.add_argument("--peak_tflops", type=float, help="One GPU's dense bf16 peak, TFLOP/s (default: by its name)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the measuring parts on CPU processes at the CPU size (for the tests)")
    parser.add_argument("--text", help="With --device cpu: the text the GPT learns")
    bare = parser.add_argument_group("the bare loop, as the gpt part runs it")
    bare.add_argument("--bare_loop", action="store_true", help=argparse.SUPPRESS)
    bare.add_argument("--size", default="gpu", choices=["cpu", "gpu"], help=argparse.SUPPRESS)
    bare.add_argument("--batch_size", type=int, default=32, help=argparse.SUPPRESS)
    bare.add_argument("--steps", type=int, default=BARE_STEPS, help=argparse.SUPPRESS)
    bare.add_argument("--warmup", type=int, default=BARE_WARMUP, help=argparse.SUPPRESS)
    bare.add_argument("--precision", default="bf16", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    bare.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set((args.only or "").split(",")) - {part.name for part in PARTS} - {""}
    if unknown:
        parser.error(f"--only: no part named {sorted(unknown)[0]}; the parts are "
                     + ", ".join(part.name for part in PARTS))
    return args


def main(argv=None):
    args = arguments(argv)
    if args.bare_loop:
        return bare_main(args)
    parts = [part for part in PARTS if not args.only or part.name in args.only.split(",")]
    gpus = torch.cuda.device_count()
    if args.dry_run:
        return dry_run(parts, args.gpus or gpus or 1, missing_modules())
    if args.device == "cpu":
        parts = [part for part in parts if part.name in ("gpt", "mesh")]
        if not args.text:
            sys.exit("error: --device cpu trains on a short text: give it with --text")
    elif gpus == 0:
        sys.exit(f"error: no CUDA GPU here (torch {torch.__version__} sees none): the GPU proof runs on a machine "
                 "with one; --dry_run prints what it would run")
    if tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
        sys.exit(f"error: torch {torch.__version__} is older than the 2.6 the steps need on GPUs")
    facts = machine(gpus if args.device == "cuda" else 0)
    day = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    out = Path(args.out or REPO / "benchmarks" / "results" / f"gpu-proof-{slug(facts['device'])}-{day}")
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} holds files already: give the report another folder (--out; nothing was changed)")
    out.mkdir(parents=True, exist_ok=True)
    peak, source = peak_of(args, gpus if args.device == "cuda" else 0)
    missing = missing_modules()
    report = dict(_began=time.monotonic(), started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seconds=0,
                  machine=facts, missing=missing, peak_tflops=peak / 1e12 if peak else None, peak_source=source,
                  parts={})
    print(f"GPU proof: {facts['device']} x {facts['gpus']}, torch {facts['torch']}, CUDA {facts['cuda']}; the report "
          f"goes to {out}")
    for module, what in missing.items():
        print(f"  not installed: {module} (left out: {what})")
    with tempfile.TemporaryDirectory(prefix="gpu-proof-") as work:
        proof = Proof(args.device, gpus, out, Path(work), peak,
                      ("--peak_tflops", args.peak_tflops) if args.peak_tflops else (), missing,
                      str(Path(args.text).resolve()) if args.text else None, CPU_SCALE if args.device == "cpu" else 1)
        run_parts(parts, proof, report)
    write_report(report, out)
    print(f"report: {out / 'README.md'} and {out / 'report.json'} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
