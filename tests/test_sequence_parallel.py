"""Sequence (context) parallelism: the zig-zag layout, masks on permuted sequences, attention
over sequence blocks, and (slow, 8 forced CPU devices in tests/sequence_check.py) both
strategies against one device, in attention and in training."""

from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sharding import run_check
from test_train import assert_succeeded, run_cli, tiny_flags, train_losses

from transformer import configs, evaluate
from transformer.data import inputs
from transformer.nn import dense_attention, masks, sequence_parallel
from transformer.nn.chunked_attention import chunked_attention
from transformer.parallel import sharding
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import finetune, startup

# --- the layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("length, shards", [(8, 2), (48, 3), (64, 8)])
def test_zigzag_is_a_permutation_that_to_and_from_zigzag_apply(length, shards):
    order = sequence_parallel.zigzag(length, shards)
    assert sorted(order.tolist()) == list(range(length))
    x = np.arange(2 * length).reshape(2, length) * 10
    np.testing.assert_array_equal(sequence_parallel.to_zigzag(x, shards), x[:, order])
    np.testing.assert_array_equal(sequence_parallel.from_zigzag(x[:, order], shards), x)
    moved = sequence_parallel.to_zigzag(jnp.asarray(x)[..., None], shards)  # traced arrays too
    np.testing.assert_array_equal(moved[..., 0], x[:, order])


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_zigzag_gives_every_device_the_same_share_of_a_causal_mask(shards):
    """The contiguous split gives the last device about 2n - 1 times the first one's query-key
    pairs; zig-zag gives each device exactly 1/n of them."""
    length = 16 * shards
    causal = np.tril(np.ones((length, length), bool))
    per_device = lambda rows: [int(causal[r].sum()) for r in np.split(rows, shards)]
    contiguous = per_device(np.arange(length))
    assert contiguous[-1] > 0.9 * (2 * shards - 1) * contiguous[0]
    balanced = per_device(sequence_parallel.zigzag(length, shards))
    assert len(set(balanced)) == 1 and sum(balanced) == causal.sum()


def test_permuted_mask_is_the_mask_with_rows_and_columns_reordered():
    ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3, 0, 0]])
    inner = masks.PrefixLM(jnp.array([2, 5])) & masks.Segment(ids) & masks.SlidingWindow(left=3)
    order = sequence_parallel.zigzag(8, 2)
    got = masks.Permuted(inner, jnp.asarray(order)).dense(8, 8)
    want = np.asarray(inner.dense(8, 8))[:, :, order][:, :, :, order]
    np.testing.assert_array_equal(got, want)


def test_without_a_sequence_axis_nothing_is_split():
    assert sequence_parallel.shards() == 1  # no mesh
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    with jax.set_mesh(mesh):
        assert sequence_parallel.shards() == 1  # a mesh but no rules
        with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
            assert sequence_parallel.shards() == 1  # sequence=1


def test_lengths_that_do_not_split_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^length=12: expected a multiple of 2 x "
                                         r"mesh.sequence=4 \(load-balanced chunks\)$"):
        sequence_parallel.zigzag(12, 4)
    with pytest.raises(ValueError, match=r"^seq_len=30: expected a multiple of "
                                         r"mesh.sequence=4$"):
        sequence_parallel.check_length(30, 4, load_balance=False, what="seq_len")
    config = configs.base_config()
    config.update(seq_len=48, batch_size=8)
    config.mesh.update(data=1, sequence=32)
    with pytest.raises(ValueError, match=r"^seq_len=48: expected a multiple of 2 x "
                                         r"mesh.sequence=32"):
        configs.validate_config(config, num_devices=32, num_processes=1)
    config.model.update(family="bert")  # bidirectional: contiguous blocks, no load balancing
    config.seq_len = 64
    configs.validate_config(config, num_devices=32, num_processes=1)



def test_evaluate_refuses_an_eval_seq_len_its_mesh_does_not_split_before_restoring(monkeypatch):
    """A run trained on data=2 x sequence=4, evaluated at 36 tokens: on 8 devices (its own
    mesh) 36 is no multiple of 2 x 4 load-balanced chunks, one line naming eval_seq_len before
    the tokenizer or checkpoint is read; on one device (data parallel: no split) it passes."""
    config = configs.base_config()
    config.update(seq_len=64, batch_size=8)
    config.mesh.update(data=2, sequence=4)
    monkeypatch.setattr(checkpoint_lib, "saved_run", lambda workdir, step: (10, config))

    class Past(Exception):
        """Got past the checks."""

    def past(*args, **kwargs):
        raise Past

    monkeypatch.setattr(inputs, "get_tokenizer", past)
    monkeypatch.setattr(finetune, "restore_params", past)
    with pytest.raises(Past):  # this process's one device: evaluated data parallel
        evaluate.evaluate_workdir("run", seq_lens=(36,))
    one = jax.devices()
    monkeypatch.setattr(jax, "devices", lambda *args: one * 8)  # as if 8: the run's mesh fits
    with pytest.raises(ValueError) as error:
        evaluate.evaluate_workdir("run", seq_lens=(32, 36))
    assert str(error.value) == ("eval_seq_len=36: expected a multiple of 2 x mesh.sequence=4 "
                                "(load-balanced chunks)")
    with pytest.raises(Past):
        evaluate.evaluate_workdir("run", seq_lens=(32, 40))
    # A training's eval_seq_lens: a length its mesh cannot split is skipped, as one it cannot
    # run at (run_eval.after_training says why), not traced to fail after the last step.
    assert not startup.evaluable(config, 36) and startup.evaluable(config, 40)

# --- attention over blocks of a longer sequence (what each device computes) ------------------


@pytest.mark.parametrize("mask_name", ["causal", "packed_zigzag", "prefix"])
def test_attention_over_a_query_block_is_those_rows_of_the_whole(mask_name):
    """chunked_attention(totals, offsets) on queries a:b (what one device of the all-gather
    strategy computes) gives rows a:b of attention over the whole sequence."""
    rng = np.random.default_rng(0)
    length, split = 24, 3
    q, k, v = (jnp.asarray(rng.standard_normal((2, length, 2, 4)), jnp.float32)
               for _ in range(3))
    ids = jnp.array([[1] * 7 + [2] * 13 + [0] * 4, [5] * 24])
    mask = {"causal": masks.Causal(),
            "packed_zigzag": masks.Permuted(masks.Causal() & masks.Segment(ids),
                                            jnp.asarray(sequence_parallel.zigzag(length, 3))),
            "prefix": masks.PrefixLM(jnp.array([9, 0]))}[mask_name]
    bias = lambda qi, ki: -0.1 * jnp.abs(qi[:, None] - ki[None, :]).astype(jnp.float32)
    whole = dense_attention.reference_attention(q, k, v, mask, bias(jnp.arange(length),
                                                               jnp.arange(length)))
    block = length // split
    for a in range(0, length, block):
        rows = chunked_attention(q[:, a:a + block], k, v, mask, bias, q_chunk=4, kv_chunk=4,
                                 totals=(length, length), offsets=(a, 0))
        np.testing.assert_allclose(rows, whole[:, a:a + block], atol=1e-6)
    with pytest.raises(ValueError, match="dense mask array"):
        chunked_attention(q, k, v, mask.dense(length, length), totals=(length, length),
                          offsets=(0, 0))


# --- 8 devices ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_check("sequence_check.py", tmp_path_factory)


@pytest.mark.slow
def test_both_strategies_give_dense_attention_on_one_device(results):
    """Causal, packed, prefix-LM, sliding-window, bottom-right and zig-zag masks, soft-capped
    logits and attention sinks; outputs and q/k/v/T5-table/sink gradients; sequence 2, 4, 8 and
    data x sequence x tensor (packed, prefix-LM, zig-zag and sinks)."""
    diffs = results["attention"]
    assert len(diffs) == (8 + 4) * 2 + 2 * 2 and all(
        strategy in " ".join(diffs) for strategy in sequence_parallel.STRATEGIES)
    bad = {case: diff for case, diff in diffs.items() if diff > 2e-5}
    assert not bad, bad


@pytest.mark.slow
def test_training_on_each_sequence_mesh_matches_one_device(results):
    runs = results["training"]
    assert {name.split("/")[0] for name in runs} == {"gpt", "prefix_lm"}
    assert {name.split("/")[3] for name in runs} == {"rope", "alibi", "t5", "learned"}
    assert {"qk_norm", "attention_softcap", "sliding_window_pattern", "parallel_block",
            "qk_norm_scope"} <= {knob for name in runs for knob in name.split("/")[4:]}
    for name, run in runs.items():
        np.testing.assert_allclose(run["losses"], run["want"], rtol=2e-6, err_msg=name)
        assert run["max_param_diff"] < 1e-5, name


@pytest.mark.slow
def test_the_ring_holds_less_per_device_as_the_axis_grows(results):
    """Compiled temp bytes per device of attention fwd + bwd at 16k tokens, sequence 1, 2, 4,
    8: the ring's fall with the axis (its K/V blocks are T / n); the all-gather's do not: on
    every split axis it holds the whole K and V, and their gradients before the reduce-scatter
    (4 x 16 MiB)."""
    ring, gather = results["memory"]["ring"], results["memory"]["all_gather"]
    whole = 4 * 16384 * 4 * 64 * 4  # K, V, dK, dV: [16384, 4, 64] float32 each
    assert ring[1] > ring[2] > ring[3]
    assert ring[3] < 0.5 * ring[1] and ring[3] < 0.5 * gather[3]
    assert min(gather[1:]) > whole > ring[3]


@pytest.mark.slow
def test_the_all_gather_gathers_each_devices_own_rows_only(results):
    """data=2 x sequence=4 with 2 rows holds what sequence=4 with 1 row holds: K / V gathered
    and dK / dV reduce-scattered for the device's row, not for the whole batch."""
    one_row, two_rows = results["memory"]["rows"]
    assert two_rows <= 1.05 * one_row, (one_row, two_rows)


@pytest.mark.slow
def test_a_checkpoint_saved_on_one_sequence_mesh_continues_on_another(results):
    """Saved on sequence=4 (ring), restored on data=2 x sequence=2 (all-gather)."""
    reshard = results["reshard"]
    np.testing.assert_allclose(reshard["losses"], reshard["want"], rtol=2e-6)
    assert reshard["max_param_diff"] < 1e-5


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """{devices: (workdir, the training's stdout)}: the tiny run trained through the CLI on one
    device and on 4 as data=2 x sequence=2 (all_gather)."""
    root, runs = tmp_path_factory.mktemp("cli"), {}
    for devices, mesh in ((1, ()), (4, ("--config.mesh.data=2", "--config.mesh.sequence=2"))):
        workdir = root / f"devices_{devices}"
        result = run_cli("transformer.train", f"--workdir={workdir}", *tiny_flags(3),
                         "--config.model.sequence_parallel=all_gather", *mesh,
                         logs=root / f"logs_{devices}", devices=devices)
        assert_succeeded(result)
        runs[devices] = workdir, result.stdout
    return runs


@pytest.mark.slow
def test_the_cli_trains_on_a_data_by_sequence_mesh_as_on_one_device(cli_runs):
    """4 devices as data=2 x sequence=2, all_gather (each device gathers the keys and values of
    its own rows over the axis: a shard_map manual over data and sequence at once, which jax
    0.12 compiles where one nested in another failed a check), train the losses one device
    trains, through the CLI. The newest-jax tier runs it (tests/select_newest_jax.py)."""
    losses = {devices: train_losses(workdir) for devices, (workdir, _) in cli_runs.items()}
    assert "sequence=2" in cli_runs[4][1] and sorted(losses[4]) == sorted(losses[1]) == [1, 2, 3]
    np.testing.assert_allclose([losses[4][s] for s in (1, 2, 3)],
                               [losses[1][s] for s in (1, 2, 3)], rtol=1e-5)


@pytest.mark.slow
def test_evaluate_at_a_length_the_axis_does_not_split_says_so_and_one_device_evaluates_it(
        cli_runs, tmp_path):
    """`transformer.evaluate --eval_seq_len=10` on the data=2 x sequence=2 run: on its 4 devices
    one line (10 is no multiple of 2 x 2 chunks) and nothing written; on one device (data
    parallel) it evaluates."""
    workdir = cli_runs[4][0]
    refused = run_cli("transformer.evaluate", f"--workdir={workdir}", "--eval_seq_len=10",
                      logs=tmp_path / "refused", devices=4)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        "error: eval_seq_len=10: expected a multiple of 2 x mesh.sequence=2 (load-balanced "
        "chunks)")
    assert not list(workdir.glob("eval_*.json"))
    result = run_cli("transformer.evaluate", f"--workdir={workdir}", "--eval_seq_len=10",
                     logs=tmp_path / "one_device", devices=1)
    assert_succeeded(result)
    assert "evaluating data parallel over 1 of the 1 devices" in result.stderr
    metrics = json.loads((workdir / "eval_3_len10.json").read_text())
    assert np.isfinite(metrics["by_seq_len"]["10"]["loss"])

@pytest.mark.slow
def test_generate_reads_a_run_trained_on_more_devices_than_it_has(cli_runs, tmp_path):
    """The data=2 x sequence=2 run's checkpoint on one device: generation and visualize read it
    data parallel with a note (they failed, calling the intact checkpoint unreadable)."""
    result = run_cli("transformer.generate", f"--workdir={cli_runs[4][0]}", "--prompt=ab",
                     "--max_new_tokens=4", logs=tmp_path, devices=1)
    assert_succeeded(result)
    assert "sequence=2 x tensor=1; reading it data parallel over 1 of the 1 devices here" in \
        result.stderr, result.stderr
    assert result.stdout.startswith("ab")
    # visualize reads it the same way (it failed so after generate was fixed)
    pictures = run_cli("transformer.visualize", f"--workdir={cli_runs[4][0]}", "--text=ab",
                       f"--output_dir={tmp_path / 'maps'}", "--layer=0", logs=tmp_path / "maps",
                       devices=1)
    assert_succeeded(pictures)
    assert "reading it data parallel over 1 of the 1 devices here" in pictures.stderr
    assert list((tmp_path / "maps").glob("*.png")), pictures.stdout


@pytest.mark.slow
def test_a_seq_len_the_axis_does_not_split_is_refused_before_anything_runs(results):
    assert results["errors"]["seq_len"] == (
        "seq_len=40: expected a multiple of 2 x mesh.sequence=8 (load-balanced chunks)")


# --- splash per device (Pallas interpret mode; 8 forced CPU devices in sequence_splash_check) --


def test_splash_reason_names_what_splash_cannot_run_under_the_axis():
    """None where splash runs each device's block; otherwise the reason the kernel line gives
    for running the chunked kernel instead."""
    order = sequence_parallel.zigzag(512, 2)
    ids = jnp.ones((2, 512), jnp.int32)
    packed = masks.Permuted(masks.Causal() & masks.Segment(ids), jnp.asarray(order),
                            zigzag_shards=2)
    reason = functools.partial(sequence_parallel.splash_reason, q_len=512, kv_len=512,
                               num_shards=2, platform="tpu", interpret=False)
    assert reason(packed, None, strategy="all_gather") is None
    assert reason(masks.Causal() & masks.SlidingWindow(left=9), None,
                  strategy="all_gather") is None
    assert "all_gather strategy only" in reason(packed, None, strategy="ring")
    assert "no bias" in reason(packed, lambda q, k: q, strategy="all_gather")
    assert "segment ids" in reason(masks.PrefixLM(jnp.array([3, 4])), None,
                                   strategy="all_gather")
    assert "multiples of 128" in sequence_parallel.splash_reason(
        packed, None, strategy="all_gather", q_len=256, kv_len=256, num_shards=4,
        platform="tpu", interpret=False)
    assert "platform tpu" in sequence_parallel.splash_reason(
        packed, None, strategy="all_gather", q_len=512, kv_len=512, num_shards=2,
        platform="cpu", interpret=False)

    def traced(order):  # an order only known at run time needs `zigzag_shards`
        unmarked = masks.Permuted(masks.Causal(), order)
        assert "at trace time" in reason(unmarked, None, strategy="all_gather")
        marked = masks.Permuted(masks.Causal(), order, zigzag_shards=2)
        assert reason(marked, None, strategy="all_gather") is None
        return order
    jax.jit(traced)(jnp.asarray(order))


@pytest.fixture(scope="module")
def splash_results(tmp_path_factory):
    return run_check("sequence_splash_check.py", tmp_path_factory)


@pytest.mark.slow
def test_splash_per_device_gives_the_chunked_and_one_device_attention(splash_results):
    """Packed causal rows with padding, sequence 2 and 4, zig-zag on and off, a sliding window
    with soft-capped logits, data x sequence x tensor: outputs and q/k/v gradients."""
    diffs = splash_results["attention"]
    assert len(diffs) == 5 and any("contiguous" in case for case in diffs)
    bad = {case: d for case, d in diffs.items() if max(d.values()) > 1e-5}
    assert not bad, bad


@pytest.mark.slow
def test_a_gpt_with_splash_under_the_axis_matches_chunked_and_one_device(splash_results):
    runs = splash_results["model"]
    assert set(runs) == {"sequence=2/zigzag", "sequence=4/zigzag", "sequence=4/contiguous"}
    for name, run in runs.items():
        n = name.split("/")[0].split("=")[1]
        assert run["kernels"] == [f"splash per device, all_gather over sequence={n}"], name
        assert run["vs_chunked"] < 1e-5 and run["vs_one_device"] < 1e-5, (name, run)
        np.testing.assert_allclose(run["loss"], run["want_loss"], rtol=1e-6)


@pytest.mark.slow
def test_what_splash_cannot_run_under_the_axis_runs_chunked_and_says_why(splash_results):
    assert splash_results["fallbacks"] == {
        "ring": ["chunked per device, ring over sequence=2 (splash runs the all_gather "
                 "strategy only (got ring))"],
        "prefix_lm": ["chunked per device, all_gather over sequence=2 (splash takes no "
                      "per-example mask but segment ids (prefix-LM, padding))"],
        "alibi": ["chunked per device, all_gather over sequence=2 (splash takes no bias "
                  "(ALiBi / T5))"]}
