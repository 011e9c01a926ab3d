"""Every command of a step that the README, the docs and the steps' docstrings show is one the step accepts, on the
machine it is shown for: its options parse, and the checks the step makes before it starts (the tp group and the GPT's
heads, the pipeline's stages and the GPT's blocks, a GPU per process...) pass with the GPT size it will train there.

A command with `--nproc_per_node=gpu` runs on nodes of 8 GPUs, the usual server (the GPU size of the GPT: 8 heads,
6 blocks); any other runs on CPU processes (the CPU size: 4 heads, 2 blocks). Each is run in this process, as rank 0
of its job, up to the moment it would start working (its process group's store, mp.spawn, or the workload): nothing
is trained, no process is started. The generated diff blocks are left out (their commands are the scripts' docstrings,
checked as such). What a step reads must be there first, as on a fresh clone: the token files step 12 reads are written
by the `python tools/prepare_data.py` commands the page shows before it (in the same block, or joined by `&&`), run
here as shown; a command shown without them stops, as it would for a learner."""
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch

import utils
import utils.loop
import utils.replicas
from harness import stepdiff
from harness.jobs import REPO, script
from harness.shown_commands import PREPARES, parsed, readme_gpu_column, shown_commands


def prepare_as_shown(command):
    """Run, in this process and folder, the `python tools/prepare_data.py ...` parts of a shown command (`A && B`)."""
    for part in command.split("&&")[:-1]:
        part = part.strip().lstrip("$ ")
        if PREPARES.match(part):
            sys.argv = ["prepare_data.py", *shlex.split(part)[2:]]
            runpy.run_path(str(REPO / "tools" / "prepare_data.py"), run_name="__main__")


class Accepted(BaseException):
    """Raised where a step would start its work: every check before it passed."""


def run_until_it_starts(monkeypatch, tmp_path, command):
    """Run the shown command's step in this process (see the module's docstring); the SystemExit it stopped with,
    or None when it got to its work."""
    name, arguments, launcher, per_node, nodes, gpus = parsed(command)

    def accept(*_, **__):
        raise Accepted

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [name, *arguments])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus)
    prepare_as_shown(command)  # the token files, where the page shows how to write them first
    monkeypatch.setattr(sys, "argv", [name, *arguments])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: per_node if gpus else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    # Where the steps start their work: torchrun's steps at watch_this_worker (its watch would end this process), just
    # before the store of their process group (attempt_store), step 2 at mp.spawn, step 1 at its workload.
    monkeypatch.setattr(utils, "watch_this_worker", accept)
    monkeypatch.setattr(utils, "attempt_store", accept)
    # Step 13 reaches its lighthouse first, before its process group (nothing answers here: it would wait --timeout,
    # then end this process with one line).
    monkeypatch.setattr(utils.replicas, "reach_the_lighthouse", accept)
    monkeypatch.setattr(torch.multiprocessing, "spawn", accept)
    monkeypatch.setattr(utils, "make_workload", accept)
    monkeypatch.setattr(utils, "stop_on_signals", lambda: None)  # its handlers would stay in this process
    monkeypatch.setattr(utils, "writable_path", str)  # a shown folder (runs/, /shared) need not exist here
    monkeypatch.setattr(utils.loop, "compiler_missing", lambda: None)  # --compile: a compiler is the machine's
    for variable in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(variable, "")  # noted, so that what step 2 sets is undone after the test
        monkeypatch.delenv(variable)
    if launcher == "torchrun":
        for variable, value in dict(LOCAL_RANK=0, RANK=0, WORLD_SIZE=per_node * nodes,
                                    LOCAL_WORLD_SIZE=per_node).items():
            monkeypatch.setenv(variable, str(value))
    try:
        runpy.run_path(script(name), run_name="__main__")
    except Accepted:
        return None
    except SystemExit as stop:
        return stop
    raise AssertionError(f"{command}: ran to its end without starting its work")


# With the README's GPU column, whose short forms (`... --nproc_per_node=gpu ... --bf16`) complete to commands too.
COMMANDS = list(dict.fromkeys(shown_commands() + readme_gpu_column()))


def test_the_commands_are_found_in_every_page_that_shows_them():
    """What the parametrized test below runs: the steps' table of the README, steps 7 and 8's GPU commands, every
    step's docstring."""
    found = {where for where, _ in COMMANDS}
    assert {"README.md", "docs/tensor-parallel.md", "docs/pipeline-parallel.md", *stepdiff.steps()} <= found, found
    assert sum(where == "README.md" for where, _ in COMMANDS) >= 10
    gpu_commands = {parsed(command)[0] for _, command in COMMANDS if parsed(command)[5]}
    assert {"tensor_parallel.py", "pipeline_parallel.py", "gpt.py", "fsdp.py"} <= gpu_commands, gpu_commands


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{where}: {command[:60]}" for where, command in COMMANDS])
def test_every_shown_command_is_accepted_on_the_machine_it_is_shown_for(monkeypatch, tmp_path, capsys, where,
                                                                        command):
    stop = run_until_it_starts(monkeypatch, tmp_path, command)
    assert stop is None, f"{where}: `{command}` stops: {stop} {capsys.readouterr().err.strip()[-300:]}"
    parts = [part.strip() for part in command.split("&&")[:-1]]
    prepared = {Path(shlex.split(part)[2]).parts[0] for part in parts if PREPARES.match(part)}
    assert {path.name for path in tmp_path.iterdir()} == prepared, "nothing but the token files shown first is written"


def test_the_readmes_gpu_column_completes_its_short_forms_from_the_cpu_column():
    column = [command for _, command in readme_gpu_column()]
    assert column[:4] == ["python single_gpu.py 50 10", "python multigpu.py 50 10",  # "same", and step 2's own
                          "torchrun --standalone --nproc_per_node=gpu multigpu_torchrun.py 50 10",
                          "torchrun --standalone --nproc_per_node=gpu fsdp.py 50 10 --bf16"]
    assert column[-1] == ("torchrun --standalone --nproc_per_node=gpu fault_tolerant.py 50 10 --group 0 --groups 2 "
                          "--lighthouse http://127.0.0.1:29510")
    # every step of the table but step 4, whose CPU column shows no command (one torchrun per node, on its page)
    assert sorted(parsed(command)[0] for command in column) == sorted(set(stepdiff.steps()) - {"multinode.py"})


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_gpu_size_splits_its_heads_over_the_tp_groups_of_an_8_gpu_node(monkeypatch, tmp_path, tp):
    """--tp 1, 2, 4 or 8 on two nodes of 8 GPUs: tensor parallelism inside each node, FSDP across them."""
    command = f"torchrun --nnodes=2 --nproc_per_node=gpu tensor_parallel.py 10 2 --tp {tp} --precision bf16"
    assert run_until_it_starts(monkeypatch, tmp_path, command) is None


def test_a_layout_the_gpt_cannot_take_is_still_refused(monkeypatch, tmp_path):
    """The check is real: the CPU size's 4 heads do not split over 8, and its 2 blocks make no 4 stages."""
    stop = run_until_it_starts(monkeypatch, tmp_path, "torchrun --nproc_per_node=8 tensor_parallel.py 2 1 --tp 8")
    assert str(stop).startswith("error: --tp 8 must divide the number of processes (8) and of attention heads (4)")
    stop = run_until_it_starts(monkeypatch, tmp_path, "torchrun --nproc_per_node=4 pipeline_parallel.py 2 1 --pp 4")
    assert str(stop).startswith("error: --pp 4 stages but the GPT has 2 blocks")
