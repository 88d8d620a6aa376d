"""Every relative link in README.md and docs/*.md resolves: the file exists and, when the link names
an anchor, the target has a heading (or an explicit ``id``/``name``) with that GitHub slug.

A section lost in an edit (docs/performance.md's first H200 run, 2026-12-05) left links to it
dangling for days; this finds such a link in the commit that breaks it.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or heading in a code block is not one)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)          # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).lower()                        # inline HTML
    text = re.sub(r"[^\w\- ]", "", text)                               # keeps letters, digits, _ and -
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file offers: heading slugs (repeats numbered as GitHub does) and ids."""
    seen: dict[str, int] = {}
    found = set(EXPLICIT_ID.findall(path.read_text()))
    for line in _prose_lines(path.read_text()):
        if m := HEADING.match(line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(path: Path) -> list[str]:
    """The targets of the file's links that point inside the repository (not URLs, not mail)."""
    targets = []
    for line in _prose_lines(path.read_text()):
        line = INLINE_CODE.sub("", line)
        targets += LINK.findall(line) + REFERENCE.findall(line)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def dangling(path: Path) -> list[str]:
    """The file's relative links whose file or anchor does not exist, each with the reason."""
    problems = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    assert dangling(doc) == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    """The checker itself: GitHub's slugs, numbered repeats, code left alone, and both kinds of miss."""
    assert slug("GPU path (first H200 run: 2026-12-04)") == "gpu-path-first-h200-run-2026-12-04"
    assert slug("Speed on the CPU (`speed`)") == "speed-on-the-cpu-speed"
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Intro\n## Intro\n<a id=\"here\"></a>\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#intro-1) [ok](a.md#here) [ok](#b) `[code](nowhere.md)`\n```\n[x](gone.md)\n```\n"
                   "# B\n[file](gone.md) [anchor](a.md#outro) [web](https://example.com/x.md)\n")
    assert dangling(doc) == ["gone.md: no file gone.md", "a.md#outro: no heading with anchor #outro in a.md"]
