"""Pre-tokenized uint16 token shards: both formats read as one sequence through memory maps,
format detection and its one-line errors, writing, pickling, and prepare --format=bin."""

from __future__ import annotations

import json
import os
import pickle
import tracemalloc

import numpy as np
import pytest
from test_cli import assert_one_line_error
from test_sources import shakespeare
from test_train import assert_succeeded, run_cli

from transformer.data import shards, sources, tokenizers
from transformer.data.shards import TokenShards

# Shard lengths with an empty shard and a one-token shard among them.
LENGTHS = [37, 1, 120, 0, 64, 9]


def raw_file(path, tokens) -> str:
    """A nanoGPT file, written here by hand rather than by the code under test."""
    np.asarray(tokens, "<u2").tofile(path)
    return str(path)


def modded_file(path, tokens, *, version=1, count=None) -> str:
    """A modded-nanogpt shard, written here by hand; `count` overrides the header's count."""
    header = np.zeros(256, "<i4")
    header[:3] = 20240520, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, "<u2").tobytes())
    return str(path)


def shard_set(directory, write, lengths=LENGTHS, seed=0):
    """Shards of random ids (the full uint16 range) -> (their paths, the concatenation)."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 65536, size=n) for n in lengths]
    paths = [write(directory / f"shard_{i:03d}.bin", part) for i, part in enumerate(parts)]
    return paths, np.concatenate(parts).astype(np.int32)


def ranges(total, rng, boundaries):
    """Empty, whole, single-token, random, and spanning 2-3 shards around each boundary."""
    yield from [(0, 0), (total, total), (0, total), (total - 1, total), (0, 1)]
    for b in boundaries:
        yield from [(b - 1, b + 1), (max(0, b - 5), min(total, b + 130)), (b, b)]
    for _ in range(200):
        start, stop = sorted(rng.integers(0, total + 1, size=2))
        yield int(start), int(stop)


# --- reading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("write", [raw_file, modded_file], ids=["nanogpt", "modded"])
def test_any_range_equals_the_concatenation(tmp_path, write):
    paths, expected = shard_set(tmp_path, write)
    data = TokenShards(str(tmp_path))
    assert data.paths == paths and data.shard_lengths == LENGTHS
    assert len(data) == len(expected) == sum(LENGTHS)
    boundaries = np.cumsum(LENGTHS)[:-1]
    for start, stop in ranges(len(data), np.random.default_rng(1), boundaries):
        got = data.read(start, stop)
        assert got.dtype == np.int32 and got.shape == (stop - start,)
        np.testing.assert_array_equal(got, expected[start:stop], err_msg=f"[{start}, {stop})")
    np.testing.assert_array_equal(data[:], expected)
    np.testing.assert_array_equal(data[-50:-3], expected[-50:-3])
    np.testing.assert_array_equal(data[30:10], expected[30:10])  # Python's empty slice
    assert [data[i] for i in (0, 37, -1)] == [expected[0], expected[37], expected[-1]]


def test_formats_are_detected_per_file_and_mix(tmp_path):
    a = raw_file(tmp_path / "a.bin", [1, 2, 3])
    b = modded_file(tmp_path / "b.bin", [4, 5])
    c = raw_file(tmp_path / "c.bin", [])
    d = modded_file(tmp_path / "d.bin", [])
    assert [shards.shard_format(p) for p in (a, b, c, d)] == [
        ("nanogpt", 0, 3), ("modded", 1024, 2), ("nanogpt", 0, 0), ("modded", 1024, 0)]
    data = TokenShards(str(tmp_path / "*.bin"))
    assert data.formats == ["nanogpt", "modded", "nanogpt", "modded"]
    assert data.read(0, 5).tolist() == [1, 2, 3, 4, 5]


def test_paths_as_file_directory_glob_or_list(tmp_path):
    (tmp_path / "sub").mkdir()
    a = modded_file(tmp_path / "sub" / "train_000001.bin", [3])
    b = modded_file(tmp_path / "sub" / "train_000000.bin", [1, 2])
    (tmp_path / "sub" / "prepare.json").write_text("{}")
    assert TokenShards(a).paths == [a]
    assert TokenShards(str(tmp_path)).paths == [b, a]  # sorted; other files skipped
    assert TokenShards(tmp_path / "sub" / "train_*.bin").paths == [b, a]
    assert TokenShards([a, b]).read(0, 3).tolist() == [3, 1, 2]  # a list keeps its order
    with pytest.raises(ValueError, match="prepare.json: not a .bin file"):
        TokenShards(str(tmp_path / "sub" / "*"))
    with pytest.raises(FileNotFoundError, match="nope"):
        TokenShards(str(tmp_path / "nope_*.bin"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="no \\*.bin files"):
        TokenShards(str(tmp_path / "empty"))


def test_out_of_range_reads_raise_index_error(tmp_path):
    data = TokenShards(modded_file(tmp_path / "a.bin", np.arange(10)))
    for start, stop in [(-1, 3), (0, 11), (5, 4), (11, 11)]:
        with pytest.raises(IndexError, match=f"tokens \\[{start}, {stop}\\) of 10: expected"):
            data.read(start, stop)
    for i in (10, -11):
        with pytest.raises(IndexError, match=f"token {i} of 10"):
            data[i]
    with pytest.raises(ValueError, match="step 2"):
        data[::2]


def test_pickle_holds_paths_not_maps(tmp_path):
    lengths = [*LENGTHS, 100_000]
    paths, expected = shard_set(tmp_path, modded_file, lengths)
    data = TokenShards(paths)
    data.read(0, len(data))  # opens every map
    blob = pickle.dumps(data)
    assert len(blob) < 4096  # the shards hold 200 KB; their maps are never pickled
    again = pickle.loads(blob)
    assert again.paths == paths and again.shard_lengths == lengths
    np.testing.assert_array_equal(again.read(30, 200), expected[30:200])


def test_reads_map_and_copy_only_the_range(tmp_path, monkeypatch):
    tokens = np.arange(1_000_000) % 65536
    path = modded_file(tmp_path / "big.bin", tokens)  # 2 MB
    data = TokenShards(path)

    def refuse(*args, **kwargs):
        raise AssertionError("a whole-file read")

    monkeypatch.setattr(np, "fromfile", refuse)
    monkeypatch.setattr(np, "load", refuse)
    monkeypatch.setattr(np, "loadtxt", refuse)
    data.read(0, 1)  # the first read opens the map
    tracemalloc.start()
    for start in range(0, 1_000_000, 100_000):
        np.testing.assert_array_equal(data.read(start + 7, start + 1007),
                                      tokens[start + 7:start + 1007])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 1024, peak  # one 1000-token int32 array is 4 KB; the file is 2 MB
    assert all(isinstance(m, np.memmap) for m in data._maps.values())


# --- format errors ---------------------------------------------------------------------------


def assert_one_line(error, *words):
    message = str(error.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


def test_a_truncated_or_over_long_modded_shard_names_file_and_sizes(tmp_path):
    truncated = modded_file(tmp_path / "t.bin", np.arange(10), count=11)
    with pytest.raises(ValueError) as e:
        TokenShards(truncated)
    assert_one_line(e, truncated, "11 tokens", "is 1044 bytes", "expected 1046")
    long = modded_file(tmp_path / "l.bin", np.arange(10), count=9)
    with pytest.raises(ValueError) as e:
        shards.shard_format(long)
    assert_one_line(e, long, "9 tokens", "is 1044 bytes", "expected 1042")
    header_only = tmp_path / "h.bin"
    header_only.write_bytes(np.array([20240520, 1], "<i4").tobytes())
    with pytest.raises(ValueError) as e:
        shards.shard_format(str(header_only))
    assert_one_line(e, str(header_only), "8 bytes", "1024-byte header")


def test_a_wrong_version_is_refused(tmp_path):
    path = modded_file(tmp_path / "v.bin", np.arange(4), version=2)
    with pytest.raises(ValueError) as e:
        TokenShards(path)
    assert_one_line(e, path, "version 2", "expected 1")


def test_a_raw_file_opening_with_the_magic_says_it_may_be_one(tmp_path):
    """Raw uint16 ids 55432, 308 are the int32 magic 20240520: such a nanoGPT file (a vocabulary
    past 55432) is refused as a broken modded shard, naming the raw reading too."""
    path = tmp_path / "train.bin"
    path.write_bytes(np.array([55432, 308, 7, 9, 11, 13], np.uint16).tobytes())
    with pytest.raises(ValueError) as e:
        TokenShards(str(path))
    assert_one_line(e, str(path), "version", "raw nanoGPT token file opening with ids 55432, 308")


def test_an_odd_sized_raw_file_is_refused(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError) as e:
        TokenShards(str(path))
    assert_one_line(e, str(path), "3 bytes", "expected an even size")


# --- writing ---------------------------------------------------------------------------------


def test_written_shards_match_the_formats_byte_for_byte(tmp_path):
    arrays = [np.arange(5), [], np.array([65535, 0], np.uint64), np.arange(100, 120)]
    stream = np.concatenate([np.asarray(a, np.int64) for a in arrays])  # 27 tokens
    paths = shards.write_token_shards(str(tmp_path / "m" / "train"), iter(arrays),
                                      tokens_per_shard=10)
    assert paths == [str(tmp_path / "m" / f"train_{i:06d}.bin") for i in range(3)]
    assert sorted(os.listdir(tmp_path / "m")) == [os.path.basename(p) for p in paths]
    for i, path in enumerate(paths):
        expected = modded_file(tmp_path / "expected.bin", stream[10 * i:10 * i + 10])
        assert open(path, "rb").read() == open(expected, "rb").read()
    raw = shards.write_token_shards(str(tmp_path / "n" / "val"), arrays, format="nanogpt")
    assert raw == [str(tmp_path / "n" / "val.bin")]
    assert open(raw[0], "rb").read() == stream.astype("<u2").tobytes()
    raw = shards.write_token_shards(str(tmp_path / "n" / "x"), arrays, format="nanogpt",
                                    tokens_per_shard=20)
    assert [TokenShards(p).formats[0] for p in raw] == ["nanogpt"] * 2
    np.testing.assert_array_equal(TokenShards(raw)[:], stream)


def test_exact_multiples_and_no_tokens(tmp_path):
    paths = shards.write_token_shards(str(tmp_path / "a"), [np.arange(20)], tokens_per_shard=10)
    assert TokenShards(paths).shard_lengths == [10, 10]  # no empty shard at the end
    paths = shards.write_token_shards(str(tmp_path / "b"), [], tokens_per_shard=10)
    assert len(paths) == 1 and len(TokenShards(paths)) == 0


@pytest.mark.parametrize("bad", [65536, -1])
def test_ids_outside_uint16_are_refused_and_nothing_is_left(tmp_path, bad):
    with pytest.raises(ValueError) as e:
        shards.write_token_shards(str(tmp_path / "x"), [np.arange(30), np.array([7, bad])],
                                  tokens_per_shard=10)
    assert_one_line(e, f"token id {bad}", "[0, 65535]")
    assert os.listdir(tmp_path) == []  # the 3 complete shards were never renamed into place
    for kwargs, match in [({"format": "gpt2"}, "format='gpt2'"),
                          ({"tokens_per_shard": 0}, "tokens_per_shard=0"),
                          ({"tokens_per_shard": 2**31}, "at most 2\\*\\*31 - 1")]:
        with pytest.raises(ValueError, match=match):
            shards.write_token_shards(str(tmp_path / "x"), [], **kwargs)
    with pytest.raises(ValueError, match="1-D array of integers"):
        shards.write_token_shards(str(tmp_path / "x"), [np.zeros(3)])


# --- prepare --format=bin --------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_bin_through_the_cli_writes_documents_joined_by_eos(tmp_path):
    text_dir, out = shakespeare(tmp_path), tmp_path / "prepared"
    args = [f"--output_dir={out}", f"--input={text_dir}", "--tokenizer=byte", "--format=bin",
            "--tokens_per_shard=500", "--validation_fraction=0.3"]
    result = run_cli("transformer.data.prepare", *args, logs=tmp_path / "logs")
    assert_succeeded(result)
    counts = json.loads(result.stdout)
    assert counts == json.loads((out / "prepare.json").read_text())
    assert counts["format"] == "bin" and counts["tokens_per_shard"] == 500
    tok = tokenizers.load_tokenizer(str(out))
    for split in sources.SPLITS:
        docs = sources.load_documents(text_dir, split, validation_fraction=0.3)
        # Every document followed by <eos>: the documents joined by <eos>, plus a final one.
        expected = np.concatenate([np.append(tok.encode(d.text), tokenizers.EOS_ID)
                                   for d in docs])
        data = TokenShards(str(out / f"{split}_*.bin"))
        assert [os.path.basename(p) for p in data.paths] == counts[split]["files"]
        assert set(data.formats) == {"modded"}
        # Each input file's stream of the split, cut every 500 tokens: {split}_{file}_{k}.bin
        lengths = dict(zip(counts[split]["files"], data.shard_lengths, strict=True))
        for unit in {name.rsplit("_", 1)[0] for name in lengths}:
            own = [n for name, n in lengths.items() if name.rsplit("_", 1)[0] == unit]
            assert all(n == 500 for n in own[:-1]) and 0 < own[-1] <= 500
        np.testing.assert_array_equal(data[:], expected)
        assert counts[split]["tokens"] == len(data) and counts[split]["documents"] == len(docs)
    assert len(counts["train"]["files"]) > 1

    again = run_cli("transformer.data.prepare", *args, logs=tmp_path / "again")
    assert_one_line_error(again, 2, "already holds", ".bin files")


@pytest.mark.slow
def test_prepare_bin_refuses_a_vocab_over_65536(tmp_path, monkeypatch):
    from transformer.data import prepare

    result = run_cli("transformer.data.prepare", f"--output_dir={tmp_path / 'out'}",
                     "--tokenizer=sentencepiece_bpe", "--vocab_size=70000", "--format=bin",
                     logs=tmp_path / "logs")
    assert_one_line_error(result, 2, "vocab_size=70000", "at most 65536")
    assert not (tmp_path / "out").exists()
    # The sentinels come on top of a SentencePiece vocab_size: checked after building too.
    monkeypatch.setattr(tokenizers, "build_tokenizer",
                        lambda *args, **kwargs: tokenizers.ByteTokenizer(num_sentinels=65300))
    with pytest.raises(ValueError, match="vocab_size 65563 with format='bin': expected at most"):
        prepare.prepare(str(tmp_path / "out"), shakespeare(tmp_path), format="bin",
                        validation_fraction=0.3)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("writer", ["bin", "array_record"])
def test_a_write_that_fails_midway_leaves_the_old_files_and_no_partial_ones(tmp_path, writer):
    """Shards are staged under .tmp names and renamed together only when all are complete."""
    def tokens():
        yield np.arange(100)
        yield np.arange(50)
        raise RuntimeError("the tokenizer died")

    if writer == "bin":
        write = lambda: shards.write_token_shards(tmp_path / "train", tokens(),  # noqa: E731
                                                  tokens_per_shard=60)
        old = shards.write_token_shards(tmp_path / "train", [np.arange(7)], tokens_per_shard=60)
    else:
        write = lambda: sources.write_array_records(tmp_path / "train", tokens(),  # noqa: E731
                                                    num_shards=2)
        old = sources.write_array_records(tmp_path / "train", [np.arange(7)], num_shards=2)
    before = {p: open(p, "rb").read() for p in old}
    with pytest.raises(RuntimeError, match="tokenizer died"):
        write()
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in old)
    assert {p: open(p, "rb").read() for p in old} == before
