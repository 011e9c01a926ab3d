"""The links of the tutorial's pages: every relative link leads to a file that exists, and every #anchor to a heading
of its target, as GitHub renders them.

    python harness/doclinks.py        # list the broken links of README.md, docs/ and the notebooks; exit 1 if any

Checked: `[text](target)` and `![alt](target)` links and `[name]: target` definitions, outside code blocks and
inline code, in README.md, docs/*.md, the steps' reference pages (docs/reference/*.md) and the notebooks' markdown
cells. Web links (http, https, mailto) are not fetched. An anchor is a heading's GitHub id: its text lowercased,
everything but letters, digits, `_`, `-` and spaces dropped, each space a `-`, and `-1`, `-2`... added to repeats
(`## Step 5 — FSDP (`fsdp.py`)` becomes `#step-5--fsdp-fsdppy`).
"""
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
HTML_ID = re.compile(r"<a\s[^>]*?(?:name|id)=\"([^\"]+)\"", re.I)
WEB = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def pages():
    """The pages whose links are checked: README.md, docs/*.md, docs/reference/*.md, notebooks/*.ipynb."""
    docs = REPO / "docs"
    return [REPO / "README.md", *sorted(docs.glob("*.md")), *sorted((docs / "reference").glob("*.md")),
            *sorted((REPO / "notebooks").glob("*.ipynb"))]


def markdown_of(path):
    """A page's markdown: the file, or a notebook's markdown cells one after the other."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    return path.read_text()


def prose(markdown):
    """The markdown without its fenced code blocks (the lines stay, empty, so line numbers still hold)."""
    return FENCE.sub(lambda match: "\n" * match[0].count("\n"), markdown)


def slug(heading):
    """GitHub's id for a heading's markdown text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or an image: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")  # HTML tags; code spans keep their text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(markdown):
    """The ids a page's headings (and its <a name/id="...">) can be linked to, in order."""
    text, ids, seen = prose(markdown), [], {}
    for match in HEADING.finditer(text):
        base = slug(match[2])
        ids.append(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return ids + HTML_ID.findall(text)


def links(markdown):
    """[(line number, target), ...]: the page's links and link definitions, outside code."""
    text = INLINE_CODE.sub(lambda match: re.sub(r"[^\n]", " ", match[0]), prose(markdown))
    found = [(match.start(), match[1]) for match in LINK.finditer(text)]
    found += [(match.start(), match[1]) for match in DEFINITION.finditer(text)]
    return sorted((text.count("\n", 0, start) + 1, target) for start, target in found)


# A file of the repository named in a code span of a page: `utils/loop.py`, `tests/test_gpt.py`, `06_gpt.ipynb`.
NAMED = re.compile(r"`([\w.*/-]+\.(?:py|md|ipynb|png|sh|sbatch|txt|ini))`")
# A page of its own named in a Python file's comment or docstring: docs/gpt.md, README.md.
NAMED_IN_CODE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")
NOT_OURS = re.compile(r"^(runs/|my_)")  # what a run writes, and the learner's own copies of a starting file


def tracked():
    """The repository's files, by their path from its root (git's list; the folder's files outside a checkout)."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        files = listed.splitlines()
    except (OSError, subprocess.CalledProcessError):
        files = [str(path.relative_to(REPO)) for path in REPO.rglob("*") if path.is_file()]
    return [name for name in files if (REPO / name).exists()]


def missing_files(text, files, named=NAMED):
    """The file names `text` mentions (a path from the root, or a bare name) that no file of `files` matches."""
    missing = []
    for name in dict.fromkeys(match[1] for match in named.finditer(text)):
        if NOT_OURS.match(name):
            continue
        pattern = re.escape(name).replace(r"\*", "[^/]*")
        found = [file for file in files if re.fullmatch(pattern if "/" in name else rf"(.*/)?{pattern}", file)]
        if not found:
            missing.append(name)
    return missing


def shown(path):
    """A path from the repository's root when it is inside."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def broken(path):
    """[(line, target, why), ...]: the links of the page at `path` that lead nowhere."""
    problems = []
    for line, target in links(markdown_of(path)):
        if WEB.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (REPO / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
        destination = destination.resolve() if file_part else path
        if not destination.exists():
            problems.append((line, target, f"no file {shown(destination)}"))
        elif anchor and destination.suffix not in (".md", ".ipynb"):
            problems.append((line, target, "an anchor into a file that is not markdown"))
        elif anchor and anchor not in anchors(markdown_of(destination)):
            problems.append((line, target, f"no heading #{anchor} in {shown(destination)}"))
    return problems


def main():
    bad = 0
    for path in pages():
        for line, target, why in broken(path):
            print(f"{shown(path)}:{line}: ({target}): {why}")
            bad += 1
    sys.exit(f"{bad} broken link(s)" if bad else 0)


if __name__ == "__main__":
    main()
