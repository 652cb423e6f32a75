"""Files shipped with the package: the configs and the benchmarks.

The repository keeps them at the top level (`configs/*.yaml`,
`benchmarks/bench_*.py`); setup.py installs them as the subpackages
`trace_mega.configs` and `trace_mega.benchmarks`, so a wheel install finds them without the checkout and
an editable install maps them back to the top-level directories.

An editable install made before these two mappings existed cannot import the
subpackages; then the checkout's top-level directories are used directly.
"""

from __future__ import annotations

import importlib
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def _shipped_dir(package: str, checkout_name: str) -> Path:
    try:
        return Path(importlib.import_module(package).__file__).resolve().parent
    except ModuleNotFoundError:
        path = _CHECKOUT / checkout_name
        if path.is_dir():
            return path
        raise FileNotFoundError(f"{package} is not installed and there is no {path}") from None


def configs_dir() -> Path:
    """Directory of the shipped YAML configs."""
    return _shipped_dir("trace_mega.configs", "configs")


def benchmarks_dir() -> Path:
    """Directory of the shipped `bench_*.py` scripts."""
    return _shipped_dir("trace_mega.benchmarks", "benchmarks")


def shipped_configs() -> dict[str, Path]:
    """Shipped config name (file stem, e.g. `demo_cpu`) -> path."""
    return {p.stem: p for p in sorted(configs_dir().glob("*.yaml"))}


def resolve_config(spec: str | Path) -> Path:
    """The YAML file `spec` names: an existing path, else a shipped config by name
    (`demo_cpu`, also `demo_cpu.yaml` or `configs/demo_cpu.yaml` from outside the checkout)."""
    path = Path(spec)
    if path.is_file():
        return path
    shipped = shipped_configs()
    name = path.name.removesuffix(".yaml")
    if name in shipped and path.parent in (Path("."), Path("configs")):
        return shipped[name]
    raise FileNotFoundError(
        f"config {str(spec)!r}: no such file and no shipped config of that name; shipped: {', '.join(shipped)}"
    )


def benchmarks() -> dict[str, Path]:
    """Benchmark name (`allocation` for bench_allocation.py) -> script path."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(benchmarks_dir().glob("bench_*.py"))}
