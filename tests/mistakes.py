"""Seeded mistakes for the workshop's checker tests: a copy of a correct script with a learner's mistake put in."""
import re

from tools.jobs import REPO


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
