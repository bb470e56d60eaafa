"""Text sources: the embedded corpus, text files cut into documents, a deterministic
train/validation split, and int32 token sequences stored as ArrayRecord shards for Grain.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import operator
import os
import pydoc_data.topics
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import SupportsIndex

import numpy as np

from transformer.data import formats
from transformer.utils import cli, fileio

SPLITS = ("train", "validation")
UNITS = ("paragraph", "file", "stream")
_INT32 = np.dtype("<i4")  # the on-disk record format: raw little-endian int32


@dataclasses.dataclass(frozen=True)
class Document:
    """One unit of text. `name` says where it came from: "pydoc:assert", "stdlib:os.py",
    "/path/file.txt#12" (paragraph 12, counting from 0, of that file)."""

    name: str
    text: str


@functools.cache
def _embedded_corpus() -> tuple[Document, ...]:
    docs = [Document(f"pydoc:{topic}", text)
            for topic, text in pydoc_data.topics.topics.items() if text.strip()]
    stdlib = sysconfig.get_paths()["stdlib"]
    for entry in os.scandir(stdlib):
        if entry.name.endswith(".py") and entry.is_file():
            text = _read_utf8(entry.path)
            if text.strip():
                docs.append(Document(f"stdlib:{entry.name}", text))
    return tuple(sorted(docs, key=lambda doc: doc.name))


def embedded_corpus(unit: str = "file") -> list[Document]:
    """Text every Python installation ships, so no download is needed: one document per topic of
    `pydoc_data.topics` ("pydoc:<topic>") and per top-level standard-library `*.py` file
    ("stdlib:<file>"), sorted by name; unit="paragraph" cuts each as a text file's
    ("stdlib:abc.py#3"). About 5 MB; read once per process."""
    return list(_embedded_corpus()) if unit != "paragraph" else [
        Document(f"{d.name}#{k}", p) for d in _embedded_corpus()
        for k, p in enumerate(split_paragraphs(d.text))]


_BOM = "\ufeff"  # a UTF-8 byte-order mark (bytes EF BB BF), which some editors write first


def _read_utf8(path: str) -> str:
    """The file's text, less a leading byte-order mark (not text; JSON Lines skip it too).
    An invalid byte is named by its offset in the file, the mark counted."""
    with fileio.open_binary(path) as f:
        data = f.read()
    try:
        return data.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: invalid UTF-8 at byte {e.start}: expected UTF-8 text") from None


def _files(path: str) -> list[str]:
    """A file, a directory or a glob pattern (local, or a gs:// URL) -> the sorted regular
    files it names. A directory's hidden files are left out, and so are its files named "_..."
    (or under a "_..." folder) when it holds Parquet / JSON Lines files (`_beside_tables`)."""
    if fileio.isdir(path):
        files = fileio.files_under(path)
        if not files:
            raise FileNotFoundError(f"{path}: no regular non-hidden files under this directory")
        return sorted(_beside_tables(path, files))
    if fileio.isfile(path):
        return [path]
    if not (files := fileio.glob_files(path)):
        raise FileNotFoundError(f"{path}: no such file or directory, and no file matches it as "
                                "a glob pattern")
    return files


def _beside_tables(directory: str, files: list[str]) -> list[str]:
    """`files` less the names starting with "_" below `directory` where the rest hold a Parquet
    / JSON Lines file: a Spark or Hadoop job's _SUCCESS, _committed_*, _temporary/ beside its
    part files, which pyarrow.dataset skips too (its ignore_prefixes); not corpus text."""
    root = directory.rstrip("/") + "/"

    def underscored(file: str) -> bool:
        below = file[len(root):] if file.startswith(root) else os.path.basename(file)
        return any(part.startswith("_") for part in below.split("/"))

    if len(kept := [file for file in files if not underscored(file)]) == len(files):
        return files
    outputs = _prepare_outputs(kept)
    tables = [f for f in kept if formats.table_kind(f) and os.path.dirname(f) not in outputs]
    return kept if tables else files


def _prepare_outputs(files: list[str]) -> set[str]:
    """The folders of `files` that `prepare` writes (an --output_dir inside --input lists its
    shards and tokenizer.json there on a resume): not corpus."""
    folders = {os.path.dirname(file) for file in files}
    return {d for d in folders if fileio.isfile(os.path.join(d, "prepare.json"))
            or fileio.isdir(os.path.join(d, ".prepare"))}


def split_paragraphs(text: str) -> list[str]:
    """Cuts text at blank lines. Each paragraph keeps the blank lines after it (the first also
    any before it), so the pieces join back to `text`; whitespace-only text gives no pieces.

    >>> split_paragraphs("\\nTo be,\\nor not.\\n\\n \\nThat is\\n\\nthe question")
    ['\\nTo be,\\nor not.\\n\\n \\n', 'That is\\n\\n', 'the question']
    """
    paragraphs, lines, has_text, ended = [], [], False, False
    for line in text.splitlines(keepends=True):
        blank = not line.strip()
        if not blank and ended:  # text after a blank line starts the next paragraph
            paragraphs.append("".join(lines))
            lines, ended = [], False
        lines.append(line)
        has_text |= not blank
        ended |= blank and has_text
    if has_text:
        paragraphs.append("".join(lines))
    return paragraphs


def _check_layout(directory: str, files: list[str]) -> None:
    """A directory read whole must hold one corpus: a one-line error for files or folders of
    several Hugging Face Hub splits (all of them would train), and a warning for files read
    as text beside Parquet / JSON Lines files (a dataset card, a LICENSE: they would train)."""
    tables = [f for f in files if formats.table_kind(f)]
    splits = formats.hub_splits(directory, tables)
    if len(splits) > 1:
        a, folder = splits.get("train") or next(iter(splits.values()))
        b = next(path for path, _ in splits.values() if path != a)
        train = f"the folder {a}" if folder else \
            f"a glob such as {os.path.join(os.path.dirname(a), 'train*')}"
        raise ValueError(f"{directory}: holds the Hugging Face Hub splits {sorted(splits)} "
                         f"({a}, {b}), which would all train: expected a path to the train "
                         f"files alone ({train}) and data.validation_path at the validation "
                         f"{'folder' if folder else 'files'}")
    # A dataset card (README.md), a LICENSE, notes: read as text, which is rarely meant (a
    # .txt beside tables is often corpus too: a mixed folder)
    texts = [f for f in files if formats.kind(f) == "text" and not f.lower().endswith(".txt")
             ] if tables else []
    if texts and (outputs := _prepare_outputs(files)):
        tables = [f for f in tables if os.path.dirname(f) not in outputs]
        texts = [f for f in texts if os.path.dirname(f) not in outputs] if tables else []
    if texts:
        more = f" and {len(texts) - 1} other files are" if len(texts) > 1 else " is"
        them = ("their", "they are") if len(texts) > 1 else ("its", "it is")
        cli.warn_once(f"{directory}: {texts[0]}{more} read as text beside {len(tables)} "
                      f"Parquet / JSON Lines files ({them[0]} paragraphs train): if {them[1]} "
                      "not corpus, point data.path at the corpus files alone (a glob)")


def document_files(path: str) -> list[str]:
    """`_files(path)`, each `datasets` save_to_disk directory among them as one entry: the
    files `read_text` reads, in its order (`prepare` works through them one by one). A
    directory of several Hub splits is refused (`_check_layout`)."""
    if formats.is_dataset_dir(path):
        return [path]
    formats.refuse_dataset_dict(path)
    entries = []
    for file in _files(path):
        if os.path.basename(file) == formats.DATASET_DICT:  # under a directory or a glob
            formats.refuse_dataset_dict(os.path.dirname(file))
        entry = formats.dataset_dir_of(file) or file
        if entry not in entries[-1:]:  # a dataset's files are adjacent in sorted order
            entries.append(entry)
    if fileio.isdir(path):
        _check_layout(path, entries)
    return entries


def shared_file(path: str, other: str) -> str | None:
    """The first of `other`'s `document_files` that is also one of `path`'s (compared by real
    path, so a link or another spelling of the same file counts), or None."""

    def real(file: str) -> str:
        return file if fileio.is_remote(file) else os.path.realpath(file)

    mine = {real(file) for file in document_files(path)}
    return next((file for file in document_files(other) if real(file) in mine), None)


def file_documents(file: str, *, split: str = "paragraph",
                   text_field: str = formats.TEXT_FIELD) -> Iterator[Document]:
    """The documents of one entry of `document_files` (see `read_text`), read lazily from
    Parquet, JSON Lines and `datasets` files; none if it holds no text."""
    if formats.kind(file) != "text":
        yield from (Document(f"{file}#{row}", text)
                    for row, text in formats.read_rows(file, text_field) if text.strip())
        return
    text = _read_utf8(file)
    if split == "file":
        yield from [Document(file, text)] if text.strip() else []
    else:
        yield from (Document(f"{file}#{k}", p) for k, p in enumerate(split_paragraphs(text)))


def read_text(path: str, *, split: str = "paragraph",
              text_field: str = formats.TEXT_FIELD) -> list[Document]:
    """Reads UTF-8 text from a file, a directory (every regular non-hidden file under it) or a glob
    pattern, files in sorted order.

    split="paragraph" cuts each file at blank lines (`split_paragraphs`) into documents named
    "<file>#<k>", k = 0, 1, ...; joining a file's documents gives back the file exactly (less a
    leading UTF-8 byte-order mark, which no document holds).
    split="file" makes one document per file, named "<file>". Files that are empty or hold only
    whitespace give no documents. Parquet, JSON Lines and `datasets` directories
    (`transformer.data.formats`) give one document per row, its `text_field`, named
    "<file>#<row>", whatever `split` is.
    """
    if split not in UNITS:
        raise ValueError(f"split={split!r}: expected one of {UNITS}")
    path = os.fspath(path)
    files = document_files(path)
    docs = [doc for file in files
            for doc in file_documents(file, split=split, text_field=text_field)]
    if not docs:
        raise ValueError(f"{path}: no text in {len(files)} file(s), all empty or whitespace: "
                         "expected some text")
    return docs


_SAMPLE = 4096  # bytes read from each end of every file for its fingerprint


def fingerprint(path: str | None) -> str:
    """A short digest of the data at `path` (None or "": the embedded corpus) that changes when
    files are added, removed, renamed, resized, or edited near either end: every file's name
    relative to `path`, its size, and its first and last 4 KiB. Cheap on large corpora; an edit
    in the middle of a file that keeps its size goes unnoticed. Moving the data elsewhere keeps
    the digest.

    >>> fingerprint(None) == fingerprint("")
    True
    """
    digest = hashlib.sha256()
    if not path:
        for doc in _embedded_corpus():
            digest.update(f"{doc.name}\0{len(doc.text)}\0".encode())
            digest.update(doc.text.encode("utf-8"))
        return digest.hexdigest()[:16]
    path = os.fspath(path)
    files = _files(path)
    is_dir = fileio.isdir(path)
    root = path if is_dir else os.path.dirname(os.path.commonprefix(files))
    prepared = is_dir and fileio.isfile(os.path.join(path, "prepare.json"))
    for file in files:
        size = fileio.getsize(file)
        name = "" if len(files) == 1 and not is_dir else os.path.relpath(file, root)
        digest.update(f"{name}\0{size}\0".encode())
        if not prepared and file.lower().endswith(".json") and not formats.dataset_dir_of(file):
            # A corpus's .json files are read as JSON Lines since 2026-12-04, as text before:
            # a checkpoint of a run that read them as text must not resume on what they give now.
            digest.update(b"json lines\0")
        with fileio.open_binary(file) as f:
            head = f.read(_SAMPLE)
            if head.startswith(_BOM.encode()) and formats.kind(file) == "text":
                # A text file's byte-order mark was read as text before 2026-12-06: a
                # checkpoint of a run that trained on it must not resume on what it gives now.
                digest.update(b"bom skipped\0")
            digest.update(head)
            if size > 2 * _SAMPLE:
                f.seek(size - _SAMPLE)
            digest.update(f.read(_SAMPLE))  # the rest of a small file
    return digest.hexdigest()[:16]


def _unit_hash(text: str) -> float:
    """sha256 of the UTF-8 text -> a number uniform in [0, 1)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(docs: Iterable[Document], split: str,
                    validation_fraction: float = 0.05) -> list[Document]:
    """The documents of one split, in input order. A document is in "validation" when the sha256
    of its text, read as a number in [0, 1), is below `validation_fraction`, else in "train": the
    split ignores names, order and position, and identical texts share a side.

    >>> docs = [Document(str(i), text) for i, text in enumerate(["a", "b", "c", "h", "a"])]
    >>> [d.name for d in split_documents(docs, "train", validation_fraction=0.25)]
    ['0', '3', '4']
    >>> [d.name for d in split_documents(docs, "validation", validation_fraction=0.25)]
    ['1', '2']
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    if not 0.0 <= validation_fraction <= 1.0:
        raise ValueError(f"validation_fraction={validation_fraction}: expected a number in [0, 1]")
    return [d for d in docs if split_of(d.text, validation_fraction) == split]


def split_of(text: str, validation_fraction: float) -> str:
    """The split a document of this text is in (`split_documents`): "train" or "validation".

    >>> split_of("a", 0.25), split_of("b", 0.25)
    ('train', 'validation')
    """
    return "validation" if _unit_hash(text) < validation_fraction else "train"


def split_stream(docs: Sequence[Document], split: str,
                 validation_fraction: float = 0.05) -> list[Document]:
    """One split of a text read as one stream (documents in order): "train" is its first
    1 - validation_fraction of the characters, "validation" the rest (nanoGPT's convention).
    The document the cut falls in is cut there; its pieces are named "<name>@<offset>".

    >>> docs = [Document("a", "abcdef"), Document("b", "ghij")]
    >>> [(d.name, d.text) for d in split_stream(docs, "train", 0.3)]
    [('a', 'abcdef'), ('b@0', 'g')]
    >>> [(d.name, d.text) for d in split_stream(docs, "validation", 0.3)]
    [('b@1', 'hij')]
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    total = sum(len(d.text) for d in docs)
    cut, start, chosen = round(total * (1.0 - validation_fraction)), 0, []
    for doc in docs:
        end = start + len(doc.text)
        lo, hi = (start, min(end, cut)) if split == "train" else (max(start, cut), end)
        if lo < hi:
            whole = (lo, hi) == (start, end)
            chosen.append(doc if whole else Document(f"{doc.name}@{lo - start}",
                                                     doc.text[lo - start:hi - start]))
        start = end
    return chosen


def load_documents(path: str | None, split: str, *, validation_fraction: float = 0.05,
                   unit: str = "paragraph", validation_path: str = "",
                   test_path: str = "", text_field: str = formats.TEXT_FIELD) -> list[Document]:
    """One split of the embedded corpus (`path` None or "") or of the text at `path`, cut into
    `unit`s: paragraph and file documents are split by `split_documents` (a hash of the text),
    a stream's (one document per file, in order) by `split_stream` (its last characters).
    With `validation_path` the splits are explicit: "train" is all of `path`, "validation"
    all of `validation_path`. Split "test" is all of `test_path`, which nothing else reads.
    `text_field`: the field of Parquet / JSON Lines / `datasets` rows that holds the text."""
    if unit not in UNITS:
        raise ValueError(f"unit={unit!r}: expected one of {UNITS}")
    read_as = "file" if unit == "stream" else unit
    read = functools.partial(read_text, split=read_as, text_field=text_field)
    if split == "test":
        if not test_path:
            raise ValueError("split='test' without a test_path: expected data.test_path (text "
                             "pretraining holds out no test split of data.path)")
        chosen = read(test_path)  # (text that is all blank is an error)
    elif validation_path:
        source = path if split == "train" else validation_path
        chosen = read(source) if source else embedded_corpus(read_as)
    else:
        docs = embedded_corpus(read_as) if not path else read(path)
        chosen = split_stream(docs, split, validation_fraction) if unit == "stream" else \
            split_documents(docs, split, validation_fraction)
        if not chosen:
            raise ValueError(f"the {split} split of {path or 'the embedded corpus'} is empty "
                             f"({len(docs)} documents, validation_fraction="
                             f"{validation_fraction}): expected more documents or another "
                             "validation_fraction")
    return chosen


# --- weighted mixtures of sources (data.sources) -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One source of a weighted mixture (`data.sources`): a `data.path`-like path (text file,
    directory, glob, or a prepared directory), its sampling weight, and its own `unit` and
    `validation_path` ("" for the run's data.unit / no explicit validation split)."""

    name: str
    path: str
    weight: float
    unit: str = ""
    validation_path: str = ""
    text_field: str = ""


_SOURCE_KEYS = ("path", "weight", "unit", "validation_path", "name", "text_field")


def parse_source(spec: str) -> MixtureSource:
    """A `data.sources` entry, comma-separated key=value pairs (path and weight required;
    unit, validation_path, text_field and name optional; name defaults to the path's last part
    without its extension), -> a `MixtureSource`. Paths may hold ':' (gs://...), not ','.

    >>> parse_source("path=data/web.txt,weight=0.7")
    MixtureSource(name='web', path='data/web.txt', weight=0.7, unit='', validation_path='', \
text_field='')
    >>> parse_source("path=code/,weight=0.3,unit=file,name=py").name
    'py'
    """
    if not isinstance(spec, str):
        raise ValueError(f"data.sources entry {spec!r}: expected a str like "
                         "'path=web.txt,weight=0.7'")
    fields = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _SOURCE_KEYS or key in fields:
            raise ValueError(f"data.sources entry {spec!r}: {part!r}: expected comma-separated "
                             f"key=value pairs, each key once, keys {_SOURCE_KEYS}")
        fields[key] = value.strip()
    if "path" not in fields or "weight" not in fields:
        raise ValueError(f"data.sources entry {spec!r}: expected path=... and weight=...")
    try:
        weight = float(fields["weight"])
    except ValueError:
        raise ValueError(f"data.sources entry {spec!r}: weight={fields['weight']!r}: expected "
                         "a number > 0") from None
    path = fields["path"]
    name = fields.get("name") or os.path.splitext(os.path.basename(path.rstrip("/")))[0]
    return MixtureSource(name, path, weight, fields.get("unit", ""),
                         fields.get("validation_path", ""), fields.get("text_field", ""))


def canonical_source(spec: str) -> str:
    """A `data.sources` entry written one way: keys in order, no spaces around '=' and ',', the
    weight as a number (0.70 -> 0.7, 1.0 -> 1) and the name only if it is not the default, so
    entries that mean the same source and weight read as the same data stream.

    >>> canonical_source("weight = 0.70, path = web.txt, name = web")
    'path=web.txt,weight=0.7'
    >>> canonical_source("path=code/,weight=3.0,unit=file,name=py")
    'path=code/,weight=3,unit=file,name=py'
    """
    source = parse_source(spec)
    weight = repr(source.weight).removesuffix(".0")
    default_name = parse_source(f"path={source.path},weight=1").name
    fields = {"path": source.path, "weight": weight, "unit": source.unit,
              "validation_path": source.validation_path,
              "name": "" if source.name == default_name else source.name,
              "text_field": source.text_field}
    return ",".join(f"{key}={value}" for key, value in fields.items() if value)


def parse_sources(specs: Sequence[str]) -> list[MixtureSource]:
    """`data.sources` -> its `MixtureSource`s, checked: one-line errors naming the source for a
    weight that is not a finite number > 0, an unknown unit, a missing path, or a name that is
    repeated or not a plain word (it names log records: `tokens/<name>`)."""
    parsed = [parse_source(spec) for spec in specs]
    for source in parsed:
        where = f"data.sources {source.name!r}"
        if not (source.weight > 0 and np.isfinite(source.weight)):
            raise ValueError(f"{where}: weight={source.weight!r}: expected a finite number > 0")
        if source.unit and source.unit not in UNITS:
            raise ValueError(f"{where}: unit={source.unit!r}: expected one of {UNITS}")
        if not source.name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise ValueError(f"{where}: expected a name of letters, digits, '_', '-', '.' "
                             "(add name=... to the entry)")
        for key in ("path", "validation_path"):
            if path := getattr(source, key):
                try:
                    _files(path)
                except FileNotFoundError as error:  # a config error like the others
                    raise ValueError(f"{where}: {key} {error}") from None
    names = [source.name for source in parsed]
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"data.sources repeats the names {repeated}: expected one name per "
                         "source (add name=... to the entries)")
    return parsed


# --- ArrayRecord shards of int32 token sequences ------------------------------------------------


def _record(sequence) -> bytes:
    array = np.asarray(sequence)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"sequence of dtype {array.dtype} and shape {array.shape}: expected a "
                         "1-D array of integers")
    info = np.iinfo(np.int32)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise ValueError(f"sequence with values in [{array.min()}, {array.max()}]: expected "
                         "values that fit in int32")
    return array.astype(_INT32).tobytes()


def write_array_records(path_prefix: str, sequences: Iterable[np.ndarray],
                        num_shards: int = 1) -> list[str]:
    """Writes int32 token sequences into `num_shards` ArrayRecord files
    "{path_prefix}-{i:05d}-of-{num_shards:05d}.array_record", one record per sequence holding its
    raw little-endian int32 bytes, sequence j into shard j % num_shards. Each shard is written
    under a ".tmp" name and renamed when complete. Returns the shard paths.
    """
    with fileio.staged() as stage:
        writer = ArrayRecordShardWriter(path_prefix, num_shards, stage=stage)
        try:
            for sequence in sequences:
                writer.write(sequence)
        finally:
            writer.close()
    return writer.paths


class ArrayRecordShardWriter:
    """`write_array_records` one sequence at a time: `write(sequence)` puts sequence j into
    shard j % num_shards, `close()` closes every shard and returns their paths. Shard `path` is
    written as `stage(path)` (its own name by default; `fileio.staged` gives a temporary one)."""

    def __init__(self, path_prefix: str, num_shards: int = 1, *,
                 stage: Callable[[str], str] = str):
        from array_record.python.array_record_module import ArrayRecordWriter

        if num_shards < 1:
            raise ValueError(f"num_shards={num_shards}: expected a positive integer")
        path_prefix = os.fspath(path_prefix)
        os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
        self.paths = [f"{path_prefix}-{i:05d}-of-{num_shards:05d}.array_record"
                      for i in range(num_shards)]
        self._writers, self._count = [], 0
        try:
            for p in self.paths:  # group_size:1 is what Grain needs for fast random access
                self._writers.append(ArrayRecordWriter(stage(p), "group_size:1"))
        except BaseException:
            self.close()
            raise

    def write(self, sequence) -> None:
        self._writers[self._count % len(self.paths)].write(_record(sequence))
        self._count += 1

    def close(self) -> list[str]:
        for writer in self._writers:
            if writer.is_open():
                writer.close()
        return self.paths


class ArrayRecordTokens:
    """A Grain random-access source over ArrayRecord files of int32 token sequences (see
    `write_array_records`): the records of the first file in order, then the next file's, ...
    Items are 1-D np.int32 arrays."""

    def __init__(self, paths: Sequence[str]):
        import grain

        self.paths = list(paths)
        self._source = grain.sources.ArrayRecordDataSource(self.paths)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: SupportsIndex) -> np.ndarray:
        i = operator.index(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"record {i} of {len(self)}: expected an index in [0, {len(self)})")
        return np.frombuffer(self._source[i % len(self)], dtype=_INT32).astype(np.int32)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def __getitems__(self, indices: Sequence[SupportsIndex]) -> list[np.ndarray]:
        records = self._source.__getitems__(indices)
        return [np.frombuffer(r, dtype=_INT32).astype(np.int32) for r in records]

    def __repr__(self) -> str:
        return f"ArrayRecordTokens({len(self.paths)} files, {len(self)} records)"


def array_record_source(pattern: str) -> ArrayRecordTokens:
    """The token sequences in the ArrayRecord files matching the glob `pattern` (sorted)."""
    pattern = os.fspath(pattern)
    paths = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    if not paths:
        raise FileNotFoundError(f"{pattern}: no ArrayRecord files match this pattern")
    return ArrayRecordTokens(paths)
