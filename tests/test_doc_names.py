"""Every code name and repository path the docs mention exists (docs/**/*.md and README.md).

Outside fenced code blocks:
* a backticked dotted name starting `trace_mega.` resolves: the longest module prefix that is a file of
  the package is imported, then the rest is looked up as attributes (a dataclass field, an annotation
  or an attribute a method assigns to `self` counts as an attribute of its class);
* a backticked `Class.attr` whose first part is a public class of the package resolves on that class
  (a class name defined in several modules: on any of them);
* a backticked repository path exists: `trace_mega/...`, `tests/...py::test_name`, `configs/...yaml`,
  ..., a `subpackage/module.py` relative to `trace_mega/`, and a bare `module.py` somewhere in the repo;
* relative Markdown links (with their `#anchor`) and `docs/X.md "Section"` references resolve.
Everywhere, code blocks included, `from trace_mega.x import a, b` names import.

Only the name is checked: a call signature or prose after it (`Learner.probe(packed, ...)`,
`Env.reset / step / reward`) is ignored. A module whose import fails only for want of an optional
GPU package is not checked, and the test says so in a warning instead of failing.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import warnings
from functools import cache
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "trace_mega"
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]

OPTIONAL = {"vllm", "transformer_engine", "flash_attn", "apex", "faiss", "wandb"}
"""Top-level packages that only a GPU machine or an optional extra has."""
REPO_DIRS = {"trace_mega", "tests", "benchmarks", "configs", "scripts", "docs", "requirements", ".ci"}
"""First components of the repository paths the docs may name."""
INSTALLED_AS = {"trace_mega.configs": "configs", "trace_mega.benchmarks": "benchmarks"}
"""setup.py installs these checkout directories under the package; in the checkout they live at the top."""
FILE_ROOTS = ["trace_mega", "tests", "benchmarks", "scripts"]
"""Where a bare `module.py` may live."""
PLACEHOLDERS = ("<", ">", "*", "{", "}", "$", "...", "NAME")
"""A path holding one of these is a pattern (`trace_mega/kernels/<op>_ref.py`, `bench_NAME.py`), not a file."""

FENCE = re.compile(r"^\s*(```|~~~)")
LEAD = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r"([\w./-]*\.md)\)?,?\s+\"([^\"]+)\"")
IMPORT = re.compile(r"^[ \t]*from[ \t]+(trace_mega[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]+)", re.M)


class OptionalMissing(Exception):
    """A module needs an optional package that is not installed here."""


# --- reading the docs ---------------------------------------------------------------------------


def _blocks(path: Path) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each paragraph outside fenced code blocks."""
    fenced, block, start = False, [], 0
    for i, line in enumerate(path.read_text().splitlines() + [""], 1):
        if FENCE.match(line) or fenced or not line.strip():
            if block:
                yield start, "\n".join(block)
                block = []
            if FENCE.match(line):
                fenced = not fenced
            continue
        if not block:
            start = i
        block.append(line)


def _spans(text: str) -> Iterator[tuple[int, str]]:
    """(offset, content) of each code span: a run of n backticks up to the next run of exactly n."""
    runs = [(m.start(), len(m.group())) for m in re.finditer(r"`+", text)]
    i = 0
    while i < len(runs):
        start, n = runs[i]
        close = next((j for j in range(i + 1, len(runs)) if runs[j][1] == n), None)
        if close is None:
            i += 1
            continue
        yield start, " ".join(text[start + n : runs[close][0]].split())
        i = close + 1


def _lead_name(span: str) -> Optional[str]:
    """The dotted name a span starts with, when what follows it is a call, prose or nothing."""
    m = LEAD.match(span)
    if m and (m.end() == len(span) or span[m.end()] in " ([,:"):
        return m.group()
    return None


def _plain(heading: str) -> str:
    return " ".join(heading.replace("`", "").split())


@cache
def _headings(path: Path) -> tuple[list[str], set[str]]:
    """The headings of a Markdown file (plain text) and their GitHub anchors."""
    titles, anchors, seen = [], set(), {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            title = _plain(m.group(1))
            titles.append(title)
            slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return titles, anchors


# --- the package -----------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _classes() -> dict[str, list[str]]:
    """Public top-level class name -> the modules of the package that define it (an AST scan)."""
    out: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                out.setdefault(node.name, []).append(_module_name(path))
    return out


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


@cache
def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in OPTIONAL:
            raise OptionalMissing(f"{name} needs the optional package {missing}") from exc
        raise


@cache
def _self_attributes(cls: type) -> frozenset[str]:
    """Names a class's own methods assign to `self` (instance attributes that `hasattr` cannot see)."""
    try:
        tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    except (TypeError, OSError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for sub in ast.walk(node):
                targets = sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]
                for t in [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return frozenset(names)


def _has(obj: object, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    if not inspect.isclass(obj):
        return False
    for c in obj.__mro__:
        fields = c.__dict__.get("__dataclass_fields__", {}) if dataclasses.is_dataclass(c) else {}
        if attr in fields or attr in c.__dict__.get("__annotations__", {}) or attr in _self_attributes(c):
            return True
    return False


def _walk(obj: object, owner: str, attrs: list[str]) -> Optional[str]:
    """None when `owner.attrs...` resolves from `obj`, else why not."""
    for attr in attrs:
        if not _has(obj, attr):
            return f"{owner} has no attribute {attr!r}"
        owner = f"{owner}.{attr}"
        obj = getattr(obj, attr, None)
        if obj is None:  # a field without a class-level value: nothing further to look into
            return None
    return None


def _check_dotted(name: str) -> Optional[str]:
    """A `trace_mega.` name: None when it resolves, else why not."""
    for prefix, directory in INSTALLED_AS.items():
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix) :].lstrip(".").split(".")
            path = ROOT / directory / "/".join(p for p in rest if p)
            return None if path.exists() or path.with_suffix(".py").exists() else f"no {path.relative_to(ROOT)}"
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        if _is_module(module):
            return _walk(_import(module), module, parts[k:])
    return "no such module"


def _check_class_attr(name: str) -> Optional[str]:
    """A `Class.attr` name whose class is defined in the package: None when it resolves, else why not."""
    cls_name, *attrs = name.split(".")
    errors, skipped = [], None
    for module in _classes()[cls_name]:
        try:
            cls = getattr(_import(module), cls_name)
        except OptionalMissing as exc:
            skipped = exc
            continue
        why = _walk(cls, f"{module}.{cls_name}", attrs)
        if why is None:
            return None
        errors.append(why)
    if skipped is not None:
        raise skipped
    return "; ".join(errors)


# --- repository paths -------------------------------------------------------------------------


@cache
def _basenames() -> frozenset[str]:
    names = {p.name for p in ROOT.glob("*.py")}
    for root in FILE_ROOTS:
        names.update(p.name for p in (ROOT / root).rglob("*.py"))
    return frozenset(names)


def _check_path(span: str) -> Optional[str]:
    """A backticked repository path: None when it exists (or the span is no such path), else why not."""
    if " " in span or any(p in span for p in PLACEHOLDERS) or "://" in span:
        return None
    path, *names = span.split("::")
    first = path.split("/")[0]
    if "/" in path and first in REPO_DIRS:
        target = ROOT / path
        dotted = path.rstrip("/").replace("/", ".")
        if any(dotted == k or dotted.startswith(k + ".") for k in INSTALLED_AS):
            target = ROOT / path.split("/", 1)[1]  # installed from the checkout's top-level directory
    elif "/" in path and (PKG / first).is_dir() and (path.endswith(".py") or path.endswith("/")):
        target = PKG / path
    elif re.fullmatch(r"\w+\.py", path):
        return None if path in _basenames() else f"no file {path} in {', '.join(FILE_ROOTS)} or the top level"
    else:
        return None
    if not target.exists():
        return f"no {target.relative_to(ROOT)}"
    if names and target.suffix == ".py":
        source = target.read_text()
        for n in names:
            n = n.split("[")[0]
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(n)}\b", source, re.M):
                return f"{target.relative_to(ROOT)} defines no {n}"
    return None


def _check_link(doc: Path, target: str) -> Optional[str]:
    if re.match(r"[a-z]+:", target):
        return None
    path, _, anchor = target.partition("#")
    file = (doc.parent / path).resolve() if path else doc
    if not file.exists():
        return "no such file"
    if anchor and file.suffix == ".md" and anchor not in _headings(file)[1]:
        return f"no heading with anchor #{anchor} in {file.relative_to(ROOT)}"
    return None


def _check_section(doc: Path, md: str, title: str) -> Optional[str]:
    file = ROOT / md if (ROOT / md).exists() else doc.parent / md
    if not file.exists():
        return f"no file {md}"
    title = _plain(title).lower()
    if any(h.lower().startswith(title) for h in _headings(file)[0]):
        return None
    return f"{file.relative_to(ROOT)} has no section {title!r}"


# --- the test ------------------------------------------------------------------------------------


def _problems(doc: Path) -> tuple[list[str], list[str]]:
    """(failures, names left unchecked for want of an optional package) of one doc, as `file:line: ...`."""
    rel = doc.relative_to(ROOT)
    bad, unchecked = [], []

    def check(line: int, what: str, fn, *args) -> None:
        try:
            why = fn(*args)
        except OptionalMissing as exc:
            unchecked.append(f"{rel}:{line}: {what}: {exc}")
            return
        except Exception as exc:  # an import that fails is a finding too
            why = f"{type(exc).__name__}: {exc}"
        if why:
            bad.append(f"{rel}:{line}: {what}: {why}")

    for start, text in _blocks(doc):
        for offset, span in _spans(text):
            line = start + text[:offset].count("\n")
            name = _lead_name(span)
            if name and name.startswith("trace_mega."):
                check(line, f"`{name}`", _check_dotted, name)
            elif name and name.split(".")[0] in _classes():
                check(line, f"`{name}`", _check_class_attr, name)
            else:
                check(line, f"`{span}`", _check_path, span)
        for m in LINK.finditer(text):
            check(start + text[: m.start()].count("\n"), f"link ({m.group(1)})", _check_link, doc, m.group(1))
        for m in SECTION_REF.finditer(text):
            line = start + text[: m.start()].count("\n")
            check(line, f'{m.group(1)} "{m.group(2)}"', _check_section, doc, m.group(1), m.group(2))
    source = doc.read_text()
    for m in IMPORT.finditer(source):
        line = source[: m.start()].count("\n") + 1
        module = m.group(1)
        for name in re.sub(r"#[^\n]*", "", m.group(2)).strip("()").split(","):
            name = name.split(" as ")[0].strip()
            if name:
                check(line, f"from {module} import {name}", _check_dotted, f"{module}.{name}")
    return bad, unchecked


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_names_and_paths_in_the_docs_exist(doc: Path) -> None:
    bad, unchecked = _problems(doc)
    for item in unchecked:
        warnings.warn(f"not checked: {item}", stacklevel=1)
    assert not bad, f"{len(bad)} name(s) in the docs that do not exist:\n" + "\n".join(bad)


def test_the_checks_find_what_they_should() -> None:
    """The checks themselves: a real name passes, a stale one fails, prose is left alone."""
    assert _check_dotted("trace_mega.rollout.tree.PackedTrees") is None
    assert _check_dotted("trace_mega.step.StepBatch.update") is None  # a dataclass field
    assert _check_dotted("trace_mega.learner.probe") is not None  # moved to trace_mega.credit.probe
    assert _check_class_attr("Learner.train_step") is None
    assert _check_class_attr("RolloutCollector.engine") is None  # assigned in __init__
    assert _check_class_attr("Learner.encode") is not None
    assert _lead_name("Learner.probe(packed, trees, ...)") == "Learner.probe"
    assert _lead_name("Env.reset / step / reward") == "Env.reset"
    assert _check_path("trace_mega/rollout/tree.py") is None
    assert _check_path("learner/probe.py") is not None
    assert _check_path("credit_metrics.py") is not None
    assert _check_path("tests/test_step.py::test_no_such_test") is not None
    assert _check_path("loss/logprob_mismatch") is None  # a metric name, not a path
    assert list(_spans("a `x` b ``y ` z`` c")) == [(2, "x"), (8, "y ` z")]
