"""The README is the tutorial's front page and docs/ its depth: the diffs they show are the scripts' real diffs,
every step is shown against the one it builds on, and the steps stay small."""
import re
import shutil
import subprocess

import pytest

from tools import stepdiff
from tools.jobs import REPO

README = (REPO / "README.md").read_text()
PAIRS = stepdiff.pairs()


@pytest.mark.parametrize("page", stepdiff.pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_the_diffs_of_every_page_are_generated_from_the_scripts(page):
    text = page.read_text()
    assert stepdiff.render(text) == text, f"{page.name} is stale: run `python tools/stepdiff.py --write`"


def test_a_stale_diff_is_noticed():
    page = next(page for page in stepdiff.pages() if "<!-- diff single_gpu.py multigpu.py -->" in page.read_text())
    text = page.read_text()
    stale = text.replace("+from torch.utils.data.distributed import DistributedSampler\n", "", 1)
    assert stale != text and stepdiff.render(stale) != stale


def test_the_diff_blocks_name_steps_in_order():
    """A block shows a step against the one it builds on, never two steps apart or a file that is not a step."""
    assert set(stepdiff.shown_pairs()) <= set(PAIRS), set(stepdiff.shown_pairs()) - set(PAIRS)


@pytest.mark.parametrize("old, new", PAIRS)
def test_every_step_shows_its_diff_against_the_one_it_builds_on(old, new):
    assert (old, new) in stepdiff.shown_pairs(), f"no page has a <!-- diff {old} {new} --> block"


@pytest.mark.parametrize("old, new", PAIRS)
def test_each_step_builds_on_the_earlier_step_it_differs_least_from(old, new):
    """The chain (tools/stepdiff.py) says which step each script is a diff of; the files must bear it out. gpt.py
    trains with DDP, so it is a smaller diff of multinode.py than of fsdp.py, the step just before it. Where two
    earlier steps are as close (pipeline_parallel.py: gpt.py's loop, with a sharded snapshot that is neither gpt.py's
    nor multinode.py's), the chain names one of them: the one whose lesson it goes on from."""
    earlier = stepdiff.steps()[:stepdiff.steps().index(new)]
    distances = {step: stepdiff.changed_lines(step, new) for step in earlier}
    assert distances[old] == min(distances.values()), distances


@pytest.mark.parametrize("name", stepdiff.steps())
def test_each_script_reads_in_one_sitting(name):
    assert len(stepdiff.lines_of(name)) <= stepdiff.budget(name)[0]


@pytest.mark.parametrize("old, new", PAIRS)
def test_each_step_is_a_small_diff_of_the_previous_one(old, new):
    assert stepdiff.changed_lines(old, new) <= stepdiff.budget(new)[1]


@pytest.mark.parametrize("name", stepdiff.steps()[1:])
def test_a_step_over_the_goal_of_its_part_says_why_in_its_row_and_no_other_does(name):
    """tools/stepdiff.STEPS is the one table of parents and budgets: a budget above its part's goal (60 changed lines
    for steps 2-6, 120 for 7-11, 160 for 12-13) carries its one-line reason, and a reason never stands beside a budget
    that needs none (it would outlive the lines it excused)."""
    limit, why = stepdiff.goal(name)
    over = stepdiff.budget(name)[1] > limit
    assert bool(why) == over, (name, stepdiff.budget(name), limit, why)
    assert "\n" not in why and len(why) <= 120, why


def test_the_first_commands_are_make_demo_and_make_test():
    before_first_section = README.split("\n## ", 1)[0]
    assert "make demo" in before_first_section and "make test" in before_first_section


@pytest.mark.parametrize("name", stepdiff.steps())
def test_the_front_page_lists_every_step(name):
    steps_table = README.split("\n## The steps", 1)[1].split("\n## ", 1)[0]
    assert re.search(rf"^\| \d+ \| `{re.escape(name)}` \|", steps_table, re.M), f"{name} is not in the table"


def test_the_front_page_stays_short():
    assert len(README.splitlines()) <= 120, "the depth belongs in docs/"


def test_ci_runs_the_readme_test_command():
    assert re.search(r"^make test\b", (REPO / ".ci" / "run").read_text(), re.M)


def make_dry_run(target):
    """The commands `make TARGET` would run, without running them."""
    return subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_lab_adds_its_own_requirements_which_make_test_never_installs():
    lab, test = make_dry_run("lab"), make_dry_run("test")
    assert "pip install --quiet -r requirements-lab.txt" in lab and re.search(r"jupyter lab notebooks/?$", lab, re.M)
    assert "requirements-lab.txt" not in test and "jupyter" not in test
    assert "jupyterlab" not in (REPO / "requirements.txt").read_text().lower()


@pytest.mark.parametrize("name", stepdiff.steps())
def test_the_steps_page_has_a_section_for_every_step(name):
    headings = re.findall(r"^## Step \d+ .*$", (REPO / "docs" / "steps.md").read_text(), re.M)
    assert any(f"`{name}`" in heading for heading in headings), f"docs/steps.md has no section for {name}"


@pytest.mark.parametrize("name", stepdiff.steps())
def test_the_reference_says_where_every_step_is(name):
    where = (REPO / "docs" / "reference.md").read_text().split("## What is where", 1)[1]
    assert re.search(rf"^{re.escape(name)} ", where, re.M), f"docs/reference.md's \"what is where\" lacks {name}"


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_stops_with_one_line_on_a_python_older_than_the_pins_need(tmp_path):
    """A Python that says it is 3.9 (the pins need 3.11): `make demo` stops before building .venv, with one line."""
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\necho False\n")  # what `import sys; print(sys.version_info >= (3, 11))` prints there
    old.chmod(0o755)
    made = subprocess.run(["make", "-n", "-B", "demo", f"PYTHON={old}"], cwd=REPO, capture_output=True, text=True)
    assert made.returncode != 0 and "venv" not in made.stdout, made
    assert re.fullmatch(rf"Makefile:\d+: \*\*\* {re.escape(str(old))} is not Python 3\.11 or newer, which "
                        r"requirements\.txt needs: run make with PYTHON=python3\.11 \(or newer\)\.  Stop\.\n",
                        made.stderr), made.stderr


@pytest.mark.parametrize("test_file", sorted(path.name for path in (REPO / "tests").glob("test_*.py")))
def test_the_reference_says_what_every_test_file_proves(test_file):
    tests = (REPO / "docs" / "reference.md").read_text().split("## The tests", 1)[1].split("\n## ", 1)[0]
    assert test_file in tests, f"docs/reference.md's tests table does not name {test_file}"
