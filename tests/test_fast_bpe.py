"""Byte-level BPE through tiktoken (transformer.data.fast_bpe): for GPT-2-, Llama 3- and
Qwen 2-shaped tokenizer.json files trained here, `HFTokenizer.encode_batch` takes the tiktoken
path and gives exactly the `tokenizers` library's ids, added tokens inside documents included;
any other shape, and any disagreement its checks find, keeps to `tokenizers`."""

import json
from pathlib import Path

import numpy as np
import pytest

tokenizers_hf = pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")
pytest.importorskip("transformers")

from test_hf_tokenizers import TEXTS, bert_style, corpus, gpt2_style  # noqa: E402

from transformer.data import fast_bpe  # noqa: E402
from transformer.data import tokenizers as tokenizers_lib  # noqa: E402
from transformer.data.hf_tokenizer import HFTokenizer  # noqa: E402

# Llama 3's and Qwen 2's split (cl100k's), as their tokenizer.json files spell it
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
         r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DOCUMENTS = TEXTS + corpus()[:300] + [
    fast_bpe.PROBE,
    "an <|endoftext|> typed inside a document, and <|end_of_text|>, <think>x</think>",
    "decomposed e\u0301 and A\u030a, composed \u00e9 \u00c5, \u212b (the Angstrom sign)",
    "Ünïcödé " * 50, "\n" * 7, " ", "digits 1234567 and 12 345",
]


def split_style(path: Path, nfc: bool) -> str:
    """A Llama 3-shaped tokenizer.json (Split regex, then ByteLevel without its own regex;
    with `nfc`, Qwen 2's NFC normalizer too), trained on the corpus, with added tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus() + [d for d in DOCUMENTS if "<" not in d],
                            trainers.BpeTrainer(vocab_size=700, special_tokens=[
                                "<|begin_of_text|>", "<|end_of_text|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["<think>", "</think>"])  # added, not special (Qwen 3's)
    tok.save(str(path))
    return path.read_text()


@pytest.fixture(scope="module")
def tokenizer_jsons(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast_bpe")
    return {"gpt2": (gpt2_style(root / "gpt2") / "tokenizer.json").read_text(),
            "llama3": split_style(root / "llama3.json", nfc=False),
            "qwen2": split_style(root / "qwen2.json", nfc=True)}


def reference_ids(tokenizer_json: str, texts) -> list[list[int]]:
    library = tokenizers_hf.Tokenizer.from_str(tokenizer_json)
    return [library.encode(t, add_special_tokens=False).ids for t in texts]


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "qwen2"])
def test_tiktoken_gives_the_tokenizers_ids_of_byte_level_bpe_files(tokenizer_jsons, kind):
    tok = HFTokenizer(tokenizer_jsons[kind], {})
    ids = tok.encode_batch(DOCUMENTS)
    assert tok.fast_bpe_skipped == "" and isinstance(tok._fast, fast_bpe.TiktokenBPE)
    assert [i.tolist() for i in ids] == reference_ids(tokenizer_jsons[kind], DOCUMENTS)
    assert all(i.dtype == np.int32 for i in ids)
    assert [i.tolist() for i in tok.encode_batch(DOCUMENTS[::-1])] == [
        i.tolist() for i in ids[::-1]]  # later batches too


def edited(tokenizer_json: str, edit) -> str:
    spec = json.loads(tokenizer_json)
    edit(spec)
    return json.dumps(spec)


def swap_two_merges(spec):
    merges = spec["model"]["merges"]
    merges[10], merges[11] = merges[11], merges[10]


def a_token_made_by_another_pair(spec):
    """Three tokens over bytes 1, 2, 3 (spelled chr(257), ...): [2 3], [1 2], then [12 3].
    BPE reads bytes 1, 2, 3 as 1 and 23, which is not a listed pair; tiktoken merges any
    neighbours that make a token, and reads them as 123."""
    model = spec["model"]
    top = max(model["vocab"].values())
    one, two, three = (chr(256 + b) for b in (1, 2, 3))
    for k, (a, b) in enumerate([(two, three), (one, two), (one + two, three)]):
        model["vocab"][a + b] = top + 1 + k
        model["merges"].append(f"{a} {b}" if isinstance(model["merges"][0], str) else [a, b])


@pytest.mark.parametrize("edit, why", [
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "the normalizer is Lowercase"),
    (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "the pre-tokenizer"),
    (lambda s: s["model"].update(dropout=0.1), "not a plain byte-level BPE"),
    (swap_two_merges, "does not make the next token in id order"),
    (a_token_made_by_another_pair, "BPE does not rebuild token"),
])
def test_other_shapes_keep_to_tokenizers_and_say_why(tokenizer_jsons, edit, why):
    changed = edited(tokenizer_jsons["gpt2"], edit)
    tok = HFTokenizer(changed, {})
    texts = DOCUMENTS[:40] + ["bytes 1, 2, 3: \x01\x02\x03"]
    if not json.loads(changed)["model"].get("dropout"):  # dropout samples: no two agree
        assert [i.tolist() for i in tok.encode_batch(texts)] == reference_ids(changed, texts)
    else:
        tok.encode_batch(texts)
    assert tok._fast is False and why in tok.fast_bpe_skipped


def test_an_added_token_typed_decomposed_goes_to_tokenizers(tokenizer_jsons):
    """An added token with normalized=True matches the NFC text: "A\u030angström" holds
    "Ångström" for Qwen 2's NFC normalizer, so the text is not tiktoken's to encode."""
    def add(spec):
        spec["added_tokens"].append({
            "id": max(spec["model"]["vocab"].values()) + 10, "content": "\u00c5ngstr\u00f6m",
            "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
            "special": False})

    changed = edited(tokenizer_jsons["qwen2"], add)
    tok = HFTokenizer(changed, {})
    texts = ["a plain text"] * 3 + ["A\u030angstr\u00f6m ring", "\u00c5ngstr\u00f6m"]
    assert [i.tolist() for i in tok.encode_batch(texts)] == reference_ids(changed, texts)
    assert isinstance(tok._fast, fast_bpe.TiktokenBPE)


def test_wordpiece_keeps_to_tokenizers(tmp_path):
    tok = tokenizers_lib.load_hf_tokenizer(str(bert_style(tmp_path)))
    tok.encode_batch(TEXTS)
    assert tok._fast is False and "not a plain byte-level BPE" in tok.fast_bpe_skipped


def test_a_difference_on_the_probe_or_the_first_batch_falls_back(tokenizer_jsons, monkeypatch):
    text = tokenizer_jsons["llama3"]
    library = tokenizers_hf.Tokenizer.from_str(text)
    fast, _ = fast_bpe.tiktoken_encoder(text, library)
    real = fast_bpe.TiktokenBPE.encode
    # one id off on texts holding a "Z": the probe holds none, so only the batch check sees it
    monkeypatch.setattr(fast_bpe.TiktokenBPE, "encode",
                        lambda self, t: real(self, t) + ("Z" in t))
    tok = HFTokenizer(text, {})
    texts = DOCUMENTS[:5] + ["Zounds!"]
    assert [i.tolist() for i in tok.encode_batch(texts)] == reference_ids(text, texts)
    assert tok._fast is False and "encoded a document differently" in tok.fast_bpe_skipped
    monkeypatch.setattr(fast_bpe.TiktokenBPE, "encode", lambda self, t: real(self, t) + 1)
    assert fast_bpe.tiktoken_encoder(text, library) == (None, "tiktoken and tokenizers split "
                                                              "the probe text differently")
    assert fast is not None


def test_the_first_batch_check_encodes_only_a_prefix_of_a_long_text(tokenizer_jsons,
                                                                    monkeypatch):
    """The check used to encode whole documents through `tokenizers` (a --unit=stream text:
    its whole Encoding in memory)."""
    text = tokenizer_jsons["gpt2"]
    monkeypatch.setattr(fast_bpe, "_CHECKED_CHARS", 500)
    tok = HFTokenizer(text, {})
    assert tok.encoder == "tiktoken"
    checked = []
    reference = tok._encode_batch
    monkeypatch.setattr(tok, "_encode_batch", lambda texts: checked.extend(texts) or
                        reference(texts))
    texts = ["".join(DOCUMENTS[5:200]), DOCUMENTS[3]]
    assert [i.tolist() for i in tok.encode_batch(texts)] == reference_ids(text, texts)
    assert checked == [texts[0][:500], DOCUMENTS[3]] and tok._fast
