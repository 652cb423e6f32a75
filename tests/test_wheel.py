"""The wheel runs without the checkout: shipped configs by name, benchmarks, demo.

The checkout is copied to a temporary directory and built there, so the test
writes nothing into the checkout: with this environment's setuptools when it
can build wheels (>= 70.1, or the `wheel` package), else in pip's isolated
build environment (setuptools and wheel from the package index). The wheel is installed into a throwaway venv that reuses
this environment's packages through a .pth file (as /work/wt/mkwt.sh does), and
`trace-mega` is run from a directory outside both.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "allocation.prompts_per_step=8",
    "allocation.root_rollouts_per_step=12",
    "rollout.max_turns=4",
    "telemetry.tensorboard=false",
    "telemetry.progress_bars=false",
]
_SKIP = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "runs",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "bench_results",
    ".pytest_cache",
    ".hypothesis",
)


def _can_build_wheels_here() -> bool:
    try:
        return bool(importlib.util.find_spec("wheel") or importlib.util.find_spec("setuptools.command.bdist_wheel"))
    except ModuleNotFoundError:  # no setuptools at all
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    isolation = ["--no-build-isolation"] if _can_build_wheels_here() else []
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("trace_mega-*.whl")
    return whl


def test_wheel_ships_configs_benchmarks_kernels_and_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "trace_mega/configs/demo_cpu.yaml",
        "trace_mega/configs/qwen3_14b_multihop.yaml",
        "trace_mega/configs/qwen3_30b_a3b_bfcl.yaml",
        "trace_mega/benchmarks/bench_allocation.py",
        "trace_mega/kernels/tree_attention.py",
        "trace_mega/data/math/problems.jsonl",
        "trace_mega/data/multihop/corpus.jsonl",
        "trace_mega/resources.py",
        "trace_mega/commands/cli.py",
    ):
        assert path in names, path
    assert not any(n.startswith(("configs/", "benchmarks/", "kernels/", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "trace-mega = trace_mega.commands.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (sp,) = venv.glob("lib/python3*/site-packages")
    # This environment's packages (torch, megatron, pip, ...) behind the wheel's own trace_mega.
    # (Its .pth files are not run from there, so an editable trace_mega in it stays inactive.)
    base = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (sp / "_base_env.pth").write_text("\n".join(base) + "\n")
    py = venv / "bin" / "python"
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(OMP_NUM_THREADS="1")

    def run(*args, timeout=300):
        p = subprocess.run(
            [str(venv / "bin" / "trace-mega"), *args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert p.returncode == 0, (args, p.stdout[-3000:] + p.stderr[-3000:])
        return p

    where = subprocess.run(
        [str(py), "-c", "import trace_mega, trace_mega.kernels as k; print(trace_mega.__file__, k.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(sp) for p in where), where
    run("bench", "allocation", "--quick")
    assert (work / "bench_results" / "allocation.json").exists()
    run("train", "--config", "demo_cpu", "steps=1", *SMALL, "telemetry.out_dir=train_run")
    assert len((work / "train_run" / "metrics.jsonl").read_text().splitlines()) == 1
    run("pretrain", "--config", "pretrain_tools", "steps=2", "episodes_per_step=2")  # the demo's warm start, by name
    run("demo", "--out", "demo_run", "--from-scratch", "steps=1", *SMALL)  # (the full warm start is ~3-4 min)
    assert (work / "demo_run" / "report.md").exists()
    bad = subprocess.run(
        [str(venv / "bin" / "trace-mega"), "train", "--config", "demo_gpu"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    shipped = ", ".join(sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))  # the wheel carries every one
    assert bad.returncode == 2 and f"shipped: {shipped}\n" in bad.stderr and "demo_cpu" in shipped
