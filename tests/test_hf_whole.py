"""A Hugging Face tokenizer comes in whole and ours go out whole: a tokenizer.json's padding and
truncation (sentence-transformers' `Fixed 128`) are turned off, a JSON file that is no tokenizer
is one clear line, export writes with the user's umask and one line per artifact, the harness
chooses its platform like the other commands, and the byte, char and SentencePiece tokenizers
export as a tokenizer.json that `transformers.AutoTokenizer` loads with our ids.

Every text and tokenizer is made here (no ../shared)."""

import json
import random
from pathlib import Path

import pytest

tokenizers_hf = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from transformer import configs  # noqa: E402
from transformer.data import inputs, prepare  # noqa: E402
from transformer.data import tokenizers as tokenizers_lib  # noqa: E402

_WORDS = ("the king my lord good sir love death night day heart hand eyes speak come go "
          "thou thee thy art hath doth shall would noble sweet fair gentle blood crown war "
          "peace honour fortune heaven time world father son daughter queen duke").split()
_NAMES = ("KING HENRY", "FIRST CITIZEN", "ROMEO", "JULIET", "LADY MACBETH", "GLOUCESTER")


def play(seed: int, speeches: int) -> str:
    """Play-like text of uneven lines: speakers, punctuation, contractions, blank lines."""
    rng = random.Random(seed)
    out = []
    for _ in range(speeches):
        lines = []
        for _ in range(rng.randint(1, 5)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 14))]
            words[0] = words[0].capitalize()
            if rng.random() < 0.3:
                words[-1] += rng.choice(["'s", "'d", "-a-day"])
            lines.append(" ".join(words) + rng.choice([",", ".", "!", "?", ";", ":", ""]))
        out.append(f"{rng.choice(_NAMES)}:\n" + "\n".join(lines) + "\n")
    return "\n".join(out)


TEXTS = [play(seed, n) for seed, n in enumerate((1, 2, 3, 8, 20))] + [
    "  leading spaces, then\ttabs\tand\r\nCRLF\n\n\nand blank lines ",
    "naïve café — 日本語 😀, Größe; ñandú",
    "x",
    "",
    "▁ a literal SentencePiece mark, <eos> and <extra_id_0> as plain text",
]
LONG = play(100, 60)[:3000]


# --- 1. a tokenizer.json's padding and truncation are turned off ------------------------------


def minilm_style(directory: Path, padding: bool = True, truncation: bool = True) -> Path:
    """A BERT WordPiece save_pretrained directory whose tokenizer.json carries the padding and
    truncation sentence-transformers writes (all-MiniLM-L6-v2: Fixed 128, max_length 128)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([play(s, 30) for s in range(10)], trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    transformers.BertTokenizerFast(tokenizer_object=tok).save_pretrained(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    if padding:
        tok.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    if truncation:
        tok.enable_truncation(128)
    tok.save(str(directory / "tokenizer.json"))
    saved = json.loads((directory / "tokenizer.json").read_text())
    assert (saved["padding"] is not None) == padding  # as the hub file carries them
    assert (saved["truncation"] is not None) == truncation
    return directory


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    return minilm_style(tmp_path_factory.mktemp("minilm"))


@pytest.mark.parametrize("padding,truncation", [(True, True), (True, False), (False, True)])
def test_padding_and_truncation_of_a_tokenizer_json_are_turned_off(tmp_path, padding,
                                                                   truncation):
    directory = minilm_style(tmp_path, padding, truncation)
    tok = tokenizers_lib.load_hf_tokenizer(str(directory), num_sentinels=0)
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    for text in [*TEXTS, LONG]:
        expected = auto(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text).tolist() == expected, text[:40]
    assert [ids.tolist() for ids in tok.encode_batch(TEXTS)] == \
        [auto(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    long_ids = tok.encode(LONG)
    assert len(long_ids) > 500 and tok.pad_id not in long_ids.tolist()  # all 3,000 chars' ids
    assert tok.encode("x").tolist() == auto("x", add_special_tokens=False)["input_ids"]
    assert len(tok.encode("x")) == 1


def test_stream_mode_and_prepare_read_every_token(minilm_dir, tmp_path):
    text = "\n".join(play(seed, 40) for seed in range(3))
    (tmp_path / "play.txt").write_text(text, encoding="utf-8")
    tok = tokenizers_lib.load_hf_tokenizer(str(minilm_dir), num_sentinels=0)
    auto = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    config = configs.experiment("gpt_tiny")
    config.data.update(path=str(tmp_path / "play.txt"), unit="stream", tokenizer="hf",
                       tokenizer_path=str(minilm_dir), num_sentinels=0)
    stream = inputs.corpus(config, tok, "train")
    train_text = text[:len(text) - round(len(text) * config.data.validation_fraction)]
    expected = auto(train_text, add_special_tokens=False)["input_ids"]
    assert len(expected) > 2000
    assert stream.read(0, len(stream)).tolist() == [*expected, tok.eos_id]

    counts = prepare.prepare(str(tmp_path / "prepared"), str(tmp_path / "play.txt"),
                             tokenizer="hf", tokenizer_path=str(minilm_dir), format="bin",
                             unit="stream")
    assert counts["train"]["tokens"] == len(expected) + 1
    saved = tokenizers_lib.load_tokenizer(str(tmp_path / "prepared"))
    config.data.update(path=str(tmp_path / "prepared"), tokenizer_path="")
    shards = inputs.corpus(config, saved, "train")
    assert shards.read(0, len(shards)).tolist() == [*expected, tok.eos_id]


# --- 2. a JSON file that is no tokenizer ---------------------------------------------------


@pytest.mark.parametrize("content,match", [
    ('{"a": 1}', r"is JSON but not a tokenizer \(it has no \"model\"\): expected a Hugging Face "
                 r"tokenizer.json or a directory holding one"),
    ('{"architectures": ["BertModel"], "hidden_size": 384}', "is JSON but not a tokenizer"),
    ("[1, 2]", "holds a JSON list: expected a Hugging Face tokenizer.json"),
    ("{bad", "is not JSON .*: expected a Hugging Face tokenizer.json"),
])
def test_a_json_file_that_is_not_a_tokenizer_is_one_clear_line(tmp_path, content, match):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as error:
        tokenizers_lib.load_hf_tokenizer(str(path))
    assert str(error.value).startswith(repr(str(path))) and "\n" not in str(error.value)


def test_a_broken_tokenizer_config_json_names_its_file(minilm_dir, tmp_path):
    import shutil

    shutil.copytree(minilm_dir, tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"tokenizer_config.json' is not JSON .*: expected a "
                                         r"Hugging Face tokenizer_config.json"):
        tokenizers_lib.load_hf_tokenizer(str(tmp_path / "tok"))
