"""Patch tokenization (ViT) and the CLIP dual encoder: patchify round trip, permutation
symmetry without positions, the contrastive loss against the CLIP paper's pseudo-code, the
temperature clip, the digits data, and zero-shot evaluation."""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import assert_succeeded, run_cli

from transformer import configs
from transformer.configs import base_config
from transformer.data import images, tokenizers
from transformer.models import build_model, transformer_config, vision

TINY = dict(num_layers=2, d_model=32, num_heads=2, d_ff=64, position="none", image_size=8,
            patch_size=2, channels=1)


@pytest.mark.parametrize("shape,patch", [((2, 8, 8, 1), 2), ((1, 12, 6, 3), 3), ((3, 4, 4, 2), 4)])
def test_patchify_round_trips_and_each_patch_is_a_square_of_the_image(shape, patch):
    x = jax.random.normal(jax.random.key(0), shape)
    patches = vision.patchify(x, patch)
    B, H, W, C = shape
    assert patches.shape == (B, (H // patch) * (W // patch), patch * patch * C)
    np.testing.assert_array_equal(vision.unpatchify(patches, patch, H, W), x)
    # Patch (row r, column c) of the grid is the square at (r * p, c * p).
    r, c = H // patch - 1, 0
    square = x[:, r * patch:(r + 1) * patch, c * patch:(c + 1) * patch].reshape(B, -1)
    np.testing.assert_array_equal(patches[:, r * (W // patch) + c], square)
    with pytest.raises(ValueError, match="divisible by patch_size=5"):
        vision.patchify(x, 5)


def permute_patches(image, patch, order):
    patches = vision.patchify(image, patch)
    return vision.unpatchify(patches[:, order], patch, image.shape[1], image.shape[2])


@pytest.mark.slow
def test_vit_without_positions_ignores_the_order_of_patches():
    """[CLS] pooling (mean pooling is symmetric by construction; the encoder's equivariance
    is tested below)."""
    config = base_config().model
    config.update(family="vit", num_classes=5, pooling="cls", **TINY)
    image = jax.random.uniform(jax.random.key(1), (2, 8, 8, 1))
    order = np.random.default_rng(0).permutation(16)
    shuffled = permute_patches(image, 2, order)
    for patch_position, invariant in (("none", True), ("sinusoidal_2d", False)):
        config.patch_position = patch_position
        model = build_model(config)
        params = jax.jit(model.init)(jax.random.key(0), image)["params"]
        apply = jax.jit(lambda x, m=model, p=params: m.apply({"params": p}, x))
        logits, moved = apply(image), apply(shuffled)
        assert np.allclose(logits, moved, atol=1e-5) == invariant, patch_position


@pytest.mark.slow
def test_vit_encoder_is_permutation_equivariant_over_patches_without_positions():
    config = base_config().model
    config.update(family="vit", num_classes=3, pooling="mean", patch_position="none", **TINY)
    stack = vision.TransformerStack(transformer_config(config), bidirectional=True)
    tokens = jax.random.normal(jax.random.key(2), (1, 16, 32))
    params = stack.init(jax.random.key(0), tokens, vision.masks.Full(), None)
    order = np.random.default_rng(1).permutation(16)
    apply = jax.jit(lambda x: stack.apply(params, x, vision.masks.Full(), None))
    out, out_permuted = apply(tokens), apply(tokens[:, order])
    np.testing.assert_allclose(out_permuted, out[:, order], atol=1e-5)


def clip_reference_loss(image_embeddings, text_embeddings, t):
    """The CLIP paper's pseudo-code (Radford et al. 2021, Figure 3) in NumPy."""
    def cross_entropy(logits, labels, axis):
        logits = logits - logits.max(axis=axis, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=axis, keepdims=True))
        picked = np.take_along_axis(log_probs, np.expand_dims(labels, axis), axis)
        return -picked.mean()

    I_e = image_embeddings / np.linalg.norm(image_embeddings, axis=1, keepdims=True)
    T_e = text_embeddings / np.linalg.norm(text_embeddings, axis=1, keepdims=True)
    logits = np.dot(I_e, T_e.T) * np.exp(t)
    labels = np.arange(len(logits))
    loss_i = cross_entropy(logits, labels, axis=1)  # each image over the texts
    loss_t = cross_entropy(logits, labels, axis=0)  # each text over the images
    return (loss_i + loss_t) / 2, logits


def test_contrastive_loss_matches_the_papers_pseudo_code_and_is_symmetric():
    rng = np.random.default_rng(0)
    image_e, text_e = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
    expected, logits = clip_reference_loss(image_e, text_e, math.log(1 / 0.07))
    loss, metrics = vision.contrastive_loss(jnp.asarray(logits, jnp.float32))
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    swapped, _ = vision.contrastive_loss(jnp.asarray(logits.T, jnp.float32))
    assert float(swapped) == pytest.approx(float(loss), rel=1e-6)
    # Padded pairs count neither as pairs nor as negatives: the loss of the first 4.
    weights = jnp.array([1, 1, 1, 1, 0, 0], jnp.float32)
    padded, _ = vision.contrastive_loss(jnp.asarray(logits, jnp.float32), weights)
    expected_4, _ = clip_reference_loss(image_e[:4], text_e[:4], math.log(1 / 0.07))
    assert float(padded) == pytest.approx(expected_4, rel=1e-5)
    assert float(metrics["num_tokens"]) == 12


@pytest.mark.slow
def test_clip_logits_are_scaled_cosines_with_a_clipped_temperature():
    config = base_config().model
    config.update(family="clip", projection_dim=16, vocab_size=300, **TINY)
    model = build_model(config)
    image = jax.random.uniform(jax.random.key(1), (3, 8, 8, 1))
    texts = jnp.array([[10, 11, 2, 0], [12, 2, 0, 0], [13, 14, 15, 2]])
    segments = (texts > 0).astype(jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), image, texts, segments)["params"]
    logits = jax.jit(model.apply)({"params": params}, image, texts, segments)
    image_e = jax.jit(lambda i: model.apply({"params": params}, i, method="embed_images"))(image)
    text_e = jax.jit(lambda t, s: model.apply({"params": params}, t, s,
                                              method="embed_texts"))(texts, segments)
    np.testing.assert_allclose(jnp.linalg.norm(image_e, axis=-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(logits, (1 / 0.07) * image_e @ text_e.T, rtol=1e-4, atol=1e-5)
    hot = {**params, "logit_scale": jnp.asarray(10.0)}
    np.testing.assert_allclose(jax.jit(model.apply)({"params": hot}, image, texts, segments),
                               100.0 * image_e @ text_e.T, rtol=1e-4, atol=1e-4)


def test_digits_splits_are_disjoint_and_captions_name_the_digit():
    splits = {s: images.split_digits(s, 0.15) for s in images.SPLITS}
    assert sum(len(labels) for _, labels in splits.values()) == 1797
    seen = {s: {x.tobytes() for x in imgs} for s, (imgs, _) in splits.items()}
    assert not seen["train"] & seen["test"] and not seen["validation"] & seen["test"]
    assert images.caption(7) == "a photo of the digit seven"
    config = base_config()
    config.update(batch_size=8, seq_len=32)
    config.model.family = "clip"
    config.data.update(objective="contrastive", validation_fraction=0.15)
    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=0)
    batch = next(iter(images.make_dataset(config, tokenizer, "test", num_epochs=1,
                                          shuffle=False)))
    texts = [tokenizer.decode(t[s > 0][:-1]) for t, s in zip(batch["texts"],
                                                              batch["text_segment_ids"],
                                                              strict=True)]
    assert texts == [images.caption(int(label)) for label in batch["targets"]]
    assert batch["images"].shape == (8, 8, 8, 1) and 0 <= batch["images"].min()


@pytest.mark.slow
def test_clip_shards_checkpoints_and_resumes_through_the_cli(tmp_path):
    """CLIP is just another param tree: 4 devices as data=2 x fsdp=2, 2 steps, then a resumed
    run to step 3, evaluated zero-shot on the test split."""
    workdir = tmp_path / "run"
    args = ["--config=experiments/clip_digits.py", f"--workdir={workdir}",
            "--config.batch_size=8", "--config.log_every=1", "--config.eval_every=100",
            "--config.eval_steps=2", "--config.checkpoint_every=2", "--config.mesh.data=2",
            "--config.mesh.fsdp=2", "--config.model.num_layers=1", "--config.model.d_model=32",
            "--config.model.d_ff=64"]
    for steps in (2, 3):
        result = run_cli("transformer.train", *args, f"--config.steps={steps}",
                         logs=tmp_path / f"logs{steps}", devices=4)
        assert_succeeded(result)
    assert "data=2 x stage=1 x fsdp=2" in result.stdout and "steps 2..3" in result.stdout
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3]
    summary = json.loads((workdir / "summary.json").read_text())
    test = len(images.split_digits("test", 0.15)[1])
    assert summary["test_num_tokens"] == 2 * test  # each test pair is scored both ways
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and "test_macro_f1" in summary
    config = base_config()
    config.model.family = "vit"
    config.data.objective = "contrastive"
    with pytest.raises(ValueError, match="'contrastive' with model.family='vit'"):
        configs.validate_config(config)


@pytest.mark.slow
def test_the_captioner_reads_the_image_through_cross_attention_and_writes_causally():
    config = base_config().model
    config.update(family="captioner", vocab_size=300, **{**TINY, "position": "learned"})
    model = build_model(config)
    image = jax.random.uniform(jax.random.key(1), (2, 8, 8, 1))
    tokens = jnp.array([[1, 40, 41, 42, 43], [1, 40, 41, 42, 43]])
    params = jax.jit(model.init)(jax.random.key(0), image, tokens)["params"]
    apply = jax.jit(lambda i, t: model.apply({"params": params}, i, t))
    logits = apply(image, tokens)
    assert logits.shape == (2, 5, 300)
    assert not np.allclose(logits[0], logits[1], atol=1e-4)  # different images, same text
    later = tokens.at[:, 3:].set(7)
    np.testing.assert_allclose(apply(image, later)[:, :3], logits[:, :3], atol=1e-5)
    assert not np.allclose(apply(image, later)[:, 3:], logits[:, 3:], atol=1e-4)


def _moe_model(family, **overrides):
    """A 1-layer MoE model of `family` with capacity routing (4 experts top-2, the default
    capacity factor 1.25)."""
    config = base_config().model
    config.update(family=family, vocab_size=300, **{**TINY, "num_layers": 1}, **overrides)
    config.moe.update(num_experts=4, top_k=2)
    return build_model(config)


def _text(padded_to):
    """8 rows of 2 real tokens (unpadded, their ceil(1.25 x 2 x 2 / 4) = 2 slots per expert
    drop nothing), and the same right-padded with 0."""
    real = np.random.default_rng(0).integers(3, 300, (8, 2)).astype(np.int32)
    return real, np.pad(real, ((0, 0), (0, padded_to - 2)))


def test_caption_padding_takes_no_expert_slot():
    """The caption's right padding must not push out a real token's expert choice: its real
    tokens' logits are those of the unpadded caption."""
    model = _moe_model("captioner")
    image = jax.random.uniform(jax.random.key(1), (8, 8, 8, 1))
    real, padded = _text(16)
    params = jax.jit(model.init)(jax.random.key(0), image, padded)
    apply = jax.jit(model.apply)
    np.testing.assert_allclose(apply(params, image, padded)[:, :2], apply(params, image, real),
                               atol=1e-5)


def test_clip_text_padding_takes_no_expert_slot():
    model = _moe_model("clip", projection_dim=16)
    image = jax.random.uniform(jax.random.key(1), (1, 8, 8, 1))
    real, padded = _text(16)
    segments = (padded > 0).astype(np.int32)
    params = jax.jit(model.init)(jax.random.key(0), image, padded, segments)
    embed = jax.jit(functools.partial(model.apply, method="embed_texts"))
    np.testing.assert_allclose(embed(params, padded, segments),
                               embed(params, real, np.ones_like(real)), atol=1e-5)


def _param_paths(model_config) -> set[str]:
    """The '/'-joined param paths of a vision model (shapes only: nothing runs)."""
    model = build_model(model_config)
    image, tokens = jnp.zeros((1, 8, 8, 1)), jnp.zeros((1, 8), jnp.int32)
    args = {"vit": (image,), "clip": (image, tokens, tokens),
            "captioner": (image, tokens)}[model_config.family]
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]
    return {"/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
            for path, _ in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.parametrize("family", ["vit", "clip", "captioner"])
def test_the_image_tower_adds_no_1d_positions_on_top_of_its_patch_positions(family):
    """model.position is the text side's (CLIP's text tower, the captioner's decoder): with
    patch positions the image tower's stack has none of its own ([CLS] gets no position 0);
    with patch_position 'none' the stack's own position is the image tower's only one."""
    config = base_config().model
    config.update(family=family, vocab_size=300, num_classes=3, projection_dim=16,
                  pooling="mean" if family == "clip" else "cls",
                  **{**TINY, "position": "learned", "max_len": 32})
    table = "image_encoder/encoder/position_embedding/embedding"
    paths = _param_paths(config)
    assert table not in paths and not any("image_encoder/encoder/" in p and "position" in p
                                          for p in paths)
    if family != "vit":  # the text side keeps its table
        assert any("position_embedding" in p and not p.startswith("image_encoder")
                   for p in paths)
    config.patch_position = "none"
    assert table in _param_paths(config)
    # that table must hold the tower's tokens (16 patches, [CLS] for ViT): past it, NaN
    tokens = 16 + (family == "vit")
    config.max_len = tokens - 1
    with pytest.raises(ValueError, match=rf"^patch_position='none' with position='learned': "
                                         rf"the image tower reads {tokens} tokens .*expected "
                                         rf"max_len >= {tokens}, or patch positions"):
        _param_paths(config)
    config.max_len = 32
    # RoPE's keys (read by the text side) do not stop the image tower from dropping RoPE.
    config.update(position="rope", rope_theta=500.0, patch_position="sinusoidal_2d")
    assert not any("image_encoder/encoder/" in p and "position" in p
                   for p in _param_paths(config))


def test_the_shipped_captioner_has_one_position_table_its_decoders():
    from transformer.training import startup

    config = configs.experiment("caption_digits")
    config.model.vocab_size = 300
    paths = _param_paths(config.model)
    assert [p for p in paths if "position" in p] == [
        "decoder/position_embedding/embedding"]
    assert startup.unread_settings(config.model) == []  # the decoder reads model.position


@pytest.mark.parametrize("objective", ["contrastive", "captioning"])
def test_a_seq_len_that_would_cut_the_captions_is_refused(objective):
    """At seq_len=16 every class's caption read "a photo of the d": zero-shot and rank
    classification always answered class 0. The longest caption + <eos> is 27 bytes."""
    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=0)
    assert images.caption_length(objective, tokenizer) == (27, "a photo of the digit three")
    assert images.caption_length(objective) == (27, "a photo of the digit three")
    config = base_config()
    config.update(batch_size=8, seq_len=16)
    config.model.family = "clip" if objective == "contrastive" else "captioner"
    config.data.update(objective=objective, validation_fraction=0.15)
    message = "^seq_len=16: .* expected seq_len >= 27"
    with pytest.raises(ValueError, match=message):
        images.make_dataset(config, tokenizer, "train")
    with pytest.raises(ValueError, match=message):
        images.class_captions(tokenizer, 16, decoder=objective == "captioning")
    with pytest.raises(ValueError, match="seq_len=26: "):
        images.check_seq_len(26, objective, tokenizer)
    rows = images.class_captions(tokenizer, 27, decoder=objective == "captioning")
    first = next(iter(rows.values()))
    assert len({row.tobytes() for row in first}) == 10  # ten distinct captions


@pytest.mark.parametrize("family", ["vit", "clip"])
def test_pooling_none_is_refused_where_a_head_reads_one_vector_an_image(family):
    config = base_config()
    config.seq_len = 16  # a ViT's 16 patches without [CLS]
    config.model.update(family=family, pooling="none", **TINY)
    config.data.objective = "image_classification" if family == "vit" else "contrastive"
    with pytest.raises(ValueError, match=f"^model.pooling='none' with family '{family}': "
                                         "expected one of \\('cls', 'mean'\\)"):
        configs.validate_config(config)


def test_clip_refuses_gradient_accumulation_whose_micro_batches_change_its_objective():
    """CLIP's other pairs are each pair's negatives: micro-batches of B / k rows would each
    have fewer (a probe: the loss 3.49, 2.26, 1.08 at k = 1, 2, 4 on one batch), training
    another objective. One line before anything runs; CLIP without accumulation validates."""
    config = configs.experiment("clip_digits")
    configs.validate_config(config, num_devices=1, files=False)
    config.optimizer.grad_accumulation_steps = 2
    with pytest.raises(ValueError) as error:
        configs.validate_config(config, num_devices=1, files=False)
    assert str(error.value) == (
        "optimizer.grad_accumulation_steps=2 with model.family='clip': expected 1 (its loss "
        "compares the batch's rows with each other; a micro-batch would compare fewer, another "
        "objective)")


def test_a_patch_size_that_does_not_divide_the_image_is_refused_before_seq_len_is_checked():
    """The ViT's seq_len check counts the image's tokens; with a patch size that does not
    divide the image, it suggested a seq_len that the next check refused."""
    config = base_config()
    config.model.update(family="vit", **{**TINY, "patch_size": 3})
    config.data.objective = "image_classification"
    with pytest.raises(ValueError, match="^image_size=8: expected a multiple of patch_size=3$"):
        configs.validate_config(config)
