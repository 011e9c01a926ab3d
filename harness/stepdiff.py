"""The diffs between consecutive step scripts, generated from the files, and the doc blocks that show them.

    python harness/stepdiff.py            # check: exit 1 if a diff in README.md or docs/ is stale
    python harness/stepdiff.py --write    # regenerate every diff block of README.md and docs/ from the scripts

The full diffs live on the steps' reference pages (docs/reference/*.md). A page marks each generated block with
`<!-- diff OLD NEW -->` ... `<!-- end diff -->`; everything between the two markers is replaced by a ```diff fence
holding `diff -u`-style output of OLD -> NEW. Any page may hold any pair's block; the tests want every step shown
against the one it builds on (`pairs()`).
"""
import argparse
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every step: (script, the step it is a diff of, most lines, most changed lines against that step, why the changed
# lines are over the goal of its part of the tutorial, in one line). A script reads in one sitting (150 lines unless
# its row says more); changed lines are removed + added, as `diff OLD NEW | grep -c '^[<>]'` counts them. The parent is
# the earlier step a script differs least from (tests/test_readme.py checks it): gpt.py trains with DDP, so it builds
# on multinode.py; tensor_parallel.py adds TP to FSDP; steps 8 to 10 are gpt.py's loop in stages, on parts of each
# sequence, with experts; fault_tolerant.py is fsdp.py as a replica group.
STEPS = [
    ("single_gpu.py", None, 150, 0, ""),
    ("multigpu.py", "single_gpu.py", 150, 65,
     "mp.spawn, the process group, the sampler and DDP, each with the sentence above it that says why"),
    ("multigpu_torchrun.py", "multigpu.py", 155, 85,
     "teaches torchrun and snapshots at once; a snapshot names its step; a mistake every rank meets is said once"),
    ("multinode.py", "multigpu_torchrun.py", 163, 60, ""),
    ("fsdp.py", "multinode.py", 202, 91,
     "sharding with its sharded snapshot, the full export, the memory tables and FSDP's precision policies"),
    ("gpt.py", "multinode.py", 219, 100,
     "the loop a real model needs: accumulation, mixed precision, clipping, a schedule that resumes, compile, a sample"),
    ("tensor_parallel.py", "fsdp.py", 234, 108, ""),
    ("pipeline_parallel.py", "gpt.py", 270, 195,
     "gpt.py's loop becomes a schedule and its one file a sharded snapshot that resumes on any cut; removals count"),
    ("context_parallel.py", "gpt.py", 244, 77, ""),
    ("expert_parallel.py", "gpt.py", 266, 157,
     "two gradient averages (experts over dp, the rest over all ranks) and a sharded snapshot in place of one file"),
    ("one_mesh.py", "pipeline_parallel.py", 357, 277,
     "every dimension on one mesh: the TP plan, FSDP per stage, the meta device, checkpointing, async snapshots"),
    ("long_run.py", "one_mesh.py", 442, 277,
     "epochs become steps read from token files: a cursor, a folder of snapshots, held-out losses; the loop counts twice"),
    ("fault_tolerant.py", "fsdp.py", 329, 279,
     "fsdp.py as a torchft replica group: the Manager, a quorum, a loop of steps, not fsdp.py's said-once blocks"),
]
# The goal for the changed lines of each part of the tutorial (steps 2-6, 7-11, 12-13): a row above it says why.
GOALS = {range(2, 7): 60, range(7, 12): 120, range(12, 14): 160}
CHAIN = [script for script, *_ in STEPS]
PARENT = {script: parent for script, parent, *_ in STEPS}
BLOCK = re.compile(r"(<!-- diff (\S+) (\S+) -->\n)(.*?)(<!-- end diff -->)", re.S)


def steps():
    """The step scripts that exist, in teaching order."""
    return [name for name in CHAIN if (REPO / name).exists()]


def pairs():
    """(the step a script builds on, the script) for every step script but the first."""
    return [(PARENT[new], new) for new in steps()[1:]]


def budget(name):
    """(most lines, most changed lines against the step it builds on) for a step script."""
    row = next(row for row in STEPS if row[0] == name)
    return row[2], row[3]


def goal(name):
    """The goal for a step's changed lines, by its part of the tutorial (GOALS), and the row's reason if over it."""
    number = CHAIN.index(name) + 1
    row = next(row for row in STEPS if row[0] == name)
    return next(limit for numbers, limit in GOALS.items() if number in numbers), row[4]


def lines_of(name):
    return (REPO / name).read_text().splitlines()


def step_diff(old, new, context=2):
    """Unified diff of two step scripts, as text."""
    return "\n".join(difflib.unified_diff(lines_of(old), lines_of(new), old, new, n=context, lineterm=""))


def changed_lines(old, new):
    """Removed plus added lines between two scripts (a modified line counts twice)."""
    ops = difflib.SequenceMatcher(None, lines_of(old), lines_of(new), autojunk=False).get_opcodes()
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def render(text):
    """A page's text with every diff block regenerated from the files."""
    return BLOCK.sub(lambda m: f"{m[1]}```diff\n{step_diff(m[2], m[3])}\n```\n{m[5]}", text)


def pages():
    """The pages that may hold diff blocks: README.md, docs/*.md, then the steps' reference pages (docs/reference/)."""
    docs = REPO / "docs"
    return [REPO / "README.md", *sorted(docs.glob("*.md")), *sorted((docs / "reference").glob("*.md"))]


def shown_pairs():
    """{(OLD, NEW): [page, ...]}: the diff blocks of every page, by the pair of scripts they show."""
    pairs = {}
    for page in pages():
        for match in BLOCK.finditer(page.read_text()):
            pairs.setdefault((match[2], match[3]), []).append(page)
    return pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the pages instead of checking them")
    args = parser.parse_args()
    stale = []
    for page in pages():
        current = page.read_text()
        fresh = render(current)
        if current != fresh:
            stale.append(str(page.relative_to(REPO)))
            if args.write:
                page.write_text(fresh)
    if stale and not args.write:
        sys.exit(f"stale step diffs in {', '.join(stale)}: run `python harness/stepdiff.py --write`")
    shown = shown_pairs()
    for old, new in pairs():
        where = ", ".join(str(page.relative_to(REPO)) for page in shown.get((old, new), [])) or "no page"
        print(f"{old} -> {new}: {changed_lines(old, new)} changed lines, shown in {where}")
    if args.write and stale:
        print(f"rewrote {', '.join(stale)}")


if __name__ == "__main__":
    main()
