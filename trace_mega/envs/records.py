"""Rows of the dataset files the environments load: JSONL, JSON, Parquet.

* `.parquet` — every row as a dict (nested columns as dicts / lists), read with
  pyarrow: the layout of verl / Search-R1 style data (`prompt` chat messages,
  `data_source`, `reward_model.ground_truth`) and of HF dataset exports;
* JSON (a file starting with `[` or `{`, not named `.jsonl`) — a list of rows, or an object
  holding one under `data` / `examples`, or one object (one row);
* `.jsonl`, and any other file that is neither — JSON Lines (one object per non-empty line).

A row that cannot be used raises `DataError`, whose message is one line naming
the place and what is wrong: `data/x.jsonl:17: invalid JSON (...)` (JSON Lines:
the line number, from 1) or `data/hotpot.json row 3: missing field 'answer'`
(JSON and Parquet: the row's index in the file, from 0). With
`on_bad_row="skip"` (`load_rows`) bad rows are left out instead and counted in
one warning per file; a file that cannot be read at all always raises.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

__all__ = ["BAD_ROW_POLICIES", "DataError", "Record", "as_paths", "check_on_bad_row", "load_rows", "read_records"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_LIST_KEYS = ("data", "examples")
BAD_ROW_POLICIES = ("error", "skip")
"""`on_bad_row` of the loaders: error (raise `DataError` at the first bad row) | skip (leave bad rows out)."""


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message is one line: place, then what is wrong."""


@dataclass(frozen=True)
class Record:
    """One row of a dataset file, or why it could not be read."""

    place: str
    """`path:LINE` (JSON Lines) or `path row N` (JSON, Parquet): where the row is, for messages."""
    index: int
    """Position among the file's rows, from 0, bad rows included (default task ids use it, so
    skipping a bad row does not renumber the others)."""
    row: Any = None
    """The parsed row (a dict), None when `error` is set."""
    error: Optional[str] = None
    """Why the row could not be read (invalid JSON, not an object), else None."""


def _json_error(err: json.JSONDecodeError) -> str:
    return f"invalid JSON ({err.msg}: column {err.colno})"  # json's own wording, less the line (the place has it)


def _records_of(path: Path, rows: Any) -> list[Record]:
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a list of rows, got {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        bad = None if isinstance(row, dict) else f"not a JSON object (got {type(row).__name__})"
        out.append(Record(f"{path} row {i}", i, row if bad is None else None, bad))
    return out


def read_rows(path: str | Path) -> list[Record]:
    """The rows of one dataset file with their places (see the module docstring). A file that
    cannot be read or parsed as a whole raises `DataError`; a bad JSON Lines line or a row
    that is not an object comes back as a `Record` with its `error`."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
            raise DataError(f"{path}: unreadable Parquet file ({type(err).__name__}: {err})") from None
        return _records_of(path, table.to_pylist())
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err})") from None
    # A `.jsonl` file is JSON Lines whatever its first line holds (a one-row file is an object too).
    head = "" if path.suffix == ".jsonl" else text.lstrip()[:1]
    if head == "[":
        try:
            return _records_of(path, json.loads(text))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: {_json_error(err)}") from None
    if head == "{":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:  # several objects: JSON Lines
            obj = None
        if isinstance(obj, dict):
            for key in _LIST_KEYS:
                if isinstance(obj.get(key), list):
                    return _records_of(path, obj[key])
            return _records_of(path, [obj])
    out = []
    # Split on "\n" only: str.splitlines also splits at U+2028 and friends, which JSON strings may
    # hold raw, and the line numbers would no longer be an editor's.
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        place = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            out.append(Record(place, len(out), error=_json_error(err)))
            continue
        bad = None if isinstance(row, dict) else f"not a JSON object (got {type(row).__name__})"
        out.append(Record(place, len(out), row if bad is None else None, bad))
    return out


def row_error(place: str, err: Exception) -> DataError:
    """`err`, raised while reading the row at `place`, as the one-line `DataError`."""
    if isinstance(err, KeyError):
        what = f"missing field {err.args[0]!r}" if err.args else "missing field"
    elif isinstance(err, (TypeError, AttributeError)):  # e.g. a string where a list of answers belongs
        what = f"malformed field value ({err})"
    else:
        what = str(err)
    return DataError(f"{place}: {what}")


def check_on_bad_row(on_bad_row: str) -> None:
    """ValueError unless `on_bad_row` is one of `BAD_ROW_POLICIES`."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {', '.join(BAD_ROW_POLICIES)}, not {on_bad_row!r}")


def load_rows(path: str | Path, make: Callable[[int, dict[str, Any]], T], on_bad_row: str = "error") -> list[T]:
    """`make(index, row)` of every row of `path`, in order.

    A row that cannot be read, or for which `make` raises KeyError (a missing field),
    ValueError, TypeError or AttributeError (a malformed one), raises `DataError` naming its
    place (`on_bad_row="error"`), or is left out (`"skip"`): the skipped rows are counted in one
    warning per file, which names the first of them.
    """
    check_on_bad_row(on_bad_row)
    records = read_rows(path)
    out: list[T] = []
    bad: list[DataError] = []
    for rec in records:
        try:
            if rec.error is not None:
                raise DataError(rec.error)
            out.append(make(rec.index, rec.row))
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            error = row_error(rec.place, err)
            if on_bad_row == "error":
                raise error from None
            bad.append(error)
    if bad:
        log.warning(
            "%s: skipped %d bad row(s) of %d (on_bad_row: skip); the first: %s", path, len(bad), len(records), bad[0]
        )
    return out


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one dataset file (see the module docstring); `DataError` at the first bad one."""
    return load_rows(path, lambda index, row: row)


def as_paths(spec: str | Path | Sequence[str | Path]) -> list[Path]:
    """One path or a list of paths (an environment split may join several benchmark files)."""
    if isinstance(spec, (str, Path)):
        return [Path(spec)]
    return [Path(p) for p in spec]
