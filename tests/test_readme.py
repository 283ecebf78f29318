"""README.md stays a front door: short, in short sentences, its links alive.

A sentence is counted in prose only: code blocks, tables, headings and images are left out;
an inline code span counts as one word and a link as its text; a sentence ends at `.`, `!` or
`?` before a space or the end of its paragraph or list item.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 220
MAX_LONG_SHARE = 0.02  # sentences over LONG words, as a share of all
LONG = 40
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")


def prose_blocks(text: str) -> list[str]:
    """The paragraphs and list items of a Markdown text, without code, tables or headings."""
    blocks, current, fenced = [], [], False

    def close():
        if current:
            blocks.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            close()
            continue
        if fenced or stripped.startswith(("|", "#")) or not stripped:
            close()
            continue
        if re.match(r"([-*]|\d+\.)\s", stripped):
            close()
            stripped = re.sub(r"^([-*]|\d+\.)\s+", "", stripped)
        current.append(stripped)
    close()
    return blocks


def sentences(text: str) -> list[list[str]]:
    """The README rule's sentences of a Markdown text, each as its list of words."""
    out = []
    for block in prose_blocks(text):
        block = re.sub(r"`[^`]*`", "CODE", block)
        block = LINK.sub(lambda m: "" if m.group(0).startswith("!") else m.group(1), block)
        for sentence in re.split(r"(?<=[.!?])\s+", block):
            words = sentence.split()
            if words:
                out.append(words)
    return out


def test_the_rule_counts_as_stated():
    text = (
        "# A heading. Not counted\n\nOne `a. b. c` two. Three [x y](z.md)!\n"
        "- an item\n- another one?\n\n```\nnot. counted.\n```\n| a. | b. |\n"
    )
    assert [len(s) for s in sentences(text)] == [3, 3, 2, 2]


def test_the_readme_is_short_in_lines_and_sentences():
    text = README.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    found = sentences(text)
    long = [" ".join(s) for s in found if len(s) > LONG]
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES})"
    assert len(found) >= 50, f"only {len(found)} sentences found: the counter is broken"
    share = len(long) / len(found)
    assert share <= MAX_LONG_SHARE, (
        f"{len(long)} of {len(found)} sentences over {LONG} words: {long}"
    )


def test_the_readme_and_docs_links_resolve():
    """Every relative link and image of README.md and docs/*.md names a file that exists."""
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for _, target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_every_doc_is_linked_from_the_readme():
    text = README.read_text(encoding="utf-8")
    unlinked = [
        p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name})" not in text
    ]
    assert unlinked == []
