"""Attention maps: probability rows with the mask's zeros, the same for scanned and unrolled
stacks, named per stack for every family (T5: encoder, decoder and cross), readable token labels,
pictures and data written only after every check, and the CLI on a saved run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import forkserver
import jax
import matplotlib.image
import numpy as np
import pytest
from test_mla import reference_weights
from test_train import cli_env

from transformer import visualize
from transformer.configs import base_config
from transformer.data import tokenizers
from transformer.models import build_model, transformer_config
from transformer.nn import layers
from transformer.nn.blocks import stack_unrolled
from transformer.nn.mixers.mla import MLASettings

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = tokenizers.ByteTokenizer(num_sentinels=4)
TEXT = "def f(x):"


def tiny(family: str, **model):
    config = base_config()
    config.model.update(**{**dict(family=family, num_layers=2, d_model=32, num_heads=2,
                                  d_ff=64, vocab_size=TOKENIZER.vocab_size), **model})
    return config


def init(config, tokens, decoder_tokens=None):
    """(model, untrained params): the init's param tree filled with seeded N(0, 0.3^2) draws,
    which skips compiling the init (the maps' properties hold for any weights)."""
    model = build_model(config.model)
    args = (tokens[None],) if decoder_tokens is None else (tokens[None], decoder_tokens[None])
    shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), *args)["params"]))
    rng = np.random.default_rng(0)
    return model, jax.tree.map(
        lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


@pytest.fixture(scope="module")
def gpt():
    config = tiny("gpt")
    tokens, decoder_tokens = visualize.encode_text(config, TOKENIZER, TEXT)
    assert decoder_tokens is None
    model, params = init(config, tokens)
    maps, layers = visualize.attention_maps(model, params, config, tokens)
    assert layers == {"decoder/self_attention": (0, 1)}
    return config, params, tokens, maps


def test_gpt_maps_are_causal_probability_rows(gpt):
    _, _, tokens, maps = gpt
    assert tokens.tolist() == TOKENIZER.encode(TEXT).tolist()  # packed documents: alone
    config = tiny("gpt")
    config.data.unit = "stream"  # each document after the previous one's <eos>
    assert visualize.encode_text(config, TOKENIZER, TEXT)[0].tolist() == [
        tokenizers.EOS_ID, *tokens.tolist()]
    assert list(maps) == ["decoder/self_attention"]
    weights = maps["decoder/self_attention"]
    t = len(tokens)
    assert weights.shape == (2, 2, t, t) and weights.dtype == np.float32
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    upper = np.triu(np.ones((t, t), bool), k=1)
    assert np.all(weights[..., upper] == 0.0)  # no query sees a later token
    assert np.all(weights[..., ~upper] > 0.0)  # but every earlier one
    assert not np.allclose(weights[0], weights[1])  # the layers differ (their order matters)


def test_scanned_layers_give_the_unrolled_maps(gpt):
    config, params, tokens, maps = gpt
    assert {"layers_0", "layers_1"} <= set(params["decoder"])
    scanned = tiny("gpt", scan_layers=True)
    scanned_params = dict(params, decoder=layers.stack_layers(params["decoder"], 2))
    scanned_maps = visualize.attention_maps(build_model(scanned.model), scanned_params, scanned,
                                            tokens)[0]
    assert list(scanned_maps) == ["decoder/self_attention"]
    np.testing.assert_allclose(scanned_maps["decoder/self_attention"],
                               maps["decoder/self_attention"], atol=1e-6)


def hybrid(layer_types="linear_attention,full_attention", **model):
    """By default layers linear_attention, full_attention, ...: Gated DeltaNet at the even
    indices."""
    config = tiny("gpt", layer_types=layer_types, **model)
    config.model.linear_attention.update(key_head_dim=8, value_head_dim=8)
    return config


def normed_inputs(model, params, tokens) -> dict[int, np.ndarray]:
    """{layer: the float64 [T, D] its self-attention reads (after its norm)} of a GPT."""
    _, state = model.apply({"params": params}, tokens[None], capture_intermediates=True,
                           mutable=["intermediates"])
    stack = state["intermediates"]["decoder"]
    return {int(name[7:]): np.asarray(layer["self_attention_norm"]["__call__"][0][0], np.float64)
            for name, layer in stack.items() if "self_attention_norm" in layer}


def causal_softmax(logits_NTS):
    t = logits_NTS.shape[-1]
    logits_NTS = np.where(np.tril(np.ones((t, t), bool)), logits_NTS, -np.inf)
    w = np.exp(logits_NTS - logits_NTS.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def attention_by_hand(p, h_TD):
    """Multi-head attention's causal weights [N, T, T] in float64 from its params: RoPE (base
    10000, half layout) on q = h W_q + b_q and k = h W_k + b_k, logits scaled by 1/sqrt(H)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    q, k = (np.einsum("td,dnh->tnh", h_TD, p[n]) + p[f"{n}_bias"] for n in ("query", "key"))
    head_dim = q.shape[-1]
    angles = np.arange(len(h_TD))[:, None, None] * 10000.0 ** (
        -np.arange(0, head_dim, 2) / head_dim)
    rope = lambda x: np.concatenate([  # noqa: E731
        x[..., :head_dim // 2] * np.cos(angles) - x[..., head_dim // 2:] * np.sin(angles),
        x[..., head_dim // 2:] * np.cos(angles) + x[..., :head_dim // 2] * np.sin(angles)], -1)
    return causal_softmax(np.einsum("tnh,snh->nts", rope(q), rope(k)) / np.sqrt(head_dim))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_a_hybrid_stacks_maps_are_its_attention_layers(tmp_path, scan_layers):
    """Layers 1 and 3 attend (0 and 2 are Gated DeltaNet): the maps are theirs, labelled so
    everywhere (scanned: `layers/block_1`, every second layer), and the others are named."""
    config = hybrid(num_layers=4)
    tokens, _ = visualize.encode_text(config, TOKENIZER, TEXT)
    model, params = init(config, tokens)
    inputs = normed_inputs(model, params, tokens)
    assert sorted(inputs) == [1, 3]  # (the input norms of the linear layers are named apart)
    want = np.stack([attention_by_hand(params["decoder"][f"layers_{i}"]["self_attention"],
                                       inputs[i]) for i in (1, 3)])
    if scan_layers:
        config = hybrid(num_layers=4, scan_layers=True)
        model = build_model(config.model)
        params = dict(params, decoder=stack_unrolled(transformer_config(config.model),
                                                     params["decoder"]))
    maps, map_layers = visualize.attention_maps(model, params, config, tokens)
    assert map_layers == {"decoder/self_attention": (1, 3)}
    weights = maps["decoder/self_attention"]
    np.testing.assert_allclose(weights, want, atol=2e-6)  # index i: layer 2 i + 1
    assert not np.allclose(weights[0], weights[1], atol=1e-2)
    assert visualize.missing_layers(config) == (
        "layers without softmax attention, so without a map: 0, 2 (linear_attention)")

    labels = visualize.token_labels(TOKENIZER, tokens)
    paths = visualize.save_attention_maps(maps, labels, labels, str(tmp_path), layers=map_layers,
                                          layer=3, head=1)
    assert [Path(p).name for p in paths] == [
        "attention.npz", "decoder.self_attention_grid.png", "decoder.self_attention_L3_H1.png"]
    data = np.load(paths[0])
    assert data["decoder.self_attention.layers"].tolist() == [1, 3]
    np.testing.assert_array_equal(data["decoder.self_attention"], weights)
    with pytest.raises(ValueError, match=r"^layer=0: expected 1, 3 \(the layers with a "
                                         r"decoder/self_attention map\)$"):
        visualize.save_attention_maps(maps, labels, labels, str(tmp_path / "no"),
                                      layers=map_layers, layer=0)


def test_a_scanned_moe_stacks_dense_layers_keep_their_indices():
    """A scanned MoE stack's first dense layers scan apart (`dense_layers`), the rest in groups
    of the MoE period (`layers/block_<j>`): the maps are still layers 0..3 in order."""
    config, scanned = (tiny("gpt", num_layers=4, scan_layers=scan) for scan in (False, True))
    for c in (config, scanned):
        c.model.moe.update(num_experts=2, top_k=1, every_n_layers=2, first_dense_layers=2)
    tokens, _ = visualize.encode_text(config, TOKENIZER, TEXT)
    model, params = init(config, tokens)
    maps, map_layers = visualize.attention_maps(model, params, config, tokens)
    scanned_params = dict(params, decoder=stack_unrolled(transformer_config(scanned.model),
                                                         params["decoder"]))
    assert set(scanned_params["decoder"]) >= {"dense_layers", "layers"}
    scanned_maps, scanned_layers = visualize.attention_maps(
        build_model(scanned.model), scanned_params, scanned, tokens)
    assert map_layers == scanned_layers == {"decoder/self_attention": (0, 1, 2, 3)}
    np.testing.assert_allclose(scanned_maps["decoder/self_attention"],
                               maps["decoder/self_attention"], atol=1e-6)


def test_mla_maps_are_its_softmax_weights():
    """Multi-head latent attention sows its weights too: each layer's map is
    softmax([q_nope; q_rope] . [k_nope; k_rope] * scale) under the causal mask, by hand."""
    config = tiny("gpt", attention_kind="mla", rope_layout="interleaved", num_heads=4,
                  use_bias=False)
    config.model.mla.update(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=6)
    tokens, _ = visualize.encode_text(config, TOKENIZER, TEXT)
    model, params = init(config, tokens)
    maps, map_layers = visualize.attention_maps(model, params, config, tokens)
    assert map_layers == {"decoder/self_attention": (0, 1)}
    weights = maps["decoder/self_attention"]
    assert weights.shape == (2, 4, len(tokens), len(tokens))
    settings = MLASettings.from_config(transformer_config(config.model))
    inputs = normed_inputs(model, params, tokens)
    for layer in (0, 1):
        want = reference_weights(params["decoder"][f"layers_{layer}"]["self_attention"],
                                 inputs[layer], settings)[0]
        np.testing.assert_allclose(weights[layer], want, atol=2e-6)
    assert not np.allclose(weights[0], weights[1], atol=1e-2)
    assert visualize.missing_layers(config) is None


def test_a_model_without_softmax_attention_says_so():
    config = hybrid(num_layers=2, layer_types="linear_attention")
    tokens, _ = visualize.encode_text(config, TOKENIZER, TEXT)
    with pytest.raises(ValueError, match=r"^model.layer_types='linear_attention': no "
                                         r"softmax-attention layer, so no attention maps: "
                                         r"expected a full_attention or sliding_attention "
                                         r"layer$"):
        visualize.attention_maps(build_model(config.model), None, config, tokens)  # no apply


def test_a_prefix_lm_sees_its_whole_prefix(gpt):
    _, params, tokens, maps = gpt  # a prefix LM has the GPT's params
    config = tiny("prefix_lm")
    model = build_model(config.model)
    weights = visualize.attention_maps(model, params, config, tokens)[0][
        "decoder/self_attention"]
    t, prefix = len(tokens), len(tokens) // 2  # the default prefix: half the tokens
    allowed = np.tril(np.ones((t, t), bool))
    allowed[:, :prefix] = True
    assert np.all(weights[..., ~allowed] == 0.0) and np.all(weights[..., allowed] > 0.0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    causal = visualize.attention_maps(model, params, config, tokens, prefix_length=0)[0]
    np.testing.assert_allclose(causal["decoder/self_attention"], maps["decoder/self_attention"],
                               atol=1e-6)
    with pytest.raises(ValueError, match=f"prefix_length={t + 1}: expected 0..{t}"):
        visualize.attention_maps(model, params, config, tokens, prefix_length=t + 1)


def test_bert_attends_everywhere_and_learned_positions_stop_at_max_len():
    config = tiny("bert", position="learned", max_len=12)
    tokens, _ = visualize.encode_text(config, TOKENIZER, TEXT)
    assert tokens.tolist() == TOKENIZER.encode(TEXT).tolist()  # read as is
    model, params = init(config, tokens)
    maps = visualize.attention_maps(model, params, config, tokens)[0]
    assert list(maps) == ["encoder/self_attention"]
    weights = maps["encoder/self_attention"]
    assert weights.shape == (2, 2, len(tokens), len(tokens)) and np.all(weights > 0.0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)

    long = TOKENIZER.encode("x" * 13)
    with pytest.raises(ValueError, match=r"^tokens of length 13: learned positions go up to "
                                         r"model.max_len=12$"):
        visualize.attention_maps(model, None, config, long)  # checked before applying


def test_t5_has_encoder_decoder_and_cross_maps():
    config = tiny("t5", num_decoder_layers=1, position="t5")
    tokens, decoder_tokens = visualize.encode_text(config, TOKENIZER, "source", target="out")
    assert tokens.tolist() == [*TOKENIZER.encode("source").tolist(), tokenizers.EOS_ID]
    assert decoder_tokens.tolist() == [tokenizers.BOS_ID, *TOKENIZER.encode("out").tolist()]
    model, params = init(config, tokens, decoder_tokens)
    maps, layers = visualize.attention_maps(model, params, config, tokens,
                                            decoder_tokens=decoder_tokens)
    assert layers == {"decoder/cross_attention": (0,), "decoder/self_attention": (0,),
                      "encoder/self_attention": (0, 1)}
    s, t = len(tokens), len(decoder_tokens)
    assert {name: w.shape for name, w in maps.items()} == {
        "decoder/cross_attention": (1, 2, t, s), "decoder/self_attention": (1, 2, t, t),
        "encoder/self_attention": (2, 2, s, s)}
    for weights in maps.values():
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(maps["decoder/self_attention"][0, 0], k=1) == 0.0)
    assert np.all(maps["encoder/self_attention"] > 0.0)

    no_target = visualize.encode_text(config, TOKENIZER, "source")[1]
    assert no_target.tolist() == [tokenizers.BOS_ID]

    enc = visualize.token_labels(TOKENIZER, tokens)
    dec = visualize.token_labels(TOKENIZER, decoder_tokens)
    assert enc == ["s", "o", "u", "r", "c", "e", "<eos>"] and dec == ["<bos>", "o", "u", "t"]
    queries, keys = visualize.axis_labels(list(maps), enc, dec)
    assert queries == {"decoder/cross_attention": dec, "decoder/self_attention": dec,
                       "encoder/self_attention": enc}
    assert keys == {"decoder/cross_attention": enc, "decoder/self_attention": dec,
                    "encoder/self_attention": enc}


def test_lstm_has_no_attention():
    config = tiny("lstm")
    message = ("model.family='lstm' has no attention to visualize: expected gpt, prefix_lm, "
               "bert or t5")
    with pytest.raises(ValueError, match=f"^{message}$"):
        visualize.encode_text(config, TOKENIZER, TEXT)
    with pytest.raises(ValueError, match=f"^{message}$"):
        visualize.attention_maps(build_model(config.model), None, config, np.array([2, 7]))


def test_token_labels_show_whitespace_specials_and_partial_bytes():
    ids = [*TOKENIZER.encode("a \n\t\x00é").tolist(), tokenizers.PAD_ID, tokenizers.BOS_ID,
           tokenizers.MASK_ID, TOKENIZER.sentinel_id(1)]
    assert visualize.token_labels(TOKENIZER, ids) == [
        "a", "␣", "\\n", "\\t", "\\x00", "\\xc3", "\\xa9", "<pad>", "<bos>", "<mask>",
        "<extra_id_1>"]
    chars = tokenizers.CharTokenizer("ab é", num_sentinels=0)
    assert visualize.token_labels(chars, chars.encode("é a?")) == ["é", "␣", "a", "<unk>"]
    with pytest.raises(ValueError, match=f"id {TOKENIZER.vocab_size} out of range"):
        visualize.token_labels(TOKENIZER, [7, TOKENIZER.vocab_size])


def synthetic_maps():
    rng = np.random.default_rng(0)
    self_attention = rng.random((2, 2, 4, 4)).astype(np.float32)
    cross = rng.random((1, 2, 2, 4)).astype(np.float32)  # a shallower decoder
    maps = {"decoder/cross_attention": cross / cross.sum(-1, keepdims=True),
            "encoder/self_attention": self_attention / self_attention.sum(-1, keepdims=True)}
    queries, keys = visualize.axis_labels(list(maps), ["a", "b", "c", "d"], ["<bos>", "x"])
    return maps, queries, keys


def test_save_writes_the_data_grids_and_every_head(tmp_path):
    maps, queries, keys = synthetic_maps()
    paths = visualize.save_attention_maps(maps, queries, keys, str(tmp_path / "out"))
    names = [Path(p).name for p in paths]
    assert names[0] == "attention.npz" and len(names) == 1 + (1 + 1 * 2) + (1 + 2 * 2)
    assert sorted(names) == sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "decoder.cross_attention_grid.png" in names
    assert "decoder.cross_attention_L0_H1.png" in names
    assert "encoder.self_attention_L1_H1.png" in names
    data = np.load(tmp_path / "out" / "attention.npz")
    np.testing.assert_array_equal(data["decoder.cross_attention"],
                                  maps["decoder/cross_attention"])
    assert data["decoder.cross_attention.query_labels"].tolist() == ["<bos>", "x"]
    assert data["decoder.cross_attention.key_labels"].tolist() == ["a", "b", "c", "d"]

    one = visualize.save_attention_maps(  # plain label lists apply to every map
        {"encoder/self_attention": maps["encoder/self_attention"]}, list("abcd"), list("abcd"),
        str(tmp_path / "one"), layer=1)
    assert [Path(p).name for p in one] == [
        "attention.npz", "encoder.self_attention_grid.png", *(
            f"encoder.self_attention_L1_H{h}.png" for h in range(2))]
    image = matplotlib.image.imread(one[-1])
    assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(head=2), r"^head=2: expected 0..1 \(decoder/cross_attention has 2 heads\)$"),
    (dict(layer=-1), r"^layer=-1: expected 0 \(the layers with a decoder/cross_attention "
                     r"map\)$"),
    (dict(layer=1), r"^layer=1: expected 0 \(the layers with a decoder/cross_attention map\)$"),
    (dict(layers={"decoder/cross_attention": [0, 1], "encoder/self_attention": [0, 1]}),
     r"^layers\['decoder/cross_attention'\]=\[0, 1\]: expected 1 increasing layer indices, "
     r"one per map$"),
    (dict(keys=["a", "b", "c"]), r"^decoder/cross_attention is 2 queries x 4 keys but got 2 "
                                 r"query and 3 key labels$"),
])
def test_save_checks_before_writing_anything(tmp_path, kwargs, message):
    maps, queries, keys = synthetic_maps()
    keys = dict(keys, **{"decoder/cross_attention": kwargs.pop("keys")}) if "keys" in kwargs \
        else keys
    with pytest.raises(ValueError, match=message):
        visualize.save_attention_maps(maps, queries, keys, str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out").exists()


def test_save_wants_labels_for_every_map_and_a_local_directory(tmp_path):
    maps, queries, keys = synthetic_maps()
    del keys["encoder/self_attention"]
    with pytest.raises(ValueError, match="expected labels for 'encoder/self_attention' too"):
        visualize.save_attention_maps(maps, queries, keys, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="output_dir='gs://bucket/run': expected a local"):
        visualize.save_attention_maps(maps, queries, keys, "gs://bucket/run")
    assert not (tmp_path / "out").exists() and not Path("gs:").exists()


# --- the command line on a saved run ---------------------------------------------------------


def tiny_run_config():
    """tests/test_train.py's tiny_config("gpt_tiny", steps=1): experiments/gpt_tiny.py, 1 step,
    1 layer, d_model 32, 2 heads."""
    spec = importlib.util.spec_from_file_location("experiment_gpt_tiny",
                                                  REPO / "experiments" / "gpt_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.update(steps=1, batch_size=2, seq_len=16, log_every=1, eval_every=1, eval_steps=1,
                  checkpoint_every=1)
    config.model.update(num_layers=1, d_model=32, num_heads=2, d_ff=64)
    return config


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, "-m", "transformer.visualize", *args], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_cli_draws_a_saved_run(tmp_path):
    from transformer import train

    workdir = tmp_path / "run"
    train.train_and_evaluate(tiny_run_config(), str(workdir))
    result = run_cli(f"--workdir={workdir}", f"--text={TEXT}", "--layer=0", "--head=1")
    assert result.returncode == 0, result.stderr[-3000:]
    # The default output directory: one per checkpoint and text.
    out = Path(visualize.default_output_dir(str(workdir), 1, TEXT))
    assert out.parent == workdir / "attention" and out.name.startswith("step1-")
    written = ["attention.npz", "decoder.self_attention_L0_H1.png",
               "decoder.self_attention_grid.png", "input.json"]
    assert sorted(p.name for p in out.iterdir()) == written
    assert result.stdout.splitlines() == [
        "decoder/self_attention: [1, 2, 9, 9] (1 layers x 2 heads, 9 queries x 9 keys; "
        "layers 0)",
        *(str(out / name) for name in (written[0], written[2], written[1], written[3]))]
    assert json.loads((out / "input.json").read_text()) == {
        "step": 1, "text": TEXT, "target": "", "prefix_length": None}
    data = np.load(out / "attention.npz")
    weights = data["decoder.self_attention"]
    assert weights.shape == (1, 2, 9, 9) and data["decoder.self_attention.layers"].tolist() == [0]
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    assert data["decoder.self_attention.query_labels"].tolist() == [  # packed: the text alone
        "d", "e", "f", "␣", "f", "(", "x", ")", ":"]
    for name in written[1:3]:
        image = matplotlib.image.imread(out / name)
        assert image.size and image.shape[0] > 100 and image.std() > 0

    bad = run_cli(f"--workdir={workdir}", "--text=hi", "--head=9",
                  f"--output_dir={tmp_path / 'bad'}")
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: head=9: expected 0..1 (decoder/self_attention has 2 heads)")
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()

    # Another text's pictures go beside these, never over them; an empty text is refused.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other = run_cli(f"--workdir={workdir}", "--text=import os")
    assert other.returncode == 0, other.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(list((workdir / "attention").iterdir())) == 2
    empty = run_cli(f"--workdir={workdir}", "--text=")
    assert empty.returncode == 2
    assert empty.stderr.strip().splitlines() == [
        "error: text='': expected a text to read (--text=...)"]
