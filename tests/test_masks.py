"""Mask specs: each pattern against a brute-force predicate, tiles, block maps, combinators."""

import functools
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


def fits(name, q_len, kv_len):
    return q_len == kv_len or not name.startswith("segment")


@functools.cache
def dense_of(q_len, kv_len):
    """{name: dense mask} for every mask of NAMES that fits the shape, from one jitted program
    (masks are pytrees; eager ops would compile one XLA program per op and shape)."""
    names = [name for name in NAMES if fits(name, q_len, kv_len)]
    dense = jax.jit(lambda ms: {n: m.dense(q_len, kv_len) for n, m in ms.items()})(
        {name: make(name) for name in names})
    return {name: np.asarray(d) for name, d in dense.items()}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("q_len,kv_len", SHAPES)
def test_dense_mask_equals_definition(name, q_len, kv_len):
    if not fits(name, q_len, kv_len):
        pytest.skip("self-attention segment ids need q_len == kv_len")
    dense = dense_of(q_len, kv_len)[name]
    np.testing.assert_array_equal(dense, expected_dense(name, q_len, kv_len))


def test_causal_mask_leaks_no_future():
    dense = np.asarray(jax.jit(lambda: masks.Causal().dense(6, 6))())[0, 0]
    assert not np.triu(dense, k=1).any()
    assert dense[np.tril_indices(6)].all()  # and position t sees every key 0..t


def test_causal_with_fewer_queries_is_bottom_right_aligned():
    square, *decodes = jax.jit(lambda: [masks.Causal().dense(q, 8) for q in (8, 1, 3, 8)])()
    square = np.asarray(square)
    for q_len, decode in zip((1, 3, 8), decodes, strict=True):
        decode = np.asarray(decode)
        np.testing.assert_array_equal(decode, square[:, :, -q_len:])
        assert decode[0, 0, -1].all()  # the last query sees every key


def test_prefix_positions_see_each_other_and_continuation_is_causal():
    dense = np.asarray(jax.jit(lambda m: m.dense(6, 6))(masks.PrefixLM(np.array([3]))))[0, 0]
    assert dense[:3, :3].all()  # bidirectional within the prefix
    assert not dense[:3, 3:].any()  # the prefix does not see the continuation
    np.testing.assert_array_equal(dense[3:, 3:], np.tril(np.ones((3, 3), bool)))


def test_cross_attention_padding_mask_only_hides_padded_encoder_keys():
    mask = masks.Padding(kv_lengths=np.array([2, 5]))
    dense = np.asarray(jax.jit(lambda m: m.dense(3, 5))(mask))  # decoder 3 over encoder 5
    assert dense.shape == (2, 1, 3, 5)
    np.testing.assert_array_equal(dense[0, 0], np.array([[1, 1, 0, 0, 0]] * 3, bool))
    assert dense[1].all()


def test_packed_cross_attention_segments_with_different_lengths():
    dec = np.array([[1, 1, 2, 0]])
    enc = np.array([[1, 1, 1, 2, 2, 0]])
    dense = np.asarray(jax.jit(lambda m: m.dense(4, 6))(masks.Segment(dec, enc)))[0, 0]
    np.testing.assert_array_equal(dense.astype(int), [[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                                      [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])


def test_and_or_are_elementwise_and_flatten():
    a, b = make("prefix_lm"), make("window_1_3")
    da, db = dense_of(9, 9)["prefix_lm"], dense_of(9, 9)["window_1_3"]
    both, either = jax.jit(lambda a, b: ((a & b).dense(9, 9), (a | b).dense(9, 9)))(a, b)
    np.testing.assert_array_equal(np.asarray(both), da & db)
    np.testing.assert_array_equal(np.asarray(either), da | db)
    assert len((a & b & masks.Causal()).parts) == 3
    with pytest.raises(TypeError, match="ndarray"):
        _ = a & np.ones((1, 1, 9, 9), bool)


@pytest.mark.parametrize("name", NAMES)
def test_tile_equals_slice_of_dense(name):
    mask, q_len, kv_len, qb, kb = make(name), 9, 9, 4, 3
    dense = dense_of(q_len, kv_len)[name]
    tile = jax.jit(lambda qs, ks: mask.tile(qs, ks, qb, kb, q_len, kv_len))
    for qs, ks in [(0, 0), (4, 3), (4, 6), (5, 0)]:  # traced starts, including unaligned ones
        np.testing.assert_array_equal(np.asarray(tile(qs, ks)), dense[:, :, qs:qs + qb, ks:ks + kb])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("q_len,kv_len,qb,kb", [(9, 9, 3, 3), (9, 9, 4, 2), (3, 9, 2, 4)])
def test_block_map_is_sound_and_exact_for_static_masks(name, q_len, kv_len, qb, kb):
    if not fits(name, q_len, kv_len):
        pytest.skip("self-attention segment ids need q_len == kv_len")
    mask = make(name)
    dense = dense_of(q_len, kv_len)[name][:, 0]
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
    prefix = masks.PrefixLM(np.array([3])).block_map(8, 8, 2, 2)
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
    (lambda: masks.as_dense(jax.device_put(np.ones((4, 4), np.float32)), 4, 4), "float32"),
])
def test_bad_mask_arguments_raise_clear_errors(make_bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_bad()


@pytest.mark.parametrize("kv_ids", [None, np.array([[1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 0, 0, 0],
                                                    [1, 1, 1, 1, 1, 1, 1]])])
def test_segment_tiles_slice_the_ids_as_the_gather_reads_them(kv_ids):
    """`Segment._tile` slices the ids (static starts) or dynamic-slices them (traced starts); a
    tile reaching past the end reads the last id, as `_allowed`'s clipped gather does."""
    mask = masks.Causal() & masks.Segment(SEGMENTS, kv_ids)
    kv_len = SEGMENTS.shape[1] if kv_ids is None else kv_ids.shape[1]
    tiles = [(0, 0, 4, 3), (4, 3, 4, 3), (6, 5, 4, 4), (8, 6, 3, 5), (2, 0, 9, 7)]

    def gathered(mask, qs, ks, qb, kb):  # the predicate over explicit (clipped) index arrays
        q_idx, kv_idx = qs + jnp.arange(qb), ks + jnp.arange(kb)
        return jnp.broadcast_to(mask._allowed(q_idx, kv_idx, 9, kv_len), (3, 1, qb, kb))

    @jax.jit  # one program: the static starts are Python ints in it, the traced ones arguments
    def all_tiles(mask, starts):
        return [(gathered(mask, qs, ks, qb, kb), mask.tile(qs, ks, qb, kb, 9, kv_len),
                 mask.tile(starts[n, 0], starts[n, 1], qb, kb, 9, kv_len))
                for n, (qs, ks, qb, kb) in enumerate(tiles)]

    results = all_tiles(mask, np.array([tile[:2] for tile in tiles], np.int32))
    for (qs, ks, _, _), (expected, static, traced) in zip(tiles, results, strict=True):
        expected = np.asarray(expected)
        np.testing.assert_array_equal(np.asarray(static), expected, err_msg=f"{qs, ks}")
        np.testing.assert_array_equal(np.asarray(traced), expected, err_msg=f"{qs, ks}")


def test_a_segment_tile_at_static_starts_reads_its_ids_without_a_gather():
    """The dense kernel's blocks start at Python ints: their segment ids are plain slices
    (a gather of iota indices stays a gather in XLA, transposed per element in each fusion)."""
    mask = masks.Causal() & masks.Segment(jnp.asarray(SEGMENTS))
    hlo = jax.jit(lambda m: m.tile(4, 0, 4, 8, 9, 9)).lower(mask).as_text()
    assert "gather" not in hlo and "slice" in hlo
