"""The package's layering (docs/design.md §7): no module imports one of a higher layer, `TYPE_CHECKING`
and function-level imports included, and the library never imports the commands."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "trace_mega"

# Lowest first. A module belongs to the most specific prefix listed; it may import its own layer and
# every layer below it (within a layer the import graph must still be acyclic, which Python enforces).
LAYERS: list[tuple[str, ...]] = [
    ("configbase", "registry", "logs", "resources"),  # foundations
    ("config", "config_trace_a"),  # typed configs: only fields and their checks
    ("kernels",),  # Triton kernels and their PyTorch references
    ("rollout.tree", "envs.base"),  # the records every stage reads: trees, packed layout, env contract
    ("rollout.react",),  # the ReAct scaffold: prompts, parser, error observations
    ("envs", "ops"),  # environments, ops over the packed layout
    ("allocation", "predictor", "credit", "objective"),  # the method: TRACE-A, TRACE-C, the RL objective
    ("sim",),  # the allocation simulator (ground-truth success probabilities)
    ("rollout",),  # engines, agent loop, replicas, the step's collector
    ("learner",),  # the Megatron-Core backend
    ("step", "sampler", "telemetry", "evaluation", "stopping"),  # the step record and the loop's helpers
    ("trainer",),
    ("commands", "__main__"),  # the `trace-mega` commands
]


def _layer(module: str) -> int:
    """Layer of a dotted module name below `trace_mega` ('' for the package itself: the lowest)."""
    best, depth = 0, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    if depth < 0 and module:
        raise AssertionError(f"trace_mega.{module} is in no layer of tests/test_layering.py")
    return best


def _imports(path: Path) -> set[str]:
    """Every `trace_mega.*` module `path` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trace_mega"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("trace_mega"))
    return out


def _modules() -> list[tuple[str, Path]]:
    mods = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods.append((name, path))
    return mods


@pytest.mark.parametrize("module,path", _modules(), ids=[m or "trace_mega" for m, _ in _modules()])
def test_no_module_imports_a_higher_layer(module, path):
    known = {m for m, _ in _modules()}
    mine = _layer(module)
    bad = []
    for imp in sorted(_imports(path)):
        name = imp.removeprefix("trace_mega").lstrip(".")
        if name not in known and name.rsplit(".", 1)[0] in known:
            name = name.rsplit(".", 1)[0]  # `from pkg.mod import symbol`
        if name in known and _layer(name) > mine:
            bad.append(f"trace_mega.{name} (layer {_layer(name)})")
    assert not bad, f"trace_mega.{module} (layer {mine}) imports a higher layer: {', '.join(bad)}"


def test_config_imports_no_component():
    """Registry names are checked where components are built, not by importing them from config.py."""
    src = (PKG / "config.py").read_text()
    assert "importlib" not in src
    assert all(imp.startswith("trace_mega.config") for imp in _imports(PKG / "config.py"))
