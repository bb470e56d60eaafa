"""benchmarks/prepare_throughput.py on a small BPE trained here (GPT-2's alphabet and pattern):
the tokenizer.json built from tiktoken ranks recovers the trainer's merges and encodes as
tiktoken does; the corpus is FineWeb-shaped Parquet; nanoGPT's shard writing cuts documents
across shards and loses no token; and a tiny rehearsal of the whole benchmark (slow)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import prepare_throughput as pt  # noqa: E402 - benchmarks/ is not a package

from transformer.data import fast_bpe, tokenizers  # noqa: E402

tiktoken = pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def trained():
    """(ranks, merges) of a byte-level BPE of 600 tokens that `tokenizers` trains on
    synthesized documents, the ranks as tiktoken keeps them (bytes -> id)."""
    import tokenizers as hf
    from tokenizers import models, pre_tokenizers, trainers

    tok = hf.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(pt.synthesize_documents(0.3, seed=1), trainer)
    byte_of = {symbol: b for b, symbol in enumerate(fast_bpe.byte_symbols())}
    ranks = {bytes(byte_of[c] for c in token): i for token, i in tok.get_vocab().items()}
    return ranks, json.loads(tok.to_str())["model"]["merges"]


@pytest.fixture(scope="module")
def ranks_file(trained, tmp_path_factory):
    path = tmp_path_factory.mktemp("ranks") / "small.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                            for t, r in trained[0].items()))
    return str(path)


def test_the_tokenizer_json_recovers_the_merges_and_encodes_as_tiktoken(trained, ranks_file,
                                                                        tmp_path):
    ranks, merges = trained
    assert pt.load_ranks(ranks_file) == ranks
    built = json.loads(pt.hf_tokenizer_json(ranks))
    assert [list(m) for m in built["model"]["merges"]] == [list(m) for m in merges]
    (tmp_path / "tokenizer.json").write_text(pt.hf_tokenizer_json(ranks))
    ours = tokenizers.load_hf_tokenizer(str(tmp_path / "tokenizer.json"), num_sentinels=0)
    assert ours.eos_id == len(ranks) == 600
    encoding = pt.tiktoken_encoding(ranks)
    docs = list(pt.synthesize_documents(0.1, seed=2)) + ["héllo wörld 123 ,,  \n\n\t x’s"]
    assert [ids.tolist() for ids in ours.encode_batch(docs)] == [
        encoding.encode_ordinary(d) for d in docs]


def test_the_corpus_is_fineweb_shaped_parquet(tmp_path):
    import pyarrow.parquet as pq

    made = pt.write_fineweb(str(tmp_path), megabytes=2.5, num_files=3, seed=0)
    assert [os.path.basename(p) for p in made["files"]] == [
        "000_00000.parquet", "001_00000.parquet", "002_00000.parquet"]
    texts = []
    for path in made["files"]:
        parquet = pq.ParquetFile(path)
        assert parquet.schema_arrow.names == [name for name, _ in pt.FINEWEB_SCHEMA]
        groups = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
        assert groups[:-1] == [1000] * (len(groups) - 1) and 0 < groups[-1] <= 1000
        texts += pq.read_table(path, columns=["text"])["text"].to_pylist()
    assert len(texts) == made["documents"] == len(set(texts))  # no document twice
    assert sum(len(t.encode()) for t in texts) == made["bytes"] > 2.5e6
    sizes = [os.path.getsize(p) for p in made["files"]]
    assert max(sizes) < 2 * min(sizes)  # about equal files


def test_nanogpt_shards_cut_documents_across_shards_and_keep_every_token(trained, ranks_file,
                                                                        tmp_path):
    made = pt.write_fineweb(str(tmp_path / "data"), megabytes=0.2, num_files=2, seed=4)
    out = str(tmp_path / "nanogpt")
    pt.run_nanogpt(made["files"], ranks_file, out, nprocs=2, shard_size=20_000)
    names = sorted(os.listdir(out))
    assert len(names) >= 3 and names[0] == "edufineweb_train_000001.npy" and \
        names[-1] == "edufineweb_val_000000.npy"
    assert all(np.load(f"{out}/{name}").size == 20_000 for name in
               ("edufineweb_val_000000.npy", "edufineweb_train_000001.npy"))
    encoding, eot = pt.tiktoken_encoding(trained[0]), len(trained[0])
    texts = [row["text"] for row in pt._fineweb_rows(made["files"])]
    expected = np.concatenate([[eot, *encoding.encode_ordinary(t)] for t in texts])
    (stream,) = pt.nanogpt_streams(out)
    np.testing.assert_array_equal(stream, expected.astype(np.uint16))
    assert sum(pt.document_digests([stream], eot, eot_first=True).values()) == len(texts)


@pytest.mark.slow
def test_a_tiny_rehearsal_prints_equal_ids_and_the_table(ranks_file, tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "prepare_throughput.py"),
               f"--gpt2_tiktoken={ranks_file}", "--megabytes=0.5", "--files=2", "--workers=2",
               "--read_batches=2", f"--workdir={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "equal on all" in out and " documents: yes; " in out, out
    assert "found among ours: yes; ours at 1 and 2 workers wrote the same bytes: yes" in out, out
    assert "| ours: prepare --num_workers=2 | 2 |" in out
    assert "nanoGPT fineweb.py logic, 1 process (its default" in out or pt.CORES != 2
    assert "training read (experiments/llama_1b7.py" in out and "one v5p host" in out
