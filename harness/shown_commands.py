"""The commands of the steps that the pages show, found and read in one place: the test that runs each one up to its
work (tests/test_shown_commands.py) and the GPU proof that runs those shown for GPUs (benchmarks/gpu_proof.py).

    shown_commands()    [(where, command)]: every command that runs a step with its epochs, on every page (with the
                        `python tools/prepare_data.py` commands shown before it, joined by `&&`)
    parsed(command)     (script, arguments, launcher, processes per node, nodes, whether it is for GPUs)
    gpu_commands()      [(where, command)]: those shown for GPUs, the README's GPU column with its short forms
    key(command)        (script, options, nodes): what a command runs, less its length (TOTAL_EPOCHS SAVE_EVERY)

The pages are README.md, docs/*.md (less their generated diff blocks, whose commands are the scripts' docstrings) and
each step's docstring. A command with `--nproc_per_node=gpu` runs on nodes of GPUS_PER_NODE GPUs, the usual server.
"""
import ast
import re
import shlex
from pathlib import Path

from harness import stepdiff
from harness.jobs import REPO

GPUS_PER_NODE = 8
LAUNCHERS = {"torchrun": "torchrun", "...": "torchrun", "python": "python", "python3": "python"}


def pages():
    """{where: text} of the README, the docs (less their generated diff blocks) and each step's docstring."""
    texts = {str(page.relative_to(REPO)): stepdiff.BLOCK.sub("", page.read_text()) for page in stepdiff.pages()}
    for name in stepdiff.steps():
        texts[name] = ast.get_docstring(ast.parse((REPO / name).read_text()))
    return texts


def runs_a_step():
    """The pattern of a command that runs a step with its epochs: a launcher (torchrun, python or `...`, the README's
    short form of `torchrun --standalone`), then a step script and its TOTAL_EPOCHS and SAVE_EVERY."""
    steps = "|".join(map(re.escape, stepdiff.steps()))
    return re.compile(rf"(?:^|[\s$])(?:torchrun|python3?|\.\.\.)(?=\s).*?[\s/\"](?:{steps})\"?\s+[^-\s]+\s+[^-\s]")


# A command that writes the token files a step reads (step 12's), which a page shows before the step's.
PREPARES = re.compile(r"python3? tools/prepare_data\.py\s")


def shown_commands():
    """[(where, command)]: every command that runs a step with its epochs (see runs_a_step), from the lines of code
    blocks and docstrings (continuation lines joined) and from inline code spans (which may wrap). The
    `python tools/prepare_data.py` commands a block shows before a step's are joined to it with `&&`, as a span
    shows them."""
    pattern = runs_a_step()
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
                elif pattern.search(command):
                    found.append((where, " && ".join([*prepared, command])))
        spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
        found += [(where, span) for span in spans if pattern.search(span)]
    return found


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


def key(command):
    """(script, its options after TOTAL_EPOCHS SAVE_EVERY as one string, nodes): what a shown command runs, whatever
    its length."""
    name, arguments, _, _, nodes, _ = parsed(command)
    return name, " ".join(arguments[2:]), nodes


def readme_gpu_column():
    """[("README.md", command)]: the command of each row of the README's table of steps, column "on GPUs". "same" is the
    CPU column's command; a short form that names no script (`... --nproc_per_node=gpu ... --bf16`) is the CPU
    column's command with that number of processes, and what follows its last `...` added. A row whose CPU column
    shows no command (step 4: one per node, on its page) gives none."""
    pattern = runs_a_step()
    table = (REPO / "README.md").read_text().split("\n## The steps", 1)[1].split("\n## ", 1)[0]
    found = []
    for row in re.findall(r"^\| \d+ \|.*$", table, re.M):
        cpu, gpu = row.split("|")[4:6]
        on_cpu = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", cpu)]
        on_cpu = [command for command in on_cpu if pattern.search(command)]
        if gpu.strip().startswith("same"):
            found += [("README.md", command) for command in on_cpu]
            continue
        for span in re.findall(r"`([^`]+)`", gpu):
            if pattern.search(span):
                found.append(("README.md", span))
            elif span.startswith("...") and "--nproc_per_node" in span:
                processes = re.search(r"--nproc_per_node=\S+", span)[0]
                added = span.rsplit("...", 1)[1].strip()
                for command in on_cpu:
                    command = re.sub(r"--nproc_per_node=\S+", processes, command)
                    found.append(("README.md", f"{command} {added}".strip()))
    return found


def gpu_commands():
    """[(where, command)]: every command the pages show for GPUs, once per page that shows it: the README's GPU column
    (readme_gpu_column), then every shown command with `--nproc_per_node=gpu`."""
    found = readme_gpu_column() + [(where, command) for where, command in shown_commands() if parsed(command)[5]]
    return list(dict.fromkeys(found))
