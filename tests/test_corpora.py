"""Pretraining corpora as researchers hold them (transformer.data.formats): Parquet, JSON Lines
(plain, gzip, zstd) and `datasets` save_to_disk directories give the same documents as each
other, through data.path and prepare; bad rows and corrupt files are one line naming the file and
the row."""

from __future__ import annotations

import gzip
import json
import random

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from transformer.data import inputs, prepare, sources


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
    }
    return paths, texts


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "jsonl.gz", "jsonl.zst", "datasets"])
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


@pytest.mark.parametrize("tokenizer", ["byte", "char"])
def test_prepare_writes_the_same_bytes_with_any_number_of_workers(corpora, tmp_path,
                                                                  monkeypatch, tokenizer):
    paths, _ = corpora
    monkeypatch.setattr(prepare, "_ENCODE_BATCH", 16)  # 15 batches of documents to share out
    written = []
    for workers in (1, 3):
        out = tmp_path / f"{workers}"
        counts = prepare.prepare(str(out), paths["parquet"], tokenizer=tokenizer,
                                 num_workers=workers, format="bin", tokens_per_shard=5000)
        assert len(counts["train"]["files"]) > 2
        written.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert written[0] == written[1]


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
    corrupt = tmp_path / "f.parquet"
    corrupt.write_bytes((tmp_path / "b.parquet").read_bytes()[:-300])
    assert row_error(corrupt).startswith(f"{corrupt}: unreadable Parquet (")


def test_a_dataset_dict_is_refused_naming_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["a b", "c d"]}),
        "test": datasets.Dataset.from_dict({"text": ["e f"]})}).save_to_disk(str(tmp_path / "dd"))
    assert row_error(tmp_path / "dd") == (
        f"{tmp_path / 'dd'}: a DatasetDict of splits ['test', 'train']: expected one split's "
        f"directory (e.g. {tmp_path / 'dd' / 'test'})")
    assert [d.text for d in sources.read_text(str(tmp_path / "dd" / "train"))] == ["a b", "c d"]
