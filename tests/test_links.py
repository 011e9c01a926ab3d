"""Every link of the front page, docs/ and the notebooks leads somewhere: relative links to files that exist,
#anchors to headings of their target, with the ids GitHub gives headings (harness/doclinks.py)."""
import re
from pathlib import Path

import pytest

from harness import doclinks
from harness.jobs import REPO


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
    files = ["utils/loop.py", "notebooks/06_gpt.ipynb", "exercises/01_ddp/hints.md"]
    text = "`utils/loop.py`, `06_gpt.ipynb`, `exercises/*/hints.md`, `utils/nothing.py`, `runs/try1/rank0.jsonl`"
    assert doclinks.missing_files(text, files) == ["utils/nothing.py"]
    assert doclinks.missing_files("see REPORT.md and docs/gpt.md", ["docs/gpt.md"], doclinks.NAMED_IN_CODE) == \
        ["REPORT.md"]


# --- the steps' pages: a learner's page, a reference page one link away, a glossary every page links ----------------

DOCS = REPO / "docs"
# Every step page that is a learner's page has its reference page, docs/reference/<page>.md; these at least.
STEP_PAGES = ["single-device.md", "ddp.md", "torchrun.md", "multinode.md", "fsdp.md", "gpt.md", "tensor-parallel.md",
              "pipeline-parallel.md", "context-parallel.md", "expert-parallel.md", "one-mesh.md", "long-run.md",
              "fault-tolerance-at-scale.md", "plan-at-scale.md"]
# The pages of docs/ that teach a topic rather than a step, split the same way: a learner's page and its reference.
TOPIC_PAGES = ["measure.md"]
LEARNER_PAGES = sorted({*STEP_PAGES, *TOPIC_PAGES, *(page.name for page in (DOCS / "reference").glob("*.md"))})
MOST_LINES = 300  # a learner's page reads in ten minutes


def link_targets(path):
    return {target.split("#")[0] for _, target in doclinks.links(doclinks.markdown_of(path))}


@pytest.mark.parametrize("name", LEARNER_PAGES)
def test_a_learner_page_is_short_and_links_the_glossary_near_its_top_and_its_reference_page(name):
    page = DOCS / name
    lines = page.read_text().splitlines()
    assert len(lines) <= MOST_LINES, f"{name} has {len(lines)} lines: move reviewer material to reference/{name}"
    top = "\n".join(lines[:8])
    assert "](glossary.md)" in top, f"{name} does not link the glossary near its top"
    assert f"reference/{name}" in link_targets(page), f"{name} does not link its reference page"


def test_every_reference_page_is_a_step_pages_or_a_topic_pages():
    """A page of docs/reference/ belongs to a learner's page this file knows, so the tests below hold it to its kind."""
    strays = sorted(set(LEARNER_PAGES) - {*STEP_PAGES, *TOPIC_PAGES})
    assert not strays, f"docs/reference/ pages of no step and no topic named here: {strays}"


def test_the_steps_page_is_short_and_sends_each_step_to_its_learners_page():
    """docs/steps.md is the path through the steps: a section a step, each linking the step's own page, where the
    diff and the proofs are one link further."""
    page = DOCS / "steps.md"
    lines = page.read_text().splitlines()
    assert len(lines) <= MOST_LINES, f"steps.md has {len(lines)} lines: a step's depth belongs on its pages"
    assert "](glossary.md)" in "\n".join(lines[:8]), "steps.md does not link the glossary near its top"
    unlinked = [name for name in STEP_PAGES if name not in link_targets(page)]
    assert not unlinked, f"steps.md links no page of {unlinked}"
    assert "```diff" not in page.read_text(), "the steps' diffs live on their reference pages"


@pytest.mark.parametrize("name", LEARNER_PAGES)
def test_a_reference_page_links_back_to_its_learner_page_and_the_glossary(name):
    reference = DOCS / "reference" / name
    assert reference.exists(), f"{name} has no reference page docs/reference/{name}"
    assert {f"../{name}", "../glossary.md"} <= link_targets(reference)


# The terms a newcomer meets in the steps; each has an entry (a heading) in docs/glossary.md.
TERMS = ["rank", "local rank", "world size", "process group", "backend", "gloo", "nccl", "torchrun", "DDP",
         "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "shard", "FSDP / FSDP2", "DTensor",
         "device mesh", "dp, tp, pp, cp and ep groups", "2D mesh", "tensor parallelism", "sequence parallelism",
         "loss parallelism", "pipeline stage", "micro-batch", "GPipe", "1F1B", "interleaved 1F1B", "bubble",
         "context parallelism", "ring attention", "online softmax", "expert", "router", "top-k", "capacity",
         "load-balancing loss", "HSDP", "replica group", "lighthouse", "quorum", "heal", "meta device",
         "seed checkpoint", "activation checkpointing", "DCP", "snapshot", "cursor", "global batch",
         "gradient accumulation", "bf16 and mixed precision", "MFU", "tokens/s", "torch.compile", "node", "rendezvous",
         "c10d and static rendezvous", "store", "mp.spawn", "elastic training", "DistributedSampler", "epoch",
         "optimizer step", "held-out loss", "overfitting", "noise floor", "samples/s and scaling efficiency",
         "checkpoint", "barrier", "attempt", "token file", "rewind"]


def glossary_entries():
    """{term, lowercased: its text} of docs/glossary.md's entries (### headings)."""
    text = (DOCS / "glossary.md").read_text()
    entries = re.finditer(r"^### ([^\n]+)\n(.*?)(?=^#|\Z)", text, re.M | re.S)
    return {match[1].strip().lower(): match[2] for match in entries}


def test_the_glossary_defines_every_term_in_a_few_sentences_with_the_page_that_teaches_it():
    entries = glossary_entries()
    missing = [term for term in TERMS if term.lower() not in entries]
    assert not missing, f"docs/glossary.md has no entry for {missing}"
    for term, text in entries.items():
        assert re.search(r"\]\([\w./-]+\.md", text), f"the glossary's {term!r} links no page that teaches it"
        assert len(re.findall(r"[.!?](?:\s|$)", text)) <= 4, f"the glossary's {term!r} is more than a few sentences"


def test_every_page_of_docs_links_the_glossary():
    """docs/glossary.md is where a page sends a term it does not teach; the steps' pages and their reference pages,
    the topic pages split the same way, the path through the steps and the reference link it (the other pages of
    docs/ are the lead's to link)."""
    pages = [DOCS / name for name in [*LEARNER_PAGES, "steps.md", "reference.md"]] + [
        DOCS / "reference" / name for name in LEARNER_PAGES]
    unlinked = [str(page.relative_to(REPO)) for page in pages
                if not {"glossary.md", "../glossary.md"} & link_targets(page)]
    assert not unlinked, f"pages that do not link the glossary: {unlinked}"


def shown_figures():
    """{figure name: [page, ...]}: the PNGs of docs/figures/ that a page of docs/ shows."""
    shown = {}
    for page in [*DOCS.glob("*.md"), *(DOCS / "reference").glob("*.md")]:
        for _, target in doclinks.links(page.read_text()):
            path = (page.parent / target.split("#")[0]).resolve()
            if path.parent == (DOCS / "figures").resolve():
                shown.setdefault(path.stem, []).append(page.name)
    return shown


def test_every_figure_a_page_shows_is_committed_and_tools_figures_draws_it():
    """Each picture of docs/figures/ is drawn from a real run by `python tools/figures.py NAME`, and each figure the
    script draws is in the repository and shown by its page (docs/NAME.md)."""
    from tools import figures

    shown, files = shown_figures(), doclinks.tracked()
    assert set(shown) <= set(figures.FIGURES), f"figures no script draws: {set(shown) - set(figures.FIGURES)}"
    for name in figures.FIGURES:
        assert f"docs/figures/{name}.png" in files, f"docs/figures/{name}.png is not committed"
        assert f"{name}.md" in shown.get(name, []), f"docs/{name}.md does not show figures/{name}.png"
        assert f"python tools/figures.py {name}" in (DOCS / f"{name}.md").read_text(), \
            f"docs/{name}.md does not say how its figure is drawn"


def test_every_step_page_shows_a_figure_drawn_from_a_run():
    """Steps 1 to 11, each parallelism among them: a learner looks before reading."""
    shown = shown_figures()
    for name in (page.removesuffix(".md") for page in STEP_PAGES):
        assert f"{name}.md" in shown.get(name, []), f"docs/{name}.md shows no figure of docs/figures/"


def step_of(page):
    """The step script a page teaches: the `name.py` of its title."""
    return re.search(r"^# .*\(`(\w+\.py)`\)", page.read_text(), re.M)[1]


@pytest.mark.parametrize("name", STEP_PAGES)
def test_the_excerpts_a_learner_page_quotes_are_lines_of_the_step_or_of_utils(name):
    """A ```python block of a learner's page is an excerpt: each of its lines is a line of the step script (or of
    utils/, where the step calls it), so a page never teaches code the step no longer has. (A snippet for the learner
    to type is a ```py block.)"""
    page = DOCS / name
    sources = [REPO / step_of(page), *sorted((REPO / "utils").glob("*.py"))]
    known = {line.strip() for path in sources for line in path.read_text().splitlines()}
    quoted = [line.strip() for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)
              for line in block.splitlines() if line.strip()]
    assert quoted, f"{name} quotes no line of {step_of(page)}"
    missing = [line for line in quoted if line not in known]
    assert not missing, f"{name} quotes lines that {step_of(page)} and utils/ do not hold: {missing}"
