"""Grain pipeline: packing, determinism, exact resume, host sharding, objective features."""

import types

import numpy as np
import pytest

from transformer.data import pipeline
from transformer.data.tokenizers import BOS_ID, EOS_ID, PAD_ID

VOCAB = 300
TOKENIZER = types.SimpleNamespace(  # ids 7..199 are ordinary tokens; 200.. are sentinels
    vocab_size=VOCAB, special_ids=tuple(range(7)) + tuple(range(200, VOCAB)))


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


def rebuild_documents(rows):
    """The documents in the order packed: the non-padding token stream cut after each EOS."""
    stream = []
    for batch in rows:
        for inputs, targets, segments in zip(batch["inputs"], batch["targets"],
                                             batch["segment_ids"], strict=True):
            stream += inputs[segments != 0].tolist()
            stream += [int(targets[-1])] if targets[-1] != PAD_ID else []  # the row's last token
    docs, current = [], []
    for token in stream:
        current.append(token)
        if token == EOS_ID:
            docs.append(tuple(current))
            current = []
    assert not current, "the stream ends inside a document"
    return docs


def test_packing_loses_and_duplicates_no_token_over_an_epoch():
    docs = documents()
    rebuilt = rebuild_documents(batches(docs=docs, batch_size=1, seq_len=8))
    assert sorted(rebuilt) == sorted(tuple(d.tolist()) for d in docs)
    assert rebuilt != [tuple(d.tolist()) for d in docs]  # shuffled


def test_packed_rows_have_correct_segments_positions_and_weights():
    for batch in batches(seq_len=8):
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
    kwargs = dict(objective=objective, tokenizer=TOKENIZER, seq_len=8, batch_size=2, seed=1,
                  num_epochs=None, process_index=0, process_count=1)
    it = iter(pipeline.make_dataset(documents(), **kwargs))
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    fresh = iter(pipeline.make_dataset(documents(), **kwargs))
    fresh.set_state(state)
    for want in expected:
        got = next(fresh)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_two_hosts_together_see_what_one_host_sees_without_overlap():
    docs = documents(n=41)
    one = rebuild_documents(batches(docs=docs, batch_size=1))
    hosts = [rebuild_documents(batches(docs=docs, batch_size=2, process_index=i,
                                       process_count=2)) for i in range(2)]
    assert not set(hosts[0]) & set(hosts[1])
    assert sorted(hosts[0] + hosts[1]) == sorted(one)
    first = batches(docs=docs, batch_size=2, process_index=1, process_count=2)[0]
    assert first["inputs"].shape == (1, 8)  # each process yields its share of the global batch


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
])
def test_bad_pipeline_arguments_raise_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        batches(**kwargs)


def test_make_global_batch_lays_out_the_process_rows_on_the_mesh():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((len(jax.devices()),), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    batch = batches(batch_size=len(jax.devices()), n=1)[0]
    global_batch = pipeline.make_global_batch(batch, NamedSharding(mesh, PartitionSpec("data")))
    for k, v in batch.items():
        np.testing.assert_array_equal(np.asarray(global_batch[k]), v)
        assert global_batch[k].sharding.spec == PartitionSpec("data")
