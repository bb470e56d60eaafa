"""Pretraining corpora as researchers hold them (transformer.data.formats): Parquet, JSON Lines
(plain, gzip, zstd) and `datasets` save_to_disk directories give the same documents as each
other, through data.path and prepare; bad rows and corrupt files are one line naming the file and
the row."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from test_cli import assert_one_line_error
from test_inputs import config_for, take
from test_train import REPO, cli_env, describe

import transformer.data
from transformer.data import inputs, prepare, prepare_units, sources
from transformer.data import shards as shards_lib
from transformer.data import tokenizers as tokenizers_lib


def web_documents(count: int = 240, seed: int = 0) -> list[str]:
    """FineWeb-like rows: uneven lengths (a word to a few paragraphs), unicode, blank lines
    inside a document, and an empty row (which gives no document)."""
    rng = random.Random(seed)
    words = "the of model data token ä ñ 漢字 attention layer — train loss".split()
    docs = []
    for k in range(count):
        paragraphs = ["".join(rng.choice(words) + " " for _ in range(rng.randint(1, 60)))
                      for _ in range(rng.choice([1, 1, 2, 4]))]
        docs.append("\n\n".join(p.strip() for p in paragraphs) + ("\n" if k % 3 else ""))
    docs[7] = ""
    return docs


def write_parquet(path, texts, field: str = "text", row_group_size: int = 50) -> str:
    table = pa.table({"id": [f"<urn:{k}>" for k in range(len(texts))], field: texts,
                      "score": np.linspace(0, 1, len(texts))})
    pq.write_table(table, path, row_group_size=row_group_size)  # several row groups
    return str(path)


def write_jsonl(path, texts, field: str = "text") -> str:
    lines = "".join(json.dumps({"id": k, field: t, "meta": {"lang": "en"}}) + "\n"
                    + ("\n" if k == 3 else "")  # a blank line, as some dumps have
                    for k, t in enumerate(texts)).encode()
    if str(path).endswith(".gz"):
        lines = gzip.compress(lines)
    elif str(path).endswith(".zst"):
        lines = zstandard.ZstdCompressor().compress(lines)
    path.write_bytes(lines)
    return str(path)


def write_dataset(path, texts, field: str = "text") -> str:
    import datasets

    datasets.Dataset.from_dict({field: texts, "id": list(range(len(texts)))}).save_to_disk(
        str(path), max_shard_size="20KB")  # several Arrow files
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The same documents in every format, each in its own folder."""
    root, texts = tmp_path_factory.mktemp("corpora"), web_documents()
    paths = {
        "parquet": write_parquet(root / "shard.parquet", texts),
        "jsonl": write_jsonl(root / "shard.jsonl", texts),
        "jsonl.gz": write_jsonl(root / "shard.jsonl.gz", texts),
        "jsonl.zst": write_jsonl(root / "shard.jsonl.zst", texts),
        "datasets": write_dataset(root / "saved", texts),
        "json": write_json(root / "shard.json", texts),
    }
    return paths, texts


def write_json(path, texts) -> str:
    """JSON Lines named .json, as `datasets.Dataset.to_json` writes them by default."""
    import datasets

    datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).to_json(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "jsonl.gz", "jsonl.zst", "datasets",
                                  "json"])
def test_every_format_gives_one_document_per_row_named_by_its_row(corpora, kind):
    paths, texts = corpora
    docs = sources.read_text(paths[kind])
    assert [d.text for d in docs] == [t for t in texts if t.strip()]
    assert [d.name for d in docs] == [f"{paths[kind]}#{k}" for k, t in enumerate(texts)
                                      if t.strip()]
    for unit in ("file", "stream"):  # rows are documents whatever the unit
        assert [d.text for d in sources.read_text(paths[kind], split=unit)] == \
            [d.text for d in docs]


def test_the_splits_are_the_texts_splits_and_a_glob_reads_shards_in_order(corpora, tmp_path):
    paths, texts = corpora
    kept = [t for t in texts if t.strip()]
    folder = tmp_path / "texts"  # a file per document: the same texts as plain text
    folder.mkdir()
    for k, t in enumerate(kept):
        (folder / f"{k:04d}.txt").write_text(t)
    for split in sources.SPLITS:
        expected = [d.text for d in sources.load_documents(str(folder), split, unit="file")]
        for kind in ("parquet", "jsonl.zst", "datasets"):
            got = sources.load_documents(paths[kind], split)
            assert [d.text for d in got] == expected, (kind, split)
    # Two shards of one corpus, as FineWeb ships them: a glob reads them in sorted order.
    write_parquet(tmp_path / "000_00000.parquet", texts[:100])
    write_parquet(tmp_path / "000_00001.parquet", texts[100:])
    assert [d.text for d in sources.read_text(str(tmp_path / "*.parquet"))] == kept


def test_text_field_names_the_column_and_a_mixture_source_may_set_its_own(tmp_path):
    texts = web_documents(40)
    code = write_jsonl(tmp_path / "code.jsonl", texts, field="content")  # The Stack's field
    with pytest.raises(ValueError) as error:
        sources.read_text(code)
    assert str(error.value) == (
        f"{code}: row 0 (line 1) has no 'text' field (it has ['content', 'id', 'meta']): "
        "expected data.text_field to name the field that holds the text")
    assert len(sources.read_text(code, text_field="content")) == 39
    web = write_parquet(tmp_path / "web.parquet", texts)
    config = ml_collections.ConfigDict({"data": {
        "path": "", "unit": "paragraph", "validation_path": "", "text_field": "text",
        "sources": (f"path={web},weight=0.7", f"path={code},weight=0.3,text_field=content")}})
    fields = {name: c.data.text_field for name, c in inputs.source_configs(config).items()}
    assert fields == {"web": "text", "code": "content"}
    assert sources.canonical_source(f"path={code},weight=0.30,text_field=content") == \
        f"path={code},weight=0.3,text_field=content"


def test_the_data_stream_names_a_text_field_other_than_the_default(tmp_path):
    path = write_parquet(tmp_path / "web.parquet", web_documents(40))
    config = ml_collections.ConfigDict({
        "batch_size": 2, "seq_len": 16, "seed": 0, "model": {"family": "gpt"},
        "data": {"path": path, "unit": "paragraph", "validation_path": "", "sources": (),
                 "text_field": "text", "objective": "next_token"}})
    default = inputs.data_stream(config)
    assert "text_field" not in default["data"]  # as a checkpoint saved before the key
    config.data.text_field = "body"
    assert inputs.data_stream(config)["data"]["text_field"] == "body"
    write_parquet(tmp_path / "web.parquet", web_documents(40, seed=1))
    config.data.text_field = "text"
    assert inputs.data_stream(config)["fingerprint"] != default["fingerprint"]


def test_prepare_gives_the_same_shards_from_every_format(corpora, tmp_path):
    paths, _ = corpora
    shards = {}
    for kind in ("parquet", "jsonl.gz", "datasets"):
        out = tmp_path / kind
        counts = prepare.prepare(str(out), paths[kind], tokenizer="byte", num_shards=2)
        assert counts["train"]["documents"] + counts["validation"]["documents"] == 239
        shards[kind] = {p.name: p.read_bytes() for p in sorted(out.glob("*.array_record"))}
    assert shards["parquet"] == shards["jsonl.gz"] == shards["datasets"]


def row_error(path, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        sources.read_text(str(path), **kwargs)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_bad_rows_and_corrupt_files_are_one_line_naming_the_file_and_row(tmp_path):
    texts = web_documents(60)
    lines = write_jsonl(tmp_path / "a.jsonl", texts)
    broken = (tmp_path / "a.jsonl").read_text().splitlines()
    broken[11] = '{"id": 10, "text": 42}'  # line 12 (a blank line after row 3): row 10
    (tmp_path / "a.jsonl").write_text("\n".join(broken) + "\n")
    assert row_error(lines) == (f"{lines}: row 10: text=42 is int: expected a string of text")
    broken[11] = '{"id": 10, "text": "cut'
    (tmp_path / "a.jsonl").write_text("\n".join(broken) + "\n")
    assert row_error(lines).startswith(f"{lines}: row 10 (line 12): not JSON (")

    nulls = write_parquet(tmp_path / "b.parquet", texts[:30] + [None] + texts[30:])
    assert row_error(nulls) == f"{nulls}: row 30: text=None is NoneType: expected a string of text"
    assert row_error(nulls, text_field="body").startswith(
        f"{nulls}: no 'body' column (it has ['id', 'text', 'score'])")
    numbers = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": list(range(5))}), numbers)
    assert row_error(numbers) == (f"{numbers}: row 0: the 'text' column holds int64: expected "
                                  "strings of text")

    truncated = tmp_path / "d.jsonl.gz"
    whole = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    truncated.write_bytes(whole[:len(whole) // 2])  # a download cut short
    assert row_error(truncated).startswith(f"{truncated}: unreadable after row ")
    zst = tmp_path / "e.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage" * 10)
    assert row_error(zst).startswith(f"{zst}: unreadable after row 0 (line 0)")
    # Cut short where a block ends (zstd's stream reader takes that for the end of the file)
    rows = "".join(json.dumps({"text": f"{k:05d} " + "word " * 24}) + "\n" for k in range(20000))
    assert len(rows) == 20000 * 139
    whole = zstandard.ZstdCompressor().compress(rows.encode())
    zst.write_bytes(whole[:len(whole) * 6 // 10])
    assert row_error(zst).startswith(f"{zst}: unreadable after row ")
    assert "the file ends inside a zstd frame (truncated)" in row_error(zst)
    (tmp_path / "g.jsonl.zst").write_bytes(whole + zstandard.ZstdCompressor().compress(
        b'{"text": "a second frame"}\n'))  # frames one after another: one file
    assert sources.read_text(str(tmp_path / "g.jsonl.zst"))[-1].text == "a second frame"
    corrupt = tmp_path / "f.parquet"
    corrupt.write_bytes((tmp_path / "b.parquet").read_bytes()[:-300])
    assert row_error(corrupt).startswith(f"{corrupt}: unreadable Parquet (")


def test_one_json_document_is_named_as_such_and_a_bom_is_skipped(tmp_path):
    """An indented JSON file beside the corpus (the Hub's dataset_infos.json) is one document,
    not a broken first row; a JSON Lines file may start with a UTF-8 byte-order mark."""
    (tmp_path / "hub").mkdir()
    write_parquet(tmp_path / "hub" / "shard.parquet", ["a row"])
    infos = tmp_path / "hub" / "dataset_infos.json"
    infos.write_text(json.dumps({"default": {"features": {"text": "string"}}}, indent=2))
    assert row_error(tmp_path / "hub") == (
        f"{infos}: one JSON document, not JSON Lines (one record a line): expected JSON Lines; "
        "if it is not corpus, point data.path at the corpus files alone (a glob)")
    # ... on one line, as datasets writes it (and a JSON array, as to_json(lines=False) does)
    infos.write_text(json.dumps({"default": {"features": {"text": "string"}}}))
    assert row_error(tmp_path / "hub") == (
        f"{infos}: row 0 (line 1) has no 'text' field (it has ['default']): expected "
        "data.text_field to name the field that holds the text; if the file is not corpus (one "
        "JSON document, such as dataset_infos.json), point data.path at the corpus files alone "
        "(a glob)")
    infos.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert row_error(tmp_path / "hub").startswith(
        f"{infos}: one JSON document (list), not JSON Lines (one record a line): ")
    one_row = write_jsonl(tmp_path / "one.jsonl", ["a row"], field="content")  # a corpus
    assert row_error(one_row).endswith("(a glob)") and "row 0 (line 1)" in row_error(one_row)
    cut = tmp_path / "cut.jsonl"  # a broken first line is still not JSON
    cut.write_text('{"text": "cut\n{"text": "b"}\n')
    assert row_error(cut).startswith(f"{cut}: row 0 (line 1): not JSON (")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    assert [d.text for d in sources.read_text(str(bom))] == ["first", "second"]


def test_text_that_is_not_unicode_is_one_line_naming_the_file_and_row(tmp_path):
    texts = [f"row {k} " + "mot " * (k % 40) for k in range(3000)]
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    latin1 = tmp_path / "a.jsonl"  # one Latin-1 byte deep in the file, past the read-ahead
    latin1.write_bytes(data.replace(b'"row 2500 ', b'"row 2500 \xe9', 1))
    assert row_error(latin1) == (f"{latin1}: row 2500 (line 2501): invalid UTF-8 at byte 19 of "
                                 "the line: expected UTF-8 text")
    surrogate = tmp_path / "b.jsonl"  # valid JSON, but no text: a lone surrogate escape
    surrogate.write_text('{"text": "\\ud83d\\ude00 a pair"}\n{"text": "one \\ud800 alone"}\n')
    assert row_error(surrogate) == (f"{surrogate}: row 1: text holds '\\ud800' at character 4, "
                                    "a lone surrogate: expected valid Unicode text")
    parquet = tmp_path / "c.parquet"  # Arrow checks no UTF-8 when it writes binary as string
    values = [t.encode() for t in texts[:90]] + [b"caf\xe9"] + [t.encode() for t in texts[90:99]]
    pq.write_table(pa.table({"text": pa.array(values, pa.binary()).view(pa.string())}), parquet,
                   row_group_size=40)
    assert row_error(parquet) == (f"{parquet}: row 90: text holds invalid UTF-8 at byte 3: "
                                  "expected UTF-8 text")


def test_a_dataset_dict_is_refused_naming_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["a b", "c d"]}),
        "test": datasets.Dataset.from_dict({"text": ["e f"]})}).save_to_disk(str(tmp_path / "dd"))
    assert row_error(tmp_path / "dd") == (
        f"{tmp_path / 'dd'}: a DatasetDict of splits ['test', 'train']: expected one split's "
        f"directory (e.g. {tmp_path / 'dd' / 'test'})")
    for covering in (f"{tmp_path / 'dd'}/*", str(tmp_path)):  # a glob, a folder above it
        assert row_error(covering) == (
            f"{tmp_path / 'dd'}: a DatasetDict of splits ['test', 'train']: expected one "
            f"split's directory (e.g. {tmp_path / 'dd' / 'test'})")
    assert [d.text for d in sources.read_text(str(tmp_path / "dd" / "train"))] == ["a b", "c d"]


# --- prepare: a unit of work per input file, resumable -----------------------------------------


def uneven_inputs(root) -> str:
    """Input files of uneven sizes in every format, one without text, as one folder: 6 units."""
    folder, texts = root / "inputs", web_documents(200, seed=2)
    folder.mkdir()
    write_parquet(folder / "a.parquet", texts[:110])
    write_jsonl(folder / "b.jsonl.gz", texts[110:113])
    (folder / "c.txt").write_text("\n\n".join(texts[113:150]))
    (folder / "d.txt").write_text("  \n\n")  # no documents at all
    write_jsonl(folder / "e.jsonl.zst", texts[150:151])
    write_dataset(folder / "f", texts[151:])
    return str(folder)


def test_prepared_data_keeps_its_validation_split_and_the_runs_tokenizer(tmp_path):
    """A validation_path beside prepared data is refused (it would be ignored), and so is a
    resume with new_data=True, or an init_from, whose run tokenized with another tokenizer
    than the one the prepared ids are of."""
    from transformer import configs

    (tmp_path / "a.txt").write_text("\n\n".join(web_documents(80, seed=3)))
    (tmp_path / "b.txt").write_text("\n\n".join(web_documents(80, seed=4)).upper())
    for name in ("a", "b"):  # char tokenizers of two texts: other ids for the same letters
        prepare.prepare(str(tmp_path / f"prepared_{name}"), str(tmp_path / f"{name}.txt"),
                        tokenizer="char", format="bin", validation_fraction=0.2)
    config = config_for(tmp_path / "prepared_a", tokenizer="char",
                        validation_path=str(tmp_path / "b.txt"))
    with pytest.raises(ValueError) as error:
        configs.validate_config(config)
    assert str(error.value) == (
        f"data.validation_path={str(tmp_path / 'b.txt')!r} with the prepared data at data.path="
        f"{str(tmp_path / 'prepared_a')!r}: expected '' (it holds its own validation split, "
        "prepare's --validation_fraction)")

    config = config_for(tmp_path / "prepared_a", tokenizer="char")
    config.new_data = True
    for name in ("a", "b"):  # workdirs trained on each prepared directory
        inputs.save_tokenizer(tokenizers_lib.load_tokenizer(str(tmp_path / f"prepared_{name}")),
                              str(tmp_path / f"run_{name}"))
    assert inputs.get_tokenizer(config, str(tmp_path / "run_a")).vocab_size == \
        tokenizers_lib.load_tokenizer(str(tmp_path / "prepared_a")).vocab_size
    with pytest.raises(ValueError) as error:
        inputs.get_tokenizer(config, str(tmp_path / "run_b"))
    assert str(error.value) == (
        f"the prepared data {str(tmp_path / 'prepared_a')!r} holds ids of another tokenizer "
        f"than the tokenizer {str(tmp_path / 'run_b')!r} was trained with: expected data "
        "prepared with that tokenizer")
    config.init_from = str(tmp_path / "run_b")
    with pytest.raises(ValueError, match="holds ids of another tokenizer than the tokenizer of "
                                         "init_from="):
        inputs.get_tokenizer(config)


def files_of(directory) -> dict[str, bytes]:
    """Every file under `directory` (hidden ones too) by its relative path."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tokenizer, format", [("byte", "bin"), ("char", "array_record")])
def test_prepare_writes_the_same_bytes_with_1_or_2_workers_across_uneven_files(
        tmp_path, monkeypatch, tokenizer, format):
    source = uneven_inputs(tmp_path)
    monkeypatch.setattr(prepare_units, "ENCODE_BATCH", 8)  # many batches to share out
    shards = {"tokens_per_shard": 500} if format == "bin" else {"num_shards": 3}
    written = []
    for workers in (1, 2):
        out = tmp_path / f"{workers}"
        counts = prepare.prepare(str(out), source, tokenizer=tokenizer, num_workers=workers,
                                 format=format, **shards)
        assert len(counts["train"]["files"]) > 6
        written.append(files_of(out))
    assert written[0] == written[1]


def test_a_stream_is_one_unit_of_work(tmp_path):
    source = uneven_inputs(tmp_path)
    counts = prepare.prepare(str(tmp_path / "out"), source, unit="stream", format="bin",
                             tokens_per_shard=2000, validation_fraction=0.2)
    assert all(name.split("_")[1] == "000000" for split in sources.SPLITS
               for name in counts[split]["files"])
    tokens = shards_lib.TokenShards(str(tmp_path / "out" / "validation_*.bin"))
    docs = sources.load_documents(source, "validation", unit="stream", validation_fraction=0.2)
    expected = [i for d in docs for i in [*tokenizers_lib.ByteTokenizer().encode(d.text), 2]]
    assert tokens[:].tolist() == expected  # the last 20% of the characters


def long_text(seed: int = 0) -> str:
    """One text file's worth of lines of every kind: CRLF, unicode, blank lines, indented
    code, and runs of thousands of characters without a newline."""
    rng = random.Random(seed)
    lines = web_documents(60, seed) + [
        "naïve café 日本語のテキスト 한국어 👩‍👩‍👧‍👦 🇺🇳 e\u0301\r\nCRLF line\r\n",
        "\n\n\n", "    def f(x):\n        return x\n", " ".join(["run"] * 1500),
        "x" * 5000, "\t\ttabbed\u2028sep\x85nel"]
    return "\n".join(rng.choice(lines) for _ in range(150))


def metaspace_tokenizer_json(path, byte_fallback: bool) -> str:
    """A SentencePiece-shaped tokenizer.json: a Metaspace pre-tokenizer that prepends "▁" to
    an encode's first word, or (`byte_fallback`, Llama 2's) a Prepend("▁") normalizer and
    byte fallback. Both add a prefix at every encode call."""
    hf = pytest.importorskip("tokenizers")
    tok = hf.Tokenizer(hf.models.BPE(unk_token="<unk>", byte_fallback=byte_fallback))
    if byte_fallback:
        tok.normalizer = hf.normalizers.Sequence([hf.normalizers.Prepend("▁"),
                                                  hf.normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = hf.pre_tokenizers.Metaspace(prepend_scheme="first")
    special = ["<unk>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] * byte_fallback
    tok.train_from_iterator(web_documents(), hf.trainers.BpeTrainer(
        vocab_size=500 + len(special), special_tokens=special, limit_alphabet=200))
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("tokenizer", ["byte_level_bpe", "metaspace", "byte_fallback", "char",
                                       "byte", "sentencepiece_bpe"])
def test_a_long_stream_encoded_in_pieces_writes_the_bytes_of_one_encode(
        tmp_path, monkeypatch, tokenizer):
    """A --unit=stream text used to be encoded as one string (~140x its size in memory): it is
    encoded in pieces cut where the ids stay the same. A tokenizer that prefixes every encode
    with "▁" (Metaspace, Llama 2's Prepend("▁"), SentencePiece's) used to have no such cut and
    encoded whole: it is cut before a space, the piece after it encoded with the space (its
    "▁") or, for Prepend("▁"), without it (the prefix stands for it)."""
    source = tmp_path / "input.txt"
    source.write_text(long_text(), newline="")
    settings = {"tokenizer": tokenizer, "validation_fraction": 0.3}
    if tokenizer == "byte_level_bpe":
        pytest.importorskip("tiktoken")
        settings.update(tokenizer="hf", tokenizer_path=hf_tokenizer_json(tmp_path / "t.json"))
    elif tokenizer in ("metaspace", "byte_fallback"):
        settings.update(tokenizer="hf", tokenizer_path=metaspace_tokenizer_json(
            tmp_path / "t.json", tokenizer == "byte_fallback"))
    elif tokenizer == "sentencepiece_bpe":
        settings.update(vocab_size=400)
    whole = prepare.prepare(str(tmp_path / "whole"), str(source), unit="stream", **settings)
    assert source.stat().st_size < prepare_units.PIECE_CHARS  # one encode

    pieces, cut = [], prepare_units._pieces
    monkeypatch.setattr(prepare_units, "_pieces",
                        lambda *args: (pieces.append(p) or p for p in cut(*args)))
    monkeypatch.setattr(prepare_units, "PIECE_CHARS", 4000)
    workers = 2 if tokenizer == "char" else 1
    assert prepare.prepare(str(tmp_path / "pieces"), str(source), unit="stream",
                           num_workers=workers, **settings) == {**whole, "input": str(source)}
    assert files_of(tmp_path / "pieces") == files_of(tmp_path / "whole")
    # the train and validation splits, each piece's text with whether its space was dropped
    assert "".join(piece for piece, _ in pieces) == source.read_bytes().decode()
    assert len(pieces) > 5
    dropped = sum(drop for _, drop in pieces)  # (each split's first piece is whole)
    assert dropped == (len(pieces) - 2 if tokenizer == "byte_fallback" else 0)


# Runs `python -m transformer.data.prepare`'s main and kills it, as kill -9 of its process group
# would (it and its tokenizing workers), at one point of its work (argv[1]):
KILLED_PREPARE = """
import os, signal, sys
from transformer.data import prepare, prepare_units
from transformer.utils import cli

point, sys.argv[1:] = sys.argv[1], sys.argv[2:]

def kill():
    os.killpg(0, signal.SIGKILL)

if point == "after_the_first_file":
    unit = prepare_units.prepare_unit
    prepare_units.prepare_unit = lambda *args, **kwargs: (unit(*args, **kwargs), kill())
elif point == "in_the_middle_of_a_file":  # input file 2's first documents are being written
    add = prepare_units._UnitWriter.add
    def add_or_kill(self, split, doc, ids):
        if doc.name.endswith("c.txt#12"):
            kill()
        return add(self, split, doc, ids)
    prepare_units._UnitWriter.add = add_or_kill
else:  # "before_a_record": input file 1's shards are renamed into place, its record not written
    record_path = prepare_units._record_path
    def path_or_kill(output_dir, settings, index):
        if index == 1:
            kill()
        return record_path(output_dir, settings, index)
    prepare_units._record_path = path_or_kill
cli.run(prepare._main, prepare._define_flags)
"""


def run_prepare(args: list[str], kill_at: str | None = None) -> subprocess.CompletedProcess:
    command = ["-c", KILLED_PREPARE, kill_at] if kill_at else ["-m", "transformer.data.prepare"]
    return subprocess.run([sys.executable, *command, *args], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300, start_new_session=True)


def hf_tokenizer_json(path) -> str:
    """A small byte-level BPE whose <|endoftext|> ends documents, as a bare tokenizer.json."""
    hf = pytest.importorskip("tokenizers")
    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    tok.train_from_iterator(web_documents(), hf.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at, tokenizer, settings", [
    ("after_the_first_file", "sentencepiece_bpe", {"vocab_size": 300, "num_shards": 2}),
    ("in_the_middle_of_a_file", "hf", {"format": "bin", "tokens_per_shard": 700}),
    ("before_a_record", "byte", {"num_shards": 2}),
])
def test_a_killed_prepare_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, kill_at,
                                                                        tokenizer, settings):
    source, out, reference = uneven_inputs(tmp_path), tmp_path / "out", tmp_path / "reference"
    if tokenizer == "hf":
        settings = {**settings, "tokenizer_path": hf_tokenizer_json(tmp_path / "tok.json")}
    counts = prepare.prepare(str(reference), source, tokenizer=tokenizer, **settings)
    expected = files_of(reference)
    args = [f"--output_dir={out}", f"--input={source}", f"--tokenizer={tokenizer}",
            *(f"--{key}={value}" for key, value in settings.items())]
    workers = ["--num_workers=2"] if kill_at == "in_the_middle_of_a_file" else []
    killed = run_prepare(args + workers, kill_at)
    assert killed.returncode == -signal.SIGKILL, describe(killed)

    # Whole shards only under the names training reads, each as the uninterrupted run wrote it.
    visible = {name: data for name, data in files_of(out).items() if "/" not in name}
    shard_names = [name for name in visible if name.endswith((".array_record", ".bin"))]
    assert shard_names and "prepare.json" not in visible
    assert all(visible[name] == expected[name] for name in shard_names)
    temporaries = [name for name in files_of(out) if name.startswith(".prepare/tmp/")]
    assert bool(temporaries) == (kill_at == "in_the_middle_of_a_file")
    recorded = {name.split("/")[-1].removesuffix(".json") for name in files_of(out)
                if name.startswith(".prepare/units/")}
    with_shards = {re.split("[-_]", name)[1] for name in shard_names}
    assert with_shards - recorded == ({"000001"} if kill_at == "before_a_record" else set())
    with pytest.raises(ValueError, match="an unfinished prepare"):
        inputs.check_finished(str(out))  # and so training refuses the directory
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()
                if "000000" in p.name or p.name.startswith("tokenizer")}

    resumed = run_prepare(args)  # the same command (1 worker now: not a setting)
    assert resumed.returncode == 0, describe(resumed)
    assert json.loads(resumed.stdout) == counts
    assert files_of(out) == expected  # .prepare/ gone, every byte as uninterrupted
    # The finished file's shards and the tokenizer were kept, not written again.
    assert {name: (out / name).stat().st_ino for name in finished} == \
        {name: ino for name, (ino, _) in finished.items()}
    assert {name: (out / name).stat().st_mtime_ns for name in finished} == \
        {name: mtime for name, (_, mtime) in finished.items()}


def stopped_after_one_file(monkeypatch, *args, **kwargs) -> None:
    """`prepare.prepare(*args, **kwargs)` stopped as a prepare killed after its first file."""
    unit = prepare_units.prepare_unit

    def stop_after_one(*args, **kwargs):
        unit(*args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(prepare_units, "prepare_unit", stop_after_one)
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare(*args, **kwargs)


def test_a_prepare_that_failed_on_its_first_row_says_how_to_start_over(tmp_path):
    """A prepare stopped by a bad --text_field on its first row has saved its settings and
    tokenizer, so the corrected command is refused as another prepare's resume: the line now
    says that it finished no file and that removing the directory starts over. The first line
    names the command's flag (the readers' own words are training's `data.text_field`)."""
    source, out = write_jsonl(tmp_path / "web.jsonl", web_documents(20)), tmp_path / "out"
    assert_one_line_error(
        run_prepare([f"--output_dir={out}", f"--input={source}", "--text_field=content"]), 2,
        "row 0 (line 1) has no 'content' field (it has ['id', 'meta', 'text']): expected "
        "--text_field to name")
    with pytest.raises(ValueError) as error:
        prepare.prepare(str(out), source)
    assert str(error.value) == (
        f"{out}: holds an unfinished prepare with --text_field=content, not text: expected its "
        f"settings to resume it, or another --output_dir (it finished no input file: removing "
        f"{out} starts over)")


@pytest.mark.slow
def test_a_resume_with_another_setting_or_other_input_is_refused_in_one_line(tmp_path,
                                                                             monkeypatch):
    source, out = uneven_inputs(tmp_path), tmp_path / "out"
    stopped_after_one_file(monkeypatch, str(out), source, num_shards=2)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    result = run_prepare([f"--output_dir={out}", f"--input={source}", "--num_shards=3"])
    assert_one_line_error(result, 2, f"error: {out}: holds an unfinished prepare with "
                          "--num_shards=2, not 3: expected its settings to resume it")
    for changed, words in [({"tokenizer": "char"}, "--tokenizer=byte, not char"),
                           ({"unit": "file"}, "--unit=paragraph, not file"),
                           ({"format": "bin", "num_shards": 1}, "--format=array_record, not bin")]:
        with pytest.raises(ValueError, match=words):
            prepare.prepare(str(out), source, **{"num_shards": 2, **changed})
    (tmp_path / "inputs" / "g.txt").write_text("one more file")
    with pytest.raises(ValueError, match="prepare of 6 input files; --input now gives 7"):
        prepare.prepare(str(out), source, num_shards=2)
    (tmp_path / "inputs" / "g.txt").unlink()
    write_parquet(tmp_path / "inputs" / "a.parquet", web_documents(110, seed=5))  # finished
    with pytest.raises(ValueError, match="a.parquet: changed since the unfinished prepare"):
        prepare.prepare(str(out), source, num_shards=2)
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert after == before


def three_files(root) -> str:
    """A folder of three small text files: three units of work."""
    folder, texts = root / "inputs", web_documents(60, seed=6)
    folder.mkdir()
    for i, name in enumerate("abc"):
        (folder / f"{name}.txt").write_text("\n\n".join(texts[20 * i:20 * i + 20]))
    return str(folder)


def test_a_second_prepare_is_refused_while_one_writes_the_directory(tmp_path, monkeypatch):
    """Two prepares of one --output_dir (two shells, two hosts on one NFS directory) would mix
    their tokenizers and shards: the second touches nothing and says so in one line."""
    source, out = three_files(tmp_path), tmp_path / "out"
    stopped_after_one_file(monkeypatch, str(out), source, tokenizer="char")
    (out / ".prepare" / "tmp" / "1-writing").mkdir(parents=True)  # the other one's shards
    (out / ".prepare" / "tmp" / "1-writing" / "train.array_record").write_bytes(b"half")
    before = files_of(out)
    with prepare_units.exclusive(str(out)):  # held as the other prepare holds it
        with pytest.raises(FileExistsError) as error:
            prepare.prepare(str(out), source, tokenizer="char")
        assert str(error.value) == (
            f"another prepare is writing {out}: expected one prepare at a time in an "
            "--output_dir (rerun this command once it has stopped)")
        assert files_of(out) == before
    prepare.prepare(str(out), source, tokenizer="char")  # once it stopped: resumes
    assert (out / "prepare.json").is_file() and not (out / ".prepare").exists()


def test_a_resume_refuses_an_unfinished_file_its_tokenizer_read_before_it_changed(
        tmp_path, monkeypatch):
    """A char tokenizer is trained on every input file: one edited since would be tokenized
    with a vocabulary of its old text. A prepare begun before the files' fingerprints were
    recorded resumes as before."""
    source, out, reference = three_files(tmp_path), tmp_path / "out", tmp_path / "reference"
    prepare.prepare(str(reference), source, tokenizer="char")
    stopped_after_one_file(monkeypatch, str(out), source, tokenizer="char")
    unfinished = tmp_path / "inputs" / "c.txt"
    text = unfinished.read_text()
    unfinished.write_text(text + "\n\nZebra quiz: letters the tokenizer never saw, 0123.")
    with pytest.raises(ValueError) as error:
        prepare.prepare(str(out), source, tokenizer="char")
    assert str(error.value) == (
        f"{unfinished}: changed since the unfinished prepare in {out} read it: expected it as it "
        "was to resume, or another --output_dir")
    unfinished.write_text(text)
    manifest = out / ".prepare" / "settings.json"
    older = json.loads(manifest.read_text())
    del older["fingerprints"]
    manifest.write_text(json.dumps(older))
    prepare.prepare(str(out), source, tokenizer="char")
    assert files_of(out) == files_of(reference)


def test_a_prepare_inside_its_input_directory_resumes(tmp_path, monkeypatch):
    """--output_dir=inputs/prepared: a resume lists its shards and tokenizer under --input=inputs
    too, and leaves them out (they are not input), to the bytes of an uninterrupted prepare."""
    source, reference = three_files(tmp_path), tmp_path / "reference"
    prepare.prepare(str(reference), source, num_shards=2)
    out = tmp_path / "inputs" / "prepared"
    stopped_after_one_file(monkeypatch, str(out), source, num_shards=2)
    assert prepare.prepare(str(out), source, num_shards=2) == \
        json.loads((reference / "prepare.json").read_text())
    assert files_of(out) == files_of(reference)


def test_settings_a_prepare_would_ignore_or_refuse_after_training_are_refused_up_front(
        tmp_path, monkeypatch):
    """A vocab_size for a tokenizer not trained to one, and what a .bin shard cannot hold (a
    count past int32, ids past uint16 once the 100 sentinels are above the vocabulary) are one
    line before any document is read: they were ignored, or refused once SentencePiece had
    trained, leaving a directory the corrected command met. (--tokens_per_shard with ArrayRecord:
    the command's test.)"""
    source, out = three_files(tmp_path), tmp_path / "out"

    def trained(*args, **kwargs):
        raise AssertionError("a tokenizer was built before the arguments were checked")

    monkeypatch.setattr(prepare_units, "_build_tokenizer", trained)
    for settings, error in [
            ({"vocab_size": 8000}, "vocab_size=8000 with tokenizer='byte': expected no "
             "vocab_size (only a SentencePiece tokenizer is trained to one)"),
            ({"tokenizer": "char", "vocab_size": 300}, "vocab_size=300 with tokenizer='char'"),
            ({"tokenizer": "hf", "tokenizer_path": str(tmp_path), "vocab_size": 50000},
             "vocab_size=50000 with tokenizer='hf'"),
            ({"format": "bin", "tokens_per_shard": 3_000_000_000}, "tokens_per_shard="
             "3000000000: expected 1 to 2**31 - 1 (a modded-nanogpt shard's int32 count)"),
            ({"format": "bin", "tokenizer": "sentencepiece_bpe", "vocab_size": 65500},
             "vocab_size=65500 with format='bin': expected at most 65536 ids (uint16) with "
             "its 100 sentinels, so vocab_size at most 65436")]:
        with pytest.raises(ValueError) as raised:
            prepare.prepare(str(out), source, **settings)
        assert str(raised.value).startswith(error)
        assert not out.exists()
    prepare._check_arguments("sentencepiece_unigram", "", "bin", 1, 1, 65436, 0.1, 2**31 - 1)


def test_a_directory_holding_a_tokenizer_is_refused_and_a_resume_still_resumes(
        tmp_path, monkeypatch):
    """A Hugging Face tokenizer folder (or an export) as --output_dir: prepare overwrote its
    tokenizer.json with its own. Refused in one line, untouched; a prepare's own tokenizer, in
    a directory it began (.prepare/), is resumed over as before."""
    source = three_files(tmp_path)
    for name in ("tokenizer.json", "sentencepiece.model", "hf_tokenizer.json"):
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        (out / name).write_bytes(b"someone else's")
        with pytest.raises(FileExistsError) as error:
            prepare.prepare(str(out), source)
        assert str(error.value) == (
            f"{out}: already holds a tokenizer ({name}), which prepare would overwrite with its "
            "own: expected a directory without one (another --output_dir)")
        assert sorted(p.name for p in out.iterdir()) == [".prepare.lock", name]
        assert (out / name).read_bytes() == b"someone else's"
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    original = pathlib.Path(hf_tokenizer_json(hf_dir / "tokenizer.json")).read_bytes()
    with pytest.raises(FileExistsError, match=r"holds a tokenizer \(tokenizer\.json\)"):
        prepare.prepare(str(hf_dir), source, tokenizer="hf", tokenizer_path=str(hf_dir))
    assert (hf_dir / "tokenizer.json").read_bytes() == original
    assert not (hf_dir / "hf_tokenizer.json").exists()
    reference, out = tmp_path / "reference", tmp_path / "resumed"
    prepare.prepare(str(reference), source, tokenizer="char")
    stopped_after_one_file(monkeypatch, str(out), source, tokenizer="char")
    assert (out / "tokenizer.json").is_file()
    prepare.prepare(str(out), source, tokenizer="char")
    assert files_of(out) == files_of(reference)
    killed = tmp_path / "killed"  # killed once its tokenizer was saved, before its settings
    (killed / ".prepare").mkdir(parents=True)
    tokenizers_lib.build_tokenizer("char", ["xyz"]).save(str(killed))
    prepare.prepare(str(killed), source, tokenizer="char")
    assert files_of(killed) == files_of(reference)


@pytest.mark.slow
def test_the_command_refuses_a_tokenizer_folder_and_tokens_per_shard_with_array_record(
        tmp_path):
    """The probe's commands: --output_dir the --tokenizer_path folder, and --tokens_per_shard
    given (its default is not) with --format=array_record; --format=bin still takes it."""
    source, hf_dir = three_files(tmp_path), tmp_path / "hf"
    hf_dir.mkdir()
    original = pathlib.Path(hf_tokenizer_json(hf_dir / "tokenizer.json")).read_bytes()
    result = run_prepare([f"--input={source}", f"--output_dir={hf_dir}", "--tokenizer=hf",
                          f"--tokenizer_path={hf_dir}", "--format=bin"])
    assert_one_line_error(result, 2, f"{hf_dir}: already holds a tokenizer (tokenizer.json)")
    assert (hf_dir / "tokenizer.json").read_bytes() == original
    result = run_prepare([f"--input={source}", f"--output_dir={tmp_path / 'out'}",
                          "--tokens_per_shard=1000"])
    assert_one_line_error(result, 2, "tokens_per_shard=1000 with format='array_record': "
                          "expected format='bin' (num_shards sizes ArrayRecord shards)")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"^tokens_per_shard=1000 with format='array_record'"):
        prepare.prepare(str(tmp_path / "out"), str(source), tokens_per_shard=1000)  # as Python
    assert not (tmp_path / "out").exists()
    result = run_prepare([f"--input={source}", f"--output_dir={tmp_path / 'bin'}",
                          "--format=bin", "--tokens_per_shard=1000"])
    assert result.returncode == 0, describe(result)
    assert json.loads((tmp_path / "bin" / "prepare.json").read_text())["tokens_per_shard"] == 1000


def test_training_refuses_prepared_data_missing_a_shard_its_prepare_json_lists(tmp_path):
    """A .bin or ArrayRecord shard deleted from (or added to) a prepared directory: the split
    trained and evaluated on part of its tokens while bits per byte took prepare.json's counts.
    The train corpus, read before training, names the files of either split in one line."""
    source = three_files(tmp_path)
    for format, split, deleted in [("bin", "validation", "validation_000001_000000.bin"),
                                   ("array_record", "train",
                                    "train-000002-00000-of-00001.array_record")]:
        out = tmp_path / format
        counts = prepare.prepare(str(out), source, format=format)
        assert deleted in counts[split]["files"]
        config = config_for(out, tokenizer="byte")
        tokenizer = inputs.get_tokenizer(config)
        whole = len(inputs.corpus(config, tokenizer, "train"))
        (out / deleted).rename(tmp_path / deleted)
        with pytest.raises(ValueError) as error:
            inputs.corpus(config, tokenizer, "train")
        assert str(error.value) == (
            f"data.path={str(out)!r}: its {split} shards are not those of its prepare.json "
            f"(missing: [{deleted!r}], not listed: []): expected the files prepare wrote "
            "(prepare the data again)")
        extra = deleted.replace("00000", "00009", 1)
        (tmp_path / deleted).rename(out / extra)
        with pytest.raises(ValueError, match=re.escape(
                f"(missing: [{deleted!r}], not listed: [{extra!r}])")):
            inputs.get_dataset(config, tokenizer, "train")
        (out / extra).rename(out / deleted)
        summary = json.loads((out / "prepare.json").read_text())
        for one in sources.SPLITS:  # a prepare.json from before the lists: not checked
            del summary[one]["files"]
        (out / "prepare.json").write_text(json.dumps(summary))
        (out / deleted).unlink()
        assert len(inputs.corpus(config, tokenizer, "train")) <= whole


def test_a_tokenizing_worker_that_dies_fails_the_prepare_in_one_line(tmp_path):
    """A worker killed (kill -9, the OOM killer) fails the prepare, which then resumes; it used
    to wait for the dead worker's batch forever."""
    tokenizer = tokenizers_lib.build_tokenizer("byte")
    tokenizer.save(str(tmp_path))
    before = set(multiprocessing.active_children())
    with prepare._encoder(tokenizer, str(tmp_path), 2) as encode:
        encoded = encode(iter([["a document", "another"]] * 20_000))  # past the death's notice
        assert [np.asarray(ids).tolist() for ids in next(encoded)] == [
            np.asarray(ids).tolist() for ids in tokenizer.encode_batch(["a document", "another"])]
        os.kill(next(iter(set(multiprocessing.active_children()) - before)).pid, signal.SIGKILL)
        with pytest.raises(RuntimeError) as error:
            list(encoded)
    assert str(error.value) == (
        "a tokenizing worker process (of --num_workers=2) died (killed, or out of memory?): "
        "rerun the same command to resume the prepare from the input files it finished")


# A prepare's tokenizing workers at work: prints their process ids, then keeps encoding.
BUSY_WORKERS = """
import multiprocessing, sys
from transformer.data import prepare, tokenizers
tokenizer = tokenizers.build_tokenizer("byte")
tokenizer.save(sys.argv[1])
with prepare._encoder(tokenizer, sys.argv[1], 2) as encode:
    encoded = encode(iter([["a document " * 1000] * 64] * 1_000_000))
    next(encoded)
    print(*[child.pid for child in multiprocessing.active_children()], flush=True)
    for _ in encoded:
        pass
"""


def running(pids: list[int]) -> list[int]:
    """The processes of `pids` still running (not gone, not a zombie)."""
    def state(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"
    return [pid for pid in pids if state(pid) not in ("gone", "Z", "X")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_prepare_killed_by_kill_9_takes_its_tokenizing_workers_with_it(tmp_path):
    """kill -9 (the OOM killer) of a prepare used to leave its workers waiting forever."""
    parent = subprocess.Popen([sys.executable, "-c", BUSY_WORKERS, str(tmp_path)], cwd=REPO,
                              env=cli_env(), stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    workers = []
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2 and running(workers) == workers
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while running(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running(workers) == []
    finally:
        parent.kill()
        for pid in running(workers):  # (left by a failure)
            os.kill(pid, signal.SIGKILL)


# --- prepare as an Apache Beam pipeline --------------------------------------------------------


def test_the_beam_pipeline_writes_the_bytes_of_the_worker_processes(tmp_path, monkeypatch):
    pytest.importorskip("apache_beam")
    source, settings = uneven_inputs(tmp_path), {"tokenizer": "char", "num_shards": 2}
    counts = prepare.prepare(str(tmp_path / "processes"), source, num_workers=2, **settings)
    expected = files_of(tmp_path / "processes")
    threads = "--direct_num_workers=2 --direct_running_mode=multi_threading"
    assert prepare.prepare(str(tmp_path / "beam"), source, engine="beam", beam_options=threads,
                           **settings) == counts
    assert files_of(tmp_path / "beam") == expected
    unit = prepare_units.prepare_unit  # a prepare the processes began, killed after a file

    def stop_after_one(*args, **kwargs):
        unit(*args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(prepare_units, "prepare_unit", stop_after_one)
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare(str(tmp_path / "resumed"), source, **settings)
    prepare.prepare(str(tmp_path / "resumed"), source, engine="beam", **settings)
    assert files_of(tmp_path / "resumed") == expected


@pytest.mark.slow
def test_beam_settings_are_checked_before_any_work(tmp_path, monkeypatch):
    pytest.importorskip("apache_beam")
    out, args = tmp_path / "out", [f"--output_dir={tmp_path / 'out'}", "--engine=beam"]
    for given, words in [(["--beam_options=--runner=DirectRunner --bogus=1"],
                          "unknown Beam options ['bogus']"),
                         (["--num_workers=4"], "--num_workers=4 with --engine=beam")]:
        assert_one_line_error(run_prepare(args + given), 2, *words)
    assert_one_line_error(run_prepare(args[:1] + ["--beam_options=--direct_num_workers=2"]),
                          2, "with --engine=processes: expected --engine=beam")
    monkeypatch.setitem(sys.modules, "apache_beam", None)  # as without the beam extra
    monkeypatch.delitem(sys.modules, "transformer.data.prepare_beam", raising=False)
    monkeypatch.delattr(transformer.data, "prepare_beam", raising=False)
    with pytest.raises(ValueError, match="expected Apache Beam installed"):
        prepare.prepare(str(out), engine="beam")
    assert not out.exists()


def test_a_corpus_in_a_bucket_reads_and_prepares_as_on_a_local_disk(tmp_path):
    """URLs go through fsspec (gs:// is gcsfs); its in-memory filesystem stands in for a bucket
    here: every format, the fingerprint and the prepared shards equal the local folder's."""
    fsspec = pytest.importorskip("fsspec")
    local = uneven_inputs(tmp_path)
    memory = fsspec.filesystem("memory")
    bucket = f"memory://bucket-{tmp_path.name}/corpus"
    memory.put(local, bucket.removeprefix("memory://"), recursive=True)
    memory.pipe(bucket.removeprefix("memory://") + "/.hidden.txt", b"never read")
    docs = {p: sources.read_text(p) for p in (local, bucket)}
    assert [d.text for d in docs[bucket]] == [d.text for d in docs[local]]
    assert all(d.name.startswith("memory://") for d in docs[bucket])
    assert sources.fingerprint(bucket) == sources.fingerprint(local)
    assert sources.fingerprint(bucket + "/*.parquet") == sources.fingerprint(f"{local}/*.parquet")
    shards = []
    for name, path in (("local", local), ("bucket", bucket)):
        prepare.prepare(str(tmp_path / name), path, tokenizer="char", num_shards=2)
        shards.append({p.name: p.read_bytes() for p in (tmp_path / name).glob("*.array_record")})
    assert len(shards[0]) > 6 and shards[0] == shards[1]
    configs = [config_for(path, tokenizer="byte") for path in (local, bucket)]  # data.path
    tokenizer = inputs.get_tokenizer(configs[0])
    assert inputs.data_stream(configs[0])["fingerprint"] == \
        inputs.data_stream(configs[1])["fingerprint"]
    for a, b in zip(*(take(inputs.get_dataset(c, tokenizer, "train"), 3) for c in configs),
                    strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(FileNotFoundError, match=r"^memory://bucket-.*/nothing\*: no such file"):
        sources.read_text(bucket + "/nothing*")
    memory.pipe(bucket.removeprefix("memory://") + "/z.parquet", b"PAR1 cut short")
    with pytest.raises(ValueError, match=r"^memory://.*/z\.parquet: unreadable Parquet"):
        sources.read_text(bucket)


def test_a_big_direct_corpus_warns_once_with_the_prepare_command_and_evaluation_reads_it_once(
        tmp_path, monkeypatch, capsys):
    from transformer.data import direct_reads
    from transformer.utils import cli

    path = write_jsonl(tmp_path / "web.jsonl.gz", web_documents(120))
    config = config_for(path, tokenizer="byte", validation_fraction=0.1)
    monkeypatch.setattr(direct_reads, "WARN_BYTES", os.path.getsize(path) - 1)  # as stored
    cli.warn_once.cache_clear()
    tokenizer = inputs.get_tokenizer(config)
    for split in ("train", "validation", "validation"):
        inputs.corpus(config, tokenizer, split)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "prepare" in line]
    assert warnings == [
        f"warning: data.path={path!r}: 0 MB on disk, read whole into memory at start-up "
        "(several times that at its peak, docs/data.md): tokenize it once, python -m "
        f"transformer.data.prepare --input={path} --output_dir=prepared --tokenizer=byte "
        "--validation_fraction=0.1, and train on that directory"]
    reads = []  # bits per byte and the samples take the evaluated split's kept text
    monkeypatch.setattr(sources, "load_documents", lambda *a, **k: reads.append(a) or [])
    assert inputs.bytes_per_token(config, tokenizer, "validation") > 0
    assert inputs.sample_prompt(config) and reads == []
    monkeypatch.setattr(direct_reads, "WARN_BYTES", os.path.getsize(path))
    cli.warn_once.cache_clear()
    inputs.corpus(config_for(path, tokenizer="byte"), tokenizer, "train")
    assert "prepare" not in capsys.readouterr().err
    # with a validation file, the advice says prepare makes its own split instead
    monkeypatch.setattr(direct_reads, "WARN_BYTES", 0)
    config.data.validation_path = str(path)
    direct_reads.warn_big_corpus(config.data)
    assert capsys.readouterr().err.rstrip().endswith(
        ", and train on that directory (prepare splits its input by --validation_fraction: a "
        "prepared data.path takes no data.validation_path)")
