"""Grain pipeline: windows through one token sequence (uniform per epoch, whole-split
evaluation, streams), determinism, exact and elastic resume, process-invariant global batches,
objective features, global batch assembly."""

import functools
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_train import cli_env

from transformer.data import features, global_batches, pipeline, tokenizers
from transformer.data.tokenizers import BOS_ID, EOS_ID, PAD_ID
from transformer.data.windows import Corpus, Windows

VOCAB = 300


def fake_tokenizer(vocab_size: int, num_sentinels: int) -> tokenizers.Tokenizer:
    """The project's id layout (specials 0..6, sentinels at the top) without any text."""
    tokenizer = tokenizers.Tokenizer()
    tokenizer.vocab_size, tokenizer.num_sentinels = vocab_size, num_sentinels
    return tokenizer


TOKENIZER = fake_tokenizer(VOCAB, 100)  # ids 7..199 are ordinary tokens; 200.. are sentinels


def documents(n=40, seed=0):
    """Distinct documents of varied lengths (some longer than a row), each ending in EOS."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = int(rng.integers(1, 30))
        body = 7 + (np.arange(length) + 3 * i) % 190
        docs.append(np.concatenate([body, [EOS_ID]]).astype(np.int32))
    return docs


def batches(objective="next_token", docs=None, n=None, **kwargs):
    kwargs = {**dict(objective=objective, tokenizer=TOKENIZER, seq_len=8, batch_size=2, seed=0,
                     num_epochs=1, process_index=0, process_count=1), **kwargs}
    ds = pipeline.make_dataset(documents() if docs is None else docs, **kwargs)
    it = iter(ds)
    return [next(it) for _ in range(n)] if n else list(it)


def rebuild_stream(batch_list):
    """The token sequence an in-order next-token pass read: each row's inputs (rows overlap by
    the one token that is the last target of one row and the first input of the next), then
    the last row's final target."""
    stream, last = [], []
    for batch in batch_list:
        for inputs, targets, segments in zip(batch["inputs"], batch["targets"],
                                             batch["segment_ids"], strict=True):
            if segments.any():
                stream += inputs[segments != 0].tolist()
                final = int(targets[segments != 0][-1])  # padding past the text's end
                last = [final] if final != PAD_ID else []
    return stream + last


def split_after_eos(stream):
    docs, current = [], []
    for token in stream:
        current.append(token)
        if token == EOS_ID:
            docs.append(tuple(current))
            current = []
    assert not current, "the stream ends inside a document"
    return docs


def test_an_in_order_pass_reads_the_documents_exactly_once_in_order():
    docs = documents()
    rebuilt = split_after_eos(rebuild_stream(batches(docs=docs, batch_size=3, shuffle=False)))
    assert rebuilt == [tuple(d.tolist()) for d in docs]


def uneven_documents(seed=0):
    """Like a real corpus: 3 long documents and 300 one-line ones (Paradise Lost's book
    titles beside its books), every token a distinct id so that reads can be counted."""
    rng = np.random.default_rng(seed)
    lengths = [900, 1500, 700] + [int(n) for n in rng.integers(2, 8, size=300)]
    rng.shuffle(lengths)
    docs, next_id = [], 7
    for length in lengths:
        docs.append(np.arange(next_id, next_id + length, dtype=np.int32))
        next_id += length
    return docs


@pytest.mark.parametrize("objective", ["next_token", "mlm", "prefix_lm"])
def test_an_evaluation_pass_reads_every_token_exactly_once(objective):
    """Whatever the document lengths: every token once (next_token: every token but each
    document's first is a weighted target once), the last batch padded with weight-0 rows."""
    docs = uneven_documents()
    tokens = np.concatenate(docs)
    got = batches(objective, docs=docs, batch_size=8, seq_len=16)
    if objective == "next_token":
        read = np.concatenate([b["targets"][b["weights"] > 0] for b in got])
        firsts = {int(d[0]) for d in docs}
        assert sorted(read.tolist()) == [t for t in tokens.tolist() if t not in firsts]
    elif objective == "mlm":  # the uncorrupted tokens are the targets where segments != 0
        read = np.concatenate([b["targets"][b["segment_ids"] > 0] for b in got])
        assert sorted(read.tolist()) == tokens.tolist()
    else:
        read = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1)
                               [np.concatenate([b["inputs"], b["targets"][:, -1:]], 1) != 0]
                               for b in got])
        assert sorted(read.tolist()) == tokens.tolist()


@pytest.mark.parametrize("stream", [False, True])
def test_training_reads_every_token_once_per_epoch_whatever_the_document_lengths(stream):
    """One epoch of training samples (the windows of one epoch) reads each token as a target
    at most once and misses at most 2 * seq_len of them; the one-line documents get exactly
    their share of the reads (the per-row streams read them 22% of the time on Milton)."""
    docs, seq_len, batch_size = uneven_documents(), 16, 4
    corpus = Corpus.from_documents(docs, stream=stream)
    windows = Windows(corpus, width=seq_len + 1, stride=seq_len, seed=0,
                                training=True, shuffle=True)
    epoch = -(-windows.rows // batch_size)
    got = batches(docs=corpus, batch_size=batch_size, seq_len=seq_len, num_epochs=None,
                  n=epoch)
    rows = [{k: v[r] for k, v in b.items()} for b in got for r in range(batch_size)]
    rows = rows[:windows.rows]  # exactly one epoch of samples
    read = np.concatenate([row["targets"] for row in rows])
    counts = np.bincount(read, minlength=int(np.concatenate(docs).max()) + 1)[7:]
    assert counts.max() == 1
    assert (counts == 0).sum() <= 2 * seq_len + 1
    short = np.concatenate([d for d in docs if len(d) < 10])
    share = np.isin(read, short).mean()
    assert abs(share - len(short) / len(np.concatenate(docs))) < 0.01


def test_each_epoch_shuffles_documents_offsets_and_windows():
    docs = uneven_documents()
    corpus = Corpus.from_documents(docs)
    windows = Windows(corpus, width=17, stride=16, seed=0, training=True,
                                shuffle=True)
    first = [windows.row(i)["tokens"] for i in range(windows.rows)]
    second = [windows.row(windows.rows + i)["tokens"] for i in range(windows.rows)]
    assert not all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert windows._epoch(0)[2] != windows._epoch(1)[2] or \
        not np.array_equal(windows._epoch(0)[0], windows._epoch(1)[0])


def test_a_stream_window_is_one_segment_with_consecutive_positions():
    """data.unit="stream": no position restart and no segment masking inside a window, even
    across a document's end; the order of the text is kept."""
    docs = uneven_documents()
    tokens = np.concatenate(docs)
    for batch in batches(docs=Corpus.from_documents(docs, stream=True), batch_size=4,
                         seq_len=16, num_epochs=None, n=20):
        assert (batch["segment_ids"] == 1).all()
        assert (batch["positions"] == np.arange(16)).all()
        assert (batch["weights"] == 1).all()
        for inputs in batch["inputs"]:  # a contiguous piece of the text
            start = int(np.flatnonzero(tokens == inputs[0])[0])
            np.testing.assert_array_equal(inputs, tokens[start:start + 16])


def test_packed_rows_have_correct_segments_positions_and_weights():
    for batch in batches(seq_len=8, num_epochs=None, n=30):
        for inputs, targets, weights, segments, positions in zip(
                batch["inputs"], batch["targets"], batch["weights"], batch["segment_ids"],
                batch["positions"], strict=True):
            assert inputs.shape == (8,)
            for t in range(8):
                if segments[t] == 0:
                    assert inputs[t] == PAD_ID and weights[t] == 0
                elif t > 0 and segments[t] == segments[t - 1]:
                    assert positions[t] == positions[t - 1] + 1  # positions count up in a doc
                else:
                    assert t == 0 or positions[t] == 0  # a new document starts at 0
            # a prediction is weighted iff its target is in the same document
            same = np.append(segments[1:] == segments[:-1], True) & (segments != 0)
            assert (weights[:-1] == same[:-1]).all()
            assert (targets[weights == 1] != PAD_ID).all()


def test_same_seed_same_batches_and_different_seed_different_order():
    a, b = batches(seed=3), batches(seed=3)
    c = batches(seed=4)
    for x, y in zip(a, b, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c, strict=False))


@pytest.mark.parametrize("objective", pipeline.OBJECTIVES)
def test_restored_iterator_continues_with_exactly_the_next_batches(objective):
    kwargs = dict(objective=objective, tokenizer=TOKENIZER, seq_len=8, batch_size=4, seed=1,
                  num_epochs=None, rows=[3, 0])
    it = iter(pipeline.make_dataset(documents(), **kwargs))
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    fresh = iter(pipeline.make_dataset(documents(), **kwargs))
    fresh.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it
    for want in expected:
        got = next(fresh)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def select_rows(batch_list, rows):
    return [{k: v[list(rows)] for k, v in b.items()} for b in batch_list]


@pytest.mark.slow
@pytest.mark.parametrize("objective", pipeline.OBJECTIVES)
def test_the_global_batch_does_not_depend_on_which_process_reads_which_rows(objective):
    kw = dict(objective=objective, batch_size=4, num_epochs=None, n=6)
    full = batches(**kw)
    assert full[0][next(iter(full[0]))].shape[0] == 4
    halves = [batches(rows=range(0, 2), **kw), batches(rows=range(2, 4), **kw)]
    assert_same_batches([{k: np.concatenate([a[k], b[k]]) for k in a}
                         for a, b in zip(*halves, strict=True)], full)
    # The default rows of process p of P are its contiguous block of the global batch.
    assert_same_batches(batches(process_index=1, process_count=2, **kw), halves[1])
    # Any subset, in any order: local row i is global row rows[i].
    for rows in ([0, 2], [3, 1], [2]):
        assert_same_batches(batches(rows=rows, **kw), select_rows(full, rows))


def test_an_evaluation_pass_has_the_same_batches_on_every_process_count():
    docs = documents(n=41)
    full = batches(docs=docs, batch_size=4)
    assert len(full) > 1
    parts = [batches(docs=docs, batch_size=4, process_index=i, process_count=4)
             for i in range(4)]
    assert all(len(part) == len(full) for part in parts)  # no process stops early
    assert_same_batches([{k: np.concatenate([b[k] for b in group]) for k in group[0]}
                         for group in zip(*parts, strict=True)], full)


def test_the_iterator_state_is_one_batch_index_any_process_count_resumes():
    """The saved position does not depend on the process: a state from process 1 of 2
    resumes a single process at the same global batch (elastic resume)."""
    kw = dict(objective="mlm", tokenizer=TOKENIZER, seq_len=8, batch_size=4, seed=1)
    half = iter(pipeline.make_dataset(documents(), process_index=1, process_count=2, **kw))
    for _ in range(3):
        next(half)
    state = half.get_state()
    whole = iter(pipeline.make_dataset(documents(), process_index=0, process_count=1, **kw))
    whole.set_state(json.loads(json.dumps(state)))
    expected = batches("mlm", batch_size=4, seed=1, num_epochs=None, n=5)[3:]
    assert_same_batches([next(whole), next(whole)], expected)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["mlm", "span_corruption", "prefix_lm"])
def test_converting_a_batch_equals_converting_each_row_in_turn(objective):
    raw = batches("next_token", docs=documents(), batch_size=3, seq_len=16, n=1)[0]
    tokens = np.concatenate([raw["inputs"], raw["targets"][:, -1:]], axis=1)  # [3, 17]
    if objective == "prefix_lm":
        batch = {"tokens": tokens, "tokens_segment_ids": (np.arange(17) < [[17], [9], [4]]) * 1}
        convert = features.prefix_lm_features
    elif objective == "mlm":
        batch = {"tokens": tokens, "tokens_segment_ids": tokens * 0 + 1,
                 "tokens_positions": tokens * 0}
        convert = functools.partial(features.mlm_features, tokenizer=TOKENIZER, rate=0.3)
    else:
        batch = {"tokens": tokens}
        convert = functools.partial(features.span_corruption_features, tokenizer=TOKENIZER,
                                    noise_density=0.3, mean_span_length=2.0)
    whole = convert(batch, np.random.default_rng(5))
    rng = np.random.default_rng(5)  # the same keys, drawn row by row
    rows = [convert({k: v[i:i + 1] for k, v in batch.items()}, rng) for i in range(3)]
    for k in whole:
        np.testing.assert_array_equal(whole[k], np.concatenate([r[k] for r in rows]), k)
    other = convert(batch, np.random.default_rng(6))
    assert any(not np.array_equal(whole[k], other[k]) for k in whole)


def test_mlm_features_corrupt_only_selected_non_special_tokens():
    rows = batches("mlm", seq_len=16, batch_size=4, num_epochs=None, n=20)
    selected = changed = 0
    for b in rows:
        inputs, targets, weights = b["inputs"], b["targets"], b["weights"]
        assert (inputs[weights == 0] == targets[weights == 0]).all()
        assert not np.isin(targets[weights == 1], TOKENIZER.special_ids).any()
        selected += int(weights.sum())
        changed += int((inputs != targets).sum())
    assert 0 < selected and changed <= selected


def test_span_corruption_features_teacher_force_the_targets():
    rows = batches("span_corruption", seq_len=16, batch_size=2, num_epochs=None, n=3)
    for b in rows:
        assert b["encoder_inputs"].shape[1] == 16
        np.testing.assert_array_equal(b["decoder_inputs"][:, 0], BOS_ID)
        np.testing.assert_array_equal(b["decoder_inputs"][:, 1:], b["targets"][:, :-1])
        assert (b["targets"][:, -1] == EOS_ID).all()
        assert (b["encoder_inputs"][:, -1] == EOS_ID).all()


def test_prefix_lm_features_weight_only_the_continuation():
    rows = batches("prefix_lm", seq_len=12, batch_size=4, num_epochs=None, n=10)
    for b in rows:
        for p, w, seg in zip(b["prefix_lengths"], b["weights"], b["segment_ids"], strict=True):
            n = int(seg.sum()) + 1  # tokens in the row (inputs + the last target)
            assert 1 <= p <= max(n - 1, 1)
            assert not w[:max(p - 1, 0)].any()


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=1), "seq_len=1: expected an int >= 2"),
    (dict(batch_size=3, process_count=2), "batch_size=3: expected a multiple"),
    (dict(objective="clm"), "objective='clm'"),
    (dict(rows=[]), r"rows=\[\]: expected at least one global batch row"),
    (dict(rows=[0, 2]), r"rows contains 2: expected ints in \[0, 2\)"),
    (dict(rows=[-1]), r"rows contains -1: expected ints in \[0, 2\)"),
    (dict(rows=[0.0]), r"rows contains 0.0: expected ints"),
    (dict(rows=[1, 0, 1]), r"rows repeats \[1\]: expected each global batch row once"),
    (dict(docs=[np.array([7, 8, EOS_ID])], seq_len=8, num_epochs=None, n=1),
     r"the split has 3 tokens, too few for one row of seq_len=8: expected more text or a "
     r"smaller seq_len"),
])
def test_bad_pipeline_arguments_raise_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as error:
        batches(**kwargs)
    assert "\n" not in str(error.value)


def test_make_global_batch_on_one_device_puts_local_row_i_at_global_row_rows_i():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((len(jax.devices()),), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    batch = batches(batch_size=len(jax.devices()), n=1)[0]
    rows = global_batches.process_rows(sharding, len(jax.devices()))
    np.testing.assert_array_equal(rows, np.arange(len(jax.devices())))
    global_batch = global_batches.make_global_batch(batch, sharding, rows,
                                                    batch_size=len(jax.devices()))
    for k, v in batch.items():
        np.testing.assert_array_equal(np.asarray(global_batch[k]), v)
        assert global_batch[k].sharding.spec == PartitionSpec("data")


# Four host CPU devices need their own process (XLA reads the flag once, at startup).
MULTI_DEVICE_CHECK = textwrap.dedent("""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from transformer.data import global_batches

    assert len(jax.devices()) == 4
    B = 8
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    for spec in (P("data"), P(("data", "model")), P(), P("data", "model")):
        rows = global_batches.process_rows(NamedSharding(mesh, spec), B)
        np.testing.assert_array_equal(rows, np.arange(B))  # one process: every row, once
    rows = np.array([5, 0, 7, 2, 1, 3, 6, 4])  # local row i is global row rows[i]
    local = {"x": rows[:, None] * 10 + np.arange(4), "y": rows.astype(np.float32)}
    want = {"x": np.arange(B)[:, None] * 10 + np.arange(4), "y": np.arange(B)}
    for spec in (P("data"), P(("data", "model")), P(), P("data", "model")):
        sharding = NamedSharding(mesh, spec)
        for k in ("x",) if len(spec) == 2 else ("x", "y"):
            out = global_batches.make_global_batch({k: local[k]}, sharding, rows,
                                                   batch_size=B)[k]
            assert out.shape == want[k].shape and out.sharding == sharding
            np.testing.assert_array_equal(np.asarray(out), want[k])
            for shard in out.addressable_shards:  # each device holds its own rows
                np.testing.assert_array_equal(shard.data, want[k][shard.index])
    try:
        global_batches.make_global_batch({"y": local["y"][:6]}, NamedSharding(mesh, P("data")),
                                         rows[:6], batch_size=B)
    except ValueError as e:
        assert "global rows [4, 6] on this process" in str(e), e  # shard 4:8 of P("data")
    else:
        raise AssertionError("rows missing from the local batch must raise")
    print("ok")
""")


def test_process_rows_and_make_global_batch_on_a_four_device_mesh():
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = cli_env(4)
    result = subprocess.run([sys.executable, "-c", MULTI_DEVICE_CHECK], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# Two JAX processes of two CPU devices each, as in a multi-host run: each process reads only its
# rows' streams, yet the global batches it assembles hold exactly the single-process batches.
TWO_PROCESS_CHECK = textwrap.dedent("""
    import json
    import sys
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2,
                               process_id=int(sys.argv[1]))
    sys.path.insert(0, sys.argv[3])
    from test_pipeline import TOKENIZER, documents
    from transformer.data import global_batches, pipeline

    B = 8
    layouts = [(jax.make_mesh((4,), ("data",)), P("data")),  # half the rows per process
               (jax.make_mesh((2, 2), ("data", "model")), P("model"))]
    all_rows = []
    for mesh, spec in layouts:
        sharding = NamedSharding(mesh, spec)
        rows = global_batches.process_rows(sharding, B)
        all_rows.append(rows.tolist())
        for objective in pipeline.OBJECTIVES:
            kw = dict(objective=objective, tokenizer=TOKENIZER, seq_len=8, batch_size=B, seed=0,
                      num_epochs=None, prefetch=0)
            mine = iter(pipeline.make_dataset(documents(), rows=rows, **kw))
            full = iter(pipeline.make_dataset(documents(), rows=range(B), **kw))
            for _ in range(2):
                global_batch = global_batches.make_global_batch(next(mine), sharding, rows,
                                                                batch_size=B)
                want = next(full)
                for k, array in global_batch.items():
                    assert array.shape == want[k].shape, k
                    for shard in array.addressable_shards:
                        np.testing.assert_array_equal(shard.data, want[k][shard.index], k)
    print(json.dumps(all_rows))
""")


@pytest.mark.slow
def test_two_processes_assemble_exactly_the_single_process_global_batches():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        address = f"localhost:{s.getsockname()[1]}"
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = cli_env(2)
    processes = [subprocess.Popen(
        [sys.executable, "-c", TWO_PROCESS_CHECK, str(i), address, str(repo / "tests")],
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=120))
    finally:
        for process in processes:
            process.kill()
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
    rows = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]
    assert sorted(rows[0][0] + rows[1][0]) == list(range(8))  # the data axis spans processes
    assert not set(rows[0][0]) & set(rows[1][0])
