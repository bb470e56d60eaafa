"""Corpora read whole into memory at start-up (`data.path` text, Parquet or JSON Lines, not
prepared): a warning where they are big, and what a validation / test split's evaluations keep
of its text so that they do not read the files again (`inputs.corpus`)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence

import ml_collections

from transformer.data import sources
from transformer.utils import cli, fileio

# data.path's files above this many bytes on disk (a compressed file counted as stored) bring a
# warning pointing to prepare (`warn_big_corpus`).
WARN_BYTES = 256 * 10**6
# prepare's defaults: its flags that read and split data.path as a run does
_PREPARE_DEFAULTS = {"tokenizer": None, "tokenizer_path": "", "vocab_size": 0,
                     "unit": "paragraph", "validation_fraction": 0.05, "text_field": "text"}


def warn_big_corpus(data: Mapping) -> None:
    """One warning where the files of data.path (the run's data settings) hold more than
    WARN_BYTES on disk: their size and the prepare command that tokenizes them once (with the
    run's tokenizer and the settings it sets otherwise than prepare's defaults). The same line
    is printed once per process (`cli.warn_once`), so once per run, not per split."""
    path = data["path"]
    size = sum(fileio.getsize(file) for entry in sources.document_files(path)
               for file in (fileio.files_under(entry) if fileio.isdir(entry) else [entry]))
    if size <= WARN_BYTES:
        return
    flags = {key: data.get(key, default) for key, default in _PREPARE_DEFAULTS.items()}
    flags = "".join(f" --{key}={shlex.quote(str(value))}" for key, value in flags.items()
                    if value != _PREPARE_DEFAULTS[key])
    cli.warn_once(f"data.path={path!r}: {size / 1e6:,.0f} MB on disk, read whole into memory at "
                  "start-up (several times that at its peak, docs/data.md): tokenize it once, "
                  f"python -m transformer.data.prepare --input={shlex.quote(path)} "
                  f"--output_dir=prepared{flags}, and train on that directory"
                  + (" (prepare splits its input by --validation_fraction: a prepared data.path"
                     " takes no data.validation_path)" if data.get("validation_path") else ""))


def split_key(data: ml_collections.ConfigDict, split: str) -> tuple:
    """A split's data settings and the fingerprints of its files (`sources.fingerprint`)."""
    paths = (data["path"], data.get("validation_path", ""), data.get("test_path", ""))
    return (json.dumps(data.to_dict(), sort_keys=True, default=str), split,
            tuple(sources.fingerprint(p) if p else "" for p in paths))


def split_text(documents: Sequence[sources.Document]) -> tuple[int, str]:
    """The documents' UTF-8 bytes, and the first line of the first 20 that is a sentence rather
    than a heading (at least 24 characters), else the first line (`inputs.sample_prompt`)."""
    lines = [line.strip() for doc in documents[:20] for line in doc.text.split("\n")
             if line.strip()]
    line = next((line for line in lines if len(line) >= 24), lines[0] if lines else "")
    return sum(len(d.text.encode("utf-8")) for d in documents), line
