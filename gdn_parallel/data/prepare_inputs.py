"""The inputs of prepare.py (gdn-prepare-data): which files, cut into work items, read back as document texts.

Formats, by suffix: `.jsonl` / `.ndjson` (one JSON object per line, its text under a key; a blank
line is no document), `.parquet` (a string column; needs pyarrow), anything else text (one file is
one document, as data.source reads it; a binary file is skipped and counted). A directory input
takes the files with one of the given suffixes (the rules of gdn_parallel.data.text_files).

A work item is a piece of one file that is read independently: a whole text file, a byte range of a
JSON-lines file (it owns the lines that start inside it), or a range of a Parquet file's row groups.
Items are plain JSON-able dicts, so the plan of a preparation can be saved and resumed.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from .text_files import is_text, list_text_files, read_file

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
RECORD_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES


def input_format(path: str) -> str:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def list_inputs(inputs: Sequence[str], suffixes: Sequence[str]) -> list[Path]:
    """The files of every input (a file, a directory filtered by `suffixes`, or a glob), in the
    order given, each input's files sorted, duplicates dropped. ValueError for an input that names
    nothing."""
    files: list[Path] = []
    for item in inputs:
        listing = list_text_files(item, suffixes)
        if listing is None:
            raise ValueError(f"input {item!r} does not exist (give files, directories or glob patterns)")
        if not listing.files:
            raise ValueError(f"input {item!r} holds no file with a suffix of {','.join(suffixes) or '*'} "
                             f"(change --suffixes)")
        files.extend(path.resolve() for _, path in listing.files)
    return list(dict.fromkeys(files))


def holds_records(files: Sequence[Path]) -> bool:
    """Whether any file is JSON lines or Parquet (the formats with a text key)."""
    return any(input_format(str(path)) != "text" for path in files)


def plan_items(path: Path, chunk_bytes: int) -> list[dict]:
    """The work items of one file; `chunk_bytes` bounds a JSON-lines range."""
    size = path.stat().st_size
    kind = input_format(str(path))
    if kind == "jsonl":
        return [{"path": str(path), "format": kind, "begin": begin, "end": min(begin + chunk_bytes, size),
                 "bytes": min(chunk_bytes, size - begin)} for begin in range(0, size, chunk_bytes)]
    if kind == "parquet":
        metadata = _parquet(path).metadata
        groups = [metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)]
        scale = size / max(sum(groups), 1)   # progress in file bytes, shared by the groups' data sizes
        return [{"path": str(path), "format": kind, "begin": i, "end": i + 1, "bytes": int(groups[i] * scale)}
                for i in range(len(groups))]
    return [{"path": str(path), "format": "text", "begin": 0, "end": size, "bytes": size}]


def read_texts(item: dict, text_key: str, counts: Counter) -> Iterator[str]:
    """The document texts of a work item. Counts binary files and empty documents in `counts`;
    ValueError for a record that is not what --text-key says."""
    if item["format"] == "jsonl":
        yield from _jsonl_texts(item, text_key, counts)
    elif item["format"] == "parquet":
        yield from _parquet_texts(item, text_key, counts)
    else:
        data = read_file(Path(item["path"]))
        if data is None:
            raise ValueError(f"{item['path']} cannot be read")
        if not data:
            counts["empty_documents"] += 1
        elif not is_text(data):
            counts["binary_files"] += 1
        else:
            yield data.decode("utf-8")


def _jsonl_texts(item: dict, text_key: str, counts: Counter) -> Iterator[str]:
    path, begin, end = item["path"], item["begin"], item["end"]
    with open(path, "rb") as fh:
        if begin > 0:   # a line that starts before the range belongs to the range before
            fh.seek(begin - 1)
            if fh.read(1) != b"\n":
                fh.readline()
        where = fh.tell()
        while where < end:
            line = fh.readline()
            if not line:
                break
            line_start, where = where, where + len(line)   # counted, not fh.tell(): cheaper per line
            if not line.strip():
                continue
            where_text = f"{path} at byte {line_start}"
            text = _record_text(_json_record(line, path, line_start), text_key, where_text, counts)
            if text is not None:
                yield text


def _json_record(line: bytes, path: str, where: int):
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} at byte {where}: not a JSON line ({err})") from None


def _record_text(record, text_key: str, where: str, counts: Counter) -> str | None:
    """The record's text; None for an empty one (counted: an empty document has no tokens)."""
    if not isinstance(record, dict) or text_key not in record:
        keys = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: the record has no key {text_key!r} (it has {keys}); name the text "
                         f"field with --text-key")
    text = record[text_key]
    if text is None or text == "":
        counts["empty_documents"] += 1
        return None
    if not isinstance(text, str):
        raise ValueError(f"{where}: {text_key!r} holds a {type(text).__name__}, not text; name the text "
                         f"field with --text-key")
    return text


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path} is Parquet, which needs pyarrow: pip install pyarrow") from None
    return pq.ParquetFile(str(path))


def _parquet_texts(item: dict, text_key: str, counts: Counter) -> Iterator[str]:
    parquet = _parquet(Path(item["path"]))
    names = parquet.schema_arrow.names
    if text_key not in names:
        raise ValueError(f"{item['path']} has no column {text_key!r} (columns: {names[:10]}); name the "
                         f"text column with --text-key")
    groups = list(range(item["begin"], item["end"]))
    where = f"{item['path']} (row groups {groups[0]}..{groups[-1]})"
    for batch in parquet.iter_batches(batch_size=1024, row_groups=groups, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            text = _record_text({text_key: value}, text_key, where, counts)
            if text is not None:
                yield text


def suffixes_with_records(text_suffixes: Sequence[str]) -> tuple:
    """The tool's default input suffixes: data.text_suffixes' text files plus the record formats."""
    return tuple(dict.fromkeys(tuple(text_suffixes) + RECORD_SUFFIXES)) if text_suffixes else ()

