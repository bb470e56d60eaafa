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


# --- 3, 5. our own tokenizers export as a tokenizer.json; export follows the umask ----------

LITERALS = "<eos> <pad> <mask> <cls> <sep> <extra_id_0> <unk> <0x41> <bos> as plain text"
CORPUS = [play(seed, 40) for seed in range(20)]
HTML = [f'<div class="c{i}">{play(i, 3)}</div>\n<span>0x{i:02X} <b>bold</b> {i * 37}</span>\n'
        for i in range(300)]  # SentencePiece pieces such as "</": "<" inside a piece


def auto_tokenizer(tok, directory: Path):
    """`transformers.AutoTokenizer` of `tok.hugging_face()` written into `directory`."""
    tokenizer_json, config = tok.hugging_face()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("kind,texts,vocab_size", [
    ("byte", None, None), ("char", CORPUS, None), ("sentencepiece_bpe", CORPUS, 600),
    ("sentencepiece_unigram", CORPUS, 400), ("sentencepiece_unigram", HTML, 500),
    ("sentencepiece_bpe", HTML, 600)])
def test_our_tokenizers_load_in_autotokenizer_with_our_ids(tmp_path, kind, texts, vocab_size):
    tok = tokenizers_lib.build_tokenizer(kind, texts, vocab_size=vocab_size, num_sentinels=3)
    auto = auto_tokenizer(tok, tmp_path)
    loaded = tokenizers_lib.load_hf_tokenizer(str(tmp_path))  # as init_from=hf: reads it
    held_out = [play(1000 + seed, n) for seed, n in enumerate((1, 3, 30))]
    texts = [*TEXTS, LONG, LITERALS, *held_out, HTML[7]]
    assert [i.tolist() for i in loaded.encode_batch(texts)] == [
        tok.encode(text).tolist() for text in texts]  # split_special_tokens: <eos> is text
    regular = range(tokenizers_lib.NUM_SPECIAL, tok.vocab_size - tok.num_sentinels)
    assert [loaded.token_bytes(i) for i in regular] == [tok.token_bytes(i) for i in regular]
    for text in texts:
        ids = tok.encode(text).tolist()
        assert auto(text, add_special_tokens=False)["input_ids"] == ids, text[:40]
        assert loaded.encode(text).tolist() == ids
        assert auto.decode(ids) == tok.decode(ids)
        if kind != "char":  # char: the characters it has no ids for decode as "<unk>"
            assert auto.decode(ids) == text
    assert len(auto) == tok.vocab_size
    assert [auto.convert_tokens_to_ids(name) for name in tokenizers_lib.SPECIAL_TOKENS] == \
        list(range(tokenizers_lib.NUM_SPECIAL))
    assert auto.convert_tokens_to_ids("<extra_id_0>") == tok.sentinel_id(0)
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id, auto.unk_token_id) == \
        (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id)
    sentinels_and_eos = [*tok.encode("to be"), tok.sentinel_id(2), tok.eos_id]
    assert auto.decode(sentinels_and_eos) == tok.decode(sentinels_and_eos)


def test_a_unigram_vocabulary_autotokenizer_would_misread_is_refused():
    """A Hugging Face Unigram matches every token in text, SentencePiece only its pieces: with
    "<" going on in pieces ("</") and no piece "x", "<0x00>" in text would become the byte
    token 7 there, and "<", "0", bytes of "x", ... here. Refused, in one line."""
    no_x = [text.replace("x", "").replace("X", "") for text in HTML]
    tok = tokenizers_lib.build_tokenizer("sentencepiece_unigram", no_x, vocab_size=500)
    with pytest.raises(ValueError, match=r"its unigram pieces go on past a '<' but none is 'x': a "
                                         r"Hugging Face Unigram would read '<0x00>' in text") \
            as error:
        tok.hugging_face()
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_export_writes_our_tokenizer_with_the_umask_one_line_per_file(tmp_path):
    import subprocess
    import sys

    from test_train import REPO, TINY_MODEL, cli_env, describe

    from transformer import train

    (tmp_path / "play.txt").write_text("\n".join(CORPUS[:4]), encoding="utf-8")
    config = configs.experiment("gpt_tiny")
    config.update(steps=1, batch_size=2, seq_len=16, log_every=1, eval_every=1, eval_steps=1,
                  checkpoint_every=1)
    config.model.update(**TINY_MODEL, position="learned", max_len=64)
    config.data.update(path=str(tmp_path / "play.txt"), unit="stream", vocab_size=340,
                       tokenizer="sentencepiece_unigram", num_sentinels=2)
    workdir, output = tmp_path / "run", tmp_path / "hf" / "model"
    train.train_and_evaluate(config, str(workdir))
    result = subprocess.run(  # under umask 027: directories 750, files 640
        ["sh", "-c", 'umask 027 && exec "$0" "$@"', sys.executable, "-m", "transformer.export",
         f"--workdir={workdir}", f"--output={output}"], cwd=REPO, env=cli_env(),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, describe(result)
    assert result.stderr == ""  # no Orbax INFO, no warnings
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json"]
    lines = result.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines[:-1]] == [f"wrote {output / n}" for n in names]
    size = (output / "model.safetensors").stat().st_size
    assert lines[2] == f"wrote {output / 'model.safetensors'} ({size / 1e3:.1f} kB)"
    assert lines[-1] == f"step 1 of {workdir} -> {output} as GPT2LMHeadModel, with its tokenizer"
    assert sorted(p.name for p in output.iterdir()) == names
    assert {oct(p.stat().st_mode & 0o777) for p in output.iterdir()} == {"0o640"}
    assert oct(output.stat().st_mode & 0o777) == "0o750"
    ours = tokenizers_lib.load_tokenizer(str(workdir / inputs.TOKENIZER_DIR))
    auto = transformers.AutoTokenizer.from_pretrained(output)
    for text in [*TEXTS, LONG]:
        assert auto(text, add_special_tokens=False)["input_ids"] == ours.encode(text).tolist()
    hf_config = json.loads((output / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["vocab_size"]) == \
        (ours.bos_id, ours.eos_id, ours.vocab_size)
