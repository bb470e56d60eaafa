"""`prepare`'s unit of work, one input file, and its progress in the output directory, so a
killed prepare continues from the files it finished (transformer.data.prepare runs the units in
worker processes, transformer.data.prepare_beam as an Apache Beam pipeline; both write the same
bytes).

The units are the entries of `sources.document_files(--input)` in sorted order: text, Parquet
and JSON Lines files, and `datasets` save_to_disk directories. With --unit=stream, and for the
embedded corpus (no --input), the whole input is one unit: a stream's validation split is its
last characters, which only the whole input knows. Unit i's documents go to their split by a
hash of their text (`sources.split_of`, as for text), are tokenized, each followed by <eos>,
and written to shards of their own, i in six digits (more from a million input files):

    {split}-{i:06d}-{k:05d}-of-{num_shards:05d}.array_record   document j of the unit's split
                                                                 in shard k = j % num_shards
    {split}_{i:06d}_{k:06d}.bin                                 the unit's split as one token
                                                                 stream, cut every
                                                                 tokens_per_shard tokens

so a split's documents in input order are unit after unit, each unit's document j the next
record of its shard j % num_shards, as training reads them (`array_record_documents`; .bin shards
in sorted order). A split with no documents in a unit has no shards there.

Progress lives in DIR/.prepare/ (hidden, so no reader or data fingerprint sees it):
settings.json (the arguments, the input's units, the tokenizer's <eos> and, for a tokenizer
trained on them, every unit's `sources.fingerprint`; written once the tokenizer is saved in
DIR), tmp/ (the shards being written) and units/{i:06d}.json (a finished
unit's counts, shard names and its file's `sources.fingerprint`). A unit's shards are renamed
from tmp/ into DIR only when all are complete, then its record is written: a killed prepare
leaves no partial shard under a name a reader globs. A rerun with the same arguments loads the
saved tokenizer, deletes the temporaries and any shards without a record, and does the units
without one; other arguments, other input files, or a file changed since the tokenizer was
trained on it or its unit finished, are refused in one line. prepare.json (the summed counts) is
written last and .prepare/ then removed. One prepare at a time writes DIR: it holds a lock on
DIR/.prepare.lock throughout (`exclusive`), and another is refused in one line.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import glob
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from transformer.data import shards, sources
from transformer.data import tokenizers as tokenizers_lib
from transformer.utils import cli, fileio

PROGRESS_DIR = ".prepare"
LOCK = ".prepare.lock"  # hidden, in DIR: held by the prepare writing DIR (`exclusive`)
SUMMARY = "prepare.json"
ENCODE_BATCH = 1024  # documents encoded at once (a Hugging Face tokenizer does them in parallel)
# A longer document (a --unit=stream input) is encoded in pieces of about this many characters
# (`_pieces`), so a tokenizer's working memory is one piece's, not the whole text's.
PIECE_CHARS = 1 << 20
CUT_CONTEXT = 2048  # characters each side of a cut that encoding checks (`_clean_cut`)
CUT_TRIES = 8  # cuts checked for a piece's end; where all fail the piece grows by PIECE_CHARS
# A cut goes after a newline that text follows, or before a single space between two words.
_CUT = re.compile(r"\n(?=\S)|(?<=\S)(?= \S)")
MAX_BIN_VOCAB = 65536  # uint16 ids
# The settings a resumed prepare must share with the one it continues (named as the flags).
ARGUMENTS = ("input", "unit", "validation_fraction", "text_field", "tokenizer", "vocab_size",
             "tokenizer_path", "format", "num_shards", "tokens_per_shard")

# encode(batches of texts) -> their token ids, batch by batch in the same order.
Encode = Callable[[Iterator[list[str]]], Iterable[list]]
# encode_now(texts) -> their token ids at once (the checks of `_pieces`' cuts).
EncodeNow = Callable[[list[str]], list]


def settings_for(input_path: str | None, **arguments) -> dict:
    """The settings of a prepare: `ARGUMENTS` (the paths absolute) and its units, the input
    files (a one-line error if --input names none). Only the format's shard setting is kept."""
    local = input_path and not fileio.is_remote(input_path)  # a URL stays as it is
    settings = {"input": os.path.abspath(input_path) if local else input_path or None,
                **arguments}
    if settings["tokenizer_path"]:
        settings["tokenizer_path"] = os.path.abspath(settings["tokenizer_path"])
    settings["num_shards" if settings["format"] == "bin" else "tokens_per_shard"] = None
    files = sources.document_files(settings["input"]) if input_path else []  # or an error
    settings["units"] = [settings["input"] or ""] if _whole(settings) else files
    return settings


def _whole(settings: dict) -> bool:
    return settings["unit"] == "stream" or not settings["input"]


def unit_documents(settings: dict, index: int) -> Iterator[tuple[str, sources.Document]]:
    """(split, document) for unit `index`'s documents: those of one file, in order, each in
    the split of `sources.split_of`; or the whole input's train split, then its validation
    split (as `sources.load_documents` gives them)."""
    fraction = settings["validation_fraction"]
    if not _whole(settings):
        for doc in sources.file_documents(settings["units"][index], split=settings["unit"],
                                          text_field=settings["text_field"]):
            yield sources.split_of(doc.text, fraction), doc
        return
    stream = settings["unit"] == "stream"
    docs = sources.read_text(settings["input"], split="file" if stream else settings["unit"],
                             text_field=settings["text_field"]) if settings["input"] else \
        sources.embedded_corpus("file" if stream else settings["unit"])
    for split in sources.SPLITS:
        chosen = sources.split_stream(docs, split, fraction) if stream else \
            sources.split_documents(docs, split, fraction)
        yield from ((split, doc) for doc in chosen)


def _width(settings: dict) -> int:
    return max(6, len(str(len(settings["units"]) - 1)))


def _progress(output_dir: str, *parts: str) -> str:
    return os.path.join(output_dir, PROGRESS_DIR, *parts)


def _record_path(output_dir: str, settings: dict, index: int) -> str:
    return _progress(output_dir, "units", f"{index:0{_width(settings)}d}.json")


def unfinished(path: str) -> bool:
    """Whether `path` is a directory a prepare has begun and not finished."""
    return bool(path) and os.path.isdir(os.path.join(path, PROGRESS_DIR)) and \
        not os.path.isfile(os.path.join(path, SUMMARY))


# An ArrayRecord shard of a unit's split, {split}-{i:06d}-{k:05d}-of-{N:05d}.array_record (and
# of a directory prepared before units, {split}-{k:05d}-of-{N:05d}.array_record): group 1 is
# what its unit's shards share.
_ARRAY_RECORD_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}\.array_record")


def array_record_units(directory: str, split: str) -> list[list[str]]:
    """The ArrayRecord shards of `split` in the prepared `directory`, by unit (in order), each
    unit's N shards in order k = 0 .. N-1; a one-line error if there are none."""
    pattern = os.path.join(glob.escape(directory), f"{split}-*.array_record")
    units: dict[str, list[str]] = {}
    for path in sorted(p for p in glob.glob(pattern) if os.path.isfile(p)):
        match = _ARRAY_RECORD_SHARD.fullmatch(os.path.basename(path))
        units.setdefault(match[1] if match else path, []).append(path)
    if not units:
        raise FileNotFoundError(f"{pattern}: no ArrayRecord files match this pattern")
    return list(units.values())


def array_record_documents(directory: str, split: str) -> list[np.ndarray]:
    """The token sequences of `split` in the prepared `directory` in input order: unit after
    unit, a unit's document j read from its shard j % N (as `_UnitWriter` wrote it, so N shards
    read as one)."""
    documents = []
    for paths in array_record_units(directory, split):
        parts = [list(sources.ArrayRecordTokens([path])) for path in paths]
        # shard k holds documents k, k + N, ...: shard 0 the most
        documents += [part[j] for j in range(len(parts[0])) for part in parts if j < len(part)]
    return documents


class _UnitWriter:
    """One unit's shards of each split, opened at the split's first document; counts."""

    def __init__(self, output_dir: str, settings: dict, index: int, stage):
        self._settings, self._stage, self._writers = settings, stage, {}
        self._eos = np.array([settings["eos"]], np.int32)
        self._dir, self._unit = output_dir, f"{index:0{_width(settings)}d}"
        self.counts = {split: {"documents": 0, "tokens": 0, "bytes": 0, "files": []}
                       for split in sources.SPLITS}

    def _writer(self, split: str):
        if split not in self._writers:
            if self._settings["format"] == "bin":
                self._writers[split] = shards.TokenShardWriter(
                    os.path.join(self._dir, f"{split}_{self._unit}"), stage=self._stage,
                    tokens_per_shard=self._settings["tokens_per_shard"])
            else:
                self._writers[split] = sources.ArrayRecordShardWriter(
                    os.path.join(self._dir, f"{split}-{self._unit}"),
                    self._settings["num_shards"], stage=self._stage)
        return self._writers[split]

    def add(self, split: str, doc: sources.Document, ids) -> int:
        ids = np.concatenate([np.asarray(ids, np.int32), self._eos])
        self._writer(split).write(ids)
        counts = self.counts[split]
        counts["documents"] += 1
        counts["tokens"] += int(ids.size)
        counts["bytes"] += len(doc.text.encode("utf-8"))
        return int(ids.size)

    def close(self) -> None:
        for split, writer in self._writers.items():
            self.counts[split]["files"] = [os.path.basename(p) for p in writer.close()]


def _clean_cut(text: str, cuts: list[int], encode_now: EncodeNow) -> tuple[int, bool] | None:
    """The first of `cuts` (offsets in `text`) where the CUT_CONTEXT characters either side
    encode, joined, to the ids of the two sides encoded apart, as (cut, drop), or None. The
    right side is tried as is, then, at a space, without it (drop=True: a tokenizer whose
    every encode starts with "▁", Llama 2's Prepend("▁") normalizer, has that "▁" stand for
    the space). This refuses a cut inside a pre-tokenizer's word, and a newline cut of a
    tokenizer that adds something at each encode (a Metaspace or Prepend("▁") prefix)."""
    texts, windows = [], []
    for cut in cuts:
        low, high = max(0, cut - CUT_CONTEXT), cut + CUT_CONTEXT
        rights = [text[cut:high]] + [text[cut + 1:high]] * (text[cut] == " ")
        texts += [text[low:high], text[low:cut], *rights]
        windows.append((cut, len(rights)))
    ids = iter([np.asarray(one, np.int64) for one in encode_now(texts)])
    for cut, tries in windows:
        joined, left, *rights = (next(ids) for _ in range(2 + tries))
        for drop, right in enumerate(rights):
            if np.array_equal(joined, np.concatenate([left, right])):
                return cut, bool(drop)
    return None


def _pieces(text: str, encode_now: EncodeNow) -> Iterator[tuple[str, bool]]:
    """`text` in pieces of about PIECE_CHARS characters, each with whether it is encoded
    without its first character (a space, `_clean_cut`'s drop), whose ids, encoded so apart
    and joined, are the ids of `text` (as far as CUT_CONTEXT characters show): each cut is the
    first `_clean_cut` of up to CUT_TRIES `_CUT`s past PIECE_CHARS; where none is, the piece
    grows by PIECE_CHARS, up to the whole text (one encode, as shorter documents are)."""
    start, drop = 0, False
    target = PIECE_CHARS
    while target < len(text):
        cuts = [m.end() for m in itertools.islice(_CUT.finditer(text, target), CUT_TRIES)]
        if not cuts:
            break
        # the first alone (it is clean in most text), then the others at once
        found = _clean_cut(text, cuts[:1], encode_now)
        if found is None and len(cuts) > 1:
            found = _clean_cut(text, cuts[1:], encode_now)
        if found is None:
            target = cuts[-1] + PIECE_CHARS
            continue
        yield text[start:found[0]], drop
        (start, drop), target = found, found[0] + PIECE_CHARS
    yield text[start:], drop


def _encoded(pairs: Iterator[tuple[str, sources.Document]], encode: Encode,
             encode_now: EncodeNow):
    """(batch of (split, document), their ids) for batches of up to ENCODE_BATCH documents; a
    document over PIECE_CHARS characters is a batch of its own, encoded in `_pieces` (one a
    batch) whose int32 ids are joined."""
    pending = collections.deque()  # (batch, None), or ((split, document), its last piece?)

    def texts():
        batch = []
        for split, doc in pairs:
            long = len(doc.text) > PIECE_CHARS
            batch += [] if long else [(split, doc)]
            if batch and (long or len(batch) == ENCODE_BATCH):
                pending.append((batch, None))
                yield [one.text for _, one in batch]
                batch = []
            if long:
                pieces = (piece[1:] if drop else piece
                          for piece, drop in _pieces(doc.text, encode_now))
                piece = next(pieces)
                for after in itertools.chain(pieces, [None]):
                    pending.append(((split, doc), after is None))
                    yield [piece]
                    piece = after
        if batch:
            pending.append((batch, None))
            yield [one.text for _, one in batch]

    parts = []
    for ids in encode(texts()):
        entry, last = pending.popleft()
        if last is None:
            yield entry, ids
            continue
        parts.append(np.asarray(ids[0], np.int32))
        if last:
            yield [entry], [np.concatenate(parts)]
            parts = []


def prepare_unit(output_dir: str, settings: dict, index: int, encode: Encode,
                 progress: Callable[[int, int], None] | None = None,
                 encode_now: EncodeNow | None = None) -> dict:
    """Tokenizes unit `index` (`encode` turns batches of texts into ids; `encode_now` a few
    texts at once, by default through `encode`), writes its shards
    under temporary names, renames them into `output_dir` when all are complete, then writes
    its record and returns it: {"unit", "input", "fingerprint", "train": {"documents",
    "tokens", "bytes", "files"}, "validation": {...}}. `progress(documents, tokens)` after each
    batch. The same settings and unit give the same bytes, whoever runs it."""
    unit = settings["units"][index]
    fingerprint = sources.fingerprint(unit or None)
    encode_now = encode_now or (lambda texts: next(iter(encode(iter([texts])))))
    os.makedirs(_progress(output_dir, "tmp"), exist_ok=True)
    temp = tempfile.mkdtemp(prefix=f"{index}-", dir=_progress(output_dir, "tmp"))
    try:
        with fileio.staged(temp) as stage:
            writer = _UnitWriter(output_dir, settings, index, stage)
            try:
                for batch, ids in _encoded(unit_documents(settings, index), encode,
                                           encode_now):
                    tokens = sum(writer.add(split, doc, one)
                                 for (split, doc), one in zip(batch, ids, strict=True))
                    if progress:
                        progress(len(batch), tokens)
            finally:
                writer.close()
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    record = {"unit": index, "input": unit, "fingerprint": fingerprint, **writer.counts}
    os.makedirs(_progress(output_dir, "units"), exist_ok=True)
    fileio.write_atomic(_record_path(output_dir, settings, index),
                        json.dumps(record, indent=1) + "\n")
    return record


def _existing_shards(output_dir: str) -> str | None:
    """What prepared data `output_dir` already holds, e.g. "2 ArrayRecord files (train-...)"."""
    names = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    for suffix, kind in ((".array_record", "ArrayRecord"), (".bin", ".bin")):
        if found := [name for name in names if name.endswith(suffix)]:
            return f"{len(found)} {kind} files ({found[0]}, ...)"
    return None


# Files a saved tokenizer may write (`Tokenizer.save`), which a fresh prepare would overwrite.
_TOKENIZER_FILES = (tokenizers_lib.CONFIG_FILE, tokenizers_lib.SENTENCEPIECE_FILE,
                    tokenizers_lib.HF_FILE)


def _existing_tokenizer(output_dir: str) -> str | None:
    """A tokenizer file of another's in `output_dir` (a Hugging Face tokenizer folder, an export),
    or None. One a prepare saved before it was killed, with its .prepare/ begun, is its own."""
    if os.path.isdir(_progress(output_dir)):
        return None
    return next((name for name in _TOKENIZER_FILES
                 if os.path.exists(os.path.join(output_dir, name))), None)


@contextlib.contextmanager
def exclusive(output_dir: str) -> Iterator[None]:
    """Holds local `output_dir` (made if missing) for one prepare: an exclusive lock on its
    hidden LOCK file, to take before anything there is read or written. A prepare holding it
    already, on this host or another mounting the same NFS directory, is refused in one line;
    on a filesystem that cannot lock, the prepare goes on after a warning. A directory made
    here and left empty (a prepare refused before it wrote) is removed again."""
    created = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    lock = os.path.join(output_dir, LOCK)
    fd, held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644), False  # NFS locks need O_RDWR
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when `fd` closes, or dies
            held = True
        except BlockingIOError:
            raise FileExistsError(f"another prepare is writing {output_dir}: expected one "
                                  "prepare at a time in an --output_dir (rerun this command "
                                  "once it has stopped)") from None
        except OSError as error:
            cli.warn_once(f"{output_dir}: cannot be locked ({error.strerror}): run one "
                              "prepare at a time in it, or their data mixes")
        yield
    finally:
        # (removed while still locked, so no other prepare has it in use)
        if created and held and os.listdir(output_dir) == [LOCK]:
            os.remove(lock)
            os.rmdir(output_dir)
        os.close(fd)


def begin(output_dir: str, settings: dict) -> tuple[dict, tokenizers_lib.Tokenizer, dict]:
    """Starts a prepare in `output_dir` or resumes the unfinished one there: (its settings,
    with the tokenizer's <eos> and vocab_size, the tokenizer, {unit: record} of the finished
    units). A fresh start builds (char, SentencePiece: trains on the train split) or loads the
    tokenizer and saves it in `output_dir`; a resume loads that one. Refuses a directory that
    holds other prepared data, or an unfinished prepare with other settings, in one line."""
    manifest = _progress(output_dir, "settings.json")
    if os.path.isfile(os.path.join(output_dir, SUMMARY)) or not os.path.isfile(manifest):
        if existing := _existing_shards(output_dir):
            raise FileExistsError(f"{output_dir}: already holds {existing}: expected a "
                                  "directory without prepared data")
        if os.path.isfile(os.path.join(output_dir, SUMMARY)):
            raise FileExistsError(f"{output_dir}: already holds a finished prepare "
                                  f"({SUMMARY}): expected a directory without prepared data")
        if existing := _existing_tokenizer(output_dir):
            raise FileExistsError(f"{output_dir}: already holds a tokenizer ({existing}), which "
                                  "prepare would overwrite with its own: expected a directory "
                                  "without one (another --output_dir)")
        if settings["tokenizer"] not in ("hf", "byte"):  # trained on every input file
            settings = {**settings, "fingerprints": [sources.fingerprint(unit or None)
                                                     for unit in settings["units"]]}
        tokenizer = _build_tokenizer(settings)
        settings = {**settings, "eos": int(tokenizer.require("eos", "(or sep) to end each "
                                                             "document")),
                    "vocab": tokenizer.vocab_size}
        os.makedirs(_progress(output_dir), exist_ok=True)
        tokenizer.save(output_dir)
        fileio.write_atomic(manifest, json.dumps(settings, indent=1) + "\n")
        return settings, tokenizer, {}
    with open(manifest) as f:
        saved = json.load(f)
    records = _records(output_dir, saved)
    _check_same(output_dir, saved, settings, bool(records))
    # The files its trained tokenizer read (a prepare begun before they were recorded resumes
    # unchecked), and the finished ones.
    read = dict(zip(saved["units"], saved.get("fingerprints", []), strict=False))
    read.update({record["input"]: record["fingerprint"] for record in records.values()})
    for unit, fingerprint in read.items():
        if sources.fingerprint(unit or None) != fingerprint:
            raise ValueError(f"{unit or 'the embedded corpus'}: changed since the unfinished "
                             f"prepare in {output_dir} read it: expected it as it was to "
                             "resume, or another --output_dir")
    shutil.rmtree(_progress(output_dir, "tmp"), ignore_errors=True)  # a killed unit's
    kept = {name for record in records.values() for split in sources.SPLITS
            for name in record[split]["files"]}
    for name in os.listdir(output_dir):  # shards renamed into place before their record
        if name.endswith((".array_record", ".bin")) and name not in kept:
            os.remove(os.path.join(output_dir, name))
    return saved, tokenizers_lib.load_tokenizer(output_dir), records


def _check_same(output_dir: str, saved: dict, settings: dict, started: bool) -> None:
    """One-line errors for a resume with other `ARGUMENTS` or other input files than the
    unfinished prepare `saved` in `output_dir` (where it finished no file yet, `started`
    False, e.g. it failed on its first row: that removing the directory starts over). Files
    under `output_dir` that it did not list are its own output (a DIR inside a directory
    --input), not input."""
    for key in ARGUMENTS:
        if saved.get(key) != settings[key]:
            raise ValueError(f"{output_dir}: holds an unfinished prepare with --{key}="
                             f"{saved.get(key)}, not {settings[key]}: expected its settings to "
                             "resume it, or another --output_dir" + ("" if started else (
                                 f" (it finished no input file: removing {output_dir} "
                                 "starts over)")))
    inside = os.path.join(os.path.realpath(output_dir), "")
    units = [unit for unit in settings["units"] if unit in saved["units"] or not unit or
             fileio.is_remote(unit) or not os.path.realpath(unit).startswith(inside)]
    if saved["units"] != units:
        new = sorted(set(units) - set(saved["units"]))
        gone = sorted(set(saved["units"]) - set(units))
        raise ValueError(f"{output_dir}: holds an unfinished prepare of {len(saved['units'])} "
                         f"input files; --input now gives {len(units)} (new: "
                         f"{new[:1]}, gone: {gone[:1]}): expected the same files to resume it, "
                         "or another --output_dir")


def _build_tokenizer(settings: dict) -> tokenizers_lib.Tokenizer:
    """The Hugging Face tokenizer at tokenizer_path, or one built on the train split (its
    splits checked non-empty first: reading them is the work a trained tokenizer needs)."""
    kind = settings["tokenizer"]
    if kind == "hf":
        tokenizer = tokenizers_lib.load_hf_tokenizer(settings["tokenizer_path"])
    elif kind == "byte":
        tokenizer = tokenizers_lib.build_tokenizer(kind)
    else:
        texts, documents = [], dict.fromkeys(sources.SPLITS, 0)
        for index in range(len(settings["units"])):
            for split, doc in unit_documents(settings, index):
                documents[split] += 1
                texts += [doc.text] if split == "train" else []
        _check_splits(settings, documents)
        tokenizer = tokenizers_lib.build_tokenizer(kind, texts, vocab_size=settings["vocab_size"])
    if settings["format"] == "bin" and tokenizer.vocab_size > MAX_BIN_VOCAB:  # with sentinels
        raise ValueError(f"tokenizer vocab_size {tokenizer.vocab_size} with format='bin': "
                         f"expected at most {MAX_BIN_VOCAB} (uint16 token ids)")
    return tokenizer


def _check_splits(settings: dict, documents: dict[str, int], then: str = "") -> None:
    for split in sources.SPLITS:
        if not documents[split]:
            raise ValueError(f"the {split} split of {settings['input'] or 'the embedded corpus'} "
                             f"is empty ({sum(documents.values())} documents, "
                             f"validation_fraction={settings['validation_fraction']}): expected "
                             f"more documents or another validation_fraction{then}")


def _records(output_dir: str, settings: dict) -> dict[int, dict]:
    """{unit: record} of the finished units."""
    records = {}
    for index in range(len(settings["units"])):
        path = _record_path(output_dir, settings, index)
        if os.path.isfile(path):
            with open(path) as f:
                records[index] = json.load(f)
    return records


def finish(output_dir: str, settings: dict, input_path: str | None) -> dict:
    """Sums the units' records into prepare.json (written last; `input_path` as given) and
    removes .prepare/. Returns the counts: input, unit, validation_fraction, text_field (when
    not "text"), tokenizer, vocab_size, format, num_shards or tokens_per_shard, and per split
    documents, tokens (<eos> included), UTF-8 bytes and shard files."""
    records = _records(output_dir, settings)
    if missing := [settings["units"][i] for i in range(len(settings["units"]))
                   if i not in records]:
        raise RuntimeError(f"{output_dir}: {len(missing)} input files not prepared ({missing[0]}"
                           ", ...): expected every unit finished (rerun to resume)")
    counts = {"input": input_path or None, "unit": settings["unit"],
              "validation_fraction": settings["validation_fraction"],
              **({"text_field": settings["text_field"]} if settings["text_field"] != "text"
                 else {}),
              "tokenizer": settings["tokenizer"], "vocab_size": settings["vocab"],
              "format": settings["format"]}
    shard_setting = "tokens_per_shard" if settings["format"] == "bin" else "num_shards"
    counts[shard_setting] = settings[shard_setting]
    for split in sources.SPLITS:
        ordered = [records[i][split] for i in sorted(records)]
        counts[split] = {key: sum(one[key] for one in ordered)
                         for key in ("documents", "tokens", "bytes")}
        counts[split]["files"] = [name for one in ordered for name in one["files"]]
    _check_splits(settings, {split: counts[split]["documents"] for split in sources.SPLITS},
                  f" (in a new --output_dir, or once {output_dir} is removed)")
    fileio.write_atomic(os.path.join(output_dir, SUMMARY), json.dumps(counts, indent=2) + "\n")
    shutil.rmtree(_progress(output_dir), ignore_errors=True)
    return counts
