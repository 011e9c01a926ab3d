"""The README is the tutorial's front page, docs/ its topic pages: their diffs are the scripts' real diffs, and the
steps stay small."""
import re

import pytest

from tools import stepdiff
from tools.jobs import REPO

README = (REPO / "README.md").read_text()
PAGES = {str(page.relative_to(REPO)): page.read_text() for page in stepdiff.pages()}
PAIRS = stepdiff.pairs()


@pytest.mark.parametrize("page", PAGES)
def test_the_diffs_of_every_page_are_generated_from_the_scripts(page):
    assert stepdiff.render(PAGES[page]) == PAGES[page], "stale: run `python tools/stepdiff.py --write`"


def test_a_stale_diff_is_noticed():
    stale = README.replace("+from torch.utils.data.distributed import DistributedSampler\n", "", 1)
    assert stale != README and stepdiff.render(stale) != stale


@pytest.mark.parametrize("old, new", PAIRS)
def test_every_step_shows_its_diff_against_the_one_it_builds_on(old, new):
    assert any(f"<!-- diff {old} {new} -->" in text for text in PAGES.values())


def test_gpt_builds_on_multinode_not_on_fsdp():
    assert ("multinode.py", "gpt.py") in PAIRS and ("multinode.py", "fsdp.py") in PAIRS


@pytest.mark.parametrize("name", stepdiff.steps())
def test_each_script_reads_in_one_sitting(name):
    assert len(stepdiff.lines_of(name)) <= stepdiff.budget(name)[0]


@pytest.mark.parametrize("old, new", PAIRS)
def test_each_step_is_a_small_diff_of_the_previous_one(old, new):
    assert stepdiff.changed_lines(old, new) <= stepdiff.budget(new)[1]


def test_the_first_commands_are_make_demo_and_make_test():
    before_first_section = README.split("\n## ", 1)[0]
    assert "make demo" in before_first_section and "make test" in before_first_section


def test_ci_runs_the_readme_test_command():
    assert re.search(r"^make test\b", (REPO / ".ci" / "run").read_text(), re.M)
