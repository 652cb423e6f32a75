"""Package layout; all other metadata lives in pyproject.toml.

`kernels/` sits at the top of the repository (beside `trace_mega/`) but is
installed as `trace_mega.kernels`, never as a top-level package `kernels`.
"""
from setuptools import find_packages, setup

packages = find_packages(include=["trace_mega", "trace_mega.*"])
packages += ["trace_mega.kernels"]

setup(packages=packages, package_dir={"trace_mega.kernels": "kernels"})
