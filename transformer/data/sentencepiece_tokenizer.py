"""SentencePiece tokenizers (BPE or unigram, byte fallback, lossless): `SentencePieceTokenizer`
over a serialized model, and `train_sentencepiece`, which trains one on texts in memory,
deterministically."""

from __future__ import annotations

import functools
import io
import random
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from transformer.data.tokenizer_base import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    NUM_SENTINELS,
    NUM_SPECIAL,
    PAD_ID,
    SENTENCEPIECE_FILE,
    SPECIAL_TOKENS,
    UNK_ID,
    Tokenizer,
    checked_texts,
)
from transformer.utils import cli, fileio

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
_CONTROL, _USER_DEFINED = 3, 4  # SentencePiece.Type values: never / always read from text


@functools.cache
def _model_proto_class():
    """The fields of SentencePiece's ModelProto that this module reads or sets, as a protobuf
    message class built at run time (the rest of a .model parses as unknown fields, kept when it
    is written again). SentencePiece's own sentencepiece_model_pb2 is generated for one protobuf
    major version (0.2.3's for 7) and refuses another (Apache Beam holds protobuf at 6)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="transformer_sentencepiece_model.proto",
                                              package="transformer_sentencepiece")
    # (message, [(number, name, type, message type or proto2 default)]), numbers as in
    # sentencepiece_model.proto; model_type and type are enums there (a varint either way)
    for name, fields in (
            ("TrainerSpec", [(3, "model_type", field.TYPE_INT32, "1")]),
            ("NormalizerSpec", [(1, "name", field.TYPE_STRING, ""),
                                (3, "add_dummy_prefix", field.TYPE_BOOL, "true"),
                                (4, "remove_extra_whitespaces", field.TYPE_BOOL, "true")]),
            ("SentencePiece", [(1, "piece", field.TYPE_STRING, ""),
                               (3, "type", field.TYPE_INT32, "1")]),
            ("ModelProto", [(1, "pieces", field.TYPE_MESSAGE, "SentencePiece"),
                            (2, "trainer_spec", field.TYPE_MESSAGE, "TrainerSpec"),
                            (3, "normalizer_spec", field.TYPE_MESSAGE, "NormalizerSpec")])):
        message = file.message_type.add(name=name)
        for number, field_name, kind, extra in fields:
            added = message.field.add(name=field_name, number=number, type=kind,
                                      label=field.LABEL_REPEATED if field_name == "pieces"
                                      else field.LABEL_OPTIONAL)
            if kind == field.TYPE_MESSAGE:
                added.type_name = f".transformer_sentencepiece.{extra}"
            elif extra:
                added.default_value = extra
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("transformer_sentencepiece.ModelProto"))


def _parsed_model(model_proto: bytes) -> tuple[int, tuple[str, bool, bool], bytes]:
    """A .model's TrainerSpec.model_type and NormalizerSpec (name, add_dummy_prefix,
    remove_extra_whitespaces), with proto2's defaults for fields it leaves out, and the model
    to encode with: the same, but with <mask>, <cls> and <sep> made control symbols where they
    are user-defined ones (as earlier versions of `train_sentencepiece` declared them), which
    SentencePiece's encoder would produce from their names in text. Only text holding those
    names gets other ids."""
    from google.protobuf.message import DecodeError

    proto = _model_proto_class()()
    try:
        proto.ParseFromString(model_proto)
    except DecodeError as error:
        raise ValueError(f"not a SentencePiece model ({error}): expected a serialized "
                         "ModelProto (.model file)") from None
    norm = proto.normalizer_spec
    user_defined = [piece for piece in proto.pieces[MASK_ID:NUM_SPECIAL]
                    if piece.type == _USER_DEFINED and piece.piece in SPECIAL_TOKENS]
    for piece in user_defined:
        piece.type = _CONTROL
    return (proto.trainer_spec.model_type,
            (norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces),
            proto.SerializeToString() if user_defined else model_proto)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece BPE or unigram model whose pieces 0..6 are exactly `SPECIAL_TOKENS` and
    which has byte-fallback pieces, so no text is lost to <unk>. Build one with
    `build_tokenizer("sentencepiece_bpe" | "sentencepiece_unigram", texts, vocab_size=N)`;
    vocab_size = N + num_sentinels. `model_proto` is the serialized .model file.

    Text is not normalized (identity rule, whitespace kept, no dummy "▁" prefix), so encoding
    is lossless and decoding is plain concatenation of pieces. The specials are control symbols,
    so a special's name in text ("<mask>") encodes as text, as in the byte and char tokenizers.
    """

    def __init__(self, model_proto: bytes, num_sentinels: int = NUM_SENTINELS):
        import sentencepiece

        self.model_proto = bytes(model_proto)  # as given: what `save` writes back
        model_type, found, encoding_model = _parsed_model(self.model_proto)
        if encoding_model is not self.model_proto:  # (a run resumed on it reads other ids)
            cli.warn_once("this SentencePiece model was trained before 2026-12-06, when it read "
                          "the names <mask>, <cls> and <sep> in text as those special ids: they "
                          "now encode as text (only text holding those names gets other ids)")
        self.model_type = _MODEL_TYPES.get(model_type)
        if self.model_type is None:
            raise ValueError(f"SentencePiece model_type={model_type}: "
                             "expected 1 (unigram) or 2 (bpe)")
        self.kind = f"sentencepiece_{self.model_type}"
        if found != ("identity", False, False):
            raise ValueError(f"SentencePiece normalizer (name, add_dummy_prefix, "
                             f"remove_extra_whitespaces) = {found}: expected lossless "
                             f"('identity', False, False)")
        sp = self._sp = sentencepiece.SentencePieceProcessor(model_proto=encoding_model)
        found = tuple(sp.id_to_piece(i) for i in range(min(NUM_SPECIAL, sp.get_piece_size())))
        if found != SPECIAL_TOKENS or any(sp.piece_to_id(p) != i
                                          for i, p in enumerate(SPECIAL_TOKENS)):
            raise ValueError(f"SentencePiece pieces 0..6 are {found}: expected {SPECIAL_TOKENS}")
        if not all(sp.is_control(i) or i == UNK_ID for i in range(NUM_SPECIAL)):
            raise ValueError(f"SentencePiece pieces 0..6 {SPECIAL_TOKENS} are not all control "
                             "symbols (<unk> aside): expected specials it never reads from text")
        byte_ids = [sp.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
        if not all(sp.is_byte(i) for i in byte_ids):
            raise ValueError("SentencePiece model has no byte pieces <0x00>..<0xFF>: expected "
                             "one trained with byte_fallback=True")
        # SentencePiece reads a literal "▁" as a space: it encodes as its UTF-8 bytes instead
        self._as_bytes = {_SPACE_MARK: [byte_ids[b] for b in _SPACE_MARK.encode()]}
        if sp.piece_to_id(_SPACE_MARK) == UNK_ID:  # (so a space would decode as "▁")
            cli.warn_once("this SentencePiece model has no '\u2581' piece (trained before "
                          "2026-12-07 on text with few spaces, when its spaces decoded as "
                          "'\u2581'): a space now encodes as the byte <0x20>, as its export does")
            self._as_bytes[" "] = [byte_ids[0x20]]
        self._split = re.compile(f"([{''.join(self._as_bytes)}])").split
        regular = [bytes([int(sp.id_to_piece(i)[3:5], 16)]) if sp.is_byte(i)
                   else sp.id_to_piece(i).replace(_SPACE_MARK, " ").encode()
                   for i in range(NUM_SPECIAL, sp.get_piece_size())]
        self._finish(regular, num_sentinels)

    def encode(self, text: str) -> np.ndarray:
        if not any(c in text for c in self._as_bytes):
            return np.asarray(self._sp.encode(text), np.int32)
        ids = []  # (the split's odd parts are the characters encoded as bytes)
        for i, part in enumerate(self._split(text)):
            ids += self._as_bytes[part] if i % 2 else self._sp.encode(part)
        return np.asarray(ids, np.int32)

    def _config(self, directory: str) -> dict[str, Any]:
        fileio.write_atomic(fileio.join(directory, SENTENCEPIECE_FILE), self.model_proto)
        return {"model_file": SENTENCEPIECE_FILE}

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
        """SentencePiece's lattice holds only its normal pieces; Hugging
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


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    """Splits texts into SentencePiece training sentences of <= _MAX_SENTENCE_BYTES: paragraphs
    (at blank lines), cut at line ends if too long, and at character boundaries as a last resort.
    Newlines inside a paragraph are kept, so pieces can learn them."""
    limit = _MAX_SENTENCE_BYTES
    for text in checked_texts(texts):
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


def train_sentencepiece(texts: Iterable[str], model_type: str, vocab_size: int) -> bytes:
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
            # control, not user-defined: SentencePiece would read their names in text as them
            control_symbols=list(SPECIAL_TOKENS[MASK_ID:]), byte_fallback=True,
            # a "▁" piece even for text with few spaces, without which spaces decode as "▁"
            required_chars=_SPACE_MARK,
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
