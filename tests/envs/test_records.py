"""records: the rows of JSON / JSONL / Parquet dataset files, and one-line errors naming their place."""

import json

import pytest

from trace_mega.envs.records import DataError, load_rows, read_records


def test_layouts_and_line_numbers(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"data": [1, 2]}) + "\n")  # a one-row JSONL file is JSON Lines, not a wrapper
    assert read_records(one) == [{"data": [1, 2]}]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"examples": [{"a": 1}, {"a": 2}]}))
    assert read_records(wrapped) == [{"a": 1}, {"a": 2}]
    sep = tmp_path / "sep.jsonl"  # U+2028 may stand raw in a JSON string; it does not end a line
    sep.write_text('{"q": "a\u2028b"}\n\n{"q": 1,}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"sep\.jsonl:3: invalid JSON \(Expecting property name enclosed"):
        read_records(sep)
    assert load_rows(sep, lambda n, row: (n, row["q"]), on_bad_row="skip") == [(0, "a\u2028b")]


def test_unreadable_files_raise_one_line(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"q": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl: not UTF-8 text \(byte 10: invalid continuation byte\)$"):
        read_records(latin)
    with pytest.raises(DataError, match=r"missing\.jsonl: cannot read \(No such file or directory\)$"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        load_rows(latin, lambda n, row: row, on_bad_row="drop")
