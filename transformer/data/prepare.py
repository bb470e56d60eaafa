"""Text -> tokenizer + ArrayRecord shards of token ids, one record per document ending in <eos>:

    python -m transformer.data.prepare --output_dir=DIR [--input=PATH] \
        [--tokenizer=byte|char|sentencepiece_bpe|sentencepiece_unigram] [--vocab_size=N] \
        [--num_shards=N] [--validation_fraction=0.05] [--unit=paragraph|file]

DIR receives the tokenizer, train-*.array_record, validation-*.array_record and prepare.json
(counts). Without --input the embedded corpus is used. A DIR that already holds ArrayRecord files
is refused, so prepared data is never overwritten.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import tqdm

from transformer.data import sources
from transformer.data import tokenizers as tokenizers_lib


def _existing_shards(output_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(output_dir), "*.array_record")))


def prepare(output_dir: str, input_path: str | None = None, tokenizer: str = "byte",
            vocab_size: int | None = None, num_shards: int = 1, validation_fraction: float = 0.05,
            unit: str = "paragraph") -> dict:
    """Builds the tokenizer on the train split of `input_path` (the embedded corpus if None),
    saves it to `output_dir`, and writes each split's documents, tokenized with <eos> appended,
    to "{output_dir}/{split}-*.array_record". Returns the counts also written to prepare.json:
    documents, tokens (<eos> included) and UTF-8 bytes per split, tokenizer kind, vocab size.
    """
    output_dir = os.fspath(output_dir)
    if existing := _existing_shards(output_dir):
        raise FileExistsError(f"{output_dir}: already holds {len(existing)} ArrayRecord files "
                              f"({os.path.basename(existing[0])}, ...): expected a directory "
                              "without prepared data")
    if tokenizer not in tokenizers_lib.KINDS:
        raise ValueError(f"tokenizer={tokenizer!r}: expected one of {tokenizers_lib.KINDS}")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: expected a positive integer")
    splits = {split: sources.load_documents(input_path, split, unit=unit,
                                            validation_fraction=validation_fraction)
              for split in sources.SPLITS}
    tok = tokenizers_lib.build_tokenizer(tokenizer, [d.text for d in splits["train"]],
                                         vocab_size=vocab_size)
    os.makedirs(output_dir, exist_ok=True)
    tok.save(output_dir)
    counts = {"input": input_path or None, "unit": unit, "validation_fraction": validation_fraction,
              "tokenizer": tok.kind, "vocab_size": tok.vocab_size, "num_shards": num_shards}
    eos = np.array([tokenizers_lib.EOS_ID], dtype=np.int32)
    for split, docs in splits.items():
        stats = counts[split] = {"documents": len(docs), "tokens": 0, "bytes": 0}

        def encoded(docs=docs, stats=stats, split=split):
            for doc in tqdm.tqdm(docs, desc=f"tokenizing {split}", unit="doc", file=sys.stderr,
                                 disable=None):
                ids = np.concatenate([np.asarray(tok.encode(doc.text), dtype=np.int32), eos])
                stats["tokens"] += int(ids.size)
                stats["bytes"] += len(doc.text.encode("utf-8"))
                yield ids

        paths = sources.write_array_records(os.path.join(output_dir, split), encoded(),
                                            num_shards)
        stats["files"] = [os.path.basename(p) for p in paths]
    summary = os.path.join(output_dir, "prepare.json")
    with open(summary + ".tmp", "w") as f:
        json.dump(counts, f, indent=2)
        f.write("\n")
    os.replace(summary + ".tmp", summary)
    return counts


def _main(argv):
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}: expected only flags")
    f = flags.FLAGS
    counts = prepare(f.output_dir, f.input, tokenizer=f.tokenizer, vocab_size=f.vocab_size,
                     num_shards=f.num_shards, validation_fraction=f.validation_fraction,
                     unit=f.unit)
    print(json.dumps(counts, indent=2))


def _define_flags():
    """Flags are defined only when run as a command, so importing this module defines none."""
    from absl import flags

    flags.DEFINE_string("output_dir", None, "Directory for the tokenizer, shards and prepare.json.",
                        required=True)
    flags.DEFINE_string("input", None, "Text file, directory or glob; default: embedded corpus.")
    flags.DEFINE_enum("tokenizer", "byte", tokenizers_lib.KINDS, "Tokenizer kind.")
    flags.DEFINE_integer("vocab_size", None, "Vocabulary size of trained tokenizers.")
    flags.DEFINE_integer("num_shards", 1, "ArrayRecord files per split.", lower_bound=1)
    flags.DEFINE_float("validation_fraction", 0.05, "Fraction of documents for validation.",
                       lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_enum("unit", "paragraph", sources.UNITS, "Document unit of text files.")


if __name__ == "__main__":
    from transformer import cli

    cli.run(_main, _define_flags)
