"""The README stays a front page, and the documentation site stays whole.

``README.md`` is short and opens with the two commands a new reader runs first; the rest of
the documentation lives in ``docs/`` and is built by mkdocs (``mkdocs.yml``; ``.ci/run`` runs
``mkdocs build --strict``). These checks need no mkdocs: every page is in the nav, and every
relative link of the README and the pages reaches an existing file, and, for a link into a
markdown page, an existing heading (anchors as mkdocs' table of contents spells them).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 300
# The README's opening, byte for byte: the title and the first code block with the two commands.
README_OPENING = """# lightning-recover

```bash
bash examples/demo.sh   # set up, then run the main job: the fault demo
bash .ci/run            # set up, then run the whole test suite
```
"""
# [text](target) outside code; an image's ![alt](target) matches the same way.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _prose(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, inline code removed."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, INLINE_CODE.sub("", line)


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs) gives a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            slug = base = _slug(match.group(1))
            suffix = 0
            while slug in anchors:  # a repeated heading gets _1, _2, ... as in Python-Markdown
                suffix += 1
                slug = f"{base}_{suffix}"
            anchors.add(slug)
    return anchors


def _nav_files(nav: Any) -> list[str]:
    """Every page file named in mkdocs.yml's nav, sections flattened."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    raise AssertionError(f"mkdocs.yml: a nav entry {nav!r} is neither a page, a list nor a section")


def _mkdocs() -> dict[str, Any]:
    # The default loader would refuse mkdocs' !ENV / !relative tags; this file uses none of them.
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    text = README.read_text()
    lines = text.count("\n")
    assert lines < MAX_README_LINES, (
        f"README.md has {lines} lines, the front page must stay under {MAX_README_LINES}: move the detail to a docs/ page and link it"
    )
    assert text.startswith(README_OPENING), (
        "README.md must open with its title and the first code block running `bash examples/demo.sh` and `bash .ci/run`, "
        f"exactly as:\n{README_OPENING}\ngot:\n{text[: len(README_OPENING)]}"
    )


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    config = _mkdocs()
    assert config.get("docs_dir", "docs") == "docs" and config.get("strict") is True, (
        "mkdocs.yml: keep docs_dir: docs and strict: true (a broken link must fail the build)"
    )
    listed = _nav_files(config["nav"])
    pages = {p.name for p in _pages()}
    assert len(listed) == len(set(listed)), f"mkdocs.yml names a page twice in nav: {sorted(listed)}"
    assert pages - set(listed) == set(), f"docs pages missing from mkdocs.yml's nav (add them): {sorted(pages - set(listed))}"
    assert set(listed) - pages == set(), f"mkdocs.yml's nav names pages docs/ does not have: {sorted(set(listed) - pages)}"


@pytest.mark.parametrize("document", [README, *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_its_heading(document: Path) -> None:
    broken = []
    for number, line in _prose(document.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not checked here
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (document.parent / path_part).resolve() if path_part else document
            where = f"{document.relative_to(ROOT)}:{number}: {target}"
            if not resolved.exists():
                broken.append(f"{where}: no such file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where}: {resolved.name} has no heading with anchor #{anchor} (its anchors: {sorted(_anchors(resolved))})")
    assert not broken, "broken links (fix the path or the anchor):\n" + "\n".join(broken)


def test_the_link_checker_sees_links_and_anchors() -> None:
    # The checks above pass vacuously if the patterns stop matching: pin them on known text.
    assert LINK.findall("see [Slurm](launching.md#slurm) and `[not](code.md)`") == ["launching.md#slurm", "code.md"]
    assert [line for _, line in _prose("a [x](y.md)\n```\n[z](w.md)\n```\n`[v](u.md)`")] == ["a [x](y.md)", ""]
    assert _slug("Cross-replica collectives in your own code: `strategy.replica_group`") == (
        "cross-replica-collectives-in-your-own-code-strategyreplica_group"
    )
    assert _slug("Compared with torchft (peers.py)") == "compared-with-torchft-peerspy"
    assert "errors-and-exit-status" in _anchors(DOCS / "failure-model.md")
    assert len(LINK.findall(README.read_text())) >= 10, "README.md should link to its docs pages"


def test_the_layout_page_names_every_module_of_the_package() -> None:
    """docs/layout.md is the package map a newcomer reads first: a module missing there is a module nobody finds."""
    text = (ROOT / "docs" / "layout.md").read_text()
    package = ROOT / "lightning_recover"
    missing = sorted(
        str(p.relative_to(ROOT)) for p in package.rglob("*.py")
        if p.name != "__init__.py" and p.name != "__main__.py" and p.name not in text
    )
    assert not missing, f"docs/layout.md does not name {missing}: add a line for each under its layer's folder"
