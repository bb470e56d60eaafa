"""Tokenizers: id layout shared by every kind, lossless round trips, save / load, and SentencePiece
training on Shakespeare (deterministic, BPE != unigram, compresses)."""

import hashlib
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from transformer.data import sentencepiece_tokenizer, tokenizers
from transformer.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    KINDS,
    MASK_ID,
    NUM_SPECIAL,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    build_tokenizer,
    load_tokenizer,
)
from transformer.utils import cli

# The excerpt of tiny Shakespeare shipped with the tests: the corpus is its first TRAIN_CHARS
# characters, the held-out text the next 20,000 (tests/data/README.md).
SHAKESPEARE = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
TRAIN_CHARS = 100_000
SP_VOCAB = 1000
SP_KINDS = ("sentencepiece_bpe", "sentencepiece_unigram")
LOSSLESS_KINDS = ("byte", *SP_KINDS)
OWN_KINDS = tuple(k for k in KINDS if k != "hf")  # the id layout this project builds

UNSEEN = "naïve café — 日本語 😀"  # none of these non-ASCII characters is in Shakespeare
SAMPLES = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    UNSEEN,
    "",
    "  leading,  double  spaces\t\ttabs\r\n\n\n\nblank lines and a trailing space ",
    "SentencePiece's space mark ▁ as text, ▁▁ twice, ▁",
    "<mask> <s> </s> <extra_id_0> look like specials",
    "\x00\x07 control bytes \ufeff BOM",
]


@pytest.fixture(scope="module")
def shakespeare():
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def corpus(shakespeare):
    return shakespeare[:TRAIN_CHARS]


@pytest.fixture(scope="module")
def held_out(shakespeare):
    text = shakespeare[TRAIN_CHARS:TRAIN_CHARS + 20_000]
    assert len(text) == 20_000, f"{SHAKESPEARE} is shorter than the tests need"
    return text


@pytest.fixture(scope="module")
def trained(corpus):
    """Every kind built once: char and both SentencePiece kinds trained on the corpus."""
    toks = {"byte": build_tokenizer("byte"), "char": build_tokenizer("char", [corpus])}
    for kind in SP_KINDS:
        toks[kind] = build_tokenizer(kind, [corpus], vocab_size=SP_VOCAB)
    return toks


def special_or_sentinel(tok, ids):
    return np.isin(ids, np.asarray(tok.special_ids))


@pytest.mark.parametrize("kind", LOSSLESS_KINDS)
def test_round_trip_is_lossless(trained, corpus, kind):
    tok = trained[kind]
    for text in [*SAMPLES, corpus[:5000]]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert tok.decode(ids) == text, text


@pytest.mark.parametrize("kind", SP_KINDS)
def test_sentencepiece_falls_back_to_bytes_for_unseen_characters(trained, kind):
    tok = trained[kind]
    ids = tok.encode(UNSEEN)
    assert UNK_ID not in ids
    pieces = [tok._sp.id_to_piece(int(i)) for i in ids]
    assert "<0xF0>" in pieces  # the emoji's first UTF-8 byte: it was spelled out, not dropped
    # Our decode table agrees with SentencePiece's own detokenizer.
    for text in [UNSEEN, SAMPLES[0], SAMPLES[3]]:
        assert tok._sp.decode(tok.encode(text).tolist()) == text


def test_byte_ids_are_utf8_bytes_plus_7(trained):
    tok = trained["byte"]
    expected = np.frombuffer(UNSEEN.encode("utf-8"), np.uint8).astype(np.int32) + 7
    np.testing.assert_array_equal(tok.encode(UNSEEN), expected)
    assert tok.encode("A").tolist() == [7 + 65]
    assert tok.vocab_size == 7 + 256 + 100 and tok.num_sentinels == 100
    assert tok.decode([7 + 0xC3]) == "\ufffd"  # a lone UTF-8 lead byte decodes as replacement


def test_char_vocab_is_sorted_distinct_chars_offset_by_7(trained, corpus):
    tok = trained["char"]
    chars = sorted(set(corpus))
    assert tok.chars == "".join(chars)
    np.testing.assert_array_equal(tok.encode("".join(chars)), 7 + np.arange(len(chars)))
    assert tok.vocab_size == 7 + len(chars) + 100
    text = corpus[1000:3000]
    assert tok.decode(tok.encode(text)) == text


def test_char_unknown_characters_encode_to_unk(trained):
    tok = trained["char"]
    ids = tok.encode("café😀")
    assert ids.tolist()[-2:] == [UNK_ID, UNK_ID]
    assert tok.decode(ids) == "caf<unk><unk>"


@pytest.mark.parametrize("kind", OWN_KINDS)
def test_special_ids_are_identical_across_kinds(trained, kind):
    tok = trained[kind]
    assert SPECIAL_TOKENS == ("<pad>", "<bos>", "<eos>", "<unk>", "<mask>", "<cls>", "<sep>")
    assert (tokenizers.PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID, tokenizers.CLS_ID,
            tokenizers.SEP_ID) == tuple(range(NUM_SPECIAL))
    assert tok.decode(list(range(NUM_SPECIAL))) == "".join(SPECIAL_TOKENS[1:])  # <pad> dropped
    assert tok.decode([BOS_ID, *tok.encode("to be"), EOS_ID, PAD_ID, PAD_ID]) == "<bos>to be<eos>"
    if kind in SP_KINDS:  # SentencePiece's own piece ids
        sp = tok._sp
        assert [sp.id_to_piece(i) for i in range(NUM_SPECIAL)] == list(SPECIAL_TOKENS)
        assert [sp.piece_to_id(p) for p in SPECIAL_TOKENS] == list(range(NUM_SPECIAL))
        assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)


@pytest.mark.parametrize("kind", OWN_KINDS)
def test_encode_never_emits_special_or_sentinel_ids(trained, corpus, held_out, kind):
    tok = trained[kind]
    texts = [corpus[:20_000], held_out] + ([] if kind == "char" else [UNSEEN, SAMPLES[3]])
    for text in texts:
        ids = tok.encode(text)
        assert not special_or_sentinel(tok, ids).any()
        assert ids.min() >= NUM_SPECIAL and ids.max() < tok.vocab_size - tok.num_sentinels


@pytest.mark.parametrize("kind", OWN_KINDS)
def test_sentinels_are_the_top_ids(trained, kind):
    tok = trained[kind]
    v = tok.vocab_size
    assert tok.sentinel_id(0) == v - 1 and tok.sentinel_id(99) == v - 100
    assert tok.decode([tok.sentinel_id(3), tok.sentinel_id(0)]) == "<extra_id_3><extra_id_0>"
    assert tok.decode([BOS_ID, tok.sentinel_id(99), EOS_ID]) == "<bos><extra_id_99><eos>"
    assert tok.special_ids == tuple(range(7)) + tuple(range(v - 100, v))
    # Everything else is a regular token, which is what MLM's random replacement may draw.
    assert len(set(range(v)) - set(tok.special_ids)) == v - 107
    for bad in (-1, 100, 1.0):
        with pytest.raises(ValueError, match=re.escape(f"sentinel index {bad!r}")):
            tok.sentinel_id(bad)


def test_num_sentinels_sizes_the_vocabulary(corpus):
    tok = build_tokenizer("byte", num_sentinels=0)
    assert tok.vocab_size == 263 and tok.special_ids == tuple(range(7))
    tok = build_tokenizer("char", ["ab"], num_sentinels=3)
    assert tok.vocab_size == 7 + 2 + 3 and tok.sentinel_id(2) == 9
    assert tok.decode([9, 10, 11]) == "<extra_id_2><extra_id_1><extra_id_0>"


@pytest.mark.parametrize("kind", SP_KINDS)
def test_sentencepiece_vocab_size_adds_sentinels(trained, kind):
    tok = trained[kind]
    assert tok._sp.get_piece_size() == SP_VOCAB
    assert tok.vocab_size == SP_VOCAB + 100 and tok.kind == kind
    assert trained["byte"].encode("<mask>").tolist() == [7 + b for b in b"<mask>"]


LITERAL_SPECIALS = "A document with <mask> and <eos>, <cls><sep> <pad><bos><unk> <extra_id_0>.\n"


@pytest.mark.parametrize("kind", SP_KINDS)
def test_sentencepiece_reads_special_names_in_text_as_text(trained, kind):
    """As byte and char do: a special id comes only from code that inserts it (BERT's mask, a
    document's <eos>), never from a document that happens to hold its name."""
    import sentencepiece

    tok = trained[kind]
    ids = tok.encode(LITERAL_SPECIALS)
    assert not special_or_sentinel(tok, ids).any(), ids
    assert tok.decode(ids) == LITERAL_SPECIALS
    # The saved model itself declares them control symbols, for any reader of sentencepiece.model
    raw = sentencepiece.SentencePieceProcessor(model_proto=tok.model_proto)
    assert raw.encode("<mask><cls><sep>") == tok.encode("<mask><cls><sep>").tolist()
    assert all(raw.is_control(i) for i in range(NUM_SPECIAL) if i != UNK_ID)


def test_sentencepiece_model_with_a_normal_special_piece_is_rejected(trained):
    proto = sentencepiece_tokenizer._model_proto_class()()
    proto.ParseFromString(trained["sentencepiece_bpe"].model_proto)
    proto.pieces[6].type = 1  # NORMAL: SentencePiece would read "<sep>" in text as id 6
    with pytest.raises(ValueError, match="are not all control symbols") as error:
        tokenizers.SentencePieceTokenizer(proto.SerializeToString())
    assert "\n" not in str(error.value)

def test_sentencepiece_saved_with_user_defined_specials_loads_alike(corpus, held_out, tmp_path,
                                                                    monkeypatch, capsys):
    """A model saved before the specials were control symbols (user-defined ones, which
    SentencePiece reads from their names in text) keeps its bytes and its ids for other text,
    and reads the names as text."""
    import sentencepiece

    train = sentencepiece.SentencePieceTrainer.train
    new = build_tokenizer("sentencepiece_bpe", [corpus[:30_000]], vocab_size=400)

    def as_before(**kwargs):
        kwargs["user_defined_symbols"] = kwargs.pop("control_symbols")
        return train(**kwargs)

    monkeypatch.setattr(sentencepiece.SentencePieceTrainer, "train", as_before)
    cli.warn_once.cache_clear()
    capsys.readouterr()
    before = build_tokenizer("sentencepiece_bpe", [corpus[:30_000]], vocab_size=400)
    # a run resumed on such a model is told its ids for those names changed
    assert "<mask>, <cls> and <sep> in text" in capsys.readouterr().err
    raw = sentencepiece.SentencePieceProcessor(model_proto=before.model_proto)
    assert raw.encode("<mask>") == [MASK_ID]  # what such a model read before the fix
    before.save(str(tmp_path))
    assert (tmp_path / "sentencepiece.model").read_bytes() == before.model_proto
    loaded = load_tokenizer(str(tmp_path))
    # its own bytes, which identity checks (inputs._tokenizer_identity) compare, unchanged
    assert loaded.model_proto == before.model_proto != new.model_proto
    for tok in (loaded, pickle.loads(pickle.dumps(loaded))):
        assert tok.encode(held_out).tolist() == raw.encode(held_out) == \
            new.encode(held_out).tolist()
        ids = tok.encode(LITERAL_SPECIALS)
        assert ids.tolist() == new.encode(LITERAL_SPECIALS).tolist()
        assert not special_or_sentinel(tok, ids).any() and tok.decode(ids) == LITERAL_SPECIALS


CJK = "我们今天在北京学习自然语言处理和机器学习的方法。日本語のテキストを読みます。"


@pytest.mark.parametrize("kind", SP_KINDS)
def test_sentencepiece_trained_without_spaces_keeps_them(kind, monkeypatch, capsys):
    """Text with (almost) no spaces (Chinese, Japanese) gave SentencePiece no "▁" piece: a
    space fell back to the bytes of "▁" and decoded as "▁", the same ids as a literal "▁".
    Training now requires the piece; a model saved without it encodes a space as <0x20>,
    as its export does, and says so."""
    import sentencepiece
    from tokenizers import Tokenizer

    text = "北京 学习 hello world\nand ▁ literal"
    tok = build_tokenizer(kind, [CJK * 400], vocab_size=320)
    assert tok._sp.piece_to_id("\u2581") != UNK_ID
    train = sentencepiece.SentencePieceTrainer.train

    def as_before(**kwargs):
        kwargs.pop("required_chars")
        return train(**kwargs)

    monkeypatch.setattr(sentencepiece.SentencePieceTrainer, "train", as_before)
    cli.warn_once.cache_clear()
    capsys.readouterr()
    before = build_tokenizer(kind, [CJK * 400], vocab_size=320)
    assert "a space now encodes as the byte <0x20>" in capsys.readouterr().err
    assert before._sp.decode(before._sp.encode(text)) != text  # what such a model read
    for t in (tok, before, pickle.loads(pickle.dumps(before))):
        ids = t.encode(text)
        assert t.decode(ids) == text
        assert t.encode("北京 学习").tolist() != t.encode("北京\u2581学习").tolist()
        exported = Tokenizer.from_str(t.hugging_face()[0])
        assert exported.encode(text, add_special_tokens=False).ids == ids.tolist()


def test_decode_accepts_lists_numpy_and_jax(trained):
    tok = trained["sentencepiece_bpe"]
    ids = tok.encode(SAMPLES[0])
    assert tok.decode(ids.tolist()) == tok.decode(ids) == tok.decode(jnp.asarray(ids))
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match=f"id {tok.vocab_size} out of range"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match=r"shape \(1, 3\)"):
        tok.decode(np.zeros((1, 3), np.int32))


@pytest.mark.parametrize("kind", OWN_KINDS)
def test_save_load_gives_identical_encodings(trained, held_out, tmp_path, kind):
    tok = trained[kind]
    directory = tmp_path / "run" / "tokenizer"  # save creates missing parents
    tok.save(str(directory))
    loaded = load_tokenizer(str(directory))
    assert type(loaded) is type(tok) and loaded.kind == tok.kind == kind
    assert (loaded.vocab_size, loaded.num_sentinels) == (tok.vocab_size, tok.num_sentinels)
    assert loaded.special_ids == tok.special_ids
    texts = [held_out[:3000]] + (
        [] if kind == "char" else SAMPLES)
    for text in texts:
        np.testing.assert_array_equal(loaded.encode(text), tok.encode(text))
        assert loaded.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    config = json.loads((directory / "tokenizer.json").read_text())
    assert config["kind"] == kind and config["num_sentinels"] == 100
    assert config["format_version"] == tokenizers.FORMAT_VERSION
    files = sorted(p.name for p in directory.iterdir())  # no temporary files left behind
    if kind in SP_KINDS:
        assert files == ["sentencepiece.model", "tokenizer.json"]
        assert (directory / "sentencepiece.model").read_bytes() == tok.model_proto
    else:
        assert files == ["tokenizer.json"]
    if kind == "char":
        assert "".join(config["chars"]) == tok.chars


def test_load_keeps_char_mapping_and_sentinel_count(tmp_path):
    tok = build_tokenizer("char", ["zyx", "ab"], num_sentinels=5)
    tok.save(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.encode("abxyz?").tolist() == [7, 8, 9, 10, 11, UNK_ID]
    assert loaded.sentinel_id(0) == loaded.vocab_size - 1 == 7 + 5 + 5 - 1


def test_load_missing_directory_names_the_path(tmp_path):
    missing = tmp_path / "no_such_run"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))) as info:
        load_tokenizer(str(missing))
    assert "\n" not in str(info.value)


def test_load_rejects_inconsistent_files(trained, tmp_path):
    trained["byte"].save(str(tmp_path))
    config_file = tmp_path / "tokenizer.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "kind": "wordpiece"}))
    with pytest.raises(ValueError, match="kind='wordpiece'"):
        load_tokenizer(str(tmp_path))
    config_file.write_text(json.dumps({**config, "vocab_size": 999}))
    with pytest.raises(ValueError, match="vocab_size=999"):
        load_tokenizer(str(tmp_path))
    config_file.write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version=99"):
        load_tokenizer(str(tmp_path))


def test_sentencepiece_model_without_our_specials_is_rejected(corpus):
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(  # SentencePiece defaults: <unk>=0, <s>=1, </s>=2
        sentence_iterator=iter(corpus[:20_000].splitlines()), model_writer=model,
        vocab_size=400, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, minloglevel=2)
    with pytest.raises(ValueError, match="pieces 0..6 are"):
        tokenizers.SentencePieceTokenizer(model.getvalue())
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(  # our specials but the default normalizer
        sentence_iterator=iter(corpus[:20_000].splitlines()), model_writer=model,
        vocab_size=400, pad_id=0, bos_id=1, eos_id=2, unk_id=3, bos_piece="<bos>",
        eos_piece="<eos>", user_defined_symbols=["<mask>", "<cls>", "<sep>"], byte_fallback=True,
        minloglevel=2)
    with pytest.raises(ValueError, match="normalizer"):
        tokenizers.SentencePieceTokenizer(model.getvalue())


@pytest.mark.parametrize("kind", SP_KINDS)
def test_sentencepiece_survives_pickling(trained, kind):
    tok = trained[kind]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.kind == kind and clone.vocab_size == tok.vocab_size
    for text in SAMPLES:
        np.testing.assert_array_equal(clone.encode(text), tok.encode(text))


def test_sentencepiece_training_is_deterministic(trained, corpus, held_out):
    for kind in SP_KINDS:
        again = build_tokenizer(kind, iter([corpus]), vocab_size=SP_VOCAB)  # a one-shot iterator
        assert again.model_proto == trained[kind].model_proto
        np.testing.assert_array_equal(again.encode(held_out), trained[kind].encode(held_out))


_RETRAIN = """
import hashlib, sys
from transformer.data import sentencepiece_tokenizer, tokenizers
sentencepiece_tokenizer._MAX_TRAINING_SENTENCES = 150
text = open(sys.argv[1], encoding="utf-8").read()[:60_000]
for kind in ("sentencepiece_bpe", "sentencepiece_unigram"):
    tok = tokenizers.build_tokenizer(kind, [text], vocab_size=400)
    print(hashlib.sha256(tok.model_proto).hexdigest())
"""


def test_sampled_training_is_deterministic_across_processes(shakespeare, monkeypatch):
    """More sentences than the cap -> a sample; the sample must not depend on the process."""
    monkeypatch.setattr(sentencepiece_tokenizer, "_MAX_TRAINING_SENTENCES", 150)
    text = shakespeare[:60_000]
    here = [hashlib.sha256(build_tokenizer(kind, [text], vocab_size=400).model_proto).hexdigest()
            for kind in SP_KINDS]
    result = subprocess.run([sys.executable, "-c", _RETRAIN, str(SHAKESPEARE)],
                            capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.split() == here


def test_sample_is_seeded_and_uniform():
    items = [str(i) for i in range(1000)]
    sample = sentencepiece_tokenizer._sample(iter(items), 100, seed=0)
    assert sample == sentencepiece_tokenizer._sample(iter(items), 100, seed=0)
    assert sample != sentencepiece_tokenizer._sample(iter(items), 100, seed=1)
    assert len(set(sample)) == 100 and 300 < np.mean([int(s) for s in sample]) < 700
    assert sentencepiece_tokenizer._sample(iter(items[:10]), 100, seed=0) == items[:10]


def test_bpe_and_unigram_differ(trained, held_out):
    bpe, unigram = trained["sentencepiece_bpe"], trained["sentencepiece_unigram"]
    pieces = [{t._sp.id_to_piece(i) for i in range(SP_VOCAB)} for t in (bpe, unigram)]
    assert len(pieces[0] ^ pieces[1]) > 100
    assert bpe.encode(held_out).tolist() != unigram.encode(held_out).tolist()


@pytest.mark.parametrize("kind", SP_KINDS)
def test_sentencepiece_compresses_shakespeare(trained, corpus, held_out, kind):
    tok, byte = trained[kind], trained["byte"]
    for text in (corpus, held_out):
        assert len(tok.encode(text)) < 0.5 * len(byte.encode(text))


def test_long_lines_and_paragraphs_are_split_not_skipped(corpus):
    one_line = corpus[:60_000].replace("\n", " ")  # 60 KB without a newline: > max length
    chunks = list(sentencepiece_tokenizer._sentences([one_line]))
    assert len(chunks) > 1 and "".join(chunks) == one_line
    assert max(len(c.encode()) for c in chunks) <= sentencepiece_tokenizer._MAX_SENTENCE_BYTES
    tok = build_tokenizer("sentencepiece_bpe", [one_line], vocab_size=600)
    assert len(tok.encode(one_line)) < 0.6 * len(one_line)  # it learned merges from that line
    paragraph = "\n".join(line for line in corpus[:12_000].splitlines() if line)  # no blank line
    chunks = list(sentencepiece_tokenizer._sentences([paragraph]))
    assert "".join(chunks) == paragraph and all(c.endswith("\n") for c in chunks[:-1])
    assert max(len(c.encode()) for c in chunks) <= sentencepiece_tokenizer._MAX_SENTENCE_BYTES


@pytest.mark.parametrize("kind", SP_KINDS)
def test_vocab_size_beyond_the_corpus_names_the_limit(corpus, kind):
    text = corpus[:3000]
    with pytest.raises(ValueError, match=r"vocab_size=5000: too large.*<= (\d+)") as info:
        build_tokenizer(kind, [text], vocab_size=5000)
    limit = int(re.search(r"<= (\d+)", str(info.value)).group(1))
    assert build_tokenizer(kind, [text], vocab_size=limit, num_sentinels=0).vocab_size == limit


@pytest.mark.parametrize("call, message", [
    (lambda: build_tokenizer("wordpiece"), "kind='wordpiece'"),
    (lambda: build_tokenizer("sentencepiece_bpe", ["some text"]), "vocab_size=None"),
    (lambda: build_tokenizer("sentencepiece_bpe", ["text"], vocab_size=263), "vocab_size=263"),
    (lambda: build_tokenizer("sentencepiece_bpe", ["text"], vocab_size=1e3), "vocab_size=1000.0"),
    (lambda: build_tokenizer("sentencepiece_unigram", ["abcdefg " * 50], vocab_size=264),
     "vocab_size=264: too small"),
    (lambda: build_tokenizer("sentencepiece_unigram", vocab_size=500), "texts=None"),
    (lambda: build_tokenizer("char"), "texts=None"),
    (lambda: build_tokenizer("char", "one string"), "texts='one string'"),
    (lambda: build_tokenizer("char", ["ok", 3]), r"texts\[1\] is a int"),
    (lambda: build_tokenizer("char", ["", ""]), "no characters"),
    (lambda: build_tokenizer("sentencepiece_bpe", ["", " \n"], vocab_size=300), "no non-blank"),
    (lambda: build_tokenizer("byte", num_sentinels=-1), "num_sentinels=-1"),
    (lambda: build_tokenizer("char", ["ab"], num_sentinels=2.0), "num_sentinels=2.0"),
    (lambda: build_tokenizer("byte", vocab_size=300), "vocab_size=300"),
    (lambda: tokenizers.CharTokenizer(""), "chars=''"),
])
def test_bad_arguments_raise_one_line_value_errors(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
