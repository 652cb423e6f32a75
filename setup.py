"""Package layout; all other metadata lives in pyproject.toml.

`configs/` and `benchmarks/` sit at the top of the repository (beside
`trace_mega/`) but are installed as `trace_mega.configs` and
`trace_mega.benchmarks`, never as top-level packages; the YAML configs are
their package's data (pyproject.toml). The Triton kernels live in
`trace_mega/kernels/` itself: a top-level `kernels` directory on `sys.path`
(any run from the checkout's root) shadows the Hugging Face `kernels` package,
which `transformers` >= 5.25 imports when it finds one.
"""

from setuptools import find_packages, setup

MAPPED = {"trace_mega.configs": "configs", "trace_mega.benchmarks": "benchmarks"}
packages = find_packages(include=["trace_mega", "trace_mega.*"]) + list(MAPPED)

setup(packages=packages, package_dir=MAPPED)
