"""Weighted data mixtures (data.sources): the block schedule meets the weights, has random
access, does not depend on the processes and resumes exactly; config errors; and one run
through the CLI with per-source token counts and validation records."""

import json

import numpy as np
import pytest
from test_pipeline import assert_same_batches, fake_tokenizer
from test_train import assert_succeeded, read_metrics, run_cli, tiny_flags

from transformer import configs
from transformer.data import inputs, pipeline, prepare, sources
from transformer.data.mixture import Mixture
from transformer.data.tokenizers import EOS_ID
from transformer.training import evaluation

TOKENIZER = fake_tokenizer(300, 0)
WEIGHTS = [(0.7, 0.2, 0.1), (0.55, 0.45), (1, 1, 1), (0.6, 0.25, 0.15), (5, 0.3, 0.01),
           (3e-6, 1e-6, 5e-7)]  # (weights so small that rounding each alone moved them)
# Each source's tokens in its own range, so a row tells which source it came from.
RANGES = [(10, 90), (100, 180), (200, 280)]


def source_documents(source: int, n: int = 12, seed: int = 0):
    rng = np.random.default_rng((seed, source))
    low, high = RANGES[source]
    return [np.append(rng.integers(low, high, int(rng.integers(3, 20))), EOS_ID)
            .astype(np.int32) for _ in range(n)]


def source_of(tokens: np.ndarray) -> int:
    """The source a row's tokens come from (its first non-special token's range)."""
    first = int(tokens[tokens >= 7][0])
    return next(s for s, (low, high) in enumerate(RANGES) if low <= first < high)


def mixture_dataset(weights=(0.75, 0.25), *, batch_size=4, **kwargs):
    kwargs = {**dict(objective="next_token", tokenizer=TOKENIZER, seq_len=8,
                     batch_size=batch_size, seed=3, process_index=0, process_count=1,
                     prefetch=0), **kwargs}
    docs = [source_documents(s) for s in range(len(weights))]
    return pipeline.make_dataset(docs, weights=weights, **kwargs)


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


# --- the schedule -----------------------------------------------------------------------------


@pytest.mark.parametrize("weights", WEIGHTS)
def test_every_prefix_of_whole_blocks_meets_the_weights_within_one_sample(weights):
    mixture = Mixture(weights, seed=0)
    w = np.array(weights, float) / sum(weights)
    K = mixture.block
    assert K == int(np.ceil(1 / w.min() - 1e-9))
    previous = np.zeros(len(w), np.int64)
    for b in range(1, 400):
        counts = mixture.counts(b * K)
        assert counts.sum() == b * K
        assert np.all(np.abs(counts - w * b * K) < 1), (b, counts, w * b * K)
        assert np.all(counts >= previous)  # no source ever gives a sample back
        # Within a block each source gets w * K samples, give or take less than two.
        assert np.all(np.abs(counts - previous - w * K) < 2)
        previous = counts


def test_weights_keep_their_ratios_at_any_scale_and_a_too_small_one_is_named():
    """Weights are ratios: (8e-7, 6e-7) is (4, 3), block for block; one under 2**-20 of the
    total is refused as that (it read "expected each > 0" for a weight of 1e-7)."""
    for small, large in (((8e-7, 6e-7), (4, 3)), ((3e-6, 1e-6, 5e-7), (6, 2, 1))):
        a, b = Mixture(small, seed=0), Mixture(large, seed=0)
        assert a.block == b.block
        assert [a.locate(i) for i in range(50)] == [b.locate(i) for i in range(50)]
    with pytest.raises(ValueError, match=r"the smallest is 1\.00e-07 of the total: expected "
                                         r"at least 2\*\*-20"):
        Mixture((1.0, 1e-7), seed=0)


@pytest.mark.parametrize("weights", WEIGHTS[:3])
def test_random_access_equals_sequential_and_each_source_reads_its_rows_in_order(weights):
    n = 30 * Mixture(weights, seed=1).block + 5
    sequential = [Mixture(weights, seed=1).locate(i) for i in range(n)]
    fresh = Mixture(weights, seed=1)  # visits blocks out of order: no history
    order = np.random.default_rng(0).permutation(n)
    assert {int(i): fresh.locate(int(i)) for i in order} == dict(enumerate(sequential))
    sources = np.array([s for s, _ in sequential])
    for s in range(len(weights)):  # source s's own samples 0, 1, 2, ... in order
        local = [k for source, k in sequential if source == s]
        assert local == list(range(len(local)))
    for m in (0, 1, n // 3, n):
        np.testing.assert_array_equal(fresh.counts(m), np.bincount(sources[:m],
                                                                   minlength=len(weights)))
    other_seed = [Mixture(weights, seed=2).locate(i) for i in range(n)]
    assert other_seed != sequential


def test_the_rows_come_from_the_sources_the_schedule_names_in_the_weights_proportions():
    weights = (0.6, 0.25, 0.15)
    batch_size, num_batches = 4, 70  # 280 samples: 40 blocks of 7
    it = iter(mixture_dataset(weights, batch_size=batch_size))
    read = np.array([source_of(row) for batch in take(it, num_batches)
                     for row in batch["inputs"]])
    mixture = Mixture(weights, seed=3)
    np.testing.assert_array_equal(read, [mixture.locate(i)[0] for i in range(len(read))])
    np.testing.assert_array_equal(np.bincount(read), [168, 70, 42])  # exactly 0.6/0.25/0.15


# --- the pipeline: processes and resume -------------------------------------------------------


def test_the_mixture_batches_do_not_depend_on_the_process_split():
    full = take(iter(mixture_dataset()), 6)
    halves = [take(iter(mixture_dataset(rows=rows)), 6) for rows in ([0, 1], [2, 3])]
    assert_same_batches([{k: np.concatenate([a[k], b[k]]) for k in a}
                         for a, b in zip(*halves, strict=True)], full)
    odd = take(iter(mixture_dataset(rows=[3, 1])), 6)
    assert_same_batches(odd, [{k: v[[3, 1]] for k, v in batch.items()} for batch in full])


@pytest.mark.parametrize("objective", ["next_token", "prefix_lm", "mlm"])
def test_a_mixture_resumes_exactly_from_its_state_on_another_process_count(objective):
    """The state is one batch index (json round trip, as a checkpoint stores it): a state
    saved by process 1 of 2 resumes one process at the same global batches."""
    half = iter(mixture_dataset(objective=objective, process_index=1, process_count=2))
    take(half, 5)
    state = json.loads(json.dumps(half.get_state()))
    whole = iter(mixture_dataset(objective=objective))
    whole.set_state(state)
    expected = take(iter(mixture_dataset(objective=objective)), 9)[5:]
    assert_same_batches(take(whole, 4), expected)


def test_a_mixture_is_for_training_only():
    with pytest.raises(ValueError, match="a mixture is for training"):
        mixture_dataset(num_epochs=1)


# --- config -----------------------------------------------------------------------------------


@pytest.fixture
def two_texts(tmp_path):
    paths = []
    for name, word in (("prose", "the quick brown fox"), ("code", "def f(x): return x")):
        path = tmp_path / f"{name}.txt"
        path.write_text("".join(f"{word} {i} {i * 7}\n\n" for i in range(120)))
        paths.append(path)
    return paths


def mixture_config(prose, code, weights=(0.75, 0.25)):
    config = configs.base_config()
    config.data.sources = (f"path={prose},weight={weights[0]}",
                           f"path={code},weight={weights[1]},unit=stream")
    return config


@pytest.mark.parametrize("change, message", [
    ({"weight": "0"}, r"data.sources 'prose': weight=0.0: expected a finite number > 0"),
    ({"weight": "-1"}, r"'prose': weight=-1.0: expected a finite number > 0"),
    ({"weight": "nan"}, r"'prose': weight=nan: expected a finite number > 0"),
    ({"weight": "inf"}, r"'prose': weight=inf: expected a finite number > 0"),
    ({"weight": "lots"}, r"weight='lots': expected a number > 0"),
    ({"unit": "sentence"}, r"'prose': unit='sentence': expected one of"),
    ({"path": "missing.txt"}, r"data.sources 'missing': path missing.txt: no such file"),
    ({"validation_path": "gone/"}, r"'prose': validation_path gone/: no such file"),
    ({"name": "code"}, r"data.sources repeats the names \['code'\]"),
    ({"colour": "red"}, r"'colour=red': expected comma-separated key=value pairs"),
])
def test_a_bad_source_is_a_one_line_value_error_naming_it(two_texts, change, message):
    config = mixture_config(*two_texts)
    fields = {"path": str(two_texts[0]), "weight": "0.75", **change}
    config.data.sources = (",".join(f"{k}={v}" for k, v in fields.items()),
                           config.data.sources[1])
    with pytest.raises(ValueError, match=message) as error:
        configs.validate_config(config, num_devices=1, num_processes=1)
    assert "\n" not in str(error.value)


def test_data_path_with_sources_is_a_one_line_error(two_texts):
    config = mixture_config(*two_texts)
    configs.validate_config(config, num_devices=1, num_processes=1)  # the mixture is valid
    config.data.path = str(two_texts[0])
    with pytest.raises(ValueError, match=r"data.path=.*: expected '' with data.sources"):
        configs.validate_config(config, num_devices=1, num_processes=1)


def test_a_validation_path_that_another_source_trains_on_is_refused(two_texts):
    """prose validating on code.txt, which the code source trains on, would score trained text."""
    prose, code = two_texts
    config = mixture_config(prose, code)
    config.data.sources = (f"path={prose},weight=0.75,validation_path={code}",
                           f"path={code},weight=0.25,unit=stream")
    with pytest.raises(ValueError) as error:
        configs.validate_config(config)
    assert str(error.value) == (
        f"data.sources 'prose': validation_path={str(code)!r}: {code} is also a training file, "
        f"of data.sources 'code': path={str(code)!r}: expected held-out files apart from the "
        "training files (point the path at the train files alone, e.g. a glob)")
    held_out = code.parent / "held_out.txt"  # a file no source trains on: accepted
    held_out.write_text(code.read_text().upper())
    config.data.sources = (f"path={prose},weight=0.75,validation_path={held_out}",
                           config.data.sources[1])
    configs.validate_config(config)


def test_the_data_stream_names_the_sources_their_weights_and_fingerprints(two_texts):
    config = mixture_config(*two_texts)
    stream = inputs.data_stream(config)
    assert set(stream["fingerprint"]) == {"prose", "code"}
    assert json.loads(json.dumps(stream)) == stream  # as the checkpoint gives it back
    assert inputs.data_stream(mixture_config(*two_texts, weights=(0.5, 0.5))) != stream
    two_texts[1].write_text("other text\n\n" * 50)
    assert inputs.data_stream(config)["fingerprint"]["code"] != stream["fingerprint"]["code"]


def test_the_same_sources_written_differently_are_the_same_data_stream(two_texts):
    """0.7 and 0.70, spaces around '=' and ',', key order and a name equal to the default do
    not change the mixture, so they do not make another data stream."""
    prose, code = two_texts
    config = configs.base_config()
    stream = None
    for first in (f"path={prose},weight=0.7", f"path={prose},weight=0.70",
                  f"path = {prose} , weight = 0.7", f"weight=0.7, path={prose}",
                  f"name=prose, path={prose}, weight=7e-1"):
        config.data.sources = (first, f"path={code}, weight = 0.3, unit = stream")
        configs.validate_config(config, num_devices=1, num_processes=1)
        assert [(s.name, s.path, s.weight, s.unit) for s in sources.parse_sources(
            config.data.sources)] == [("prose", str(prose), 0.7, ""),
                                      ("code", str(code), 0.3, "stream")], first
        assert inputs.mixture_weights(config) == [0.7, 0.3]
        stream = stream or inputs.data_stream(config)
        assert inputs.data_stream(config) == stream, first
    assert stream["data"]["sources"] == [f"path={prose},weight=0.7",
                                         f"path={code},weight=0.3,unit=stream"]
    config.data.sources = (f"path={prose},weight=0.71", config.data.sources[1])
    assert inputs.data_stream(config) != stream
    config.data.sources = (f"path={prose},weight=0.7,name=other", config.data.sources[1])
    assert inputs.data_stream(config) != stream


def test_the_tokenizer_is_built_on_the_union_of_the_sources_train_splits(two_texts):
    config = mixture_config(*two_texts)
    config.data.tokenizer = "char"
    tokenizer = inputs.get_tokenizer(config)
    both = "".join(path.read_text() for path in two_texts)
    assert set(tokenizer.decode(tokenizer.encode(both))) == set(both)  # no <unk> from either
    prose_only = configs.base_config()
    prose_only.data.update(path=str(two_texts[0]), tokenizer="char")
    assert inputs.get_tokenizer(prose_only).vocab_size < tokenizer.vocab_size


def test_a_prepared_source_brings_the_tokenizer_and_must_agree_with_the_others(two_texts,
                                                                              tmp_path):
    for name, kind in (("char_a", "char"), ("char_b", "char"), ("bytes", "byte")):
        prepare.prepare(str(tmp_path / name), str(two_texts[0]), tokenizer=kind)
    config = configs.base_config()
    config.data.update(tokenizer="char", sources=(f"path={tmp_path / 'char_a'},weight=1",
                                                  f"path={two_texts[1]},weight=1"))
    tokenizer = inputs.get_tokenizer(config)
    assert tokenizer.kind == "char"
    batch = next(iter(inputs.get_dataset(config, tokenizer, "train")))  # text + prepared
    assert batch["inputs"].shape == (config.batch_size, config.seq_len)
    config.data.sources += (f"path={tmp_path / 'char_b'},weight=1",)
    inputs.get_tokenizer(config)  # prepared with the same tokenizer: fine
    config.data.sources += (f"path={tmp_path / 'bytes'},weight=1",)
    with pytest.raises(ValueError, match="'bytes'.* was prepared with another tokenizer"):
        inputs.get_tokenizer(config)


# --- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_mixture_trains_through_the_cli_and_refuses_a_resume_with_other_weights(two_texts,
                                                                                  tmp_path):
    workdir = tmp_path / "run"
    prose, code = two_texts

    def train(weights, steps):
        sources = (f"('path={prose},weight={weights[0]}', "
                   f"'path={code},weight={weights[1]},unit=stream')")
        return run_cli("transformer.train", f"--workdir={workdir}",
                       f"--config.data.sources={sources}", *tiny_flags(steps),
                       logs=tmp_path / f"logs_{weights[0]}_{steps}")

    assert_succeeded(train((0.75, 0.25), 2))
    records = read_metrics(workdir)
    last_train = [r for r in records if r["split"] == "train"][-1]
    mixture = Mixture((0.75, 0.25), seed=0)
    expected = mixture.counts(2 * 2) * 16  # 2 steps of batch 2, rows of 16 tokens
    assert [last_train["tokens/prose"], last_train["tokens/code"]] == expected.tolist()
    splits = {r["split"]: r for r in records if r["split"].startswith("validation")}
    assert set(splits) == {"validation", "validation/prose", "validation/code"}
    n = splits["validation/prose"]["num_tokens"] + splits["validation/code"]["num_tokens"]
    assert splits["validation"]["num_tokens"] == n
    assert splits["validation"]["loss"] == pytest.approx(
        sum(splits[f"validation/{s}"]["loss"] * splits[f"validation/{s}"]["num_tokens"]
            for s in ("prose", "code")) / n)
    # The final pass's windows: each source's (eval_steps x batch_size), one after the other.
    windows = evaluation.load_windows(str(workdir))
    assert windows["step"] == 2 and len(windows["num_tokens"]) == 2 * 2
    assert windows["num_tokens"].sum() == n
    assert abs(windows["loss_sum"].sum() / n - splits["validation"]["loss"]) < 1e-6
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["tokens/prose"] == last_train["tokens/prose"]

    refused = train((0.5, 0.5), 4)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "data.sources" in refused.stderr and "another data stream" in refused.stderr
