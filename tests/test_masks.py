"""Mask specs: each pattern against a brute-force predicate, tiles, block maps, combinators."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.nn import masks

PREFIX = np.array([2, 0, 5])
Q_LENGTHS = np.array([4, 7, 1])
KV_LENGTHS = np.array([3, 9, 6])
SEGMENTS = np.array([[1, 1, 2, 2, 2, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1],
                     [1, 2, 3, 4, 5, 6, 7, 8, 9]])


def brute_force(name, b, i, j, q_len, kv_len):
    """The seeds' definitions, one (query i, key j) pair at a time; t = i's position."""
    t = i + kv_len - q_len
    return {
        "full": True,
        "causal": j <= t,
        "window_2_0": t - 2 <= j <= t,
        "window_1_3": t - 1 <= j <= t + 3,
        "window_none_1": j <= t + 1,
        "chunked_3": j <= t and t // 3 == j // 3,
        "prefix_lm": j <= t or j < PREFIX[b],
        "padding": i < Q_LENGTHS[b] and j < KV_LENGTHS[b],
        "segment": SEGMENTS[b, i] == SEGMENTS[b, j] and SEGMENTS[b, i] != 0,
        "segment_causal": SEGMENTS[b, i] == SEGMENTS[b, j] != 0 and j <= t,
        "prefix_or_window": (j <= t or j < PREFIX[b]) or (t - 1 <= j <= t + 3),
    }[name]


def make(name):
    return {
        "full": masks.Full(),
        "causal": masks.Causal(),
        "window_2_0": masks.SlidingWindow(left=2),
        "window_1_3": masks.SlidingWindow(left=1, right=3),
        "window_none_1": masks.SlidingWindow(left=None, right=1),
        "chunked_3": masks.ChunkedCausal(chunk_size=3),
        "prefix_lm": masks.PrefixLM(jnp.asarray(PREFIX)),
        "padding": masks.Padding(jnp.asarray(Q_LENGTHS), jnp.asarray(KV_LENGTHS)),
        "segment": masks.Segment(jnp.asarray(SEGMENTS)),
        "segment_causal": masks.Segment(jnp.asarray(SEGMENTS)) & masks.Causal(),
        "prefix_or_window": masks.PrefixLM(jnp.asarray(PREFIX))
        | masks.SlidingWindow(left=1, right=3),
    }[name]


NAMES = ["full", "causal", "window_2_0", "window_1_3", "window_none_1", "chunked_3", "prefix_lm",
         "padding", "segment", "segment_causal", "prefix_or_window"]
SHAPES = [(9, 9), (3, 9), (1, 9)]  # square, and bottom-right aligned decoding shapes


def expected_dense(name, q_len, kv_len):
    batch = make(name).batch_size
    grid = np.zeros((batch, 1, q_len, kv_len), bool)
    for b, i, j in itertools.product(range(batch), range(q_len), range(kv_len)):
        grid[b, 0, i, j] = brute_force(name, b, i, j, q_len, kv_len)
    return grid


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("q_len,kv_len", SHAPES)
def test_dense_mask_equals_definition(name, q_len, kv_len):
    if name.startswith("segment") and q_len != kv_len:
        pytest.skip("self-attention segment ids need q_len == kv_len")
    dense = np.asarray(make(name).dense(q_len, kv_len))
    np.testing.assert_array_equal(dense, expected_dense(name, q_len, kv_len))


def test_causal_mask_leaks_no_future():
    dense = np.asarray(masks.Causal().dense(6, 6))[0, 0]
    assert not np.triu(dense, k=1).any()
    assert dense[np.tril_indices(6)].all()  # and position t sees every key 0..t


def test_causal_with_fewer_queries_is_bottom_right_aligned():
    square = np.asarray(masks.Causal().dense(8, 8))
    for q_len in (1, 3, 8):
        decode = np.asarray(masks.Causal().dense(q_len, 8))
        np.testing.assert_array_equal(decode, square[:, :, -q_len:])
        assert decode[0, 0, -1].all()  # the last query sees every key


def test_prefix_positions_see_each_other_and_continuation_is_causal():
    dense = np.asarray(masks.PrefixLM(jnp.array([3])).dense(6, 6))[0, 0]
    assert dense[:3, :3].all()  # bidirectional within the prefix
    assert not dense[:3, 3:].any()  # the prefix does not see the continuation
    np.testing.assert_array_equal(dense[3:, 3:], np.tril(np.ones((3, 3), bool)))


def test_cross_attention_padding_mask_only_hides_padded_encoder_keys():
    mask = masks.Padding(kv_lengths=jnp.array([2, 5]))
    dense = np.asarray(mask.dense(3, 5))  # decoder length 3 over encoder length 5
    assert dense.shape == (2, 1, 3, 5)
    np.testing.assert_array_equal(dense[0, 0], np.array([[1, 1, 0, 0, 0]] * 3, bool))
    assert dense[1].all()


def test_packed_cross_attention_segments_with_different_lengths():
    dec = jnp.array([[1, 1, 2, 0]])
    enc = jnp.array([[1, 1, 1, 2, 2, 0]])
    dense = np.asarray(masks.Segment(dec, enc).dense(4, 6))[0, 0]
    np.testing.assert_array_equal(dense.astype(int), [[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                                      [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])


def test_and_or_are_elementwise_and_flatten():
    a, b = make("prefix_lm"), make("window_1_3")
    da, db = np.asarray(a.dense(9, 9)), np.asarray(b.dense(9, 9))
    np.testing.assert_array_equal(np.asarray((a & b).dense(9, 9)), da & db)
    np.testing.assert_array_equal(np.asarray((a | b).dense(9, 9)), da | db)
    assert len((a & b & masks.Causal()).parts) == 3
    with pytest.raises(TypeError, match="ndarray"):
        _ = a & np.ones((1, 1, 9, 9), bool)


@pytest.mark.parametrize("name", NAMES)
def test_tile_equals_slice_of_dense(name):
    mask, q_len, kv_len, qb, kb = make(name), 9, 9, 4, 3
    dense = np.asarray(mask.dense(q_len, kv_len))
    tile = jax.jit(lambda qs, ks: mask.tile(qs, ks, qb, kb, q_len, kv_len))
    for qs, ks in [(0, 0), (4, 3), (4, 6), (5, 0)]:  # traced starts, including unaligned ones
        np.testing.assert_array_equal(np.asarray(tile(qs, ks)), dense[:, :, qs:qs + qb, ks:ks + kb])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("q_len,kv_len,qb,kb", [(9, 9, 3, 3), (9, 9, 4, 2), (3, 9, 2, 4)])
def test_block_map_is_sound_and_exact_for_static_masks(name, q_len, kv_len, qb, kb):
    if name.startswith("segment") and q_len != kv_len:
        pytest.skip("self-attention segment ids need q_len == kv_len")
    mask = make(name)
    dense = np.asarray(mask.dense(q_len, kv_len))[:, 0]
    block_map = mask.block_map(q_len, kv_len, qb, kb)
    assert block_map.shape == (-(-q_len // qb), -(-kv_len // kb))
    for i, j in np.ndindex(*block_map.shape):
        tile = dense[:, i * qb:(i + 1) * qb, j * kb:(j + 1) * kb]
        truth = masks.EMPTY if not tile.any() else masks.FULL if tile.all() else masks.PARTIAL
        if mask.is_static:
            assert block_map[i, j] == truth, (i, j)
        elif block_map[i, j] != masks.PARTIAL:  # dynamic masks may only be conservative
            assert block_map[i, j] == truth, (i, j)


def test_block_map_skips_tiles_for_causal_and_keeps_them_under_prefix_lm():
    causal = masks.Causal().block_map(8, 8, 2, 2)
    np.testing.assert_array_equal(np.diag(causal), [masks.PARTIAL] * 4)
    assert (causal[np.triu_indices(4, 1)] == masks.EMPTY).all()
    assert (causal[np.tril_indices(4, -1)] == masks.FULL).all()
    prefix = masks.PrefixLM(jnp.array([3])).block_map(8, 8, 2, 2)
    assert (prefix[np.tril_indices(4, -1)] == masks.FULL).all()  # causal part is always allowed
    static_and = (masks.Causal() & masks.SlidingWindow(left=1)).block_map(8, 8, 2, 2)
    assert static_and[3, 0] == masks.EMPTY  # static parts are classified jointly


def test_masks_are_pytrees_that_pass_through_jit():
    mask = masks.Segment(jnp.asarray(SEGMENTS)) & masks.Causal()
    dense = jax.jit(lambda m: m.dense(9, 9))(mask)
    np.testing.assert_array_equal(np.asarray(dense), expected_dense("segment_causal", 9, 9))


@pytest.mark.parametrize("make_bad,match", [
    (lambda: masks.SlidingWindow(left=-1), "left=-1"),
    (lambda: masks.SlidingWindow(left=2, right=1.5), "right=1.5"),
    (lambda: masks.ChunkedCausal(chunk_size=0), "chunk_size=0"),
    (lambda: masks.Padding(), "give at least one"),
    (lambda: masks.as_dense(jnp.ones((4, 4)), 4, 4), "float32"),
])
def test_bad_mask_arguments_raise_clear_errors(make_bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_bad()


@pytest.mark.parametrize("kv_ids", [None, np.array([[1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 0, 0, 0],
                                                    [1, 1, 1, 1, 1, 1, 1]])])
def test_segment_tiles_slice_the_ids_as_the_gather_reads_them(kv_ids):
    """`Segment._tile` slices the ids (static starts) or dynamic-slices them (traced starts); a
    tile reaching past the end reads the last id, as `_allowed`'s clipped gather does."""
    ids = jnp.asarray(SEGMENTS)
    mask = masks.Causal() & masks.Segment(ids, None if kv_ids is None else jnp.asarray(kv_ids))
    kv_len = SEGMENTS.shape[1] if kv_ids is None else kv_ids.shape[1]

    def gathered(qs, ks, qb, kb):  # the predicate over explicit (clipped) index arrays
        q_idx, kv_idx = qs + jnp.arange(qb), ks + jnp.arange(kb)
        return jnp.broadcast_to(mask._allowed(q_idx, kv_idx, 9, kv_len), (3, 1, qb, kb))

    for qs, ks, qb, kb in [(0, 0, 4, 3), (4, 3, 4, 3), (6, 5, 4, 4), (8, 6, 3, 5), (2, 0, 9, 7)]:
        expected = np.asarray(gathered(qs, ks, qb, kb))
        static = mask.tile(qs, ks, qb, kb, 9, kv_len)
        traced = jax.jit(lambda a, b, qb=qb, kb=kb: mask.tile(a, b, qb, kb, 9, kv_len))(qs, ks)
        np.testing.assert_array_equal(np.asarray(static), expected, err_msg=f"{qs, ks}")
        np.testing.assert_array_equal(np.asarray(traced), expected, err_msg=f"{qs, ks}")


def test_a_segment_tile_at_static_starts_reads_its_ids_without_a_gather():
    """The dense kernel's blocks start at Python ints: their segment ids are plain slices
    (a gather of iota indices stays a gather in XLA, transposed per element in each fusion)."""
    mask = masks.Causal() & masks.Segment(jnp.asarray(SEGMENTS))
    hlo = jax.jit(lambda m: m.tile(4, 0, 4, 8, 9, 9)).lower(mask).as_text()
    assert "gather" not in hlo and "slice" in hlo
