"""The programs the workshop's checker tests run: seeded mistakes (a copy of a correct script with a learner's mistake
put in) and independent programs (a starting file finished by a learner: tests/independent/)."""
import ast
import re
from pathlib import Path

import pytest

from exercises.judging import JOB_LIMIT_S
from harness.jobs import REPO

INDEPENDENT = Path(__file__).resolve().parent / "independent"
# A test that runs a check waits longer than the check itself may take: its jobs (JOB_LIMIT_S) and the references it
# computes in this process, which on a busy machine take as long again. Exercise 12's check of its solution took 642 s
# at a load average of 37 to 39, past the suite's backstop of 600 s.
CHECKING = pytest.mark.timeout(3 * JOB_LIMIT_S)


def exercise_problems(number, script, tmp_path):
    """What `python exercises/check.py NUMBER SCRIPT` finds wrong (its list of problems), checked in a folder of
    tmp_path's own."""
    from exercises.check import check

    workdir = tmp_path / "work"
    workdir.mkdir()
    return check(number, script, workdir)


def seeded(tmp_path, source, *edits):
    """A copy of `source` (a path in the repository: a step, an exercise's solution) with mistakes put in: each edit is
    (pattern, replacement), and each pattern must occur, so a seeded mistake cannot silently stop applying."""
    text = (REPO / source).read_text()
    for old, new in edits:
        assert re.search(old, text), f"{source} no longer contains {old!r}: update this seeded mistake"
        text = re.sub(old, new, text)
    path = tmp_path / f"mistaken_{source.replace('/', '_')}"
    path.write_text(text)
    return path


def _definitions(text):
    """{name: (first line, last line)} of the top-level functions, classes and single-name assignments of `text`
    (lines from 1; a definition's decorators and the comment lines right above it included), and the imports as
    [(first line, last line)]."""
    lines, named, imports = text.splitlines(), {}, []
    for node in ast.parse(text).body:
        first = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", ()))])
        while first > 1 and lines[first - 2].startswith("#"):
            first -= 1
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append((first, node.end_lineno))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            named[node.name] = (first, node.end_lineno)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            named[node.targets[0].id] = (first, node.end_lineno)
    return named, imports


def written(tmp_path, start, part):
    """A learner's script: the starting file `start` (a path in the repository) with what the learner wrote in it, the
    file tests/independent/`part`: each of its top-level definitions replaces the starting file's of that name (the
    class or function with the TODOs), its other definitions go in before the first one replaced, its imports after
    the starting file's. What the learner wrote is theirs alone; the rest of the script is the starting file's."""
    text, mine = (REPO / start).read_text(), (INDEPENDENT / part).read_text()
    lines, own = text.splitlines(), mine.splitlines()
    named, imports = _definitions(text)
    my_named, my_imports = _definitions(mine)
    segment = {name: own[first - 1:last] for name, (first, last) in my_named.items()}
    replaced = [name for name in my_named if name in named]
    assert replaced, f"{part} defines nothing of {start}'s"
    added = [line for name in my_named if name not in named for line in [*segment[name], "", ""]]
    new_imports = [line for first, last in my_imports for line in own[first - 1:last] if line not in lines]
    edits = [(named[name], segment[name]) for name in replaced]
    first_replaced = min(named[name][0] for name in replaced)
    edits.append(((first_replaced, first_replaced - 1), added))
    edits.append(((imports[-1][1] + 1, imports[-1][1]), new_imports))
    for (first, last), new in sorted(edits, key=lambda edit: (edit[0][0], edit[0][1]), reverse=True):
        lines[first - 1:last] = new
    path = tmp_path / f"learners_{Path(part).stem}.py"
    path.write_text("\n".join(lines) + "\n")
    return path
