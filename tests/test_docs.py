"""The README stays a short how-to with a table of contents, and no link in it or in docs/ is dead.

Links are checked as GitHub renders them: a relative path must name a file (or folder) of the
repository, and a `#fragment` must be the slug GitHub gives one of the target's headings (or
an explicit `<a id=...>` / `<a name=...>`). Code spans and fenced blocks are not links.
"""

import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from mdprose import prose_lines

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_LIMIT = 16_000  # bytes (issue #26): past it, the how-to gets lost again

# a closing run of #s follows a space
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
INLINE_LINK = re.compile(
    r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text, lower case, punctuation other than
    '-' and '_' removed, each space a '-' (github-slugger)."""
    # a link shows its text
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags show nothing
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every fragment that leads somewhere in a Markdown file; repeated headings get -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        ref = REFERENCE_LINK.match(line)
        if ref:
            targets.append(ref.group(1))
            continue
        line = CODE_SPAN.sub("", line)
        targets += [target for _, target in INLINE_LINK.findall(line)]
    return targets


def dead(path: Path, target: str) -> str | None:
    """Why a link of `path` leads nowhere; None when it resolves (external links are not followed)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, ...
        return None
    file_part, _, fragment = target.partition("#")
    dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
    if not dest.exists():
        return f"{target}: no such file"
    if ROOT not in dest.parents and dest != ROOT:
        return f"{target}: outside the repository"
    if fragment:
        if dest.suffix != ".md" or dest.is_dir():
            return f"{target}: an anchor into something that is not Markdown"
        if unquote(fragment) not in anchors(dest):
            return f"{target}: no heading of {dest.relative_to(ROOT)} has that anchor"
    return None


def test_slug_is_githubs():
    assert slug("Weights & Biases") == "weights--biases"
    assert (
        slug("Fine-tuning, evaluation and translation") == "fine-tuning-evaluation-and-translation"
    )
    assert slug("pipeline.prepare") == "pipelineprepare"
    assert (
        slug("Translation: ours against Hugging Face's Seq2SeqTrainer + MarianMTModel")
        == "translation-ours-against-hugging-faces-seq2seqtrainer--marianmtmodel"
    )
    assert slug("The `gpu` tests") == "the-gpu-tests"
    assert slug("See [docs](docs/x.md) now") == "see-docs-now"
    assert [HEADING.match(line).group(2) for line in ("## C# ##", "### Done #")] == ["C#", "Done"]


def test_readme_fits_its_limit():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: move detail to docs/"
    )


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    problems = [why for why in (dead(path, target) for target in links(path)) if why]
    assert not problems, problems


def test_readme_links_every_page_of_docs():
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for target in links(README)
        if target.partition("#")[0]
    }
    assert not [page.name for page in DOCS if page not in linked], [
        page.name for page in DOCS if page not in linked
    ]


def test_readme_has_a_table_of_contents_that_covers_it():
    lines = prose_lines(README.read_text(encoding="utf-8"))
    headings = {
        i: (len(m.group(1)), slug(m.group(2))) for i, m in enumerate(map(HEADING.match, lines)) if m
    }
    toc_names = ("contents", "table-of-contents")
    start = next(
        (i for i, (level, name) in headings.items() if level == 2 and name in toc_names), None
    )
    assert start is not None, "README.md has no '## Contents' section"
    end = next((i for i in headings if i > start), len(lines))
    toc = [
        target
        for line in lines[start + 1 : end]
        for _, target in INLINE_LINK.findall(CODE_SPAN.sub("", line))
    ]
    assert toc, "README.md's contents list no links"
    problems = [why for why in (dead(README, target) for target in toc) if why]
    assert not problems, problems
    # Every section of the README is reachable from its contents.
    linked = {target[1:] for target in toc if target.startswith("#")}
    unlisted = [
        name
        for level, name in headings.values()
        if level == 2 and name not in toc_names and name not in linked
    ]
    assert not unlisted, f"sections missing from README.md's contents: {unlisted}"


def test_a_dead_link_is_caught(tmp_path, monkeypatch):
    # The checker itself can fail: a missing file, a missing heading, and a link in code that is not
    # one.
    tmp_path = tmp_path.resolve()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "# Title\n\n## Some: section\n\n## Some: section\n\n"
        "[ok](#some-section-1) [ok](../b.md#b) [gone](#nope) [gone](missing.md) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text("Intro\n\n# B\n", encoding="utf-8")
    assert [dead(page, target) is None for target in links(page)] == [True, True, False, False]


CODE_DOC_LINK = re.compile(r"\b(docs/[\w.-]+\.md(?:#[\w-]+)?)")


def code_doc_links() -> list[tuple[str, str]]:
    """(file, target) for every `docs/PAGE.md[#anchor]` named in the code: the module docstrings
    keep a summary and point there for the rest."""
    found = []
    for package in ("common", "pipeline", "model", "launch", "benchmarks", "slurm"):
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in (".py", ".sh", ".sbatch") and path.is_file():
                found += [
                    (str(path.relative_to(ROOT)), target)
                    for target in CODE_DOC_LINK.findall(path.read_text(encoding="utf-8"))
                ]
    return found


def test_every_docs_link_in_the_code_resolves():
    found = code_doc_links()
    assert any("#" in target for _, target in found), (
        "no module points into docs/ any more: is the pattern right?"
    )
    problems = [
        f"{where}: {why}" for where, target in found if (why := dead(ROOT / "README.md", target))
    ]
    assert not problems, problems
