"""Text -> tokenizer + token shards of each split, every document followed by <eos>:

    python -m transformer.data.prepare --output_dir=DIR [--input=PATH] \
        [--tokenizer=byte|char|sentencepiece_bpe|sentencepiece_unigram] [--vocab_size=N] \
        [--tokenizer=hf --tokenizer_path=TOKENIZER_JSON_OR_DIR] \
        [--format=array_record|bin] [--num_shards=N] [--tokens_per_shard=N] \
        [--validation_fraction=0.05] [--unit=paragraph|file|stream] [--text_field=text] \
        [--num_workers=N | --engine=beam [--beam_options="--runner=... ..."]]

--input takes what data.path takes: text, Parquet and JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst)
files, directories or globs of them, or a `datasets` save_to_disk directory (one document a row,
its --text_field: transformer.data.formats). Without --input the embedded corpus is used.

Each input file is a unit of work (`transformer.data.prepare_units`): its documents, split into
train and validation by a hash of their text, are written to shards of its own. DIR receives
the tokenizer, prepare.json (the counts, written last) and, by --format, for input file i:
  * array_record (default): train-{i:06d}-{k:05d}-of-{num_shards:05d}.array_record, ...,
    validation-...: one record per document, the file's documents of the split in --num_shards
    files, document j in file k = j % num_shards;
  * bin: modded-nanogpt uint16 shards train_{i:06d}_{k:06d}.bin, ..., validation_...: the
    file's documents of the split as one token stream cut every --tokens_per_shard tokens.
Training reads a split's documents in input order: file after file, a file's document j from
its shard j % num_shards (.bin shards in sorted order). With --unit=stream, or without --input,
the whole input is one unit (i = 0).

A killed prepare resumes: the same command continues from the input files it finished (their
shards were renamed into DIR when complete; DIR/.prepare/ holds the progress) and writes the same
bytes as an uninterrupted run; another setting, or an input file changed since it was read,
is refused in one line, and so is a second prepare while one is writing DIR. A DIR that holds a
finished prepare, ArrayRecord or .bin files or a tokenizer of its own is refused, so prepared
data, a Hugging Face tokenizer folder or an export is never overwritten. --num_workers
processes tokenize (default: every core); the output is the same bytes for any number.
--engine=beam runs the same units as an Apache Beam pipeline (transformer.data.prepare_beam),
for the same bytes again.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from concurrent import futures

import numpy as np
import tqdm

from transformer.data import prepare_units, shards, sources
from transformer.data import tokenizers as tokenizers_lib
from transformer.utils import fileio

FORMATS = ("array_record", "bin")
ENGINES = ("processes", "beam")
TOKENS_PER_SHARD = 100_000_000  # format="bin"'s default
MAX_TOKENS_PER_SHARD = 2**31 - 1  # a modded-nanogpt shard header's int32 count
_SENTINELS = tokenizers_lib.NUM_SENTINELS  # above a built tokenizer's vocabulary (its default)
_WORKER_TOKENIZER = None  # a worker process's tokenizer (_load_worker_tokenizer)


def _die_with(parent: int) -> None:
    """Has the kernel kill this worker process when its parent dies (Linux's PR_SET_PDEATHSIG;
    elsewhere nothing): a prepare killed by kill -9 or the OOM killer used to leave its workers
    waiting forever, holding their memory."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def _load_worker_tokenizer(directory: str, parent: int | None = None) -> None:
    global _WORKER_TOKENIZER
    if parent is not None:
        _die_with(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process: the pool is the
    _WORKER_TOKENIZER = tokenizers_lib.load_tokenizer(directory)  # parallelism


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.int32) for ids in _WORKER_TOKENIZER.encode_batch(texts)]


@contextlib.contextmanager
def _encoder(tok, tokenizer_dir: str, num_workers: int):
    """An `prepare_units.Encode`: batches of texts -> their ids, in order, encoded by
    `num_workers` processes (each loads the tokenizer saved in `tokenizer_dir`) that keep at
    most 2 batches each in flight; the order, and so every byte written, is the same whatever
    `num_workers` is. A worker that dies (killed, out of memory) fails the prepare in one
    line."""
    if num_workers <= 1:
        yield lambda batches: map(tok.encode_batch, batches)
        return
    # spawn: a fork of a process that holds threads (a Hugging Face tokenizer's) can deadlock
    pool = futures.ProcessPoolExecutor(num_workers, multiprocessing.get_context("spawn"),
                                       initializer=_load_worker_tokenizer,
                                       initargs=(tokenizer_dir, os.getpid()))

    def encode(batches):
        pending = collections.deque()
        try:
            for texts in batches:
                pending.append(pool.submit(_worker_encode, texts))
                if len(pending) >= 2 * num_workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except futures.process.BrokenProcessPool:
            raise RuntimeError(f"a tokenizing worker process (of --num_workers={num_workers}) "
                               "died (killed, or out of memory?): rerun the same command to "
                               "resume the prepare from the input files it finished") from None

    try:
        yield encode
    finally:
        pool.shutdown(cancel_futures=True)


def _check_arguments(tokenizer: str, tokenizer_path: str, format: str, num_shards: int,
                     num_workers: int, vocab_size: int | None, validation_fraction: float,
                     tokens_per_shard: int | None = None) -> None:
    """One-line errors for `prepare`'s arguments, before any document is read (so before a
    tokenizer is trained, or anything written to --output_dir)."""
    if tokenizer not in tokenizers_lib.KINDS:
        raise ValueError(f"tokenizer={tokenizer!r}: expected one of {tokenizers_lib.KINDS}")
    if (tokenizer == "hf") != bool(tokenizer_path):
        raise ValueError(f"tokenizer={tokenizer!r} with tokenizer_path={tokenizer_path!r}: "
                         "expected a path exactly with tokenizer='hf'")
    trained = tokenizer.startswith("sentencepiece_")  # the kinds that take a vocab_size
    if vocab_size is not None and not trained:
        raise ValueError(f"vocab_size={vocab_size} with tokenizer={tokenizer!r}: expected no "
                         "vocab_size (only a SentencePiece tokenizer is trained to one)")
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {FORMATS}")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: expected a positive integer")
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers}: expected a positive integer")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction}: expected a number in "
                         "(0, 1) (prepare writes both splits)")
    if format == "bin" and num_shards != 1:
        raise ValueError(f"num_shards={num_shards} with format='bin': expected tokens_per_shard "
                         "to size .bin shards")
    if format != "bin" and tokens_per_shard is not None:  # (None: not given)
        raise ValueError(f"tokens_per_shard={tokens_per_shard} with format={format!r}: expected "
                         "format='bin' (num_shards sizes ArrayRecord shards)")
    if tokens_per_shard is not None and not 1 <= tokens_per_shard <= MAX_TOKENS_PER_SHARD:
        raise ValueError(f"tokens_per_shard={tokens_per_shard}: expected 1 to 2**31 - 1 "
                         "(a modded-nanogpt shard's int32 count)")
    # A SentencePiece tokenizer's ids reach vocab_size + its sentinels; other tokenizers' sizes
    # are checked once built (`prepare_units`).
    limit = prepare_units.MAX_BIN_VOCAB
    if format == "bin" and trained and (vocab_size or 0) + _SENTINELS > limit:
        raise ValueError(f"vocab_size={vocab_size} with format='bin': expected at most {limit} "
                         f"ids (uint16) with its {_SENTINELS} sentinels, so vocab_size at most "
                         f"{limit - _SENTINELS}")


def prepare(output_dir: str, input_path: str | None = None, tokenizer: str = "byte",
            vocab_size: int | None = None, num_shards: int = 1, validation_fraction: float = 0.05,
            unit: str = "paragraph", format: str = "array_record",
            tokens_per_shard: int | None = None, tokenizer_path: str = "",
            text_field: str = "text", num_workers: int = 1, engine: str = "processes",
            beam_options: str = "") -> dict:
    """Builds the tokenizer on the train split of `input_path` (the embedded corpus if None; a
    Hugging Face tokenizer="hf" is loaded from `tokenizer_path` instead), saves it to
    `output_dir`, and writes each input file's documents of each split, tokenized with <eos>
    appended, to its own shards: "{output_dir}/{split}-{i:06d}-*.array_record"
    (format="array_record", `num_shards` files) or modded-nanogpt shards
    "{output_dir}/{split}_{i:06d}_*.bin" (format="bin", `tokens_per_shard` tokens each,
    default TOKENS_PER_SHARD; the command refuses it with array_record).
    Returns the counts also written to prepare.json (`prepare_units.finish`). `num_workers`
    processes tokenize (the output is the same bytes for any number), or with engine="beam"
    an Apache Beam pipeline of `beam_options` does (`prepare_beam`; the same bytes again).
    Resumes an unfinished prepare of the same settings in `output_dir` (`prepare_units.begin`).
    """
    output_dir = os.fspath(output_dir)
    _check_arguments(tokenizer, tokenizer_path, format, num_shards, num_workers, vocab_size,
                     validation_fraction, tokens_per_shard)
    tokens_per_shard = tokens_per_shard or TOKENS_PER_SHARD  # (array_record: unused)
    if unit not in sources.UNITS:
        raise ValueError(f"unit={unit!r}: expected one of {sources.UNITS}")
    if fileio.is_remote(output_dir):
        raise ValueError(f"output_dir={output_dir!r}: expected a local directory (a bucket "
                         "mounted as one, e.g. by gcsfuse, is local)")
    run = _beam_runner(engine, beam_options) if engine != "processes" else \
        lambda *args: _run(*args, num_workers)
    settings = prepare_units.settings_for(
        input_path, unit=unit, validation_fraction=validation_fraction, text_field=text_field,
        tokenizer=tokenizer, vocab_size=vocab_size, tokenizer_path=tokenizer_path,
        format=format, num_shards=num_shards, tokens_per_shard=tokens_per_shard)
    with prepare_units.exclusive(output_dir):
        settings, tok, finished = prepare_units.begin(output_dir, settings)
        todo = [i for i in range(len(settings["units"])) if i not in finished]
        if todo:
            if getattr(tok, "encoder", None) == "tiktoken":  # a Hugging Face byte-level BPE
                print("encoding through tiktoken: the tokenizer's own ids, faster "
                      "(transformer.data.fast_bpe)", file=sys.stderr)
            elif getattr(tok, "fast_bpe_skipped", ""):
                print(f"encoding through tokenizers: {tok.fast_bpe_skipped}", file=sys.stderr)
            run(output_dir, settings, tok, todo)
        counts = prepare_units.finish(output_dir, settings, input_path)
    _warn_unknown_chars(output_dir, settings, tok, counts["validation"]["files"])
    return counts


def _warn_unknown_chars(output_dir: str, settings: dict, tok, files: list[str]) -> None:
    """A char tokenizer, built from the train split's characters, wrote the validation split's
    others as <unk>: counted in the validation shards (`files`), then, where there are any,
    named from the text (`tokenizers.warn_unknown_chars`: bits per byte undercounts them)."""
    if tok.kind != "char" or not files:
        return
    if settings["format"] == "bin":
        parts = (shards.TokenShards(os.path.join(glob.escape(output_dir), name))
                 for name in files)
        ids = (part.read(0, len(part)) for part in parts)
    else:
        ids = prepare_units.array_record_documents(output_dir, "validation")
    if any(np.any(one == tokenizers_lib.UNK_ID) for one in ids):
        texts = (doc.text for index in range(len(settings["units"]))
                 for split, doc in prepare_units.unit_documents(settings, index)
                 if split == "validation")
        tokenizers_lib.warn_unknown_chars(tok, texts, f"--output_dir={output_dir}: the "
                                          "validation split")


def _beam_runner(engine: str, beam_options: str):
    """engine="beam": `prepare_beam.run` with `beam_options`, checked before any work."""
    if engine != "beam":
        raise ValueError(f"engine={engine!r}: expected one of {ENGINES}")
    beam_logs = logging.getLogger()  # Beam's imports note the Google Cloud clients it lacks
    level = beam_logs.level
    beam_logs.setLevel(logging.ERROR)
    try:
        from transformer.data import prepare_beam
    except ImportError as error:
        raise ValueError(f"engine='beam': {error}: expected Apache Beam installed (pip install "
                         "-e '.[beam]')") from None
    finally:
        beam_logs.setLevel(level)
    prepare_beam.options(beam_options)
    return lambda output_dir, settings, tok, todo: prepare_beam.run(output_dir, settings, todo,
                                                                    beam_options)


def _run(output_dir: str, settings: dict, tok, todo: list[int], num_workers: int) -> None:
    """Units `todo` in order, tokenized by `num_workers` processes, under a progress bar of
    input files with documents, tokens and tokens/s."""
    done = {"documents": 0, "tokens": 0}
    start = time.perf_counter()
    with _encoder(tok, output_dir, num_workers) as encode, \
            tqdm.tqdm(total=len(todo), desc="preparing", unit="file", file=sys.stderr,
                      disable=None) as bar:

        def progress(documents: int, tokens: int) -> None:
            done["documents"] += documents
            done["tokens"] += tokens
            rate = done["tokens"] / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{done['documents']:,} documents, {done['tokens']:,} tokens, "
                                f"{rate:,.0f} tokens/s")

        for index in todo:
            prepare_units.prepare_unit(output_dir, settings, index, encode, progress,
                                       encode_now=tok.encode_batch)  # (a long text's cuts)
            bar.update(1)


# What the corpus readers (transformer.data.formats, sources) call their settings in a
# training config, and the flag of this command that sets each.
_FLAGS_OF_SETTINGS = {"data.text_field": "--text_field", "data.path": "--input"}


def _main(argv):
    from absl import app, flags

    f = flags.FLAGS
    if f.engine == "beam" and f.num_workers is not None:
        raise app.UsageError(f"--num_workers={f.num_workers} with --engine=beam: expected the "
                             "runner's own workers in --beam_options (--direct_num_workers=N)")
    if f.engine != "beam" and f.beam_options:
        raise app.UsageError(f"--beam_options={f.beam_options!r} with --engine={f.engine}: "
                             "expected --engine=beam")
    try:
        counts = prepare(f.output_dir, f.input, tokenizer=f.tokenizer, vocab_size=f.vocab_size,
                         num_shards=f.num_shards, validation_fraction=f.validation_fraction,
                         unit=f.unit, format=f.format, tokens_per_shard=f.tokens_per_shard,
                         tokenizer_path=f.tokenizer_path, text_field=f.text_field,
                         num_workers=f.num_workers or os.cpu_count() or 1, engine=f.engine,
                         beam_options=f.beam_options)
    except ValueError as error:  # the readers name training's settings; here they are flags
        text = str(error)
        for setting, flag in _FLAGS_OF_SETTINGS.items():
            text = text.replace(setting, flag)
        raise ValueError(text) from None
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
    flags.DEFINE_integer("tokens_per_shard", None, "Tokens per .bin shard (--format=bin; "
                         f"default {TOKENS_PER_SHARD:,}).", lower_bound=1)
    flags.DEFINE_float("validation_fraction", 0.05,
                       "Fraction of documents for validation, in (0, 1).")
    flags.DEFINE_enum("unit", "paragraph", sources.UNITS, "Document unit of text files.")
    flags.DEFINE_integer("num_workers", None, "Processes that tokenize (default: every core); "
                         "the output is the same for any number.", lower_bound=1)
    flags.DEFINE_enum("engine", "processes", ENGINES, "processes: --num_workers processes on "
                      "this machine; beam: an Apache Beam pipeline (the same bytes).")
    flags.DEFINE_string("beam_options", "", "--engine=beam: Beam pipeline options, e.g. "
                        "'--runner=DataflowRunner --project=P' (default --runner=FnApiRunner).")


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(_main, _define_flags)
