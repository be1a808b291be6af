"""Reading a dataset's rows without copying: a ``datasets.Dataset``, a list or dict of columns, or a
``.jsonl`` / ``.json`` / ``.parquet`` file (errors name the file, line and what to change).

``datasets`` itself is never imported; Parquet files are read with ``pyarrow``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from swiftune.data.row_formats import DataFormatError


def load_rows(data: Any) -> Sequence[Mapping[str, Any]]:
    """Rows of ``data`` as a sequence of mappings, without copying a ``datasets.Dataset``.

    ``datasets`` itself is never imported here: a Dataset is recognised by its
    ``column_names``; Parquet files are read with ``pyarrow`` (which ``datasets`` installs).
    """
    if isinstance(data, (str, os.PathLike)):
        return _read_file(os.fspath(data))
    if hasattr(data, "column_names") and isinstance(data.column_names, dict):
        raise DataFormatError(
            f"got a DatasetDict with splits {sorted(data.column_names)}; pass one split, "
            "e.g. dataset['train']"
        )
    if hasattr(data, "column_names"):
        if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
            return data  # datasets.Dataset: indexable, yields dict rows, no copy
        return list(data)  # datasets.IterableDataset: read it once
    if isinstance(data, Mapping):
        columns = list(data)
        if columns and all(isinstance(data[c], Sequence) and not isinstance(data[c], str) for c in columns):
            n = len(data[columns[0]])
            return [{c: data[c][i] for c in columns} for i in range(n)]
        raise DataFormatError("a dict dataset must map column names to equal-length lists")
    if isinstance(data, Iterable):
        rows = data if isinstance(data, Sequence) else list(data)
        for row in rows[:1]:
            if not isinstance(row, Mapping):
                raise DataFormatError(
                    f"dataset rows must be dicts, got {type(row).__name__}; "
                    "e.g. [{'prompt': ..., 'completion': ...}]"
                )
        return rows
    raise DataFormatError(
        f"cannot read a dataset from {type(data).__name__}; pass a datasets.Dataset, a list of "
        "dicts, or a path to a .jsonl / .json / .parquet file"
    )


def _decode_utf8(path: str, raw: bytes) -> str:
    """The file's text; not UTF-8: an error naming the file, line and byte. A UTF-8 BOM is dropped."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataFormatError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); JSON data files "
            "must be UTF-8: re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from err


def _json_rows(path: str, text: str) -> list[dict]:
    """Rows of a JSON array, or of JSON lines (one object a line); errors name the file and line."""
    if text.lstrip().startswith("["):  # a .json file holding one array of rows
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataFormatError(
                f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}); the file holds a JSON array of "
                "rows, so the whole file must parse (or write one JSON object a line, JSON lines)"
            ) from err
        where = [f"{path}: element {i} of the JSON array" for i in range(len(rows))]
    else:
        rows, where = [], []
        for line_number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataFormatError(f"{path}:{line_number}: not valid JSON ({err.msg})") from err
                where.append(f"{path}:{line_number}")
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise DataFormatError(
                f"{at} is a JSON {type(row).__name__}, not an object; each row must be an object such as "
                '{"prompt": ..., "completion": ...}'
            )
    return rows


def _read_file(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise DataFormatError(f"dataset file {path!r} does not exist")
    if os.path.isdir(path):
        raise DataFormatError(
            f"{path} is a folder, not a dataset file: pass a .jsonl, .json or .parquet file, or the folder loaded "
            "with datasets (datasets.load_from_disk for save_to_disk output, datasets.load_dataset(folder, "
            "split='train') for a folder of data files)"
        )
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # lazy: only Parquet input needs it
        except ImportError as err:
            raise DataFormatError(
                f"reading {path!r} needs pyarrow: pip install pyarrow (or datasets)"
            ) from err
        return pq.read_table(path).to_pylist()
    if suffix in (".jsonl", ".json"):
        with open(path, "rb") as f:
            return _json_rows(path, _decode_utf8(path, f.read()))
    raise DataFormatError(
        f"unsupported dataset file type {suffix!r} ({path}); use .jsonl, .json or .parquet"
    )


def is_named_datasets(data: Any) -> bool:
    """Whether ``data`` is transformers' named datasets (``{"name": dataset, ...}``, as ``eval_dataset``
    takes them) rather than one dataset given as a dict of columns: every value is a dataset (a
    ``datasets.Dataset``, a file path, rows as a list of dicts, or rows already prepared), where a
    column's values are strings, numbers or lists of them."""
    if not isinstance(data, Mapping) or not data:
        return False

    def dataset_like(value: Any) -> bool:
        if hasattr(value, "column_names") or hasattr(value, "examples") or isinstance(value, (str, os.PathLike)):
            return True
        return isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) > 0 \
            and isinstance(value[0], Mapping)

    return all(dataset_like(v) for v in data.values())


def each_named(data: Any, prepare: Any) -> Any:
    """``prepare(data)``, or for named datasets (:func:`is_named_datasets`) ``{name: prepare(d)}``; None
    stays None."""
    if data is None:
        return None
    if is_named_datasets(data):
        return {name: prepare(d) for name, d in data.items()}
    return prepare(data)
