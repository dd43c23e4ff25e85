"""Every relative link of the READMEs (the repository's, dev/, tests/) and the docs pages resolves: the file or folder
it names exists, and an anchor (``page.md#section``, or ``#section`` within the page) names a heading of that page,
slugged as GitHub slugs it. Links inside code (fenced blocks, inline code) and links with a scheme (``https:``,
``mailto:``) are not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "dev" / "README.md",
         ROOT / "tests" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The page without its code, where brackets and parentheses are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters, digits, '-', '_' kept), spaces to '-'."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets '-1', '-2', ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", page.read_text())):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slug_matches_github():
    assert slug("Recall at 75% removed (`configs/both_ratios.yaml`)") == "recall-at-75-removed-configsboth_ratiosyaml"
    assert slug("Mamba-2 and Qwen3.5 on the GPU") == "mamba-2-and-qwen35-on-the-gpu"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for m in LINK.finditer(prose(page.read_text())):
        target = m.group(1)
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
