"""The layering of docs/concepts.md holds, with no way around it.

The allowed list below is docs/concepts.md's "Layers" section, word for word (a test
checks that too). Every import counts: inside functions and under ``if TYPE_CHECKING:``
too (a type-only import still ties two modules). The package root is the top layer, and
the only module that loads pipeswap's modules by name (``importlib``); no two modules
import each other, however far round; and no module reads another module's private
(``_name``) names.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeswap"

# Each layer: the modules and packages it holds, and the layers it may import.
LAYERS = """
base: pipeswap.errors, pipeswap.units, pipeswap.jsonio, pipeswap.json_fields, pipeswap.config_fields, pipeswap.version, pipeswap.streams, pipeswap.progress, pipeswap.precision, pipeswap.metrics, pipeswap.step_memory, pipeswap.checkpoint -> base
models: pipeswap.models -> base
configs: pipeswap.optim, pipeswap.data_config, pipeswap.swap.swap_config, pipeswap.schedule.actions, pipeswap.schedule.orders, pipeswap.schedule.kinds, pipeswap.schedule.modes, pipeswap.schedule.pipeline_config, pipeswap.train_config -> base, configs, models
data: pipeswap.data, pipeswap.loss_share, pipeswap.user_data, pipeswap.user_files, pipeswap.user_images, pipeswap.user_pairs -> base, models
profile: pipeswap.profiling -> base, models, configs, profile, hardware
hardware: pipeswap.hardware -> base
sim: pipeswap.sim -> base, hardware
schedule: pipeswap.schedule -> base, configs, profile, hardware, sim
dist: pipeswap.dist -> base
swap: pipeswap.swap -> base, configs, models, profile, hardware, sim, schedule
pipeline: pipeswap.pipeline -> base, configs, models, data, profile, hardware, sim, schedule, dist
layouts: pipeswap.layouts -> base, configs, models, profile, hardware, sim, schedule, swap
training: pipeswap.training -> base, configs, models, data, profile, hardware, sim, schedule, dist, swap, pipeline, layouts
commands: pipeswap, pipeswap.commands, pipeswap.cli, pipeswap.__main__ -> base, configs, models, data, profile, hardware, sim, schedule, dist, swap, pipeline, layouts, training, commands
"""

# The package root loads its public names on first use (``pipeswap.train``); every other
# module imports with a statement this test reads. Loading the user's own code by name is
# the one other need, and another package's module may be loaded by its fixed name.
LOADS_USER_CODE = {"pipeswap.models.load": "a model given as module:function"}
_LOADERS = {"import_module", "__import__", "reload", "spec_from_file_location", "run_module"}
_SELF = {"self", "cls"}


def _layers() -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module or package -> its layer, layer -> layers it may import)."""
    where: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for line in LAYERS.strip().splitlines():
        name, _, rest = line.partition(":")
        members, _, imports = rest.partition("->")
        for member in members.split(","):
            where[member.strip()] = name
        allowed[name] = {layer.strip() for layer in imports.split(",")} | {name}
    return where, allowed


def _layer_of(module: str, where: dict[str, str]) -> str:
    """The layer of the longest listed prefix of ``module``; the package root ``pipeswap``
    is pipeswap/__init__.py alone, the prefix of no other module."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        found = where.get(".".join(parts[:end]))
        if found is not None:
            return found
    if module == "pipeswap":
        return where["pipeswap"]
    raise AssertionError(f"{module} is in no layer of docs/concepts.md: add it to one")


@cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_modules()[module].read_text())


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, a relative one resolved against ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if _modules()[module].name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _import_bindings(module: str) -> Iterator[tuple[str, str, str | None]]:
    """(pipeswap module imported, the local name it binds, the name taken from it or None)."""
    modules = _modules()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] != "pipeswap":
                continue
            for alias in node.names:
                child = f"{source}.{alias.name}"  # `from pipeswap.swap import plan`: a module
                if child in modules:
                    yield child, alias.asname or alias.name, None
                else:
                    yield source, alias.asname or alias.name, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pipeswap":
                    yield alias.name, alias.asname or alias.name.split(".")[0], None


def _imports(module: str) -> set[str]:
    """Every pipeswap module ``module`` imports: inside functions and TYPE_CHECKING too."""
    return {imported for imported, _, _ in _import_bindings(module)}


def test_every_import_is_allowed_by_the_layering() -> None:
    where, allowed = _layers()
    wrong = []
    for module in _modules():
        mine = _layer_of(module, where)
        for imported in sorted(_imports(module)):
            theirs = _layer_of(imported, where)
            if theirs not in allowed[mine]:
                wrong.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert wrong == []


def test_no_module_imports_itself_back() -> None:
    modules = _modules()
    graph = {m: {i for i in _imports(m) if i in modules and i != m} for m in modules}
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def _loader_names(tree: ast.Module) -> set[str]:
    """The local names of importlib's loaders (``from importlib import import_module as x``)."""
    names = set(_LOADERS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("importlib"):
            names.update(a.asname or a.name for a in node.names if a.name in _LOADERS)
    return names


def test_only_the_package_root_loads_modules_by_name() -> None:
    found = []
    for module, path in _modules().items():
        if module == "pipeswap":
            continue
        tree = _tree(module)
        loaders = _loader_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in loaders:
                continue
            first = node.args[0] if node.args else None
            fixed = first.value if isinstance(first, ast.Constant) else None
            if isinstance(fixed, str) and fixed.split(".")[0] != "pipeswap":
                continue  # another package's module, by a name this test can read
            if fixed is None and module in LOADS_USER_CODE:
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


@cache
def _classes() -> dict[str, dict[str, set[str]]]:
    """Module -> each class it defines -> that class's private members (methods, class
    attributes, attributes set on self or cls)."""
    out: dict[str, dict[str, set[str]]] = {}
    for module in _modules():
        classes = out.setdefault(module, {})
        for node in ast.walk(_tree(module)):
            if not isinstance(node, ast.ClassDef):
                continue
            members = set()
            for statement in node.body:
                if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    members.add(statement.name)
                elif isinstance(statement, ast.Assign | ast.AnnAssign):
                    targets = getattr(statement, "targets", [getattr(statement, "target", None)])
                    members.update(t.id for t in targets if isinstance(t, ast.Name))
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.ctx, ast.Store)
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id in _SELF
                ):
                    members.add(inner.attr)
            classes[node.name] = {m for m in members if _private(m)}
    return out


def _typed_names(function: ast.AST, foreign: set[str]) -> set[str]:
    """Names in ``function`` annotated with, or made by, a class of ``foreign``."""

    def mentions(expr: ast.AST | None) -> bool:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):  # "Class"
            expr = ast.parse(expr.value, mode="eval")
        return expr is not None and any(
            isinstance(n, ast.Name) and n.id in foreign for n in ast.walk(expr)
        )

    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.arg) and mentions(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if mentions(node.annotation):
                names.add(node.target.id)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if mentions(node.value.func):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _private_reads(module: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each private name of another pipeswap module that ``module`` reads."""
    classes = _classes()
    mine = set().union(*classes[module].values())
    others = {
        member: other
        for other, defined in classes.items()
        if other != module
        for members in defined.values()
        for member in members
    }
    aliases = set()  # local names of pipeswap modules
    foreign = set()  # local names of other modules' classes
    for imported, local, name in _import_bindings(module):
        if name is None:
            aliases.add(local)
        elif name in classes.get(imported, {}):
            foreign.add(local)
        if name is not None and _private(name) and imported != module:
            yield 0, f"from {imported} import {name}"
    typed = _typed_names(_tree(module), foreign)
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Attribute):
            owner, attr = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in {"getattr", "setattr", "hasattr", "delattr"}
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            owner, attr = node.args[0], node.args[1].value
        else:
            continue
        if not _private(attr):
            continue
        if isinstance(owner, ast.Name) and owner.id in _SELF:
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            continue
        named = isinstance(owner, ast.Name) and (owner.id in aliases or owner.id in typed)
        if named or (attr in others and attr not in mine):
            yield node.lineno, ast.unparse(node)


def test_no_module_reads_another_modules_private_names() -> None:
    # Self's own attributes and dunder names are a module's own business; so are other
    # libraries' private names (torch._C): the rule is about pipeswap's modules.
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for module, path in _modules().items()
        for line, what in _private_reads(module)
    ]
    assert found == []


def test_the_layering_is_docs_concepts_word_for_word() -> None:
    text = (ROOT / "docs" / "concepts.md").read_text()
    section = re.search(r"^## Layers\n(.*?)^## ", text, re.S | re.M)
    assert section is not None, "docs/concepts.md has a Layers section"
    assert "```\n" + LAYERS.strip() + "\n```" in section.group(1)


def test_only_dist_touches_process_groups() -> None:
    pattern = re.compile(r"isend|irecv|DistributedDataParallel|init_process_group")
    outside = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in _modules().values()
        if "dist" not in path.relative_to(PACKAGE).parts[:1]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert outside == []


def test_mechanism_packages_name_no_flags() -> None:
    # Only the CLI speaks of --flags; mechanisms name config fields ({field}, pipeswap.config_fields).
    flag = re.compile(r"[\"'][^\"']*(^|[^a-zA-Z0-9_-])--[a-z][a-z-]+")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("sim", "swap", "pipeline", "profiling", "hardware", "models")
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if flag.search(line)
    ]
    assert found == []


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): count
        for path in _modules().values()
        if (count := len(path.read_text().splitlines())) > 400
    }
    assert long == {}
