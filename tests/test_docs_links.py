"""Every relative link in the README and ``docs/`` names a file that exists and, after ``#``, a heading in it.

Anchors follow GitHub's rule for heading ids: the heading's text (inline code unwrapped, links reduced to
their text) lower-cased, every character that is not a letter, digit, space, ``-`` or ``_`` removed, spaces
turned into ``-``; a repeated id gets ``-1``, ``-2``, ... in order.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+([^`]*)`+")
MARKDOWN_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, line)`` of the document's lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def heading_ids(path: Path) -> set[str]:
    """GitHub's ids of the headings of ``path`` (see the module docstring)."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        title = MARKDOWN_LINK.sub(r"\1", INLINE_CODE.sub(r"\1", match.group(2)))
        slug = "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link in ``path`` that is not a URL or a mail address (links inside
    code, fenced or inline, are code)."""
    found = []
    for number, line in prose_lines(path):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                found.append((number, target))
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per link of ``path`` whose file or heading does not exist, paths relative to ``root``."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        shown = linked.relative_to(root) if linked.is_relative_to(root) else linked
        if not linked.exists():
            problems.append(f"{where}: no file {shown}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_ids(linked):
            problems.append(f"{where}: no heading with id '{anchor}' in {shown}")
    return problems


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path):
    assert broken_links(document) == []


def test_heading_ids_follow_githubs_rule(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Time to accuracy (issue 14) — `benchmarks/convergence.py`\n"
        "## `--quick` again, on a faster machine (2026-11-26/27, eighth session)\n"
        "## Notes\n## Notes\n"
        "```\n# not a heading\n```\n"
        "## See [the model](models.md)\n",
        encoding="utf-8",
    )
    assert heading_ids(page) == {
        "time-to-accuracy-issue-14--benchmarksconvergencepy",
        "--quick-again-on-a-faster-machine-2026-11-2627-eighth-session",
        "notes",
        "notes-1",
        "see-the-model",
    }


def test_a_missing_file_and_a_missing_heading_are_reported(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Present\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "See [here](other.md#present), [there](other.md#absent), [gone](gone.md), [web](https://example.org),\n"
        "`[code](not-a-link.md)` and [self](#top).\n# Top\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "page.md:1: other.md#absent: no heading with id 'absent' in other.md",
        "page.md:1: gone.md: no file gone.md",
    ]
