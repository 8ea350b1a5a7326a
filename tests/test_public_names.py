"""Every module of pipeswap says which of its names are public, and says it right.

Each module has an ``__all__`` (a package that imports nothing lists none); every name in
it is bound in the module (defined, or imported: a package's public names may be imported
under ``if TYPE_CHECKING:`` and loaded on first use); and every top-level function and
class whose name has no leading underscore is listed: a helper only its own module uses
takes a leading underscore instead.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeswap"

MODULES = sorted(str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py"))


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The module's statements, those inside top-level ``if`` and ``try`` blocks too."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If):
            yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _top_level(statement.body)
            for handler in statement.handlers:
                yield from _top_level(handler.body)


def _bound(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for statement in _top_level(tree.body):
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            names |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
        elif isinstance(statement, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in statement.names}
    return names


def _all_of(tree: ast.Module) -> list[str] | None:
    """The module's ``__all__``: a list of strings, or a package's ``module.__all__`` (it
    re-exports that module's names with ``from module import *``)."""
    for statement in tree.body:
        target = statement.targets[0] if isinstance(statement, ast.Assign) else None
        if isinstance(statement, ast.AnnAssign):
            target = statement.target
        if isinstance(target, ast.Name) and target.id == "__all__":
            given = statement.value  # type: ignore[attr-defined]
            if isinstance(given, ast.Attribute) and given.attr == "__all__":
                return _all_of(ast.parse(_module_file(tree, given.value).read_text()))
            value = ast.literal_eval(given)
            assert isinstance(value, list | tuple), "__all__ must be a list of strings"
            return list(value)
    return None


def _parsed(module: str) -> ast.Module:
    return ast.parse(ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text())


def _module_file(tree: ast.Module, name: ast.expr) -> Path:
    """The file of the module ``name`` stands for (``from package import module``)."""
    assert isinstance(name, ast.Name), "__all__ = module.__all__ names an imported module"
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module:
            for alias in statement.names:
                if (alias.asname or alias.name) == name.id:
                    return ROOT.joinpath(*statement.module.split("."), f"{alias.name}.py")
    raise AssertionError(f"__all__ = {name.id}.__all__: {name.id} is not imported there")


@pytest.mark.parametrize("path", MODULES)
def test_the_module_lists_its_public_names(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    listed = _all_of(tree)
    assert listed is not None, f"{path} has no __all__: list its public names"
    assert len(set(listed)) == len(listed), f"{path}: __all__ lists a name twice"
    stars = [
        s.module for s in tree.body if isinstance(s, ast.ImportFrom) and s.names[0].name == "*"
    ]
    bound = _bound(tree) | {n for m in stars if m for n in _all_of(_parsed(m)) or []}
    unbound = sorted(set(listed) - bound)
    assert not unbound, f"{path}: __all__ lists {unbound}, which the module does not bind"
    public = {
        statement.name
        for statement in tree.body
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and not statement.name.startswith("_")
    }
    missing = sorted(public - set(listed))
    assert not missing, (
        f"{path}: {missing} are public but not in __all__: list them, or name them with a "
        "leading underscore if only this module uses them"
    )
