"""The id layout the project's tokenizers share, the `Tokenizer` base class, and the two kinds
that need no model: `ByteTokenizer` and `CharTokenizer` (`transformer.data.tokenizers` builds
and loads every kind).

The layout: ids 0..6 are the specials `SPECIAL_TOKENS` (<pad>, <bos>, <eos>, <unk>, <mask>,
<cls>, <sep>), then the kind's regular tokens, then `num_sentinels` T5 sentinels at the top
(<extra_id_i> = vocab_size - 1 - i). A Hugging Face tokenizer keeps its own ids: code that
needs a special reads it from the tokenizer (`tokenizer.eos_id`), never from the constants.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from transformer.utils import fileio

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>", "<mask>", "<cls>", "<sep>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID, CLS_ID, SEP_ID = range(7)
NUM_SPECIAL = 7
NUM_SENTINELS = 100  # T5 sentinel ids above the vocabulary, by default (data.num_sentinels)
ROLES = ("pad", "bos", "eos", "unk", "mask", "cls", "sep")  # the special tokens, by role

FORMAT_VERSION = 1
CONFIG_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "sentencepiece.model"
HF_FILE = "hf_tokenizer.json"  # an "hf" tokenizer's own tokenizer.json, beside CONFIG_FILE


def is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_num_sentinels(num_sentinels: Any) -> int:
    if not is_int(num_sentinels) or num_sentinels < 0:
        raise ValueError(f"num_sentinels={num_sentinels!r}: expected an int >= 0")
    return int(num_sentinels)


def checked_texts(texts: Iterable[Any]) -> Iterator[str]:
    """`texts`, each checked to be a str (a one-line error names the first that is not)."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{i}] is a {type(text).__name__}: expected str")
        yield text


def _special_bytes() -> list[bytes]:
    """How `decode` writes ids 0..6: <pad> vanishes, every other special as its name."""
    return [b""] + [name.encode() for name in SPECIAL_TOKENS[1:]]


class Tokenizer:
    """Base class. A subclass sets `kind`, calls `_finish(regular_token_bytes, num_sentinels)`
    from `__init__` and implements `encode` and `_config` (kind-specific fields of tokenizer.json).

    `decode` is shared: every id maps to a byte string (a byte, a character's UTF-8, a piece, or a
    special / sentinel name); the concatenation is decoded as UTF-8 with errors="replace".
    """

    kind: str = ""
    vocab_size: int
    num_sentinels: int
    # The specials' ids (an "hf" tokenizer: None where its vocabulary has no such token).
    pad_id: int | None = PAD_ID
    bos_id: int | None = BOS_ID
    eos_id: int | None = EOS_ID  # also what ends every document in the token stream
    unk_id: int | None = UNK_ID
    mask_id: int | None = MASK_ID
    cls_id: int | None = CLS_ID
    sep_id: int | None = SEP_ID
    chat_template: str | None = None  # only a Hugging Face tokenizer's (transformer.data.chat)

    def _finish(self, regular: list[bytes], num_sentinels: int) -> None:
        self.num_sentinels = check_num_sentinels(num_sentinels)
        sentinels = [f"<extra_id_{i}>".encode() for i in reversed(range(self.num_sentinels))]
        self._id_bytes = _special_bytes() + regular + sentinels
        self.vocab_size = len(self._id_bytes)

    def encode(self, text: str) -> np.ndarray:
        """Text -> int32 ids [N]. Adds no BOS / EOS."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text (an "hf" tokenizer encodes them in parallel)."""
        return [self.encode(text) for text in texts]

    @property
    def decoder_start_id(self) -> int:
        """What an encoder-decoder's decoder reads first: <bos>, or <pad> where there is no
        <bos> (T5's own convention)."""
        start = self.bos_id if self.bos_id is not None else self.pad_id
        if start is None:
            raise ValueError(f"{self!r} has neither a bos nor a pad token: expected one to "
                             "start the decoder")
        return start

    def require(self, role: str, why: str) -> int:
        """The id of special `role` ("mask", "cls", ...), or a one-line error saying `why` it
        is needed."""
        value = getattr(self, f"{role}_id")
        if value is None:
            raise ValueError(f"{self!r} has no {role} token: expected one {why}")
        return value

    def unknown_chars(self, text: str) -> list[str]:
        """The distinct characters of `text` this tokenizer has no ids for (they encode to
        <unk>), in order of first appearance. None for byte and SentencePiece (byte fallback)."""
        return []

    def _checked_ids(self, ids) -> list[int]:
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"ids of shape {ids.shape}, dtype {ids.dtype}: expected 1-D integers")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
            raise ValueError(f"id {int(bad)} out of range: expected 0 <= id < {self.vocab_size}")
        return ids.tolist()

    def decode(self, ids) -> str:
        """Ids [N] (list, NumPy or JAX array) -> text. Drops <pad>; writes other specials and
        sentinels as their names (e.g. "<eos>", "<extra_id_3>")."""
        table = self._id_bytes
        return b"".join([table[i] for i in self._checked_ids(ids)]).decode("utf-8",
                                                                        errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """Id i's own bytes (a lone byte of a multi-byte character is not valid UTF-8)."""
        return self._id_bytes[i]

    @property
    def special_names(self) -> dict[int, str]:
        """{id: name} of the specials (not the sentinels)."""
        return dict(enumerate(SPECIAL_TOKENS))

    def sentinel_id(self, i: int) -> int:
        """The id of <extra_id_i>: vocab_size - 1 - i, for 0 <= i < num_sentinels."""
        if not is_int(i) or not 0 <= i < self.num_sentinels:
            raise ValueError(f"sentinel index {i!r}: expected an int in [0, {self.num_sentinels})")
        return self.vocab_size - 1 - int(i)

    @property
    def sentinel_ids(self) -> tuple[int, ...]:
        """Every sentinel id, ascending (the top `num_sentinels` ids)."""
        return tuple(range(self.vocab_size - self.num_sentinels, self.vocab_size))

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The specials' and sentinels' ids, ascending: what MLM masking must never select."""
        return tuple(sorted(self.special_names)) + self.sentinel_ids

    def _config(self, directory: str) -> dict[str, Any]:
        """Kind-specific tokenizer.json fields; may write extra files into `directory`."""
        return {}

    def _hf_tokenizer(self) -> Any:
        """A `tokenizers.Tokenizer` of ids 0 .. vocab_size - num_sentinels - 1, for
        `hugging_face`."""
        raise ValueError(f"kind={self.kind!r}: expected byte, char, SentencePiece or hf to "
                         "write a Hugging Face tokenizer")

    def hugging_face(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json text, tokenizer_config.json) of this tokenizer for `transformers`:
        `AutoTokenizer(text, add_special_tokens=False)` gives `encode(text)`'s ids (a unigram
        model's ties between equal-score segmentations aside: docs/models.md), and its
        `decode` gives text back. Built with the `tokenizers` library's own models:
          * byte: BPE without merges over the 256 byte tokens <0x00>..<0xFF> (byte fallback);
          * char: BPE without merges over the characters (other characters: <unk>);
          * SentencePiece: its BPE (merges from the pieces' scores) or unigram pieces with
            byte fallback, "▁" written as the space it stands for.
        The specials keep their ids (named by role in the config), the sentinels are special
        tokens on top, and `split_special_tokens` makes a special's literal name in text encode
        as text, as `encode` does."""
        from tokenizers import AddedToken

        tok = self._hf_tokenizer()
        names = [f"<extra_id_{i}>" for i in reversed(range(self.num_sentinels))]
        tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
        if tok.get_vocab_size(with_added_tokens=True) != self.vocab_size:
            raise ValueError(f"the Hugging Face tokenizer of {self!r} has "
                             f"{tok.get_vocab_size(with_added_tokens=True)} ids: expected "
                             f"{self.vocab_size}")
        roles = {f"{role}_token": name for role, name in zip(ROLES, SPECIAL_TOKENS, strict=True)}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **roles,
                  "additional_special_tokens": names, "split_special_tokens": True,
                  "clean_up_tokenization_spaces": False}
        return tok.to_str(pretty=True), config

    def _hf_vocab(self, regular: list[str]) -> dict[str, int]:
        """{token: id} of the specials and the `regular` tokens that follow them."""
        vocab = {name: i for i, name in enumerate([*SPECIAL_TOKENS, *regular])}
        if len(vocab) != NUM_SPECIAL + len(regular):
            raise ValueError(f"{self!r} has a token named like a special: expected distinct "
                             "token names")
        return vocab

    def save(self, directory: str) -> None:
        """Writes directory/tokenizer.json (and any model file), creating the directory."""
        fileio.path(directory).mkdir(parents=True, exist_ok=True)
        config = {"format_version": FORMAT_VERSION, "kind": self.kind,
                  "num_sentinels": self.num_sentinels, "vocab_size": self.vocab_size}
        config.update(self._config(directory))
        fileio.write_atomic(fileio.join(directory, CONFIG_FILE),
                      (json.dumps(config, indent=1) + "\n").encode())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, "
                f"num_sentinels={self.num_sentinels})")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: byte b -> id 7 + b; vocab_size = 7 + 256 + num_sentinels.

    >>> tok = ByteTokenizer(num_sentinels=2)
    >>> tok.encode("hé").tolist(), tok.vocab_size, tok.sentinel_id(0)
    ([111, 202, 176], 265, 264)
    >>> tok.decode([BOS_ID, 111, 202, 176, EOS_ID, 264, PAD_ID])
    '<bos>hé<eos><extra_id_0>'
    """

    kind = "byte"

    def __init__(self, num_sentinels: int = NUM_SENTINELS):
        self._finish([bytes([b]) for b in range(256)], num_sentinels)

    def encode(self, text: str) -> np.ndarray:
        data = np.frombuffer(text.encode("utf-8"), np.uint8)
        return data.astype(np.int32) + NUM_SPECIAL

    def _hf_tokenizer(self) -> Any:
        from tokenizers import Tokenizer, decoders, models

        vocab = self._hf_vocab([f"<0x{b:02X}>" for b in range(256)])
        # No token is a character: each character falls back to its UTF-8 bytes.
        tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        return tok


class CharTokenizer(Tokenizer):
    """Characters: character i of the sorted distinct `chars` -> id 7 + i; any other character
    encodes to UNK_ID. Saved with its character list, so a reloaded tokenizer maps identically.

    >>> tok = CharTokenizer("hello", num_sentinels=1)
    >>> tok.chars, tok.vocab_size
    ('ehlo', 12)
    >>> tok.encode("hole!").tolist()
    [8, 10, 9, 7, 3]
    >>> tok.decode(tok.encode("hole!"))
    'hole<unk>'
    >>> tok.unknown_chars("hole!?!")
    ['!', '?']
    """

    kind = "char"

    def __init__(self, chars: str, num_sentinels: int = NUM_SENTINELS):
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"chars={chars!r}: expected a non-empty str")
        self.chars = "".join(sorted(set(chars)))
        self._index = {c: NUM_SPECIAL + i for i, c in enumerate(self.chars)}
        self._finish([c.encode("utf-8", errors="surrogatepass") for c in self.chars],
                     num_sentinels)

    def encode(self, text: str) -> np.ndarray:
        index = self._index
        return np.fromiter((index.get(c, UNK_ID) for c in text), np.int32, count=len(text))

    def unknown_chars(self, text: str) -> list[str]:
        return [c for c in dict.fromkeys(text) if c not in self._index]

    def _config(self, directory: str) -> dict[str, Any]:
        return {"chars": list(self.chars)}

    def _hf_tokenizer(self) -> Any:
        from tokenizers import Tokenizer, decoders, models

        bad = [c for c in self.chars if 0xD800 <= ord(c) <= 0xDFFF]
        if bad:
            raise ValueError(f"character {bad[0]!r} is a lone surrogate: expected characters "
                             "a Hugging Face tokenizer can hold (valid Unicode)")
        # Without merges, a BPE word is its characters; the text is one word (no pre-tokenizer).
        tok = Tokenizer(models.BPE(self._hf_vocab(list(self.chars)), [],
                                   unk_token=SPECIAL_TOKENS[UNK_ID]))
        tok.decoder = decoders.Fuse()
        return tok
