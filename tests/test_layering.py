"""The layering of docs/concepts.md holds: every import is allowed, and no module imports itself back.

The allowed list below is docs/concepts.md's "Layers" section, word for word (a test
checks that too). Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeswap"

# Each layer: the modules and packages it holds, and the layers it may import.
LAYERS = """
base: pipeswap, pipeswap.errors, pipeswap.units, pipeswap.jsonio, pipeswap.config, pipeswap.streams, pipeswap.progress, pipeswap.checkpoint -> base
models: pipeswap.models -> base
configs: pipeswap.optim, pipeswap.data_config, pipeswap.swap.config, pipeswap.pipeline.config, pipeswap.pipeline.modes, pipeswap.pipeline.schedule_kinds, pipeswap.pipeline.orders, pipeswap.pipeline.actions, pipeswap.train_config -> base, configs, models
data: pipeswap.data, pipeswap.user_data, pipeswap.user_files, pipeswap.user_images, pipeswap.user_pairs -> base, models
profile: pipeswap.profile, pipeswap.profiling -> base, models, configs, profile, hardware
hardware: pipeswap.hardware -> base
sim: pipeswap.sim -> base, hardware
dist: pipeswap.dist -> base
swap: pipeswap.swap -> base, configs, models, profile, hardware, sim
pipeline: pipeswap.pipeline -> base, configs, models, data, profile, hardware, sim, dist
layouts: pipeswap.layouts -> base, configs, models, profile, hardware, sim, swap, pipeline
training: pipeswap.training -> base, configs, models, data, profile, hardware, sim, dist, swap, pipeline, layouts
commands: pipeswap.commands, pipeswap.cli, pipeswap.__main__ -> base, configs, models, data, profile, hardware, sim, dist, swap, pipeline, layouts, training, commands
"""


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
    """The layer of the longest listed prefix of ``module``."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        found = where.get(".".join(parts[:end]))
        if found is not None:
            return found
    raise AssertionError(f"{module} is in no layer of docs/concepts.md")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every pipeswap module ``path`` imports (inside functions too), TYPE_CHECKING aside."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found: set[str] = set()
    modules = _modules()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeswap"):
            for alias in node.names:  # `from pipeswap.swap import plan` imports a module
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pipeswap"))
    return found


def test_every_import_is_allowed_by_the_layering() -> None:
    where, allowed = _layers()
    wrong = []
    for module, path in _modules().items():
        mine = _layer_of(module, where)
        for imported in sorted(_imports(path)):
            theirs = _layer_of(imported, where)
            if theirs not in allowed[mine]:
                wrong.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert wrong == []


def test_no_module_imports_itself_back() -> None:
    modules = _modules()
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
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
    # Only the CLI speaks of --flags; mechanisms name config fields ({field}, pipeswap.config).
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
