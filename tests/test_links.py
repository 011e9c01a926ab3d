"""Every link of the front page, docs/ and the notebooks leads somewhere: relative links to files that exist,
#anchors to headings of their target, with the ids GitHub gives headings (tools/doclinks.py)."""
import re
from pathlib import Path

import pytest

from tools import doclinks
from tools.jobs import REPO


@pytest.mark.parametrize("page", doclinks.pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_link_of_the_page_leads_somewhere(page):
    problems = doclinks.broken(page)
    assert not problems, "\n".join(f"{page.name}:{line}: ({target}): {why}" for line, target, why in problems)


def test_the_front_page_links_into_docs():
    targets = [target for _, target in doclinks.links(doclinks.markdown_of(REPO / "README.md"))]
    assert {target.split("#")[0] for target in targets if target.startswith("docs/")} >= {
        f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")}, "a page of docs/ that the front page hides"


@pytest.mark.parametrize("heading, anchor", [
    ("Step 5 — FSDP: shard the model instead of copying it (`fsdp.py`)",
     "step-5--fsdp-shard-the-model-instead-of-copying-it-fsdppy"),
    ("Workloads: pick one with `--workload`", "workloads-pick-one-with---workload"),
    ("Why the DDP steps end with `exit_without_teardown()`", "why-the-ddp-steps-end-with-exit_without_teardown"),
    ("DataParallel or DDP?", "dataparallel-or-ddp"),
    ("See [the notebooks](notebooks.md)", "see-the-notebooks"),
])
def test_anchors_follow_githubs_rules(heading, anchor):
    assert doclinks.slug(heading) == anchor


def test_repeated_headings_get_numbered_anchors_and_code_is_not_a_heading():
    page = "# Tests\n\n## Tests\n\n```bash\n# not a heading\n```\n\n### Tests\n"
    assert doclinks.anchors(page) == ["tests", "tests-1", "tests-2"]


def test_a_broken_link_and_a_broken_anchor_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(doclinks, "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#its-part) [gone](docs/b.md) [wrong](docs/a.md#no-such-part) "
                    "`[code](not/a/link.md)` [here](#a-page) [web](https://example.com/x)\n\n# A page\n")
    assert {target: why for _, target, why in doclinks.broken(page)} == {
        "docs/b.md": "no file docs/b.md", "docs/a.md#no-such-part": "no heading #no-such-part in docs/a.md"}


@pytest.mark.parametrize("page", doclinks.pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_test_a_page_names_exists(page):
    """`tests/FILE.py::NAME` in a page (the fault table cites its proofs that way) is a test function of that file."""
    named = re.findall(r"(tests/\w+\.py)::(\w+)", doclinks.markdown_of(page))
    missing = [f"{path}::{name}" for path, name in named
               if not (REPO / path).exists() or f"def {name}(" not in (REPO / path).read_text()]
    assert not missing, f"{page.name} names tests that do not exist: {missing}"


@pytest.mark.parametrize("page", doclinks.pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_file_a_page_names_exists(page):
    """`utils/loop.py`, `benchmarks/gpt_scaling.py`, `06_gpt.ipynb` in a page's code spans are files of the repository
    (what a run writes, `runs/...`, and a learner's `my_*.py` are not)."""
    missing = doclinks.missing_files(doclinks.markdown_of(page), doclinks.tracked())
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_every_page_the_code_cites_exists():
    """A comment or docstring that sends the reader to a page (docs/gpt.md, README.md) sends them somewhere."""
    files, this_file = doclinks.tracked(), Path(__file__).resolve()  # this file's own examples aside
    cited = {str(path.relative_to(REPO)): doclinks.missing_files(path.read_text(), files, doclinks.NAMED_IN_CODE)
             for path in sorted(REPO.glob("**/*.py")) if ".venv" not in path.parts and path != this_file}
    missing = {path: names for path, names in cited.items() if names}
    assert not missing, missing


def test_a_file_named_but_missing_is_found():
    files = ["utils/loop.py", "notebooks/06_gpt.ipynb", "exercises/1_ddp/hints.md"]
    text = "`utils/loop.py`, `06_gpt.ipynb`, `exercises/*/hints.md`, `utils/nothing.py`, `runs/try1/rank0.jsonl`"
    assert doclinks.missing_files(text, files) == ["utils/nothing.py"]
    assert doclinks.missing_files("see REPORT.md and docs/gpt.md", ["docs/gpt.md"], doclinks.NAMED_IN_CODE) == \
        ["REPORT.md"]
