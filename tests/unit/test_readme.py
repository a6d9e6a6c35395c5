"""The README stays the user's door (a few screens) and no link in it or in docs/ points nowhere."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300

# [text](target) and [text](target "title"); images too. Reference-style definitions: [id]: target
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")   # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text without fenced or indented code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    text = "\n".join("" if line.startswith(("    ", "\t")) else line for line in text.split("\n"))
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(path: Path) -> list[str]:
    prose = _prose(path.read_text(encoding="utf-8"))
    targets = INLINE_LINK.findall(prose) + REF_LINK.findall(prose)
    return [t for t in targets if not EXTERNAL.match(t) and not t.startswith("#")]


def test_readme_fits_on_a_few_screens():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines, more than {MAX_README_LINES}: "
                                   "move the detail into docs/ and link to it")


def test_docs_exist_and_readme_links_them():
    assert DOCS, "docs/ holds no .md pages"
    linked = {(README.parent / unquote(t.split("#", 1)[0])).resolve() for t in relative_links(README)}
    unlinked = [p.name for p in DOCS if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link docs/{', docs/'.join(unlinked)}: add it to the Documentation list"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(page: Path):
    broken = []
    for target in relative_links(page):
        file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if file_part and not (page.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to files that do not exist: {', '.join(broken)}"


def test_link_finder_sees_links_and_skips_code(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("see [a](docs/a.md) and [b](https://x.org) and [c](#here) and [d](e.md#sec)\n"
                    "`[not](code.md)`\n\n    [indented](code.md)\n\n```\n[fenced](code.md)\n```\n"
                    "[ref]: docs/ref.md\n", encoding="utf-8")
    assert relative_links(page) == ["docs/a.md", "e.md#sec", "docs/ref.md"]
