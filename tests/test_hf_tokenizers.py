"""Hugging Face tokenizers (data.tokenizer="hf"): each tokenizer is built in the test with the
`tokenizers` library (GPT-2 byte-level BPE, BERT WordPiece, a T5-style vocabulary with its own
sentinels, a bare tokenizer.json); ids must be exactly those of the library and of
`transformers.AutoTokenizer`, specials keep their pretrained ids, and a run trains, resumes,
fine-tunes an imported model and generates with them."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

tokenizers_hf = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from test_train import (  # noqa: E402
    SHAKESPEARE,
    TINY_MODEL,
    assert_succeeded,
    describe,
    run_cli,
    tiny_flags,
)

from transformer import configs, train  # noqa: E402
from transformer.data import features, inputs, prepare, shards, sources, windows  # noqa: E402
from transformer.data import tokenizers as tokenizers_lib  # noqa: E402

TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "naïve café — 日本語 😀",
    "",
    "  leading,  double  spaces\t\ttabs\r\n\n\n\nblank lines ",
    "<extra_id_0> and <mask> look like specials",
]


def corpus() -> list[str]:
    return SHAKESPEARE.read_text(encoding="utf-8")[:100_000].split("\n\n")


def gpt2_style(directory: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE with <|endoftext|> as bos, eos and unk (GPT-2's layout), written with
    `save_pretrained` (tokenizer.json + tokenizer_config.json naming the roles)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    end = "<|endoftext|>"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=end, eos_token=end,
                                         unk_token=end).save_pretrained(directory)
    return directory


def bert_style(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus(), trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    transformers.BertTokenizerFast(tokenizer_object=tok).save_pretrained(directory)
    return directory


def t5_style(path: Path, num_sentinels: int = 5) -> Path:
    """A bare tokenizer.json (no tokenizer_config.json) with T5's layout: <pad> 0, </s> 1,
    <unk> 2, and <extra_id_i> as the last ids in reverse order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus(), trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    tok.add_special_tokens([f"<extra_id_{i}>" for i in reversed(range(num_sentinels))])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return gpt2_style(tmp_path_factory.mktemp("gpt2_tokenizer"))


def test_ids_are_the_librarys_and_transformers_and_decode_is_lossless(gpt2_dir):
    tok = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir), num_sentinels=3)
    library = tokenizers_hf.Tokenizer.from_file(str(gpt2_dir / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(gpt2_dir)
    for text in TEXTS + corpus()[:50]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert ids.tolist() == library.encode(text, add_special_tokens=False).ids
        assert ids.tolist() == auto(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text  # "<extra_id_0>" is not a token here: plain text
    assert [a.tolist() for a in tok.encode_batch(TEXTS)] == [tok.encode(t).tolist() for t in TEXTS]


def test_specials_keep_their_pretrained_ids_and_sentinels_go_on_top(gpt2_dir):
    tok = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir), num_sentinels=3)
    end = tokenizers_hf.Tokenizer.from_file(str(gpt2_dir / "tokenizer.json")).token_to_id(
        "<|endoftext|>")
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (end, end, end)
    assert (tok.pad_id, tok.mask_id, tok.cls_id, tok.sep_id) == (None, None, None, None)
    base = len(transformers.AutoTokenizer.from_pretrained(gpt2_dir))
    assert tok.vocab_size == base + 3 and tok.sentinel_id(0) == base + 2
    assert tok.special_ids == (end, base, base + 1, base + 2)
    assert tok.decode([*tok.encode("to be"), tok.sentinel_id(0), end]) == \
        "to be<extra_id_0><|endoftext|>"
    with pytest.raises(ValueError, match="has no mask token: expected one for data.objective"):
        tok.require("mask", "for data.objective='mlm'")


def test_the_document_start_is_the_templates_leading_specials_whatever_the_vocab_order():
    """BERT's template puts [CLS] before a text and [SEP] after it: the document start is
    [CLS] alone. It is probed with a one-token text; tokens that the normalizer erases (accents
    under strip_accents) encode to nothing, so a probe among them would read [CLS] [SEP] as
    the start (the probe was whichever token the vocabulary's hash order gave first)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    marks = [chr(c) for c in range(0x300, 0x314)]  # combining accents: erased
    vocab = {token: i for i, token in enumerate(["[UNK]", *marks, "[CLS]", "[SEP]", "a"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]),
                                                 ("[SEP]", vocab["[SEP]"])])
    assert tok.encode(marks[0]).ids == [vocab["[CLS]"], vocab["[SEP]"]]
    for _ in range(5):  # (the vocabulary's order differs between tokenizers built alike)
        hf = tokenizers_lib.HFTokenizer(tok.to_str(), {"bos": "[CLS]", "eos": "[SEP]"})
        assert hf.document_start == [vocab["[CLS]"]]


def test_save_load_and_pickle_give_the_same_mapping(gpt2_dir, tmp_path):
    tok = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir), num_sentinels=2)
    tok.save(str(tmp_path / "saved"))
    for other in (tokenizers_lib.load_tokenizer(str(tmp_path / "saved")),
                  pickle.loads(pickle.dumps(tok))):
        assert other.kind == "hf" and other.vocab_size == tok.vocab_size
        assert other.specials == tok.specials and other.eos_id == tok.eos_id
        assert [other.encode(t).tolist() for t in TEXTS] == [tok.encode(t).tolist() for t in TEXTS]


def test_roles_filled_in_from_well_known_tokens_leave_the_tokenizers_identity(gpt2_dir,
                                                                             tmp_path):
    """A bare tokenizer.json's roles are filled in from well-known tokens and saved as such
    (`unnamed`: chat templates do not see them); a tokenizer saved before that list was kept
    tokenizes alike, so prepared data and workdirs holding either are one tokenizer's."""
    directory = tmp_path / "bare"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((gpt2_dir / "tokenizer.json").read_bytes())
    tok = tokenizers_lib.load_hf_tokenizer(str(directory))
    assert tok.unnamed and tok.specials["eos"] == "<|endoftext|>"
    tok.save(str(tmp_path / "new"))
    saved = json.loads((tmp_path / "new" / tokenizers_lib.CONFIG_FILE).read_text())
    assert saved["specials"]["unnamed"] == list(tok.unnamed)
    del saved["specials"]["unnamed"]  # as saved before the list was kept
    (tmp_path / "old").mkdir()
    for name in os.listdir(tmp_path / "new"):
        (tmp_path / "old" / name).write_bytes((tmp_path / "new" / name).read_bytes())
    (tmp_path / "old" / tokenizers_lib.CONFIG_FILE).write_text(json.dumps(saved))
    assert inputs._tokenizer_identity(str(tmp_path / "old")) == inputs._tokenizer_identity(
        str(tmp_path / "new"))
    assert tokenizers_lib.load_tokenizer(str(tmp_path / "old")).unnamed == ()


def test_a_checkpoints_generation_config_stop_ids_are_kept_saved_and_checked(gpt2_dir,
                                                                           tmp_path):
    """generation_config.json's eos_token_id (one id, or a list kept in its order) becomes the
    tokenizer's stop_ids, which saving, loading and pickling keep. They are saved beside the
    tokenizer's own tokenizer.json, which stays as it was (prepared data is checked against
    it), and a tokenizer saved without them (before they were kept) loads with none. A bad
    entry is a one-line error naming the file or the ids. Without the file, config.json's."""
    directory = tmp_path / "tok"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((gpt2_dir / name).read_bytes())
    plain = tokenizers_lib.load_hf_tokenizer(str(directory))
    assert plain.stop_ids == ()
    plain.save(str(tmp_path / "plain"))
    # Without generation_config.json, config.json's (its text config's where it has none), as
    # transformers' generate takes them then (GenerationConfig.from_model_config)
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [5, 3]}))
    assert tokenizers_lib.load_hf_tokenizer(str(directory)).stop_ids == (5, 3)
    (directory / "config.json").write_text(json.dumps({"eos_token_id": None,
                                                       "text_config": {"eos_token_id": 6}}))
    assert tokenizers_lib.load_hf_tokenizer(str(directory)).stop_ids == (6,)
    generation = directory / "generation_config.json"
    generation.write_text(json.dumps({"eos_token_id": 7}))
    assert tokenizers_lib.load_hf_tokenizer(str(directory)).stop_ids == (7,)
    generation.write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [9, 0, 7]}))
    tok = tokenizers_lib.load_hf_tokenizer(str(directory))
    assert tok.stop_ids == (9, 0, 7)
    saved = tmp_path / "saved"
    tok.save(str(saved))
    for other in (tokenizers_lib.load_tokenizer(str(saved)), pickle.loads(pickle.dumps(tok))):
        assert other.stop_ids == (9, 0, 7)
    assert inputs._tokenizer_identity(str(saved)) == inputs._tokenizer_identity(
        str(tmp_path / "plain"))
    (saved / "stop_ids.json").unlink()  # as a tokenizer saved before they were kept
    assert tokenizers_lib.load_tokenizer(str(saved)).stop_ids == ()
    for value, match in (("2", "has eos_token_id='2': expected a token id or a list of them"),
                         ([1, 4000], r"stop ids \[1, 4000\] \(the eos_token_id of "
                                     r"generation_config.json, or of config.json without one\): "
                                     r"expected ids of the tokenizer's vocabulary, in \[0, 400\)")):
        generation.write_text(json.dumps({"eos_token_id": value}))
        with pytest.raises(ValueError, match=match) as error:
            tokenizers_lib.load_hf_tokenizer(str(directory))
        assert "\n" not in str(error.value)


def test_documents_end_with_the_tokenizers_own_eos(gpt2_dir):
    tok = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir))
    docs = [sources.Document("a", TEXTS[0]), sources.Document("b", TEXTS[1])]
    corpus_ = windows.tokenize_documents(docs, tok)
    expected = [*tok.encode(TEXTS[0]), tok.eos_id, *tok.encode(TEXTS[1]), tok.eos_id]
    assert corpus_.read(0, len(corpus_)).tolist() == expected
    assert tok.eos_id != tokenizers_lib.EOS_ID  # not the project's fixed id


def test_bert_wordpiece_roles_and_sep_ends_documents(tmp_path):
    tok = tokenizers_lib.load_hf_tokenizer(str(bert_style(tmp_path)))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    roles = {r: getattr(tok, f"{r}_id") for r in ("pad", "unk", "cls", "sep", "mask")}
    assert roles == {r: auto.convert_tokens_to_ids(getattr(auto, f"{r}_token")) for r in roles}
    assert tok.bos_id is None and tok.eos_id == tok.sep_id  # BERT ends a segment with [SEP]
    assert set(tok.special_ids) == set(roles.values()) and tok.num_sentinels == 0
    assert tok.decode(tok.encode("Hear me speak")) == "hear me speak"  # lower-cased
    # MLM corruption never selects a special; [MASK] is the tokenizer's own.
    rows = np.stack([np.concatenate([tok.encode("before we proceed any further hear me"),
                                     [tok.sep_id]])[:8]] * 64)
    batch = {"tokens": rows, "tokens_segment_ids": np.ones_like(rows),
             "tokens_positions": np.zeros_like(rows)}
    corrupted = features.mlm_features(batch, np.random.default_rng(0), tokenizer=tok, rate=0.5)
    selected = corrupted["weights"] == 1
    assert selected.any() and not np.isin(rows[selected], tok.special_ids).any()
    assert (corrupted["inputs"][selected] == tok.mask_id).mean() > 0.6
    # padding (segment 0) is never selected, whatever its id: windows pad with id 0, a real
    # token of vocabularies whose [PAD] is elsewhere (ModernBERT's); here a word's id stands in
    word = int(tok.encode("hear")[0])
    assert word not in tok.special_ids
    batch["tokens"][:, 5:], batch["tokens_segment_ids"][:, 5:] = word, 0
    corrupted = features.mlm_features(batch, np.random.default_rng(0), tokenizer=tok, rate=0.5)
    assert corrupted["weights"][:, :5].any() and not corrupted["weights"][:, 5:].any()
    assert (corrupted["inputs"][:, 5:] == word).all()


def test_own_sentinels_of_a_t5_style_vocabulary(tmp_path):
    path = t5_style(tmp_path / "t5" / "tokenizer.json")
    tok = tokenizers_lib.load_hf_tokenizer(str(path))  # bare file: roles by well-known names
    library = tokenizers_hf.Tokenizer.from_file(str(path))
    size = library.get_vocab_size()
    assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.bos_id) == (0, 1, 2, None)
    assert tok.decoder_start_id == 0  # T5 starts its decoder with <pad>
    assert tok.num_sentinels == 5 and tok.vocab_size == size
    assert [tok.sentinel_id(i) for i in range(5)] == [
        library.token_to_id(f"<extra_id_{i}>") for i in range(5)]
    ids = tok.encode("to be <extra_id_1> or not")
    assert tok.sentinel_id(1) in ids.tolist()
    assert "<extra_id_1>" in tok.decode(ids)
    with pytest.raises(ValueError, match="its own 5 sentinels <extra_id_i>: expected 5"):
        tokenizers_lib.load_hf_tokenizer(str(path), num_sentinels=100)


def test_the_export_carries_appended_sentinels_as_special_tokens_at_their_ids(gpt2_dir,
                                                                             tmp_path):
    """A byte-level BPE with 5 sentinels appended (as a T5 run attaches them), saved and read
    back as train and export do, written by the export's `_tokenizer_files`: `AutoTokenizer`
    has the sentinels as additional special tokens at our ids, and every other text keeps its
    ids."""
    from transformer.export import _tokenizer_files

    tokenizers_lib.load_hf_tokenizer(str(gpt2_dir), num_sentinels=5).save(str(tmp_path / "w"))
    tok = tokenizers_lib.load_tokenizer(str(tmp_path / "w"))
    (out := tmp_path / "export").mkdir()
    _tokenizer_files(tok, str(out), "t5")
    auto = transformers.AutoTokenizer.from_pretrained(out)
    names = [f"<extra_id_{i}>" for i in range(5)]
    assert len(auto) == tok.vocab_size and set(names) <= set(auto.all_special_tokens)
    assert auto.convert_tokens_to_ids(names) == [tok.sentinel_id(i) for i in range(5)]
    ids = [tok.sentinel_id(0), *tok.encode("Romeo"), tok.sentinel_id(1), tok.sentinel_id(4)]
    assert auto.decode(ids) == tok.decode(ids) == "<extra_id_0>Romeo<extra_id_1><extra_id_4>"
    for i, name in enumerate(names):
        assert auto(name, add_special_tokens=False)["input_ids"] == [tok.sentinel_id(i)]
    library = tokenizers_hf.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in [t for t in TEXTS if "<extra_id" not in t] + corpus()[:50]:
        assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text).tolist()
        assert library.encode(text, add_special_tokens=False).ids == tok.encode(text).tolist()
        assert auto.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    # Read back, the export's sentinels are its own, at the same ids.
    again = tokenizers_lib.load_hf_tokenizer(str(out))
    assert (again.num_sentinels, again.sentinel_ids) == (5, tok.sentinel_ids)
    # The tokenizer's own additional special tokens stay, first.
    own = type(tok)(tok.tokenizer_json, tok.specials, 2,
                    settings={"additional_special_tokens": ["<|endoftext|>"]})
    assert own.hugging_face()[1]["additional_special_tokens"] == [
        "<|endoftext|>", "<extra_id_1>", "<extra_id_0>"]


def test_a_tokenizer_without_appended_sentinels_is_exported_unchanged(gpt2_dir, tmp_path):
    for tok in (tokenizers_lib.load_hf_tokenizer(str(gpt2_dir), num_sentinels=0),
                tokenizers_lib.load_hf_tokenizer(str(t5_style(tmp_path / "t5.json")))):
        tokenizer_json, config = tok.hugging_face()
        assert tokenizer_json == tok.tokenizer_json
        assert "additional_special_tokens" not in config


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(eos_token="<nope>"), "eos token '<nope>' is not in the tokenizer's"),
    (lambda c: c.update(pad_token={"content": "<also nope>"}), "pad token '<also nope>'"),
])
def test_a_role_naming_a_missing_token_is_a_one_line_error(gpt2_dir, tmp_path, change, match):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((gpt2_dir / "tokenizer.json").read_bytes())
    config = json.loads((gpt2_dir / "tokenizer_config.json").read_text())
    change(config)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match) as error:
        tokenizers_lib.load_hf_tokenizer(str(directory))
    assert "\n" not in str(error.value)


def test_a_role_no_file_names_comes_from_the_next_file_or_the_well_known_names(gpt2_dir,
                                                                              tmp_path):
    """GPT-2's hub tokenizer_config.json names no role ({"model_max_length": 1024}; its class
    makes <|endoftext|> bos, eos and unk): the roles come from special_tokens_map.json where it
    names them, else from the well-known names (for GPT-2 what AutoTokenizer's class gives).
    A role set to null stays unset."""
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((gpt2_dir / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    tok = tokenizers_lib.load_hf_tokenizer(str(directory))
    end = tok._tok.token_to_id("<|endoftext|>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (end, end, None)
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "pad_token": {"content": "<|endoftext|>"}}))
    tok = tokenizers_lib.load_hf_tokenizer(str(directory))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, end, end)


def test_a_directory_without_a_chat_template_is_read_without_transformers(gpt2_dir, tmp_path):
    """The roles AutoTokenizer's class would give matter only to a chat template: GPT-2's hub
    layout without one keeps the well-known roles (unnamed), and loading it, saving it and
    unpickling it never import transformers (a data-loading worker does not pay for it)."""
    import subprocess
    import sys

    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((gpt2_dir / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    script = ("import pickle, sys\n"
              "from transformer.data import tokenizers\n"
              f"tok = tokenizers.load_hf_tokenizer({str(directory)!r})\n"
              f"tok.save({str(tmp_path / 'saved')!r})\n"
              f"tokenizers.load_tokenizer({str(tmp_path / 'saved')!r})\n"
              "pickle.loads(pickle.dumps(tok))\n"
              "print(tok.specials['bos'], tok.specials['unk'], tok.unnamed, "
              "'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True).stdout
    assert out.split("\n")[-2] == "<|endoftext|> None ('bos', 'eos') False"


def test_token_bytes_are_each_tokens_own_bytes(gpt2_dir):
    """A byte-level token that is part of a character is its byte(s), not the "\ufffd" that
    decoding it alone gives (visualize labels tokens by these)."""
    from transformer.data.fast_bpe import byte_symbols

    tok = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir))
    assert [tok.token_bytes(tok._tok.token_to_id(symbol)) for symbol in byte_symbols()] == [
        bytes([b]) for b in range(256)]
    ids = tok.encode("café ☕ naïve")
    assert b"".join(tok.token_bytes(int(i)) for i in ids) == "café ☕ naïve".encode()


def hf_config(tokenizer_dir: Path, workdir_steps: int = 4):
    config = configs.experiment("gpt_tiny")
    config.update(steps=workdir_steps, batch_size=2, seq_len=16, log_every=1,
                  eval_every=workdir_steps, eval_steps=1, checkpoint_every=2)
    config.model.update(**TINY_MODEL)
    config.data.update(path=str(SHAKESPEARE), unit="stream", tokenizer="hf",
                       tokenizer_path=str(tokenizer_dir), num_sentinels=0)
    return config


@pytest.mark.slow
def test_a_run_trains_on_hf_ids_saves_the_tokenizer_and_refuses_another_on_resume(
        gpt2_dir, tmp_path):
    config = hf_config(gpt2_dir)
    workdir = tmp_path / "run"
    result = train.train_and_evaluate(config, str(workdir))
    tok = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir), num_sentinels=0)
    saved = tokenizers_lib.load_tokenizer(str(workdir / inputs.TOKENIZER_DIR))
    assert saved.kind == "hf" and saved.tokenizer_json == tok.tokenizer_json
    assert result["config"].model.vocab_size == tok.vocab_size
    # The training stream is the library's ids of the text, <|endoftext|> after it.
    batch = next(iter(inputs.get_dataset(result["config"], saved, "validation", num_epochs=1,
                                         shuffle=False)))
    text = SHAKESPEARE.read_text(encoding="utf-8")
    held_out = text[len(text) - round(len(text) * config.data.validation_fraction):]
    expected = tok.encode(held_out)
    assert set(batch["inputs"][0]) <= set(expected.tolist()) | {tok.eos_id}
    assert np.isfinite(result["summary"]["val_loss"])
    # Resuming with another tokenizer at data.tokenizer_path is refused before anything runs.
    other = gpt2_style(tmp_path / "other", vocab_size=350)
    config = hf_config(other, workdir_steps=6)
    with pytest.raises(ValueError, match="is not the tokenizer .* was trained with"):
        train.train_and_evaluate(config, str(workdir))


@pytest.mark.slow
def test_init_from_hf_takes_the_checkpoints_tokenizer_and_fine_tunes_and_generates(
        gpt2_dir, tmp_path):
    """A save_pretrained directory with weights and tokenizer: data.tokenizer='hf' reads the
    tokenizer from init_from, the weights load, and the workdir generates text."""
    from transformer.hf import convert

    checkpoint = tmp_path / "hf_gpt2"
    auto = transformers.AutoTokenizer.from_pretrained(gpt2_dir)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(auto), n_positions=32, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=auto.bos_token_id, eos_token_id=auto.eos_token_id))
    hf.save_pretrained(checkpoint)
    auto.save_pretrained(checkpoint)
    model_config, _ = convert.from_hf(hf.config, hf.state_dict())
    base = configs.experiment("gpt_tiny").model
    flags = [f"--config.model.{k}={v}" for k, v in model_config.items()
             if v is not None and v != base.get(k)]
    workdir = tmp_path / "finetuned"
    args = ["--config=experiments/gpt_tiny.py", f"--workdir={workdir}",
            f"--config.init_from=hf:{checkpoint}", "--config.data.tokenizer=hf",
            "--config.data.num_sentinels=0", f"--config.data.path={SHAKESPEARE}",
            "--config.data.unit=stream", *[f for f in tiny_flags(2) if ".model." not in f],
            *flags]
    result = run_cli("transformer.train", *args, logs=tmp_path)
    assert_succeeded(result)
    assert "init_from hf:" in result.stdout and "new 0" in result.stdout
    saved = tokenizers_lib.load_tokenizer(str(workdir / inputs.TOKENIZER_DIR))
    assert saved.tokenizer_json == (checkpoint / "tokenizer.json").read_text(encoding="utf-8")
    result = run_cli("transformer.generate", f"--workdir={workdir}", "--prompt=ROMEO:",
                     "--num_samples=1", logs=tmp_path)
    assert_succeeded(result)
    assert "ROMEO:" in result.stdout
    # The same directory with the project's byte tokenizer would read other ids: refused.
    args = [a for a in args if "data.tokenizer=" not in a] + ["--config.data.tokenizer=byte"]
    result = run_cli("transformer.train", *args[:1], f"--workdir={tmp_path / 'byte'}", *args[2:],
                     logs=tmp_path)
    assert result.returncode == 2
    assert "comes with its Hugging Face tokenizer: expected data.tokenizer='hf'" in result.stderr
    assert not (tmp_path / "byte").exists()


@pytest.mark.slow
def test_prepare_writes_token_shards_with_an_hf_tokenizer(gpt2_dir, tmp_path):
    counts = prepare.prepare(str(tmp_path / "prepared"), str(SHAKESPEARE), tokenizer="hf",
                             tokenizer_path=str(gpt2_dir), format="bin", unit="stream")
    tok = tokenizers_lib.load_tokenizer(str(tmp_path / "prepared"))
    assert counts["tokenizer"] == "hf" and tok.kind == "hf"
    config = hf_config(gpt2_dir)
    config.data.update(path=str(tmp_path / "prepared"), tokenizer_path="")
    corpus_ = inputs.corpus(config, tok, "train")
    text = SHAKESPEARE.read_text(encoding="utf-8")
    head = tok.encode(text[:2000])[:200]
    assert corpus_.read(0, 200).tolist() == head.tolist()
    with pytest.raises(ValueError, match="expected a path exactly with tokenizer='hf'"):
        prepare.prepare(str(tmp_path / "x"), str(SHAKESPEARE), tokenizer="hf")


def test_span_corruption_on_prepared_data_needs_its_tokenizers_sentinels(gpt2_dir, tmp_path):
    """A prepared directory's tokenizer keeps its own sentinels (data.num_sentinels left at
    its default takes them): a GPT-2 vocabulary has none, so span corruption marked its spans
    with the ids of real tokens. The run stops in one line before anything is written."""
    prepare.prepare(str(tmp_path / "prepared"), str(SHAKESPEARE), tokenizer="hf",
                    tokenizer_path=str(gpt2_dir), validation_fraction=0.2)
    workdir = tmp_path / "run"
    result = run_cli("transformer.train", "--config=experiments/t5_span.py",
                     f"--workdir={workdir}", *tiny_flags(2, family="t5"),
                     f"--config.data.path={tmp_path / 'prepared'}", "--config.data.tokenizer=hf",
                     "--config.seq_len=64", logs=tmp_path / "logs")
    assert result.returncode == 2, describe(result)
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the tokenizer has 0 sentinels: span corruption of seq_len=64 makes 3 noise spans "
        "a row (data.noise_density=0.15, data.mean_span_length=3.0), each its own sentinel: "
        "expected a tokenizer with sentinels (data.num_sentinels, or a T5 tokenizer's "
        "<extra_id_i>) >= 3, or a smaller seq_len or noise_density")
    assert not (workdir / "checkpoints").exists()


def test_an_eval_length_past_a_prepared_tokenizers_sentinels_is_skipped_and_named(tmp_path):
    """The validation lengths a span-corruption run evaluates at are checked against the
    sentinels of the tokenizer it reads (a prepared directory's 5), as its seq_len is: a longer
    one is skipped (or refused by evaluate) before anything runs, named as eval_seq_len."""
    from transformer.training import evaluation, startup

    path = t5_style(tmp_path / "t5" / "tokenizer.json")
    prepare.prepare(str(tmp_path / "prepared"), str(SHAKESPEARE), tokenizer="hf",
                    tokenizer_path=str(path), validation_fraction=0.2)
    config = configs.experiment("t5_span")
    config.data.update(path=str(tmp_path / "prepared"), tokenizer="hf")
    config.update(seq_len=64, eval_seq_lens=(64, 512))
    tokenizer = inputs.get_tokenizer(config)
    assert tokenizer.num_sentinels == 5 and config.data.num_sentinels == 100
    assert startup.evaluable(config, 64, tokenizer) and startup.evaluable(config, 512)
    assert not startup.evaluable(config, 512, tokenizer)
    with pytest.raises(ValueError) as error:
        evaluation.check_eval_seq_len(config, 512, tokenizer)
    assert str(error.value).startswith("the tokenizer has 5 sentinels: span corruption of "
                                       "eval_seq_len=512 makes 28 noise spans a row")


@pytest.mark.slow
def test_nanogpt_train_bin_and_val_bin_as_data_path(gpt2_dir, tmp_path):
    """nanoGPT's prepared layout (train.bin, val.bin: raw uint16 ids) trains as data.path with
    the tokenizer it was written with; ids past that tokenizer are refused before any step."""
    tok = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir))
    text = SHAKESPEARE.read_text(encoding="utf-8")
    split = int(len(text) * 0.9)
    data = tmp_path / "shakespeare"
    data.mkdir()
    for name, part in (("train", text[:split]), ("val", text[split:])):
        shards.write_token_shards(str(data / name), [tok.encode(part)], format="nanogpt")
    config = hf_config(gpt2_dir)
    config.data.path = str(data)
    result = train.train_and_evaluate(config, str(tmp_path / "run"))
    validation = inputs.corpus(result["config"], tok, "validation")
    assert validation.read(0, len(validation)).tolist() == tok.encode(text[split:]).tolist()
    assert np.isfinite(result["summary"]["val_loss"])

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.bin").write_bytes((data / "train.bin").read_bytes())
    ids = np.fromfile(data / "val.bin", "<u2")
    ids[5] = tok.vocab_size + 7
    ids.tofile(bad / "val.bin")
    args = ["--config=experiments/gpt_tiny.py", f"--workdir={tmp_path / 'bad_run'}",
            f"--config.data.path={bad}", "--config.data.tokenizer=hf",
            f"--config.data.tokenizer_path={gpt2_dir}", "--config.data.num_sentinels=0",
            *tiny_flags(2)]
    result = run_cli("transformer.train", *args, logs=tmp_path)
    assert result.returncode != 0
    assert f"val.bin holds token id {tok.vocab_size + 7}: expected ids < the tokenizer's " \
        f"vocab_size {tok.vocab_size}" in result.stderr
    assert not (tmp_path / "bad_run").exists()
    result = run_cli("transformer.train", *args[:2], f"--config.data.path={data}", *tiny_flags(2),
                     logs=tmp_path)
    assert result.returncode == 2 and "holds token shards (*.bin): expected data.tokenizer='hf'" \
        in result.stderr
    config = hf_config(gpt2_dir)
    config.data.update(path=str(data), validation_path=str(SHAKESPEARE))
    with pytest.raises(ValueError, match="their \\*val\\*.bin files are the validation split"):
        configs.validate_config(config)


@pytest.mark.parametrize("data,match", [
    (dict(tokenizer="hf"), "data.tokenizer='hf' without data.tokenizer_path"),
    (dict(tokenizer="byte", tokenizer_path="{dir}"), "expected data.tokenizer='hf'"),
    (dict(tokenizer="hf", tokenizer_path="{dir}/nope"), "expected a Hugging Face tokenizer"),
    (dict(tokenizer="hf", tokenizer_path="{dir}", vocab_size=500),
     "data.vocab_size=500: expected 0 with data.tokenizer='hf'"),
])
def test_hf_tokenizer_settings_are_checked_before_anything_runs(gpt2_dir, tmp_path,
                                                                monkeypatch, data, match):
    # A tokenizer.json in the working directory must not stand in for a missing path.
    (tmp_path / "tokenizer.json").write_bytes((gpt2_dir / "tokenizer.json").read_bytes())
    monkeypatch.chdir(tmp_path)
    config = configs.base_config()
    config.data.update({k: v.format(dir=gpt2_dir) if isinstance(v, str) else v
                        for k, v in data.items()})
    with pytest.raises((ValueError, FileNotFoundError), match=match) as error:
        configs.validate_config(config)
    assert "\n" not in str(error.value)


def test_a_fine_tune_of_an_import_reads_each_document_as_transformers_tokenizes_it(
        gpt2_dir, tmp_path):
    """init_from=hf:DIR whose tokenizer puts a BOS before a text (Llama 3's template): every
    training and validation document is `AutoTokenizer(text).input_ids` then <eos>, as a
    transformers fine-tune reads it and as generation reads a prompt; the stream records it (a
    checkpoint trained without it resumes on it only under new_data=True), and prepared data
    gives the same documents and bits per byte. GPT-2's template (nothing first) and a run
    from scratch read the text alone."""
    from test_sft import LLAMA3, build_tokenizer

    from transformer.training.checkpoint_manager import stream_differences

    llama = build_tokenizer(tmp_path / "llama", LLAMA3)
    tok = tokenizers_hf.Tokenizer.from_file(str(llama / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = tokenizers_hf.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(llama / "tokenizer.json"))
    text = tmp_path / "notes.txt"  # paragraphs of uneven lengths
    text.write_text("\n\n".join(" ".join(corpus()[i:i + 1 + i % 7]) for i in range(0, 240, 3)),
                    encoding="utf-8")
    config = hf_config(llama)
    config.update(init_from=f"hf:{llama}")
    config.data.update(path=str(text), unit="paragraph", tokenizer_path="",
                       validation_fraction=0.2)
    ours = tokenizers_lib.load_hf_tokenizer(str(llama))
    auto = transformers.AutoTokenizer.from_pretrained(llama)

    def documents(config, split, tokenizer=ours):
        tokens = inputs.corpus(config, tokenizer, split)
        ends = [*tokens.doc_starts[1:], len(tokens)]
        return [tokens.read(a, b).tolist() for a, b in zip(tokens.doc_starts, ends, strict=True)]

    for split in ("train", "validation"):
        texts = [d.text for d in inputs._documents(config, split)]
        expected = [auto(t)["input_ids"] + [ours.eos_id] for t in texts]
        assert expected[0][0] == bos and documents(config, split) == expected, split
    assert inputs.data_stream(config)[inputs.DOCUMENT_START] == [bos]
    saved = {k: v for k, v in inputs.data_stream(config).items() if k != inputs.DOCUMENT_START}
    assert stream_differences(saved, inputs.data_stream(config)) == [
        f"document_start: checkpoint None, config [{bos}]"]
    prepare.prepare(str(tmp_path / "prepared"), str(text), tokenizer="hf",
                    tokenizer_path=str(llama), validation_fraction=0.2)
    prepared = hf_config(llama)
    prepared.update(init_from=f"hf:{llama}")
    prepared.data.update(path=str(tmp_path / "prepared"), unit="paragraph", tokenizer_path="")
    for split in ("train", "validation"):
        assert sorted(documents(prepared, split)) == sorted(documents(config, split)), split
        assert inputs.bytes_per_token(prepared, ours, split) == pytest.approx(
            inputs.bytes_per_token(config, ours, split), rel=1e-12), split
    # .bin shards are ids already: nothing goes before their documents, nothing is recorded;
    # a mixture records each source's
    prepare.prepare(str(tmp_path / "bin"), str(text), tokenizer="hf", tokenizer_path=str(llama),
                    validation_fraction=0.2, format="bin")
    prepared.data.path = str(tmp_path / "bin")
    assert inputs.DOCUMENT_START not in inputs.data_stream(prepared)
    mixture = hf_config(llama)
    mixture.update(init_from=f"hf:{llama}")
    mixture.data.update(path="", tokenizer_path="", sources=(
        f"name=text,path={text},weight=0.5", f"name=ids,path={tmp_path / 'bin'},weight=0.5"))
    assert inputs.data_stream(mixture)[inputs.DOCUMENT_START] == {"text": [bos]}
    # evaluate reads the run's saved tokenizer: the source directory may be gone
    (llama / "tokenizer.json").rename(tmp_path / "moved.json")
    assert inputs.data_stream(config, ours)[inputs.DOCUMENT_START] == [bos]
    (tmp_path / "moved.json").rename(llama / "tokenizer.json")
    # GPT-2's template puts nothing first; a run from scratch reads no BOS either
    gpt2 = tokenizers_lib.load_hf_tokenizer(str(gpt2_dir))
    config.update(init_from=f"hf:{gpt2_dir}")
    texts = [d.text for d in inputs._documents(config, "train")]
    assert documents(config, "train", gpt2) == [gpt2.encode(t).tolist() + [gpt2.eos_id]
                                                for t in texts]
    config.update(init_from="")
    config.data.tokenizer_path = str(llama)
    assert documents(config, "train") == [ours.encode(t).tolist() + [ours.eos_id]
                                          for t in texts]
    assert inputs.DOCUMENT_START not in inputs.data_stream(config)
