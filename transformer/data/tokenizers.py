"""Tokenizers: text <-> int32 ids with special tokens and T5 sentinels, plus save / load so a
resumed run re-uses the exact same mapping.

The kinds this project builds (byte, char, SentencePiece BPE / unigram) share one id layout:
  * 0..6: the specials `SPECIAL_TOKENS` (<pad>, <bos>, <eos>, <unk>, <mask>, <cls>, <sep>),
  * then the kind's regular tokens (bytes, characters or SentencePiece pieces),
  * then `num_sentinels` T5 sentinels at the top: <extra_id_i> = vocab_size - 1 - i.
`encode` never adds BOS / EOS; `decode` drops <pad> and writes other specials and sentinels as
their names, so `decode(encode(text)) == text` for any text a kind can represent (all text for
byte and SentencePiece, which falls back to UTF-8 bytes for unseen characters).
`hugging_face()` gives the tokenizer.json (built with the `tokenizers` library) and
tokenizer_config.json with which `transformers.AutoTokenizer` encodes and decodes like `encode`
and `decode`: the export writes them beside the model.

The "hf" kind (`HFTokenizer`) wraps a Hugging Face `tokenizer.json` (GPT-2 or Llama BPE, BERT
WordPiece, T5 unigram, ...) and keeps its own ids: its specials are wherever that vocabulary has
them (`pad_id`, `eos_id`, ... may be None), and its sentinels are its own `<extra_id_i>` tokens
or, if it has none, `num_sentinels` ids appended above its vocabulary; it keeps the stop ids of
the checkpoint's generation_config.json (`stop_ids`). Code that needs a special reads it from
the tokenizer (`tokenizer.eos_id`), never from its constants.

The kinds live in `tokenizer_base` (the id layout, the base class, byte and char),
`sentencepiece_tokenizer` and `hf_tokenizer`; this module builds and loads them, and is where
their public names are imported from.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable

from transformer.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer, saved_stop_ids
from transformer.data.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece
from transformer.data.tokenizer_base import (
    BOS_ID,
    CLS_ID,
    CONFIG_FILE,
    EOS_ID,
    FORMAT_VERSION,
    HF_FILE,
    MASK_ID,
    NUM_SENTINELS,
    NUM_SPECIAL,
    PAD_ID,
    ROLES,
    SENTENCEPIECE_FILE,
    SEP_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    check_num_sentinels,
    checked_texts,
    is_int,
)
from transformer.utils import cli, fileio

__all__ = [
    "BOS_ID", "CLS_ID", "CONFIG_FILE", "EOS_ID", "FORMAT_VERSION", "HF_FILE", "KINDS", "MASK_ID",
    "NUM_SENTINELS", "NUM_SPECIAL", "PAD_ID", "ROLES", "SENTENCEPIECE_FILE", "SEP_ID",
    "SPECIAL_TOKENS", "UNK_ID",
    "ByteTokenizer", "CharTokenizer", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer",
    "build_tokenizer", "check_settings", "load_hf_tokenizer", "load_tokenizer",
    "warn_unknown_chars",
]

KINDS = ("byte", "char", "sentencepiece_bpe", "sentencepiece_unigram", "hf")


def load_tokenizer(directory: str) -> Tokenizer:
    """Reads a tokenizer written by `Tokenizer.save(directory)`.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     CharTokenizer("abc", num_sentinels=3).save(d)
    ...     load_tokenizer(d).encode("cab").tolist()
    [9, 7, 8]
    """
    path = fileio.join(directory, CONFIG_FILE)
    if not fileio.path(path).is_file():
        raise FileNotFoundError(f"{path!r} not found: expected a directory written by save()")
    config = json.loads(fileio.path(path).read_text(encoding="utf-8"))
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path!r} has format_version={version!r}: expected {FORMAT_VERSION}")
    kind, num_sentinels = config.get("kind"), config.get("num_sentinels")
    if kind == "byte":
        tokenizer: Tokenizer = ByteTokenizer(num_sentinels)
    elif kind == "char":
        tokenizer = CharTokenizer("".join(config["chars"]), num_sentinels)
    elif kind in ("sentencepiece_bpe", "sentencepiece_unigram"):
        model_proto = fileio.path(directory).joinpath(config["model_file"]).read_bytes()
        tokenizer = SentencePieceTokenizer(model_proto, num_sentinels)
        if tokenizer.kind != kind:
            raise ValueError(f"{path!r} says kind={kind!r} but its model is {tokenizer.kind!r}")
    elif kind == "hf":
        text = fileio.path(directory).joinpath(config["model_file"]).read_text(encoding="utf-8")
        tokenizer = HFTokenizer(text, config["specials"], num_sentinels,
                                config.get("chat_template"), config.get("settings"),
                                saved_stop_ids(directory))
    else:
        raise ValueError(f"{path!r} has kind={kind!r}: expected one of {KINDS}")
    if tokenizer.vocab_size != config.get("vocab_size"):
        raise ValueError(f"{path!r} says vocab_size={config.get('vocab_size')!r} but the loaded "
                         f"tokenizer has {tokenizer.vocab_size}")
    return tokenizer


def build_tokenizer(kind: str, texts: Iterable[str] | None = None, *,
                    vocab_size: int | None = None,
                    num_sentinels: int = NUM_SENTINELS) -> Tokenizer:
    """Builds (for char / SentencePiece: trains on `texts`) a tokenizer of one of `KINDS`.

    byte needs no texts and char no vocab_size (both derive their size, so passing vocab_size is
    an error rather than silently ignored). The "hf" kind is loaded, not built:
    `load_hf_tokenizer`. For SentencePiece, `vocab_size` counts its pieces
    including the 7 specials and 256 byte pieces; the tokenizer's vocab_size adds the sentinels.
    A vocab_size the corpus cannot fill raises ValueError naming the largest feasible value.
    Training is deterministic: the same texts give the same model.

    >>> tok = build_tokenizer("char", ["to be", "or not"], num_sentinels=0)
    >>> tok.chars, tok.vocab_size
    (' benort', 14)
    >>> build_tokenizer("bpe")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: kind='bpe': expected one of ('byte', 'char', ...)
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    if kind == "hf":
        raise ValueError("kind='hf': a Hugging Face tokenizer is loaded, not built: expected "
                         "load_hf_tokenizer(path)")
    num_sentinels = check_num_sentinels(num_sentinels)
    if isinstance(texts, str | bytes):
        raise ValueError(f"texts={texts[:20]!r}...: expected an iterable of str, not one string")
    if kind in ("byte", "char") and vocab_size is not None:
        raise ValueError(f"vocab_size={vocab_size!r}: the {kind} kind derives its own size, "
                         f"expected None")
    if kind == "byte":
        return ByteTokenizer(num_sentinels)
    if texts is None:
        raise ValueError(f"texts=None: the {kind} kind is built from texts, expected an iterable")
    if kind == "char":
        chars: set[str] = set()
        for text in checked_texts(texts):
            chars.update(text)
        if not chars:
            raise ValueError("texts contain no characters: expected at least one")
        return CharTokenizer("".join(chars), num_sentinels)
    if not is_int(vocab_size) or vocab_size <= NUM_SPECIAL + 256:
        raise ValueError(f"vocab_size={vocab_size!r}: expected an int > {NUM_SPECIAL + 256} "
                         f"(7 specials + 256 byte pieces + characters and merges)")
    model_type = kind.removeprefix("sentencepiece_")
    return SentencePieceTokenizer(train_sentencepiece(texts, model_type, int(vocab_size)),
                                  num_sentinels)


def check_settings(tokenizer: Tokenizer, what: str, data, *, prepared: bool = False,
                   from_workdir: bool = False) -> None:
    """One-line errors where a run's data settings (`data`: its config.data) are not those of
    `tokenizer` (`what`: the one the run reads text with instead of building its own: saved in
    its workdir, or of prepared data), which would then be kept silently. data.num_sentinels
    must be the tokenizer's, unless `prepared` data is read and it is left at its default (the
    prepared tokenizer's count applies). data.vocab_size (0:
    unset) is checked for SentencePiece only, whose size is trained (its pieces, sentinels not
    counted; byte, char and "hf" sizes are no setting), and not `from_workdir` (an init_from
    workdir's tokenizer, which a start reads whatever data.vocab_size says)."""
    sentinels = data.num_sentinels
    if sentinels != tokenizer.num_sentinels and not (prepared and sentinels == NUM_SENTINELS):
        raise ValueError(f"data.num_sentinels={sentinels}: {what} has "
                         f"{tokenizer.num_sentinels} sentinels: expected "
                         f"data.num_sentinels={tokenizer.num_sentinels}")
    pieces, size = tokenizer.vocab_size - tokenizer.num_sentinels, data.get("vocab_size") or 0
    if size and size != pieces and tokenizer.kind.startswith("sentencepiece_") and \
            not from_workdir:
        raise ValueError(f"data.vocab_size={size}: {what} has {pieces} pieces (sentinels not "
                         f"counted): expected data.vocab_size={pieces}"
                         + (" or 0" if prepared else ""))


def warn_unknown_chars(tokenizer: Tokenizer, texts: Iterable[str], what: str) -> int:
    """Warns (once per process for the same line) where `texts` (`what`, e.g. "the
    validation split") hold characters a char tokenizer has no id for, because the train split
    it was built from has none of them: each reads as one <unk>, a cheap token, so bits per
    byte undercounts them. Returns how many such characters the texts hold (other kinds: 0;
    byte and SentencePiece fall back to bytes)."""
    if tokenizer.kind != "char":
        return 0
    counts: collections.Counter = collections.Counter()
    for text in texts:
        for char in tokenizer.unknown_chars(text):
            counts[char] += text.count(char)
    total = sum(counts.values())
    line = (f"{what} holds {total} characters ({len(counts)} distinct: "
            f"{', '.join(repr(c) for c, _ in counts.most_common(5))}"
            f"{', ...' if len(counts) > 5 else ''}) that the char tokenizer has no id for (the "
            "train split it was built from has none): each reads as <unk>, so bits per byte "
            "undercounts them")
    if total:
        cli.warn_once(line)
    return total
