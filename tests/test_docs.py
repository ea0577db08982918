"""README.md and docs/*.md: every relative link and image resolves, anchors included, and the
README stays one screen long with the test command CI runs. Every `scripts/...` path they (or
the project's sources) name exists, and each benchmark of scripts/benchmarks/ and the page
whose tables it reproduces name each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS = ROOT / "scripts" / "benchmarks"
# Where a script's path is written for a user to run or read: the pages, and the messages,
# docstrings and comments of the code (tests/ is left out: it holds patterns and stand-ins).
CODE = [p for d in ("scripts", "trainer", "conf") for p in sorted((ROOT / d).rglob("*"))]
SOURCES = [*PAGES, *(p for p in CODE if p.suffix in (".py", ".sh", ".yaml"))]
SOURCES += [ROOT / "train.py", ROOT / "Makefile"]
# A path under scripts/, also as a link from docs/ (../scripts/...); not one inside another
# path (nanoGPT/scripts/...). A sentence's full stop or comma after it is not part of it.
SCRIPT_PATH = re.compile(r"(?<![\w./-])(?:\.\./)*(scripts/[\w.-]+(?:/[\w.-]+)*/?)")
DOCS_PAGE = re.compile(r"\bdocs/[\w-]+\.md\b")

# [text](target) and ![alt](target), with an optional "title"; text may hold one level of
# brackets ([`x`](y) or [![img](a)](b)).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).+?\1")


def _prose(path: Path) -> list[tuple[int, str, str]]:
    """The lines outside fenced code blocks: number from 1, the line, and the line with its
    inline code blanked (same length, so a match's span indexes the line)."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -1, -2 for
    repeats."""
    seen: dict[str, int] = {}
    out = set()
    for _, line, _ in _prose(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        heading = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").strip().lower())
        slug = heading.replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code, also one whose text
    runs over two lines. Matched on the blanked text, so a link whose text is inline code
    keeps its target and one inside code is none."""
    prose = {number: (line, blanked) for number, line, blanked in _prose(path)}
    raw = path.read_text().splitlines()
    text = "\n".join(prose.get(n, ("", ""))[1] for n in range(1, len(raw) + 1))
    found = []
    for m in LINK.finditer(text):
        number = text.count("\n", 0, m.start(1)) + 1
        column = m.start(1) - (text.rfind("\n", 0, m.start(1)) + 1)
        found.append((number, raw[number - 1][column : column + len(m.group(1))]))
    return found


def _relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)  # http:, https:, mailto: ...


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for number, target in links(page):
        if not _relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = {
        (ROOT / t.partition("#")[0]).resolve() for _, t in links(ROOT / "README.md") if _relative(t)
    }
    unlinked = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_readme_fits_a_screen_and_shows_the_test_command() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    # The command CI runs (.ci/run), on a line of its own, not only make test-kernels.
    assert re.search(r"(?m)^make test(?![\w-])", text)


def test_the_checker_sees_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A `title`: here\n## Past one node: hybrid sharding\n## Again\n## Again\n"
        '[a](x.py) ![b](img/c.png "t") [`d`](../e.md#f) [g](https://h) [i\nj](#again-1)\n'
        "`[not](code.md)`\n```\n[not](fenced.md)\n```\n"
    )
    expected = ["x.py", "img/c.png", "../e.md#f", "https://h", "#again-1"]
    assert [t for _, t in links(page)] == expected
    assert anchors(page) == {"a-title-here", "past-one-node-hybrid-sharding", "again", "again-1"}


def script_paths(path: Path) -> list[tuple[int, str]]:
    """(line number, path) of every `scripts/...` path the file names, code included."""
    return [
        (number, m.group(1).rstrip(".,:;"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for m in SCRIPT_PATH.finditer(line)
    ]


def test_every_script_path_named_exists() -> None:
    missing = [
        f"{src.relative_to(ROOT)}:{number}: {path}"
        for src in SOURCES
        for number, path in script_paths(src)
        if not (ROOT / path).exists()
    ]
    assert not missing, "paths under scripts/ that do not exist:\n" + "\n".join(missing)


def test_every_benchmark_is_named_in_the_docs() -> None:
    docs = "\n".join(p.read_text() for p in PAGES[1:])
    files = [p for p in BENCHMARKS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert files, f"no files in {BENCHMARKS}"
    named = [str(p.relative_to(ROOT)) for p in sorted(files)]
    unnamed = [name for name in named if name not in docs]
    assert not unnamed, f"benchmarks no docs/*.md page names: {unnamed}"


def test_each_benchmark_names_the_page_of_its_tables() -> None:
    """Its docstring names docs pages that exist, one of which names it back by its path."""
    wrong = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        rel = str(script.relative_to(ROOT))
        pages = DOCS_PAGE.findall(ast.get_docstring(ast.parse(script.read_text())) or "")
        if not pages:
            wrong.append(f"{rel}: its docstring names no docs/*.md page")
        elif missing := [p for p in pages if not (ROOT / p).is_file()]:
            wrong.append(f"{rel}: its docstring names {missing}, which do not exist")
        elif not any(rel in (ROOT / p).read_text() for p in pages):
            wrong.append(f"{rel}: none of {sorted(set(pages))} names it")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_script_paths(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `python scripts/a.py --x 1` ([b](../scripts/benchmarks/b.py)), then\n"
        "scripts/benchmarks/. Not nanoGPT/scripts/c.py, nor a bare scripts/ dir.\n"
        "```\ntorchrun scripts/d.sh, scripts/e.py\n```\n"
    )
    assert script_paths(page) == [
        (1, "scripts/a.py"),
        (1, "scripts/benchmarks/b.py"),
        (2, "scripts/benchmarks/"),
        (4, "scripts/d.sh"),
        (4, "scripts/e.py"),
    ]
