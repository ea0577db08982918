"""The house rules a reader of trainer/ relies on, checked from the source text alone (ast;
nothing imported, no processes): every module opens with a docstring of at most 25 lines,
packages' __init__ included; each mode file is at most 600 lines; no module reaches into
another project module's underscore-private names, by import or by attribute."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCSTRING_LINES = 25  # counted from the opening quotes to the closing ones
MODE_FILES = ("trainer/parallel/ddp.py", "trainer/parallel/zero.py", "trainer/parallel/fsdp.py")
MODE_FILE_LINES = 600


def modules(root: Path) -> list[Path]:
    return sorted((root / "trainer").rglob("*.py"))


def docstring_problems(root: Path) -> list[str]:
    """Modules without a docstring, or with one longer than DOCSTRING_LINES."""
    problems = []
    for path in modules(root):
        body = ast.parse(path.read_text(), filename=str(path)).body
        first = body[0] if body else None
        rel = path.relative_to(root)
        if not (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            problems.append(f"{rel}: no module docstring")
            continue
        lines = first.end_lineno - first.lineno + 1
        if lines > DOCSTRING_LINES:
            problems.append(f"{rel}: module docstring of {lines} lines")
    return problems


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _absolute(path: Path, root: Path, node: ast.ImportFrom) -> str:
    """The module an ImportFrom names, relative imports resolved against `path`."""
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(root).with_suffix("").parts)[: -node.level]
    return ".".join(package + ([node.module] if node.module else []))


def private_reaches(root: Path) -> list[str]:
    """`from trainer.x import _y`, and `x._y` where x names a module of trainer/ other than
    the one that reads it."""
    found = []
    for path in modules(root):
        rel = path.relative_to(root)
        me = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), filename=str(path))
        names: dict[str, str] = {}  # a local name -> the trainer module or object it binds
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(path, root, node)
                if module != "trainer" and not module.startswith("trainer."):
                    continue
                for alias in node.names:
                    if _private(alias.name) and module != me:
                        found.append(f"{rel}:{node.lineno}: from {module} import {alias.name}")
                    names[alias.asname or alias.name] = f"{module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "trainer" or alias.name.startswith("trainer."):
                        top = alias.name if alias.asname else "trainer"
                        names[alias.asname or "trainer"] = top
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in names:
                continue
            module = ".".join([names[value.id], *chain])
            if module != me and _is_module(root, module):
                found.append(f"{rel}:{node.lineno}: {module}.{node.attr}")
    return found


def test_every_module_has_a_short_docstring() -> None:
    assert len(modules(ROOT)) > 50  # the tree is where this test thinks it is
    problems = docstring_problems(ROOT)
    assert not problems, (
        f"module docstrings are at most {DOCSTRING_LINES} lines: what the module is, its "
        "picture, what to read next; move the detail into `# [Note: title]` blocks beside "
        "the code:\n" + "\n".join(problems)
    )


@pytest.mark.parametrize("mode_file", MODE_FILES)
def test_a_mode_file_reads_in_one_sitting(mode_file: str) -> None:
    lines = len((ROOT / mode_file).read_text().splitlines())
    assert lines <= MODE_FILE_LINES, (
        f"{mode_file} has {lines} lines; a mode file has at most {MODE_FILE_LINES}: move what "
        "other modes could share into its own module"
    )


def test_no_module_uses_another_modules_private_names() -> None:
    found = private_reaches(ROOT)
    assert not found, (
        "a module's underscore names are its own: make the name public or move it to a "
        "module both import:\n" + "\n".join(found)
    )


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """Each check finds a violation planted in a tree of its own."""
    pkg = tmp_path / "trainer" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "trainer" / "__init__.py").write_text('"""Top."""\n')
    (pkg / "__init__.py").write_text("")  # no docstring
    (pkg / "owner.py").write_text('"""Owner."""\n\n\ndef _hidden():\n    pass\n')
    long_doc = '"""' + "line\n" * DOCSTRING_LINES + '"""\n'  # 26 lines, quotes included
    (pkg / "long.py").write_text(long_doc)
    (pkg / "reach.py").write_text(
        '"""Reaches in."""\n\n'
        "from trainer.sub.owner import _hidden\n"
        "from trainer.sub import owner\n"
        "import trainer.sub.owner as alias\n"
        "import trainer\n"
        "from . import owner as relative\n\n"
        "owner._hidden()\n"
        "alias._hidden()\n"
        "trainer.sub.owner._hidden()\n"
        "relative._hidden()\n"
        "owner.__name__\n"  # dunder: allowed
    )
    (pkg / "fine.py").write_text('"""' + "line\n" * (DOCSTRING_LINES - 1) + '"""\n')
    assert docstring_problems(tmp_path) == [
        "trainer/sub/__init__.py: no module docstring",
        f"trainer/sub/long.py: module docstring of {DOCSTRING_LINES + 1} lines",
    ]
    assert sorted(private_reaches(tmp_path)) == sorted(
        ["trainer/sub/reach.py:3: from trainer.sub.owner import _hidden"]
        + [f"trainer/sub/reach.py:{line}: trainer.sub.owner._hidden" for line in (9, 10, 11, 12)]
    )
