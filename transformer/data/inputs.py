"""An experiment's data: its tokenizer (saved in the workdir) and its Grain datasets per split.

`data.path` is empty (the embedded corpus), a text file / directory / glob, or a directory
written by `python -m transformer.data.prepare` (pre-tokenized ArrayRecord shards and their
tokenizer). `data.sources` instead trains on a weighted mixture of such paths
(`source_configs`, `mixture.Mixture`); each source's validation split is evaluated on its own.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re

import grain
import jax
import ml_collections
import numpy as np

from transformer.data import chat, images, pipeline, prepare_units, shards, sources, tasks, windows
from transformer.data import direct_reads as direct
from transformer.data import tokenizers as tokenizers_lib
from transformer.utils import cli, fileio

TOKENIZER_DIR = "tokenizer"


def source_configs(config: ml_collections.ConfigDict) -> dict[str, ml_collections.ConfigDict]:
    """A mixture's sources (`data.sources`) by name, each as the config of a run on that source
    alone (its data.path, unit and validation_path filled in, data.sources empty); {} for a
    single-source config.

    >>> web = f"path={sources.__file__},weight=0.7,unit=file"  # any existing file
    >>> config = ml_collections.ConfigDict({"data": {"path": "", "unit": "paragraph",
    ...     "validation_path": "", "sources": (web,)}})
    >>> {name: c.data.unit for name, c in source_configs(config).items()}
    {'sources': 'file'}
    """
    configs = {}
    for source in sources.parse_sources(config.data.get("sources") or ()):
        one = ml_collections.ConfigDict(config.to_dict())
        one.data.update(path=source.path, unit=source.unit or config.data.unit,
                        validation_path=source.validation_path, sources=(),
                        text_field=source.text_field or config.data.get("text_field", "text"))
        configs[source.name] = one
    return configs


def mixture_weights(config: ml_collections.ConfigDict) -> list[float]:
    """The weights of `data.sources`, in order (as given: `mixture.Mixture` normalizes)."""
    return [source.weight for source in sources.parse_sources(config.data.get("sources") or ())]


def _prepared_dirs(config: ml_collections.ConfigDict) -> list[str]:
    """data.path if it is a prepared directory; for a mixture, its prepared sources'."""
    paths = [c.data.path for c in source_configs(config).values()] or [config.data.path]
    return [p for p in paths if p and os.path.isfile(os.path.join(p, "prepare.json"))]


def _prepared_dir(config: ml_collections.ConfigDict) -> str | None:
    """The first of `_prepared_dirs`, or None."""
    return next(iter(_prepared_dirs(config)), None)


def prepared_settings(config: ml_collections.ConfigDict) -> dict | None:
    """What the prepared data.path fixed of the data settings (None if it is not prepared): by
    data key, prepare.json's unit, validation_fraction and text_field ("format" is the shards'
    layout, "array_record" or "bin"). Its tokenizer's settings are checked where it is loaded
    (`get_tokenizer`)."""
    if not (prepared := _prepared_dir(config)):
        return None
    summary = _summary(prepared)
    return {"unit": summary.get("unit"), "validation_fraction": summary.get("validation_fraction"),
            "text_field": summary.get("text_field", "text"),
            "format": summary.get("format", "array_record")}


def _summary(prepared: str) -> dict:
    """A prepared directory's prepare.json."""
    with open(os.path.join(prepared, "prepare.json")) as f:
        return json.load(f)


def streamed(config: ml_collections.ConfigDict) -> bool:
    """Whether training read its documents as one stream, each after the previous one's <eos>
    (data.unit="stream", a directory of token shards, a prepared directory's .bin shards:
    `corpus`), rather than packed, each from position 0 of its own segment with nothing before
    it. Only the next_token objective reads a stream; the others lay out their own rows (sft: a
    conversation from position 0, whatever data.unit says). A mixture streams if one of its
    sources does. A data.path no longer on this machine reads as its data.unit says.

    >>> config = ml_collections.ConfigDict({"data": {"path": "", "unit": "paragraph",
    ...     "sources": (), "objective": "next_token"}, "model": {"family": "gpt"}})
    >>> streamed(config)
    False
    >>> config.data.unit = "stream"
    >>> streamed(config)
    True
    """
    if pipeline.objective_for(config) != "next_token":
        return False
    return any(one.data.unit == "stream" or _token_ids(one)
               for one in list(source_configs(config).values()) or [config])


def _token_ids(config: ml_collections.ConfigDict) -> bool:
    """Whether a single source's data is token ids already, read as one stream: a directory of
    token shards, or a prepared directory's .bin shards (`corpus`)."""
    return bool(token_shard_dir(config.data.path)) or \
        (prepared_settings(config) or {}).get("format") == "bin"


# A directory of token shards given as data.path (no prepare.json): each split's files by name,
# as nanoGPT (train.bin, val.bin) and modded-nanogpt (fineweb_train_000001.bin,
# fineweb_val_000000.bin) name them.
SHARD_SPLITS = {"train": "*train*.bin", "validation": "*val*.bin"}
# Ids checked against the tokenizer at start-up: the first this many tokens of every shard.
_SHARD_CHECK_TOKENS = 1 << 20


def token_shard_dir(path: str) -> bool:
    """Whether `path` is a directory of token shards (*.bin) that prepare.py did not write (nor
    is writing: an unfinished prepare is refused, `check_finished`)."""
    return bool(path) and os.path.isdir(path) and not os.path.isfile(
        os.path.join(path, "prepare.json")) and not prepare_units.unfinished(path) and \
        bool(glob.glob(os.path.join(glob.escape(path), "*.bin")))


def check_finished(path: str) -> None:
    """A one-line error for a directory a prepare has begun and not finished (its shards are
    whole, but not yet all of them)."""
    if prepare_units.unfinished(path):
        raise ValueError(f"data.path={path!r}: an unfinished prepare (no prepare.json yet): "
                         "expected its prepare to finish (the same command resumes it)")


def shard_split(file: str) -> str | None:
    """The split of a token shard in a `token_shard_dir`: the one whose `SHARD_SPLITS` pattern
    its name matches (None: neither). A name matching both goes by its parts (cut at what is
    not a letter or digit): the split of the one part starting with "train" or "val", else a
    one-line error.

    >>> [shard_split(name) for name in ("val.bin", "fineweb_train_000001.bin",
    ...                                 "pretrain_val_000000.bin", "retrieval_train_000000.bin")]
    ['validation', 'train', 'validation', 'train']
    """
    name = os.path.basename(file)
    splits = _named_splits(name)
    if len(splits) > 1:  # "*train*.bin" -> "train": what a part of the split's names starts with
        parts = re.split(r"[^0-9A-Za-z]+", name)
        splits = [split for split in splits if any(
            part.startswith(SHARD_SPLITS[split].split("*")[1]) for part in parts)]
        if len(splits) != 1:
            raise ValueError(f"{file}: its name matches both {SHARD_SPLITS['train']!r} and "
                             f"{SHARD_SPLITS['validation']!r}, and its parts do not say which "
                             "split: expected one part starting with 'train' or 'val' (rename "
                             "the shard)")
    return splits[0] if splits else None


def _named_splits(file: str) -> list[str]:
    """The splits whose `SHARD_SPLITS` pattern the shard's file name matches."""
    return [split for split, pattern in SHARD_SPLITS.items()
            if fnmatch.fnmatch(os.path.basename(file), pattern)]


def _token_shards(config: ml_collections.ConfigDict, split: str) -> shards.TokenShards:
    """data.path's shards of `split` (`shard_split`), or a one-line error naming what is
    missing."""
    path = config.data.path
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*.bin")))
    files = [file for file in found if shard_split(file) == split]
    if unnamed := [os.path.basename(file) for file in found if shard_split(file) is None]:
        cli.warn_once(f"data.path={path!r}: {', '.join(unnamed[:3])}"
                          f"{' ...' if len(unnamed) > 3 else ''} matches neither "
                          f"{SHARD_SPLITS['train']!r} nor {SHARD_SPLITS['validation']!r}: "
                          "not read (name a shard for its split)")
    if not files:
        raise FileNotFoundError(f"data.path={path!r}: no {SHARD_SPLITS[split]} shards for the "
                                f"{split} split: expected token shards named as nanoGPT's "
                                "train.bin / val.bin")
    return shards.TokenShards(files)


def check_token_shards(config: ml_collections.ConfigDict, tokenizer) -> None:
    """Token shards at data.path must hold ids of `tokenizer`: each shard's first ids are read
    (a shard written with another vocabulary shows within its first million tokens)."""
    for one in list(source_configs(config).values()) or [config]:
        if not token_shard_dir(one.data.path):
            continue
        for split in SHARD_SPLITS:
            tokens = _token_shards(one, split)
            for path, length, start in zip(tokens.paths, tokens.shard_lengths,
                                           np.cumsum([0, *tokens.shard_lengths]), strict=False):
                head = tokens.read(int(start), int(start) + min(length, _SHARD_CHECK_TOKENS))
                if head.size and int(head.max()) >= tokenizer.vocab_size:
                    raise ValueError(f"{path} holds token id {int(head.max())}: expected ids < "
                                     f"the tokenizer's vocab_size {tokenizer.vocab_size} (the "
                                     "shards were written with another vocabulary)")


def _documents(config: ml_collections.ConfigDict, split: str) -> list[sources.Document]:
    """A split's documents (`sources.load_documents`); a mixture's are its sources' in order."""
    if mixture := source_configs(config):
        return [doc for one in mixture.values() for doc in _documents(one, split)]
    data = config.data
    if data.path and (split == "train" or split != "test" and not data.get("validation_path")):
        direct.warn_big_corpus(data)  # (before the read)
    return sources.load_documents(data.path or None, split, unit=data.unit,
                                  validation_fraction=data.validation_fraction,
                                  validation_path=data.get("validation_path", ""),
                                  test_path=data.get("test_path", ""),
                                  text_field=data.get("text_field", "text"))


def get_tokenizer(config: ml_collections.ConfigDict, workdir: str | None = None):
    """The experiment's tokenizer: the one saved in `workdir` (pass it only for a workdir with
    checkpoints: a run saves its tokenizer with its first checkpoint, `save_tokenizer`), else
    the fine-tuning source's, the prepared data's, or one built from the train split.

    A resumed run and an evaluation thus always use the tokenizer the run started with, and a
    run that failed before its first checkpoint leaves no tokenizer for the next run to pick
    up. Char and SentencePiece tokenizers are trained on the train split only
    (deterministically, so every process of a multi-host run builds the same one).
    """
    saved = fileio.join(workdir, TOKENIZER_DIR) if workdir else None
    kind, source, _ = fileio.parse_init_from(config.get("init_from", ""))
    # Written last (atomically), so its presence means the tokenizer was saved completely.
    if saved and fileio.path(saved).joinpath(tokenizers_lib.CONFIG_FILE).is_file():
        tokenizer = tokenizers_lib.load_tokenizer(saved)
        what = f"the tokenizer {workdir!r} was trained with"
        _check_hf_path(config, tokenizer, what)
        _check_prepared_tokenizer(config, saved, what)
        tokenizers_lib.check_settings(  # (a resume with new_data=True would keep it silently)
            tokenizer, what, config.data, prepared=bool(_prepared_dirs(config)),
            from_workdir=bool(source) and kind == "workdir")
        return tokenizer
    if source and kind == "workdir":  # fine-tuning reads text as it was pretrained
        tokenizer = tokenizers_lib.load_tokenizer(fileio.join(source, TOKENIZER_DIR))
        origin = f"init_from={config.init_from!r}"
        _check_prepared_tokenizer(config, fileio.join(source, TOKENIZER_DIR),
                                  f"the tokenizer of init_from={config.init_from!r}")
        tokenizers_lib.check_settings(tokenizer, f"the tokenizer of {origin}", config.data,
                                      prepared=bool(_prepared_dirs(config)), from_workdir=True)
    elif prepared := _prepared_dir(config):
        tokenizer = tokenizers_lib.load_tokenizer(prepared)
        origin = f"the prepared data {prepared!r}"
        tokenizers_lib.check_settings(tokenizer, f"the tokenizer of {origin}", config.data,
                                      prepared=True)
        _check_same_tokenizer(config, prepared)
        _check_hf_path(config, tokenizer, f"the tokenizer of the prepared data {prepared!r}")
    elif config.data.tokenizer == "hf":
        return tokenizers_lib.load_hf_tokenizer(_hf_tokenizer_path(config),
                                                config.data.num_sentinels)
    else:
        kind = config.data.tokenizer
        texts = None if kind == "byte" else [d.text for d in _documents(config, "train")]
        return tokenizers_lib.build_tokenizer(
            kind, texts, vocab_size=config.data.vocab_size or None,
            num_sentinels=config.data.num_sentinels)
    if tokenizer.kind != config.data.tokenizer:  # the checkpoint would record the wrong one
        raise ValueError(f"data.tokenizer={config.data.tokenizer!r}: {origin} was tokenized "
                         f"with {tokenizer.kind!r}: expected data.tokenizer={tokenizer.kind!r}")
    return tokenizer


def _hf_tokenizer_path(config: ml_collections.ConfigDict) -> str:
    """data.tokenizer_path, else the init_from="hf:DIR" directory's tokenizer ("" if none)."""
    if path := config.data.get("tokenizer_path", ""):
        return path
    kind, source, _ = fileio.parse_init_from(config.get("init_from", ""))
    return source if kind == "hf" and fileio.path(source).joinpath("tokenizer.json").is_file() \
        else ""


def _check_hf_path(config: ml_collections.ConfigDict, tokenizer, what: str) -> None:
    """A Hugging Face tokenizer the config names must be the one already in use (`what`)."""
    if config.data.tokenizer != "hf" or not (path := _hf_tokenizer_path(config)):
        return
    given = tokenizers_lib.load_hf_tokenizer(path)
    if (given.tokenizer_json, given.specials) != (getattr(tokenizer, "tokenizer_json", None),
                                                  getattr(tokenizer, "specials", None)):
        raise ValueError(f"data.tokenizer_path / init_from: {path!r} is not {what}: expected "
                         "that tokenizer")


def _tokenizer_identity(directory: str) -> tuple[dict, bytes | None]:
    """A saved tokenizer's settings and model file (SentencePiece's, a Hugging Face
    tokenizer.json): equal for two directories exactly when they tokenize alike."""
    config = json.loads(fileio.path(directory).joinpath(tokenizers_lib.CONFIG_FILE).read_text())
    config.get("specials", {}).pop("unnamed", None)  # (which roles chat templates see, not ids)
    model = config.get("model_file")
    return config, fileio.path(directory).joinpath(model).read_bytes() if model else None


def _check_prepared_tokenizer(config: ml_collections.ConfigDict, directory: str,
                              what: str) -> None:
    """Prepared data (data.path, or a mixture's source) must hold ids of the run's tokenizer,
    saved in `directory` (`what`): a resume with new_data=True, or init_from, on data prepared
    with another tokenizer would read its ids as other tokens."""
    runs = _tokenizer_identity(directory)
    for path in _prepared_dirs(config):
        if _tokenizer_identity(path) != runs:
            raise ValueError(f"the prepared data {path!r} holds ids of another tokenizer than "
                             f"{what}: expected data prepared with that tokenizer")


def _check_same_tokenizer(config: ml_collections.ConfigDict, prepared: str) -> None:
    """A mixture's prepared sources must share one tokenizer (the text sources then use it)."""
    saved = _tokenizer_identity(prepared)
    for name, one in source_configs(config).items():
        other = _prepared_dir(one)
        if other and _tokenizer_identity(other) != saved:
            raise ValueError(f"data.sources {name!r}: {other!r} was prepared with another "
                             f"tokenizer than {prepared!r}: expected one tokenizer for all")


def save_tokenizer(tokenizer, workdir: str) -> None:
    """Saves a run's tokenizer into its workdir (process 0; the others built the same one)."""
    if jax.process_index() == 0:
        tokenizer.save(fileio.join(workdir, TOKENIZER_DIR))


# Changes whenever the same settings and data would give other batches (a checkpoint's
# iterator position then means nothing): 2 = windows through one token sequence per split.
PIPELINE_VERSION = 2
# Data settings that do not change which batches a run reads.
# (data.tokenizer_path: a resumed run reads the tokenizer saved in its workdir and refuses a
# different one, get_tokenizer.)
_NOT_STREAM = ("prefetch", "tokenizer_path", "test_path")  # (test_path: never trained on)


def data_stream(config: ml_collections.ConfigDict, tokenizer=None) -> dict:
    """What defines the sequence of batches a run reads, so a checkpoint's iterator position
    means something only together with it: the data settings, batch size, length and seed, and
    a fingerprint of the data's content (`sources.fingerprint`; of a prepared directory, its
    tokenizer, prepare.json and every input file's shards, never its hidden .prepare/).
    A mixture's sources (paths, weights, units; `sources.canonical_source`, so 0.7 and 0.70
    are one stream) are among the data settings, and its fingerprints are per source:
    {"fingerprint": {"web": ..., "code": ...}}. Where documents begin with ids of the
    tokenizer's (`document_start`), those too (`tokenizer`: the run's, default
    `get_tokenizer`'s). A labeled task's class names, in class order (`tasks.stream_labels`)."""
    data = {k: v for k, v in config.data.to_dict().items() if k not in _NOT_STREAM}
    if data.get("text_field") == "text":  # the default: as checkpoints saved before the key
        del data["text_field"]
    data["objective"] = pipeline.objective_for(config)
    if "sources" in data:  # a list, as JSON gives it back from a checkpoint
        data["sources"] = [sources.canonical_source(spec) for spec in data["sources"]]
    stream = {"pipeline": PIPELINE_VERSION, "batch_size": config.batch_size,
              "seq_len": config.seq_len, "seed": config.seed, "data": data,
              "fingerprint": sources.fingerprint(config.data.path or None),
              DOCUMENTS: "stream" if streamed(config) else "packed", **tasks.stream_labels(config)}
    if data["objective"] == "sft":  # (older checkpoints' masks took text after end of turn)
        stream[SFT_MASK] = 2
    if not source_configs(config) and (start := document_start(config, tokenizer)):
        stream[DOCUMENT_START] = start  # (only then: other runs' streams are as they were)
    if config.data.get("validation_path"):
        stream["validation_fingerprint"] = sources.fingerprint(config.data.validation_path)
    if config.data.get("test_path"):
        stream[TEST_FINGERPRINT] = sources.fingerprint(config.data.test_path)
    if token_shard_dir(config.data.path) and any(  # (read into both splits before `shard_split`)
            len(_named_splits(file)) > 1
            for file in glob.glob(os.path.join(glob.escape(config.data.path), "*.bin"))):
        stream["shards_by_name_parts"] = True
    if _interleaved_units(config.data.path):
        stream[_IN_INPUT_ORDER] = True
    if mixture := source_configs(config):
        per_source = {name: data_stream(one, tokenizer) for name, one in mixture.items()}
        stream["fingerprint"] = {name: s["fingerprint"] for name, s in per_source.items()}
        if starts := {name: s[DOCUMENT_START] for name, s in per_source.items()
                      if DOCUMENT_START in s}:
            stream[DOCUMENT_START] = starts
        stream["validation_fingerprint"] = {
            name: s.get("validation_fingerprint", "") for name, s in per_source.items()}
        if in_order := [name for name, s in per_source.items() if _IN_INPUT_ORDER in s]:
            stream[_IN_INPUT_ORDER] = in_order
    return stream


# The test file's content (data.test_path): never trained on, so never a difference on resume
# (`stream_differences`); `transformer.evaluate --split=test` compares it.
TEST_FINGERPRINT = "test_fingerprint"


# How training laid out its documents (`streamed`), recorded with each checkpoint so that
# generation and scoring read texts the same way wherever the workdir is read
# (`generate.load_workdir`), the data moved or not. Derived from the data settings and content
# the stream holds already: never a difference on resume (`stream_differences`).
DOCUMENTS = "documents"


# The ids before each document's text (`document_start`), where there are any.
DOCUMENT_START = "document_start"
# SFT's loss mask version (`chat.assistant_tokens`): 2 ends each reply at its end of turn.
SFT_MASK = "sft_mask"


def document_start(config: ml_collections.ConfigDict, tokenizer=None) -> list[int]:
    """The ids each training document begins with, before its text: for weights imported from
    Hugging Face (init_from="hf:...") trained on next-token rows, what the run's tokenizer
    puts before a text (`HFTokenizer.document_start`: Llama's, Gemma's, Mistral's BOS), as
    fine-tuning with transformers reads `tokenizer(text)`, and as generation reads a prompt
    (`text.document_prefix`); none otherwise, nor in token shards (ids already). GPT-2's and
    Qwen's tokenizers put nothing there. `tokenizer`: the run's (default: `get_tokenizer`'s).
    A single source's: a mixture's `data_stream` records each source's.

    >>> config = ml_collections.ConfigDict({"init_from": "", "data": {"objective": "auto",
    ...     "tokenizer": "hf"}, "model": {"family": "gpt"}})
    >>> document_start(config)
    []
    """
    if not str(config.get("init_from") or "").startswith("hf:") or \
            pipeline.objective_for(config) != "next_token":
        return []
    if _token_ids(config):
        return []  # read as they are
    if tokenizer is None and config.data.get("tokenizer") != "hf":
        return []  # (only a Hugging Face tokenizer puts anything there)
    return [int(i) for i in getattr(tokenizer or get_tokenizer(config), "document_start", [])]


# Prepared ArrayRecord data whose units have several shards (--num_shards > 1) trained shard
# after shard until its documents were read in input order (`prepare_units.
# array_record_documents`): its stream carries this key, so a checkpoint of the old order is
# refused on resume. Other data's stream is as it was.
_IN_INPUT_ORDER = "documents_in_input_order"


def _interleaved_units(path: str) -> bool:
    """Whether `path` is prepared ArrayRecord data with a unit of several shards."""
    if not path or not os.path.isfile(os.path.join(path, "prepare.json")) or \
            _summary(path).get("format", "array_record") != "array_record":
        return False
    return any(len(unit) > 1 for unit in prepare_units.array_record_units(path, "train"))


def _check_prepared_files(prepared: str, summary: dict) -> None:
    """A one-line error if the prepared directory's shards of a split are not those its
    prepare.json `summary` lists (one deleted or added since: the split's counts, and so bits
    per byte, would not be its tokens'). Every split is checked, so the train corpus, read
    before training, checks the validation one too; a prepare.json without the lists is not."""
    for split in sources.SPLITS:
        if (listed := (summary.get(split) or {}).get("files")) is None:
            continue
        pattern = f"{split}_*.bin" if summary.get("format") == "bin" else \
            f"{split}-*.array_record"
        found = {os.path.basename(p)
                 for p in glob.glob(os.path.join(glob.escape(prepared), pattern))}
        missing, extra = sorted(set(listed) - found), sorted(found - set(listed))
        if missing or extra:
            raise ValueError(f"data.path={prepared!r}: its {split} shards are not those of its "
                             f"prepare.json (missing: {missing}, not listed: {extra}): expected "
                             "the files prepare wrote (prepare the data again)")


def corpus(config: ml_collections.ConfigDict, tokenizer, split: str) -> windows.Corpus:
    """A split's tokens as a `windows.Corpus`: its documents (each ending in <eos>) end to end,
    read as one stream under data.unit="stream". A prepared directory's .bin shards are always a
    stream (memory-mapped); its ArrayRecord documents are read into memory. A mixture has one
    corpus per source: call this with each of `source_configs(config)`."""
    _single_source(config, "corpus")
    stream = config.data.unit == "stream"
    if token_shard_dir(config.data.path):
        return windows.Corpus(_token_shards(config, split), stream=True)
    if prepared := _prepared_dir(config):
        _check_prepared_files(prepared, summary := _summary(prepared))
        if summary.get("format", "array_record") == "bin":
            return windows.Corpus(shards.TokenShards(
                os.path.join(glob.escape(prepared), f"{split}_*.bin")), stream=True)
        documents = prepare_units.array_record_documents(prepared, split)
        if start := document_start(config, tokenizer):
            documents = [np.concatenate([np.asarray(start, np.int32), d]) for d in documents]
        return windows.Corpus.from_documents(documents, stream=stream)
    if split == "train":  # built once per run
        return windows.tokenize_documents(_documents(config, split), tokenizer, stream=stream,
                                          start=document_start(config, tokenizer))
    return _kept_split(config, tokenizer, split)[0]


def _kept_split(config: ml_collections.ConfigDict, tokenizer, split: str) -> tuple:
    """(tokens, UTF-8 bytes, prompt line) of a direct validation / test split, which every
    evaluation reads: the last few kept, keyed by data settings, file fingerprints, tokenizer."""
    key = (*direct.split_key(config.data, split), tokenizer)
    if key not in _EVAL_CORPORA:
        documents, data = _documents(config, split), config.data
        field = f"{split}_path" if data.get(f"{split}_path") else "path"  # (or held out)
        tokenizers_lib.warn_unknown_chars(  # (a char tokenizer's characters are train's)
            tokenizer, (d.text for d in documents),
            f"the {split} split (data.{field}={data.get(field)!r})")
        _EVAL_CORPORA[key] = (windows.tokenize_documents(
            documents, tokenizer, stream=data.unit == "stream",
            start=document_start(config, tokenizer)), *direct.split_text(documents))
        while len(_EVAL_CORPORA) > _EVAL_CORPORA_KEPT:
            _EVAL_CORPORA.pop(next(iter(_EVAL_CORPORA)))
    return _EVAL_CORPORA[key]


_EVAL_CORPORA: dict = {}  # insertion-ordered: the oldest goes first
_EVAL_CORPORA_KEPT = 8


def sample_prompt(config: ml_collections.ConfigDict, max_chars: int = 32) -> str:
    """A prompt suited to the data for end-of-training samples: the start of the validation
    split's `direct.split_text` line (cut to `max_chars` at a word's end), kept from its
    evaluation (`corpus`) if any; "" for token shards, prepared data and mixtures (no text at hand).

    >>> config = ml_collections.ConfigDict({"data": {"path": "", "unit": "paragraph",
    ...     "validation_fraction": 0.05, "validation_path": "", "sources": ()}})
    >>> 0 < len(sample_prompt(config)) <= 32
    True
    """
    if config.data.get("sources") or token_shard_dir(config.data.path) or _prepared_dir(config):
        return ""
    key = direct.split_key(config.data, "validation")  # (kept: any tokenizer's)
    if (line := next((kept[2] for at, kept in _EVAL_CORPORA.items() if at[:-1] == key),
                     None)) is None:
        line = direct.split_text(_documents(config, "validation"))[1]
    if len(line) <= max_chars:
        return line
    cut = line[:max_chars + 1].rfind(" ")
    return line[:cut] if cut > 0 else line[:max_chars]


def bytes_per_token(config: ml_collections.ConfigDict, tokenizer, split: str) -> float:
    """UTF-8 bytes per *target* token of a split, for bits per byte: the mean next-token loss
    times target tokens / bytes is the split's summed cross-entropy over its bytes.

    A whole evaluation pass predicts every token of the split (<eos> included) but the ones
    with nothing before them: the first of a stream (a window's first token is the previous
    window's last target), or the first of each packed document (`features.
    next_token_features` gives a prediction across a document start weight 0)."""
    _single_source(config, "bytes_per_token")
    if prepared := _prepared_dir(config):
        stats = (summary := _summary(prepared))[split]
        # .bin shards are always read as a stream (`corpus`)
        stream = config.data.unit == "stream" or summary.get("format") == "bin"
        tokens = stats["tokens"] + stats["documents"] * len(document_start(config, tokenizer))
        targets = tokens - (1 if stream else stats["documents"])
        return stats["bytes"] / max(targets, 1)
    tokens, num_bytes, _ = _kept_split(config, tokenizer, split) if split != "train" else (
        corpus(config, tokenizer, split), *direct.split_text(_documents(config, split)))
    targets = len(tokens) - (1 if tokens.stream else len(tokens.doc_starts))
    return num_bytes / max(targets, 1)


def get_dataset(config: ml_collections.ConfigDict, tokenizer, split: str, *,
                num_epochs: int | None = None, shuffle: bool = True, rows=None,
                process_index: int | None = None,
                process_count: int | None = None) -> grain.IterDataset:
    """This process's batches of `split` for the experiment's objective.

    `rows` are the global batch rows this process produces (see `pipeline.make_dataset`), e.g.
    `global_batches.process_rows(batch_sharding, config.batch_size)`; by default this process's
    contiguous block of `config.batch_size // process_count` rows.
    """
    data = config.data
    objective = pipeline.objective_for(config)
    if objective in tasks.OBJECTIVES + images.OBJECTIVES + chat.OBJECTIVES:
        module = tasks if objective in tasks.OBJECTIVES else \
            images if objective in images.OBJECTIVES else chat
        return module.make_dataset(config, tokenizer, split, num_epochs=num_epochs,
                                   shuffle=shuffle, rows=rows)
    weights, mixture = None, source_configs(config)
    if mixture and split == "train" and num_epochs is None:
        weights = mixture_weights(config)
    split_tokens = [corpus(one, tokenizer, split) for one in mixture.values()] if weights \
        else corpus(config, tokenizer, split)
    return pipeline.make_dataset(
        split_tokens, weights=weights, objective=objective,
        tokenizer=tokenizer, seq_len=config.seq_len, batch_size=config.batch_size,
        seed=config.seed, num_epochs=num_epochs, shuffle=shuffle, rows=rows,
        process_index=process_index,
        process_count=process_count, mlm_rate=data.mlm_rate, noise_density=data.noise_density,
        mean_span_length=data.mean_span_length, prefetch=data.prefetch)


def _single_source(config: ml_collections.ConfigDict, what: str) -> None:
    if config.data.get("sources"):
        raise ValueError(f"{what}: data.sources is a mixture: expected one source's config "
                         "(inputs.source_configs); only training reads the mixture")


def has_test_split(config: ml_collections.ConfigDict) -> bool:
    """Whether the run holds out a test split: a labeled task's, or data.test_path."""
    return bool(config.data.get("test_path")) or labeled_task(config) is not None


def labeled_task(config: ml_collections.ConfigDict) -> tasks.Task | None:
    """The config's labeled task (fine-tuning text or the digits images), or None when it
    pretrains on raw text. Labeled tasks hold out a test split."""
    objective = pipeline.objective_for(config)
    if objective in tasks.OBJECTIVES:
        return tasks.task_for(config)
    if objective in images.OBJECTIVES:
        return images.digits_task(config)
    return None
