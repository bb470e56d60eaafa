"""Text -> tokenizer + token shards of each split, every document followed by <eos>:

    python -m transformer.data.prepare --output_dir=DIR [--input=PATH] \
        [--tokenizer=byte|char|sentencepiece_bpe|sentencepiece_unigram] [--vocab_size=N] \
        [--tokenizer=hf --tokenizer_path=TOKENIZER_JSON_OR_DIR] \
        [--format=array_record|bin] [--num_shards=N] [--tokens_per_shard=N] \
        [--validation_fraction=0.05] [--unit=paragraph|file] [--text_field=text] \
        [--num_workers=N]

--input takes what data.path takes: text, Parquet and JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst)
files, directories or globs of them, or a `datasets` save_to_disk directory (one document a row,
its --text_field: transformer.data.formats).

DIR receives the tokenizer, prepare.json (counts) and, by --format:
  * array_record (default): train-*.array_record, validation-*.array_record, one record per
    document, --num_shards files per split, document j in file j % num_shards;
  * bin: modded-nanogpt uint16 shards train_000000.bin, ..., validation_000000.bin, ... of
    --tokens_per_shard tokens, each split one token stream in document order (see shards.py).
Without --input the embedded corpus is used. A DIR that already holds ArrayRecord or .bin files
is refused, so prepared data is never overwritten.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import sys

import numpy as np
import tqdm

from transformer.data import shards, sources
from transformer.data import tokenizers as tokenizers_lib
from transformer.utils import fileio

FORMATS = ("array_record", "bin")
_ENCODE_BATCH = 1024  # documents encoded at once (a Hugging Face tokenizer does them in parallel)
MAX_BIN_VOCAB = 65536  # uint16 ids
_WORKER_TOKENIZER = None  # a worker process's tokenizer (_load_worker_tokenizer)


def _existing_shards(output_dir: str) -> str | None:
    """What prepared data `output_dir` already holds, e.g. "2 ArrayRecord files (train-...)"."""
    for pattern, kind in (("*.array_record", "ArrayRecord"), ("*.bin", ".bin")):
        if found := sorted(glob.glob(os.path.join(glob.escape(output_dir), pattern))):
            return f"{len(found)} {kind} files ({os.path.basename(found[0])}, ...)"
    return None


def _load_worker_tokenizer(directory: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process: the pool is the
    _WORKER_TOKENIZER = tokenizers_lib.load_tokenizer(directory)  # parallelism


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.int32) for ids in _WORKER_TOKENIZER.encode_batch(texts)]


def _encode(tok, tokenizer_dir: str, docs, num_workers: int):
    """(batch of documents, their token ids) in document order, encoded by `num_workers`
    processes (each loads the tokenizer saved in `tokenizer_dir`); the order, and so every
    byte written, is the same whatever `num_workers` is."""
    batches = [docs[i:i + _ENCODE_BATCH] for i in range(0, len(docs), _ENCODE_BATCH)]
    texts = ([d.text for d in batch] for batch in batches)
    if num_workers <= 1 or len(batches) <= 1:
        yield from zip(batches, map(tok.encode_batch, texts), strict=True)
        return
    # spawn: a fork of a process that holds threads (a Hugging Face tokenizer's) can deadlock
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(num_workers, len(batches)), initializer=_load_worker_tokenizer,
                      initargs=(tokenizer_dir,)) as pool:
        yield from zip(batches, pool.imap(_worker_encode, texts), strict=True)


def _check_arguments(tokenizer: str, tokenizer_path: str, format: str, num_shards: int,
                     num_workers: int, vocab_size: int | None) -> None:
    """One-line errors for `prepare`'s arguments, before any document is read."""
    if tokenizer not in tokenizers_lib.KINDS:
        raise ValueError(f"tokenizer={tokenizer!r}: expected one of {tokenizers_lib.KINDS}")
    if (tokenizer == "hf") != bool(tokenizer_path):
        raise ValueError(f"tokenizer={tokenizer!r} with tokenizer_path={tokenizer_path!r}: "
                         "expected a path exactly with tokenizer='hf'")
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {FORMATS}")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: expected a positive integer")
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers}: expected a positive integer")
    if format == "bin" and num_shards != 1:
        raise ValueError(f"num_shards={num_shards} with format='bin': expected tokens_per_shard "
                         "to size .bin shards")
    if format == "bin" and (vocab_size or 0) > MAX_BIN_VOCAB:  # before a long tokenizer training
        raise ValueError(f"vocab_size={vocab_size} with format='bin': expected at most "
                         f"{MAX_BIN_VOCAB} (uint16 token ids)")


def prepare(output_dir: str, input_path: str | None = None, tokenizer: str = "byte",
            vocab_size: int | None = None, num_shards: int = 1, validation_fraction: float = 0.05,
            unit: str = "paragraph", format: str = "array_record",
            tokens_per_shard: int = 100_000_000, tokenizer_path: str = "",
            text_field: str = "text", num_workers: int = 1) -> dict:
    """Builds the tokenizer on the train split of `input_path` (the embedded corpus if None; a
    Hugging Face tokenizer="hf" is loaded from `tokenizer_path` instead), saves it to
    `output_dir`, and writes each split's documents, tokenized with <eos> appended,
    to "{output_dir}/{split}-*.array_record" (format="array_record", `num_shards` files) or as
    one token stream to modded-nanogpt shards "{output_dir}/{split}_{i:06d}.bin" (format="bin",
    `tokens_per_shard` tokens each). Returns the counts also written to prepare.json: format,
    documents, tokens (<eos> included), UTF-8 bytes and files per split, tokenizer kind, vocab
    size. `num_workers` processes tokenize (the output is the same bytes for any number).
    """
    output_dir = os.fspath(output_dir)
    if existing := _existing_shards(output_dir):
        raise FileExistsError(f"{output_dir}: already holds {existing}: expected a directory "
                              "without prepared data")
    _check_arguments(tokenizer, tokenizer_path, format, num_shards, num_workers, vocab_size)
    splits = {split: sources.load_documents(input_path, split, unit=unit,
                                            validation_fraction=validation_fraction,
                                            text_field=text_field)
              for split in sources.SPLITS}
    if tokenizer == "hf":
        tok = tokenizers_lib.load_hf_tokenizer(tokenizer_path)
    else:
        tok = tokenizers_lib.build_tokenizer(tokenizer, [d.text for d in splits["train"]],
                                             vocab_size=vocab_size)
    if format == "bin" and tok.vocab_size > MAX_BIN_VOCAB:  # sentinels come on top of vocab_size
        raise ValueError(f"tokenizer vocab_size {tok.vocab_size} with format='bin': expected at "
                         f"most {MAX_BIN_VOCAB} (uint16 token ids)")
    os.makedirs(output_dir, exist_ok=True)
    tok.save(output_dir)
    counts = {"input": input_path or None, "unit": unit, "validation_fraction": validation_fraction,
              **({"text_field": text_field} if text_field != "text" else {}),
              "tokenizer": tok.kind, "vocab_size": tok.vocab_size, "format": format}
    counts.update({"num_shards": num_shards} if format == "array_record"
                  else {"tokens_per_shard": tokens_per_shard})
    eos = np.array([tok.require("eos", "(or sep) to end each document")], dtype=np.int32)
    for split, docs in splits.items():
        stats = counts[split] = {"documents": len(docs), "tokens": 0, "bytes": 0}

        def encoded(docs=docs, stats=stats, split=split):
            with tqdm.tqdm(total=len(docs), desc=f"tokenizing {split}", unit="doc",
                           file=sys.stderr, disable=None) as progress:
                for batch, batch_ids in _encode(tok, output_dir, docs, num_workers):
                    for doc, ids in zip(batch, batch_ids, strict=True):
                        ids = np.concatenate([np.asarray(ids, dtype=np.int32), eos])
                        stats["tokens"] += int(ids.size)
                        stats["bytes"] += len(doc.text.encode("utf-8"))
                        yield ids
                    progress.update(len(batch))
                    seconds = progress.format_dict["elapsed"] or 1e-9
                    progress.set_postfix_str(f"{stats['tokens']:,} tokens, "
                                             f"{stats['tokens'] / seconds:,.0f} tokens/s",
                                             refresh=False)

        prefix = os.path.join(output_dir, split)
        if format == "bin":  # one stream of the documents, each followed by <eos>, cut every N
            paths = shards.write_token_shards(prefix, encoded(), tokens_per_shard=tokens_per_shard)
        else:
            paths = sources.write_array_records(prefix, encoded(), num_shards)
        stats["files"] = [os.path.basename(p) for p in paths]
    summary = os.path.join(output_dir, "prepare.json")
    fileio.write_atomic(summary, json.dumps(counts, indent=2) + "\n")
    return counts


def _main(argv):
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}: expected only flags")
    f = flags.FLAGS
    counts = prepare(f.output_dir, f.input, tokenizer=f.tokenizer, vocab_size=f.vocab_size,
                     num_shards=f.num_shards, validation_fraction=f.validation_fraction,
                     unit=f.unit, format=f.format, tokens_per_shard=f.tokens_per_shard,
                     tokenizer_path=f.tokenizer_path, text_field=f.text_field,
                     num_workers=f.num_workers or os.cpu_count() or 1)
    print(json.dumps(counts, indent=2))


def _define_flags():
    """Flags are defined only when run as a command, so importing this module defines none."""
    from absl import flags

    flags.DEFINE_string("output_dir", None, "Directory for the tokenizer, shards and prepare.json.",
                        required=True)
    flags.DEFINE_string("input", None, "Text, Parquet or JSON Lines file, directory or glob, or a "
                        "datasets save_to_disk directory; default: the embedded corpus.")
    flags.DEFINE_string("text_field", "text", "The field of Parquet / JSON Lines / datasets rows "
                        "that holds the text.")
    flags.DEFINE_enum("tokenizer", "byte", tokenizers_lib.KINDS, "Tokenizer kind.")
    flags.DEFINE_integer("vocab_size", None, "Vocabulary size of trained tokenizers.")
    flags.DEFINE_string("tokenizer_path", "", "--tokenizer=hf: a Hugging Face tokenizer.json or "
                        "a directory holding one.")
    flags.DEFINE_enum("format", "array_record", FORMATS,
                      "array_record: one record per document; bin: modded-nanogpt uint16 shards.")
    flags.DEFINE_integer("num_shards", 1, "ArrayRecord files per split.", lower_bound=1)
    flags.DEFINE_integer("tokens_per_shard", 100_000_000, "Tokens per .bin shard.", lower_bound=1)
    flags.DEFINE_float("validation_fraction", 0.05, "Fraction of documents for validation.",
                       lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_enum("unit", "paragraph", sources.UNITS, "Document unit of text files.")
    flags.DEFINE_integer("num_workers", None, "Processes that tokenize (default: every core); "
                         "the output is the same for any number.", lower_bound=1)


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(_main, _define_flags)
