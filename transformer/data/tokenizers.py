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
or, if it has none, `num_sentinels` ids appended above its vocabulary. Code that needs a special
reads it from the tokenizer (`tokenizer.eos_id`), never from the constants below.
"""

from __future__ import annotations

import io
import json
import random
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from transformer.utils import fileio

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>", "<mask>", "<cls>", "<sep>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID, CLS_ID, SEP_ID = range(7)
NUM_SPECIAL = 7
KINDS = ("byte", "char", "sentencepiece_bpe", "sentencepiece_unigram", "hf")
ROLES = ("pad", "bos", "eos", "unk", "mask", "cls", "sep")  # the special tokens, by role

FORMAT_VERSION = 1
CONFIG_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "sentencepiece.model"
HF_FILE = "hf_tokenizer.json"  # an "hf" tokenizer's own tokenizer.json, beside CONFIG_FILE

# SentencePiece training: at most this many sentences are used (a seeded sample beyond that), and
# a sentence is at most this many UTF-8 bytes; longer paragraphs are cut at line ends (or, for a
# single huge line, at character boundaries) before training.
_MAX_TRAINING_SENTENCES = 1_000_000
_MAX_SENTENCE_BYTES = 4096
# Fixed, not os.cpu_count(): unigram EM sums per-thread statistics, so the thread count is part
# of what makes training reproducible across machines.
_TRAINING_THREADS = 16
_TRAINING_SEED = 0
_SPACE_MARK = "\u2581"  # SentencePiece's "▁", which it substitutes for " " in input text.
_MODEL_TYPES = {1: "unigram", 2: "bpe"}  # TrainerSpec.ModelType values in the .model protobuf


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_num_sentinels(num_sentinels: Any) -> int:
    if not _is_int(num_sentinels) or num_sentinels < 0:
        raise ValueError(f"num_sentinels={num_sentinels!r}: expected an int >= 0")
    return int(num_sentinels)


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
        self.num_sentinels = _check_num_sentinels(num_sentinels)
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
        if not _is_int(i) or not 0 <= i < self.num_sentinels:
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

    # Specials this kind finds in text as text, not as roles (SentencePiece's user-defined ones)
    _found_in_text: tuple[str, ...] = ()

    def _hf_tokenizer(self) -> Any:
        """A `tokenizers.Tokenizer` of ids 0 .. vocab_size - num_sentinels - 1, for
        `hugging_face`."""
        raise ValueError(f"kind={self.kind!r}: expected byte, char, SentencePiece or hf to "
                         "write a Hugging Face tokenizer")

    def hugging_face(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json text, tokenizer_config.json) of this tokenizer for `transformers`:
        `AutoTokenizer(text, add_special_tokens=False)` gives `encode(text)`'s ids, and its
        `decode` gives text back. Built with the `tokenizers` library's own models:
          * byte: BPE without merges over the 256 byte tokens <0x00>..<0xFF> (byte fallback);
          * char: BPE without merges over the characters (other characters: <unk>);
          * SentencePiece: its BPE (merges from the pieces' scores) or unigram pieces with
            byte fallback, "▁" written as the space it stands for.
        The specials keep their ids (named by role in the config), the sentinels are special
        tokens on top, and `split_special_tokens` makes a special's literal name in text encode
        as text, as `encode` does. SentencePiece finds <mask>, <cls> and <sep> in text, so
        there they are plain added tokens, not roles (a role would not be found in text)."""
        from tokenizers import AddedToken

        tok = self._hf_tokenizer()
        names = [f"<extra_id_{i}>" for i in reversed(range(self.num_sentinels))]
        tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
        tok.add_tokens([AddedToken(n, special=False, normalized=False)
                        for n in self._found_in_text])
        if tok.get_vocab_size(with_added_tokens=True) != self.vocab_size:
            raise ValueError(f"the Hugging Face tokenizer of {self!r} has "
                             f"{tok.get_vocab_size(with_added_tokens=True)} ids: expected "
                             f"{self.vocab_size}")
        roles = {f"{role}_token": name for role, name in zip(ROLES, SPECIAL_TOKENS, strict=True)
                 if name not in self._found_in_text}
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

    def __init__(self, num_sentinels: int = 100):
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

    def __init__(self, chars: str, num_sentinels: int = 100):
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


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece BPE or unigram model whose pieces 0..6 are exactly `SPECIAL_TOKENS` and
    which has byte-fallback pieces, so no text is lost to <unk>. Build one with
    `build_tokenizer("sentencepiece_bpe" | "sentencepiece_unigram", texts, vocab_size=N)`;
    vocab_size = N + num_sentinels. `model_proto` is the serialized .model file.

    Text is not normalized (identity rule, whitespace kept, no dummy "▁" prefix), so encoding
    is lossless and decoding is plain concatenation of pieces.
    """

    def __init__(self, model_proto: bytes, num_sentinels: int = 100):
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2

        self.model_proto = bytes(model_proto)
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.model_proto)
        self.model_type = _MODEL_TYPES.get(proto.trainer_spec.model_type)
        if self.model_type is None:
            raise ValueError(f"SentencePiece model_type={proto.trainer_spec.model_type}: "
                             "expected 1 (unigram) or 2 (bpe)")
        self.kind = f"sentencepiece_{self.model_type}"
        norm = proto.normalizer_spec
        found = (norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces)
        if found != ("identity", False, False):
            raise ValueError(f"SentencePiece normalizer (name, add_dummy_prefix, "
                             f"remove_extra_whitespaces) = {found}: expected lossless "
                             f"('identity', False, False)")
        sp = self._sp = sentencepiece.SentencePieceProcessor(model_proto=self.model_proto)
        found = tuple(sp.id_to_piece(i) for i in range(min(NUM_SPECIAL, sp.get_piece_size())))
        if found != SPECIAL_TOKENS or any(sp.piece_to_id(p) != i
                                          for i, p in enumerate(SPECIAL_TOKENS)):
            raise ValueError(f"SentencePiece pieces 0..6 are {found}: expected {SPECIAL_TOKENS}")
        byte_ids = [sp.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
        if not all(sp.is_byte(i) for i in byte_ids):
            raise ValueError("SentencePiece model has no byte pieces <0x00>..<0xFF>: expected "
                             "one trained with byte_fallback=True")
        self._space_mark_ids = [byte_ids[b] for b in _SPACE_MARK.encode()]
        regular = [bytes([int(sp.id_to_piece(i)[3:5], 16)]) if sp.is_byte(i)
                   else sp.id_to_piece(i).replace(_SPACE_MARK, " ").encode()
                   for i in range(NUM_SPECIAL, sp.get_piece_size())]
        self._finish(regular, num_sentinels)

    def encode(self, text: str) -> np.ndarray:
        if _SPACE_MARK not in text:
            return np.asarray(self._sp.encode(text), np.int32)
        # SentencePiece reads a literal "▁" as a space; emit its UTF-8 bytes instead.
        parts = [self._sp.encode(part) for part in text.split(_SPACE_MARK)]
        ids = parts[0]
        for part in parts[1:]:
            ids += self._space_mark_ids + part
        return np.asarray(ids, np.int32)

    def _config(self, directory: str) -> dict[str, Any]:
        fileio.write_atomic(fileio.join(directory, SENTENCEPIECE_FILE), self.model_proto)
        return {"model_file": SENTENCEPIECE_FILE}

    _found_in_text = SPECIAL_TOKENS[MASK_ID:]  # its user-defined symbols

    def _hf_tokenizer(self) -> Any:
        """SentencePiece's pieces with "▁" as the space it stands for, so a literal "▁" in text
        is no piece and falls back to its bytes, as in `encode`; no normalizer (ours is
        identity, whitespace kept, no dummy prefix)."""
        from tokenizers import Tokenizer, decoders, models

        sp = self._sp
        normal = [i for i in range(NUM_SPECIAL, sp.get_piece_size()) if not sp.is_byte(i)]
        pieces = {i: sp.id_to_piece(i).replace(_SPACE_MARK, " ") for i in normal}
        tokens = [*SPECIAL_TOKENS, *(pieces.get(i) or sp.id_to_piece(i)
                                     for i in range(NUM_SPECIAL, sp.get_piece_size()))]
        vocab = self._hf_vocab(tokens[NUM_SPECIAL:])
        if self.model_type == "bpe":
            # SentencePiece merges the adjacent pair whose concatenation is the best-scored
            # piece: Hugging Face's merges, ranked by that score.
            known, merges = set(pieces.values()), []
            for i in sorted(normal, key=lambda i: (-sp.get_score(i), i)):
                piece = pieces[i]
                merges += [(piece[:k], piece[k:]) for k in range(1, len(piece))
                           if piece[:k] in known and piece[k:] in known]
            tok = Tokenizer(models.BPE(vocab, merges, unk_token=SPECIAL_TOKENS[UNK_ID],
                                       byte_fallback=True))
        else:
            tok = self._hf_unigram(pieces, tokens)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        return tok

    def _hf_unigram(self, pieces: dict[int, str], tokens: list[str]) -> Any:
        """SentencePiece's lattice holds only its normal and user-defined pieces; Hugging
        Face's holds every token, so a literal "<eos>" or "<0x41>" in text could become that
        token. Those tokens get a score below any path of known characters; one spanning an
        unknown character would still win, so the text is cut after each "<" (every such name
        starts with one) where no piece goes on past a "<" (then the cut changes nothing), or
        else every character of those names must be a piece."""
        from tokenizers import Tokenizer, models, pre_tokenizers

        sp = self._sp
        lowest = min(sp.get_score(i) for i in pieces)
        tok = Tokenizer(models.Unigram(
            [(token, sp.get_score(i) if i in pieces else len(token) * lowest - 1.0)
             for i, token in enumerate(tokens)], UNK_ID, True))
        if not any("<" in piece[:-1] for piece in pieces.values()):
            tok.pre_tokenizer = pre_tokenizers.Split("<", "merged_with_previous")
            return tok
        missing = {c for i, token in enumerate(tokens) if i not in pieces for c in token}
        missing -= set(pieces.values())
        if missing:
            example = next(t for i, t in enumerate(tokens) if i not in pieces and
                           missing & set(t))
            raise ValueError(
                f"{self!r}: its unigram pieces go on past a '<' but none is "
                f"{''.join(sorted(missing))!r}: a Hugging Face Unigram would read {example!r} "
                f"in text as one token, where SentencePiece reads it as text; expected every "
                f"character of the special and byte token names as a piece")
        return tok

    def __getstate__(self) -> dict[str, Any]:  # for multiprocess data loaders
        return {"model_proto": self.model_proto, "num_sentinels": self.num_sentinels}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model_proto"], state["num_sentinels"])


# Where a Hugging Face directory names no roles (a bare tokenizer.json), a role is taken by the
# first of these tokens its vocabulary has: the names GPT-2, BERT, Llama and T5 use.
_WELL_KNOWN = {
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<|endoftext|>"),
    "eos": ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>"),
    "unk": ("<unk>", "[UNK]"),
    "mask": ("<mask>", "[MASK]"),
    "cls": ("[CLS]", "<cls>"),
    "sep": ("[SEP]", "<sep>"),
}
_SENTINEL = re.compile(r"<extra_id_(\d+)>")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer (`tokenizer_json`: the text of a tokenizer.json)
    with its own ids. `specials` maps roles (`ROLES`) to token strings of its vocabulary, or
    None where it has no such token; read them from a save_pretrained directory with
    `load_hf_tokenizer`.

    - Documents end with <eos>; a vocabulary without one but with [SEP] (BERT) ends them with
      [SEP]. A role a feature needs and the vocabulary lacks is a clear error there (e.g. the
      mask token for MLM), never a stand-in id.
    - Sentinels: a vocabulary with its own `<extra_id_i>` (T5: <extra_id_0> is its last id)
      uses those, and `num_sentinels` must equal their count (None: whatever it has); otherwise
      `num_sentinels` ids are appended above the vocabulary, written "<extra_id_i>" by `decode`
      as for the other kinds.
    - `encode` adds no specials (no BOS / EOS / [CLS]); `decode` drops <pad> and writes other
      specials as their text, so decode(encode(text)) == text wherever the tokenizer is
      lossless (byte-level BPE is; BERT's lower-casing WordPiece is not).
    - The tokenizer.json's `padding` and `truncation` are turned off: every text gives all of
      its ids, as `AutoTokenizer(text, add_special_tokens=False)` does.
    """

    kind = "hf"

    def __init__(self, tokenizer_json: str, specials: dict[str, str | None],
                 num_sentinels: int | None = None, chat_template: str | None = None):
        import tokenizers

        self.tokenizer_json = tokenizer_json
        self.chat_template = chat_template or None  # a Jinja template (transformer.data.chat)
        self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        # A tokenizer.json may pad or cut every encoding to a fixed length (sentence-transformers
        # saves `padding: Fixed 128` and `truncation: 128`): documents are encoded whole.
        self._tok.no_padding()
        self._tok.no_truncation()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1
        unknown = sorted(set(specials) - set(ROLES))
        if unknown:
            raise ValueError(f"special roles {unknown}: expected some of {ROLES}")
        self.specials = {role: specials.get(role) for role in ROLES}
        for role, token in self.specials.items():
            if token is not None and token not in vocab:
                raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
            setattr(self, f"{role}_id", None if token is None else vocab[token])
        if self.eos_id is None:
            self.eos_id = self.sep_id
        own = sorted(int(m.group(1)) for t in vocab if (m := _SENTINEL.fullmatch(t)))
        num_sentinels = _check_num_sentinels(len(own) if num_sentinels is None else num_sentinels)
        if own:
            if own != list(range(len(own))) or any(
                    vocab[f"<extra_id_{i}>"] != size - 1 - i for i in own):
                raise ValueError(f"the tokenizer's <extra_id_i> tokens are not its last ids in "
                                 f"reverse order: expected <extra_id_i> = {size - 1} - i (T5)")
            if num_sentinels != len(own):
                raise ValueError(f"num_sentinels={num_sentinels}: the tokenizer has its own "
                                 f"{len(own)} sentinels <extra_id_i>: expected {len(own)}")
        self._base_size = size - len(own)
        self.num_sentinels = num_sentinels
        self.vocab_size = self._base_size + num_sentinels
        self._names = {vocab[t.content]: t.content
                       for t in self._tok.get_added_tokens_decoder().values()
                       if t.special and not _SENTINEL.fullmatch(t.content)}
        for token in self.specials.values():
            if token is not None and not _SENTINEL.fullmatch(token):
                self._names[vocab[token]] = token
        self._pad_dropped = (self.specials["pad"] is not None and
                             self.pad_id not in (self.eos_id, self.bos_id, self.unk_id))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in
                self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def unknown_chars(self, text: str) -> list[str]:
        if self.unk_id is None:
            return []
        return [c for c in dict.fromkeys(text) if self.unk_id in self.encode(c).tolist()]

    def decode(self, ids) -> str:
        out, run = [], []
        for i in self._checked_ids(ids):
            if i >= self._base_size:  # an appended or own sentinel
                out += [self._tok.decode(run, skip_special_tokens=False),
                        f"<extra_id_{self.vocab_size - 1 - i}>"]
                run = []
            elif not (self._pad_dropped and i == self.pad_id):
                run.append(i)
        return "".join(out) + self._tok.decode(run, skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        return self.decode([i]).encode()

    @property
    def special_names(self) -> dict[int, str]:
        return dict(self._names)

    def _config(self, directory: str) -> dict[str, Any]:
        fileio.write_atomic(fileio.join(directory, HF_FILE), self.tokenizer_json.encode())
        chat = {"chat_template": self.chat_template} if self.chat_template else {}
        return {"model_file": HF_FILE, "specials": self.specials, **chat}

    def hugging_face(self) -> tuple[str, dict[str, Any]]:
        """Its own tokenizer.json, with its roles (and chat template) in the config."""
        roles = {f"{role}_token": token for role, token in self.specials.items()
                 if token is not None}
        chat = {"chat_template": self.chat_template} if self.chat_template else {}
        return self.tokenizer_json, {"tokenizer_class": "PreTrainedTokenizerFast", **roles,
                                     **chat}

    def __getstate__(self) -> dict[str, Any]:  # for multiprocess data loaders
        return {"tokenizer_json": self.tokenizer_json, "specials": self.specials,
                "num_sentinels": self.num_sentinels, "chat_template": self.chat_template}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, num_sentinels={self.num_sentinels}, "
                f"specials={ {r: t for r, t in self.specials.items() if t is not None} })")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string
    or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _json_object(file, expected: str) -> dict[str, Any]:
    """`file`'s JSON object, or a one-line error naming `file` and saying what was `expected`."""
    try:
        content = json.loads(file.read_bytes().decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(file)!r} is not JSON ({e}): expected {expected}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(content).__name__}: expected "
                         f"{expected}")
    return content


def load_hf_tokenizer(path: str, num_sentinels: int | None = None) -> HFTokenizer:
    """An `HFTokenizer` from a Hugging Face tokenizer.json, or a directory holding one (e.g. a
    `save_pretrained` directory). The roles come from the directory's tokenizer_config.json
    (else special_tokens_map.json): its `bos_token`, `eos_token`, ... entries. A bare
    tokenizer.json names none, so each role is then the first well-known token (<pad>, [PAD],
    </s>, <|endoftext|>, [CLS], ...) its vocabulary has.
    """
    location = fileio.path(path)
    file = location.joinpath("tokenizer.json") if location.is_dir() else location
    if not file.is_file():
        raise FileNotFoundError(f"{path!r}: expected a Hugging Face tokenizer.json or a "
                                "directory holding one")
    expected = "a Hugging Face tokenizer.json or a directory holding one"
    if not isinstance(_json_object(file, expected).get("model"), dict):
        raise ValueError(f"{str(file)!r} is JSON but not a tokenizer (it has no \"model\"): "
                         f"expected {expected}")
    text = file.read_text(encoding="utf-8")
    named = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (meta := file.parent.joinpath(name)).is_file():
            config = _json_object(meta, f"a Hugging Face {name}")
            named = {role: _token_content(config.get(f"{role}_token")) for role in ROLES}
            break
    template = _chat_template(file.parent)
    try:
        tokenizer = HFTokenizer(text, named or {}, num_sentinels, template)
    except Exception as e:
        raise ValueError(f"{str(file)!r}: {e}") from None
    if named is None:
        vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
        guessed = {role: next((t for t in names if t in vocab), None)
                   for role, names in _WELL_KNOWN.items()}
        tokenizer = HFTokenizer(text, guessed, num_sentinels, template)
    return tokenizer


def _chat_template(directory) -> str | None:
    """A save_pretrained directory's chat template, where transformers keeps it: the
    tokenizer_config.json's `chat_template` (a string, or a list of named templates: the one
    named "default"), else chat_template.jinja (transformers 5 writes it there)."""
    config = directory.joinpath("tokenizer_config.json")
    template = _json_object(config, "a Hugging Face tokenizer_config.json").get(
        "chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict)
                         and t.get("name") == "default"), None)
    if not template and (jinja := directory.joinpath("chat_template.jinja")).is_file():
        template = jinja.read_text(encoding="utf-8")
    return template if isinstance(template, str) and template else None


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
                                config.get("chat_template"))
    else:
        raise ValueError(f"{path!r} has kind={kind!r}: expected one of {KINDS}")
    if tokenizer.vocab_size != config.get("vocab_size"):
        raise ValueError(f"{path!r} says vocab_size={config.get('vocab_size')!r} but the loaded "
                         f"tokenizer has {tokenizer.vocab_size}")
    return tokenizer


def build_tokenizer(kind: str, texts: Iterable[str] | None = None, *,
                    vocab_size: int | None = None, num_sentinels: int = 100) -> Tokenizer:
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
    num_sentinels = _check_num_sentinels(num_sentinels)
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
        for text in _checked(texts):
            chars.update(text)
        if not chars:
            raise ValueError("texts contain no characters: expected at least one")
        return CharTokenizer("".join(chars), num_sentinels)
    if not _is_int(vocab_size) or vocab_size <= NUM_SPECIAL + 256:
        raise ValueError(f"vocab_size={vocab_size!r}: expected an int > {NUM_SPECIAL + 256} "
                         f"(7 specials + 256 byte pieces + characters and merges)")
    model_type = kind.removeprefix("sentencepiece_")
    return SentencePieceTokenizer(_train_sentencepiece(texts, model_type, int(vocab_size)),
                                  num_sentinels)


def _checked(texts: Iterable[Any]) -> Iterator[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{i}] is a {type(text).__name__}: expected str")
        yield text


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    """Splits texts into SentencePiece training sentences of <= _MAX_SENTENCE_BYTES: paragraphs
    (at blank lines), cut at line ends if too long, and at character boundaries as a last resort.
    Newlines inside a paragraph are kept, so pieces can learn them."""
    limit = _MAX_SENTENCE_BYTES
    for text in _checked(texts):
        for paragraph in text.split("\n\n"):
            if len(paragraph.encode()) <= limit:
                if paragraph.strip():
                    yield paragraph
                continue
            chunk, size = [], 0
            for line in paragraph.splitlines(keepends=True):
                n = len(line.encode())
                if size + n > limit and chunk:
                    yield "".join(chunk)
                    chunk, size = [], 0
                if n > limit:  # <= 4 bytes per character, so limit // 4 characters always fit
                    yield from (line[j:j + limit // 4] for j in range(0, len(line), limit // 4))
                else:
                    chunk.append(line)
                    size += n
            if chunk:
                yield "".join(chunk)


def _sample(sentences: Iterable[str], k: int, seed: int) -> list[str]:
    """A seeded uniform sample of k sentences (all of them if fewer), by reservoir sampling.
    Done here because SentencePiece's own sampling (shuffle_input_sentence) differs from run to
    run even with `set_random_generator_seed`."""
    rng, sample = random.Random(seed), []
    for n, sentence in enumerate(sentences):
        if n < k:
            sample.append(sentence)
        elif (j := rng.randrange(n + 1)) < k:
            sample[j] = sentence
    return sample


def _train_sentencepiece(texts: Iterable[str], model_type: str, vocab_size: int) -> bytes:
    """Trains in memory (no files) and returns the serialized model."""
    import sentencepiece

    sentences = _sample(_sentences(texts), _MAX_TRAINING_SENTENCES, _TRAINING_SEED)
    if not sentences:
        raise ValueError("texts contain no non-blank text: expected at least one")
    model = io.BytesIO()
    sentencepiece.set_random_generator_seed(_TRAINING_SEED)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, model_type=model_type,
            vocab_size=vocab_size, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
            pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>", unk_piece="<unk>",
            user_defined_symbols=list(SPECIAL_TOKENS[MASK_ID:]), byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, input_sentence_size=0, max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=_TRAINING_THREADS, minloglevel=2)
    except RuntimeError as e:
        message = str(e)
        too_high = re.search(r"value <= (\d+)", message)
        if too_high:
            raise ValueError(f"vocab_size={vocab_size}: too large for these texts, expected "
                             f"<= {too_high.group(1)} for {model_type}") from None
        too_low = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
        if too_low:
            raise ValueError(f"vocab_size={vocab_size}: too small for the characters of these "
                             f"texts, expected >= {too_low.group(1)}") from None
        raise ValueError(f"SentencePiece training failed for vocab_size={vocab_size}: "
                         f"{message.strip().splitlines()[0]}") from None
    return model.getvalue()
