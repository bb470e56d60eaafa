"""Corpora as researchers hold them: files whose rows are documents, each row's text in one
field (`data.text_field`, default "text"). FineWeb, FineWeb-Edu, DCLM, Dolma and SlimPajama come
this way:

- Parquet files (`.parquet`), the column `text_field`;
- JSON Lines (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`, also `.json`, `.json.gz` and `.json.zst` as
  Dolma and `datasets.Dataset.to_json` name them), one JSON object per line, its key
  `text_field`;
- a Hugging Face `datasets` directory written by `Dataset.save_to_disk` (state.json,
  dataset_info.json and the Arrow files it lists, read in its order).

Every row is one document, named "<file>#<row>" (row counting from 0, blank JSONL lines not
counted): `sources.read_text` reads these beside plain text. A row whose text is empty or
whitespace gives no document (as an empty text file gives none). A missing field, a row that is
not a string, text that is not valid Unicode (invalid UTF-8, a lone surrogate escape), or a
corrupt or truncated file is a one-line ValueError naming the file and the row (a Parquet
file's row group and its rows).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterator

from transformer.utils import cli, fileio

TEXT_FIELD = "text"
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst", ".ndjson")
DATASET_FILES = ("state.json", "dataset_info.json")  # what save_to_disk writes beside its data


def kind(path: str) -> str:
    """"parquet", "jsonl", "datasets" (a save_to_disk directory) or "text".

    >>> [kind(p) for p in ("a/b.parquet", "c.jsonl.zst", "d.JSONL", "e.json", "notes.txt")]
    ['parquet', 'jsonl', 'jsonl', 'jsonl', 'text']
    """
    return table_kind(path) or ("datasets" if is_dataset_dir(path) else "text")


def table_kind(path: str) -> str | None:
    """"parquet" or "jsonl" by the file's name (no file is read), else None."""
    name = os.path.basename(path).lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_JSONL):
        return "jsonl"
    return None


def is_dataset_dir(path: str) -> bool:
    """Whether `path` is a directory `datasets.Dataset.save_to_disk` wrote."""
    return all(fileio.isfile(os.path.join(path, name)) for name in DATASET_FILES)


def dataset_dir_of(file: str) -> str | None:
    """The save_to_disk directory `file` belongs to (its own folder), or None."""
    parent = os.path.dirname(file)
    return parent if parent and is_dataset_dir(parent) else None


DATASET_DICT = "dataset_dict.json"  # what DatasetDict.save_to_disk writes beside its splits


def refuse_dataset_dict(directory: str) -> None:
    """A one-line error if `directory` is a DatasetDict's (its splits would all be read)."""
    if fileio.isfile(os.path.join(directory, DATASET_DICT)):
        with fileio.open_binary(os.path.join(directory, DATASET_DICT)) as f:
            splits = sorted(json.load(f).get("splits") or ["train"])
        raise ValueError(f"{directory}: a DatasetDict of splits {splits}: expected one split's "
                         f"directory (e.g. {os.path.join(directory, splits[0])})")


# A split's file as the Hugging Face Hub names it: train-00000-of-00004.parquet (optionally
# followed by a hash), or train.jsonl; group 1 is the split's name. The names and aliases are
# those `datasets` infers splits from (its SPLIT_KEYWORDS): "eval" is the test split there.
_HUB_SPLITS = {"train": "train", "training": "train", "validation": "validation",
               "valid": "validation", "val": "validation", "dev": "validation",
               "test": "test", "testing": "test", "eval": "test", "evaluation": "test"}
_HUB_SPLIT_FILE = re.compile(rf"({'|'.join(_HUB_SPLITS)})(-\d+-of-\d+(-[0-9a-f]+)?)?\.")


def hub_splits(directory: str, tables: list[str]) -> dict[str, tuple[str, bool]]:
    """split -> (its first file, False) for split-named files (train.jsonl), or (its folder,
    True) for files under a split-named folder below `directory` (the Hub's Parquet export:
    default/train/0000.parquet)."""
    splits, root = {}, directory.rstrip("/") + "/"
    for file in tables:
        if match := _HUB_SPLIT_FILE.match(os.path.basename(file).lower()):
            splits.setdefault(_HUB_SPLITS[match[1]], (file, False))
            continue
        # folders between `directory` and the file (none when a path does not start with it)
        folders = os.path.dirname(file)[len(root):].split("/") if file.startswith(root) else []
        for k, folder in enumerate(folders):
            if folder.lower() in _HUB_SPLITS:
                path = os.path.join(directory, *folders[:k + 1])
                splits.setdefault(_HUB_SPLITS[folder.lower()], (path, True))
                break
    return splits


def read_rows(path: str, text_field: str = TEXT_FIELD) -> Iterator[tuple[int, str]]:
    """(row, text) for each row of a Parquet file, a JSON Lines file or a save_to_disk
    directory (`kind`), in order."""
    readers = {"parquet": _parquet_rows, "jsonl": _jsonl_rows, "datasets": _dataset_rows}
    yield from readers[kind(path)](path, text_field)


def _text(value, path: str, row: int, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{path}: row {row}: {field}={cli.short_repr(value)} is "
                         f"{type(value).__name__}: expected a string of text")
    return value


def _unicode(text: str, path: str, row: int, field: str) -> str:
    """`text` if UTF-8 can encode it: a JSON escape such as "\\ud800" decodes to a lone
    surrogate, which no encoder (nor tokenizer) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{path}: row {row}: {field} holds {text[e.start]!r} at character "
                         f"{e.start}, a lone surrogate: expected valid Unicode text") from None
    return text


class _Zstd(io.RawIOBase):
    """A .zst file's bytes, its frames one after another; an end of file inside a frame raises
    zstandard.ZstdError (`ZstdDecompressor.stream_reader` reads a truncated file as a shorter
    one, with no error)."""

    def __init__(self, raw):
        import zstandard

        self._raw, self._decompressor, self._frame = raw, zstandard.ZstdDecompressor(), None
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        import zstandard

        while self._at == len(self._out):
            compressed = self._raw.read(1 << 20)
            if not compressed:
                if self._frame is not None and not self._frame.eof:
                    raise zstandard.ZstdError("the file ends inside a zstd frame (truncated)")
                return 0
            self._out, self._at = b"", 0
            while compressed:  # a frame's end may fall inside the chunk: the next one follows
                if self._frame is None or self._frame.eof:
                    self._frame = self._decompressor.decompressobj()
                self._out += self._frame.decompress(compressed)
                compressed = self._frame.unused_data if self._frame.eof else b""
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = memoryview(self._out)[self._at:self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open_binary(path: str) -> io.BufferedIOBase:
    """The file's bytes, decompressed by its suffix (.gz, .zst)."""
    raw = fileio.open_binary(path)
    if path.lower().endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if path.lower().endswith(".zst"):
        return io.BufferedReader(_Zstd(raw), 1 << 20)
    return raw


def _invalid_utf8(path: str) -> str:
    """Where the first byte that is not UTF-8 is: "row R (line L): invalid UTF-8 at byte B of
    the line" (the text reader decodes ahead of the line it yields, so it cannot say)."""
    row = 0
    with _open_binary(path) as lines:
        for line_number, data in enumerate(lines, 1):
            try:
                blank = not data.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                return (f"row {row} (line {line_number}): invalid UTF-8 at byte {e.start} of "
                        "the line")
            row += not blank
    return "invalid UTF-8"


_ONE_DOCUMENT_MAX = 64 << 20  # a larger file is not read whole to see if it is one document


def _one_json_document(path: str) -> bool:
    """Whether the file parses as one JSON document (an indented JSON file: metadata such as
    dataset_infos.json, or a JSON array), read whole if it is at most 64 MiB."""
    try:
        with _open_binary(path) as f:
            data = f.read(_ONE_DOCUMENT_MAX + 1)
        if len(data) > _ONE_DOCUMENT_MAX:
            return False
        json.loads(data.decode("utf-8-sig"))
        return True
    except Exception:  # unreadable or not JSON as a whole: the line's own error stands
        return False


def _no_field(path: str, row: int, line_number: int, record, field: str) -> None:
    """The one line for a JSON Lines row that is no object holding `field`. A first row that
    is the whole file may be metadata on one line (datasets writes dataset_infos.json so; a
    JSON array): that is said too."""
    whole = row == 0 and _one_json_document(path)
    if whole and not isinstance(record, dict):
        raise ValueError(f"{path}: one JSON document ({type(record).__name__}), not JSON Lines "
                         "(one record a line): expected JSON Lines; if it is not corpus, point "
                         "data.path at the corpus files alone (a glob)")
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{path}: row {row} (line {line_number}) has no {field!r} field (it has "
                     f"{keys}): expected data.text_field to name the field that holds the text"
                     + ("; if the file is not corpus (one JSON document, such as "
                        "dataset_infos.json), point data.path at the corpus files alone (a glob)"
                        if whole else ""))


def _jsonl_rows(path: str, field: str) -> Iterator[tuple[int, str]]:
    import zstandard

    row, line_number = 0, 0
    try:
        # utf-8-sig skips a byte-order mark at the start; rows are counted, so none shift
        with io.TextIOWrapper(_open_binary(path), encoding="utf-8-sig") as lines:
            for line_number, line in enumerate(lines, 1):  # noqa: B007 - read in the except
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    if row == 0 and _one_json_document(path):
                        raise ValueError(f"{path}: one JSON document, not JSON Lines (one "
                                         "record a line): expected JSON Lines; if it is not "
                                         "corpus, point data.path at the corpus files alone "
                                         "(a glob)") from None
                    raise ValueError(f"{path}: row {row} (line {line_number}): not JSON ({e}): "
                                     "expected JSON Lines, one JSON object per line") from None
                if not isinstance(record, dict) or field not in record:
                    _no_field(path, row, line_number, record, field)
                text = _text(record[field], path, row, field)
                yield row, _unicode(text, path, row, field) if "\\u" in line else text
                row += 1
    except UnicodeDecodeError:
        raise ValueError(f"{path}: {_invalid_utf8(path)}: expected UTF-8 text") from None
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:
        # `row` counts the rows read, so the last one read is row - 1 (line_number is the last
        # line read); "row 0 (line 0)" when none was.
        raise ValueError(f"{path}: unreadable after row {max(row - 1, 0)} (line {line_number}): "
                         f"{type(e).__name__}: {e}: expected a complete, uncorrupted "
                         "file") from None


def _holds_text(column_type) -> bool:
    """Whether a column of `column_type` holds strings: string, large_string, string_view, or a
    dictionary of them (what a pandas categorical column is written as); to_pylist reads each
    as Python strings."""
    import pyarrow as pa

    if pa.types.is_dictionary(column_type):
        column_type = column_type.value_type
    is_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16, which added views
    return (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            or bool(is_view and is_view(column_type)))


def _table_rows(batches, path: str, field: str, schema) -> Iterator[tuple[int, str]]:
    """Rows of Arrow record batches whose schema has `field` as a string column."""

    if field not in schema.names:
        raise ValueError(f"{path}: no {field!r} column (it has {schema.names}): expected "
                         "data.text_field to name the column that holds the text")
    column_type = schema.field(field).type
    if not _holds_text(column_type):
        raise ValueError(f"{path}: row 0: the {field!r} column holds {column_type}: expected "
                         "strings of text")
    row = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(field))
        try:
            values = column.to_pylist()
        except UnicodeDecodeError:  # Arrow checks no UTF-8 on read: find the row
            for k, value in enumerate(column):
                try:
                    value.as_py()
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: row {row + k}: {field} holds invalid UTF-8 at "
                                     f"byte {e.start}: expected UTF-8 text") from None
            raise
        for value in values:
            yield row, _text(value, path, row, field)
            row += 1


def _parquet_rows(path: str, field: str) -> Iterator[tuple[int, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with fileio.open_binary(path) as file, pq.ParquetFile(file) as table:
            schema = table.schema_arrow
            columns = [field] if field in schema.names else []
            yield from _table_rows(_row_groups(table, columns, path), path, field, schema)
    except (pa.ArrowException, OSError) as e:  # the footer: no row group to name
        raise ValueError(f"{path}: unreadable Parquet ({_line(e)}): expected a complete "
                         "Parquet file") from None


def _line(error: Exception) -> str:
    """"Type: message" on one line (Thrift's errors hold line breaks)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _row_groups(table, columns: list[str], path: str):
    """The record batches of a ParquetFile, row group by row group, so that a corrupt page is
    named by its row group and rows (a..b, both included)."""
    import pyarrow as pa

    start = 0
    for group in range(table.num_row_groups):
        rows = table.metadata.row_group(group).num_rows
        try:
            yield from table.iter_batches(row_groups=[group], columns=columns)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: row group {group} (rows {start}..{start + rows - 1}): "
                             f"unreadable Parquet ({_line(e)}): expected a complete, "
                             "uncorrupted Parquet file") from None
        start += rows


def _dataset_rows(directory: str, field: str) -> Iterator[tuple[int, str]]:
    """A save_to_disk directory's rows: its Arrow files (IPC streams) in state.json's order."""
    import pyarrow as pa

    with fileio.open_binary(os.path.join(directory, "state.json")) as f:
        state = json.load(f)
    files = [entry["filename"] for entry in state.get("_data_files", [])]
    if state.get("_indices_data_files"):  # select/shuffle without flatten_indices
        raise ValueError(f"{directory}: the dataset keeps an indices mapping: expected one "
                         "written after dataset.flatten_indices()")
    offset = 0
    for name in files:
        path = os.path.join(directory, name)
        try:
            source = pa.memory_map(path) if not fileio.is_remote(path) else \
                pa.PythonFile(fileio.open_binary(path), mode="r")
            with source, pa.ipc.open_stream(source) as reader:
                rows = 0
                for row, text in _table_rows(reader, path, field, reader.schema):
                    yield offset + row, text
                    rows = row + 1
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: unreadable Arrow file ({type(e).__name__}: {e}): "
                             "expected the dataset's files as save_to_disk wrote them") from None
        offset += rows
