"""The documentation holds together: the root README stays short enough to read, and every
relative link in README.md, docs/*.md and the packages' READMEs points at a file that
exists (and, for a `#fragment`, at a heading that exists in that file)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_LIMIT_BYTES = 12 * 1024
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "packages").glob("*/README.md")])
# [text](target) outside code; the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _unfenced(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return kept


def relative_links(text: str) -> list[str]:
    prose = "\n".join(re.sub(r"`[^`]*`", "", line) for line in _unfenced(text))
    return [t for t in LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation but `-` and
    `_` dropped, spaces to `-`, repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    for line in _unfenced(text):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(path: pathlib.Path) -> list[str]:
    problems = []
    for target in relative_links(path.read_text()):
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{target}: no file {resolved}")
            continue
        if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
            problems.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return problems


def test_the_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; keep it to {README_LIMIT_BYTES}"


def test_the_docs_exist() -> None:
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert names >= {
        "design.md",
        "benchmarks.md",
        "deployment.md",
        "security.md",
        "configuration.md",
        "changelog.md",
    }


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_points_at_a_file(path: pathlib.Path) -> None:
    assert broken_links(path) == []


def test_the_link_check_finds_broken_links(tmp_path: pathlib.Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, here\n\ntext\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-here) [web](https://example.org/x.md)\n"
        "`[in code](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n"
        "[missing](gone.md) [bad anchor](there.md#elsewhere) [self](#nothing)\n"
    )
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert any(p.startswith("gone.md") for p in problems)
    assert any("#elsewhere" in p for p in problems)
    assert any("#nothing" in p for p in problems)
