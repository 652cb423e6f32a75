"""Rows of the dataset files the environments load: JSONL, JSON, Parquet.

* `.parquet` — every row as a dict (nested columns as dicts / lists), read with
  pyarrow: the layout of verl / Search-R1 style data (`prompt` chat messages,
  `data_source`, `reward_model.ground_truth`) and of HF dataset exports;
* JSON — a list of rows, or an object holding one under `data` / `examples`;
* anything else — JSON Lines (one object per non-empty line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

_LIST_KEYS = ("data", "examples")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one dataset file (see the module docstring)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    head = text.lstrip()[:1]
    if head == "[":
        return json.loads(text)
    if head == "{":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:  # several objects: JSON Lines
            obj = None
        if isinstance(obj, dict):
            for key in _LIST_KEYS:
                if isinstance(obj.get(key), list):
                    return obj[key]
            return [obj]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def as_paths(spec: str | Path | Sequence[str | Path]) -> list[Path]:
    """One path or a list of paths (an environment split may join several benchmark files)."""
    if isinstance(spec, (str, Path)):
        return [Path(spec)]
    return [Path(p) for p in spec]
