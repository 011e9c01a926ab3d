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
import ast
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch

import utils
import utils.loop
from tools import stepdiff
from tools.jobs import REPO, script

GPUS_PER_NODE = 8
LAUNCHERS = {"torchrun": "torchrun", "...": "torchrun", "python": "python", "python3": "python"}


def pages():
    """{where: text} of the README, the docs (less their generated diff blocks) and each step's docstring."""
    texts = {str(page.relative_to(REPO)): stepdiff.BLOCK.sub("", page.read_text()) for page in stepdiff.pages()}
    for name in stepdiff.steps():
        texts[name] = ast.get_docstring(ast.parse((REPO / name).read_text()))
    return texts


def shown_commands():
    """[(where, command)]: every command that runs a step with its epochs (a launcher, torchrun, python or `...`, the
    README's short form of `torchrun --standalone`, then a step script and its TOTAL_EPOCHS and SAVE_EVERY), from the
    lines of code blocks and docstrings (continuation lines joined) and from inline code spans (which may wrap). The
    `python tools/prepare_data.py` commands a block shows before a step's are joined to it with `&&`, as a span
    shows them."""
    steps = "|".join(map(re.escape, stepdiff.steps()))
    runs_a_step = re.compile(rf"(?:^|[\s$])(?:torchrun|python3?|\.\.\.)(?=\s).*?[\s/\"](?:{steps})\"?"
                             r"\s+[^-\s]+\s+[^-\s]")
    found = []
    for where, text in pages().items():
        blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S) if where.endswith(".md") else [text]
        prose = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.M | re.S) if where.endswith(".md") else ""
        for block in blocks:
            prepared = []
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                command = re.sub(r"\s#\s.*", "", line).strip()  # less a shell comment
                if PREPARES.match(command):
                    prepared.append(command)
                elif runs_a_step.search(command):
                    found.append((where, " && ".join([*prepared, command])))
        spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
        found += [(where, span) for span in spans if runs_a_step.search(span)]
    return found


PREPARES = re.compile(r"python3? tools/prepare_data\.py\s")


def prepare_as_shown(command):
    """Run, in this process and folder, the `python tools/prepare_data.py ...` parts of a shown command (`A && B`)."""
    for part in command.split("&&")[:-1]:
        part = part.strip().lstrip("$ ")
        if PREPARES.match(part):
            arguments = shlex.split(part)[2:]
            sys.argv = ["prepare_data.py", *arguments]
            runpy.run_path(str(REPO / "tools" / "prepare_data.py"), run_name="__main__")


def parsed(command):
    """(script, its arguments, launcher, processes per node, nodes, GPUs) of a shown command."""
    tokens = shlex.split(command.split("&&")[-1].lstrip("$ "), comments=True)
    start = next(i for i, token in enumerate(tokens) if token in LAUNCHERS)
    launcher, tokens = LAUNCHERS[tokens[start]], tokens[start:]
    at = next(i for i, token in enumerate(tokens) if Path(token).name in stepdiff.steps())
    options = " ".join(tokens[1:at])
    if launcher == "python" and options.startswith("-m torch.distributed.run"):
        launcher = "torchrun"
    per_node = re.search(r"--nproc[_-]per[_-]node[= ](\S+)", options)
    # `torchrun ...` elides the launcher's options: the README's `--standalone --nproc_per_node=2`
    per_node = per_node[1] if per_node else "2" if "..." in tokens[:at + 1] else "1"
    nodes = re.search(r"--nnodes[= ](?:\d+:)?(\d+)", options)
    gpus = per_node == "gpu"
    # Placeholders for the epochs (TOTAL_EPOCHS, N): any number does.
    arguments = ["2" if index < 2 and re.fullmatch(r"[A-Z][A-Z_]*", value) else value
                 for index, value in enumerate(tokens[at + 1:])]
    return (Path(tokens[at]).name, arguments, launcher, GPUS_PER_NODE if gpus else int(per_node),
            int(nodes[1]) if nodes else 1, gpus)


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
    # Where the steps start their work: torchrun's steps at attempt_store (the store of their process group, which
    # would also start a watch that ends the process), step 2 at mp.spawn, step 1 at its workload.
    monkeypatch.setattr(utils, "attempt_store", accept)
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


COMMANDS = shown_commands()


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
