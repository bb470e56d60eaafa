"""A real Hugging Face checkpoint comes in whole: `init_from=hf:DIR` takes the architecture from
DIR's config.json (`finetune.resolve_init_config`), and a base model without its head (a
sentence-transformers BertModel, LlamaModel, T5EncoderModel) converts to a config whose head
matches its params.

The checkpoint is built here in the shape family of sentence-transformers all-MiniLM-L6-v2 (a
headless BertModel, layer_norm_eps 1e-12, a WordPiece tokenizer.json padded and truncated to
128 as that checkpoint's is), only tiny. No test reads ../shared."""

import random
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from transformer import configs, train  # noqa: E402
from transformer.hf import convert  # noqa: E402
from transformer.models import build_model  # noqa: E402
from transformer.training import finetune  # noqa: E402

_WORDS = ("the king my lord good sir love death night day heart hand eyes speak come go thou "
          "thee thy art hath doth shall noble sweet fair gentle blood crown war peace").split()


# A 2-layer BertModel's params without the pooler, and the MLM head bert_mlm adds.
BODY_PARAMS = 5 + 2 * 16
HEAD = "mlm_bias, mlm_dense/bias, mlm_dense/kernel, mlm_norm/bias, mlm_norm/scale"


def text(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + "."
                     for _ in range(lines)) + "\n"


def randomized(hf_model):
    """Every tensor perturbed (norm scales and biases too), so a swapped one cannot hide."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return hf_model.eval()


def minilm_style(directory):
    """A headless BertModel (MiniLM's settings, tiny sizes) with its WordPiece tokenizer, as
    save_pretrained writes them (the tokenizer.json padded and truncated to 128, as
    sentence-transformers saves it: test_hf_whole.minilm_style)."""
    from test_hf_whole import minilm_style as minilm_tokenizer
    from tokenizers import Tokenizer

    minilm_tokenizer(Path(directory))
    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    hf = randomized(transformers.BertModel(transformers.BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
        layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0)))
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("minilm")
    return directory, minilm_style(directory)


def bert_config(directory, **data):
    config = configs.experiment("bert_mlm")
    config.init_from = f"hf:{directory}"
    config.data.update(tokenizer="hf", **data)
    return config


def hidden_states(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)) \
            .last_hidden_state.numpy()


def difference(got, expected) -> float:
    return float(np.abs(np.asarray(got) - expected).max() / max(1.0, np.abs(expected).max()))


# --- a headless checkpoint runs as it is ---------------------------------------------------------


def base_models():
    """(name, headless HF model, our apply's keyword args from ids and mask)."""
    llama = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    t5 = transformers.T5Config(
        vocab_size=97, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu")
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97,
                                   n_positions=64, tie_word_embeddings=False)
    return {"llama": (transformers.LlamaModel(llama), "gpt", lambda m: {}),
            "t5_encoder": (transformers.T5EncoderModel(t5), "bert",
                           lambda m: {"segment_ids": m}),
            "gpt2_untied": (transformers.GPT2Model(gpt2), "gpt", lambda m: {})}


def test_a_headless_bert_model_converts_to_head_none_and_gives_last_hidden_state(minilm):
    directory, hf = minilm
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 10))
    mask = np.ones((2, 10), np.int64)
    mask[1, 6:] = 0  # padding
    config, params = convert.from_hf(hf.config, hf.state_dict())
    assert (config.family, config.head, config.norm_epsilon) == ("bert", "none", 1e-12)
    model = build_model(config)
    fresh = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.asarray(ids))["params"])
    # The head matches the params: every param the model has, and no head; the pooler comes
    # along for a classifier's init_from.
    assert set(finetune._flat(fresh)) == set(finetune._flat(params)) - {
        "pooler/kernel", "pooler/bias"}
    got = jax.jit(model.apply)({"params": params}, jnp.asarray(ids),
                               segment_ids=jnp.asarray(mask))
    expected = hidden_states(hf, ids, mask)
    valid = mask.astype(bool)
    assert got.shape == expected.shape
    assert difference(np.asarray(got)[valid], expected[valid]) <= 1e-5


@pytest.mark.parametrize("name", ["llama", "t5_encoder", "gpt2_untied"])
def test_other_base_models_without_a_head_run_as_they_are(name):
    hf, family, kwargs = base_models()[name]
    hf = randomized(hf)
    ids = np.random.default_rng(1).integers(0, 97, (2, 9))
    mask = np.ones((2, 9), np.int64)
    config, params = convert.from_hf(hf.config, hf.state_dict())
    assert (config.family, config.head) == (family, "none")
    model = build_model(config)
    fresh = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.asarray(ids))["params"])
    assert set(finetune._flat(fresh)) == set(finetune._flat(params))
    got = jax.jit(model.apply)({"params": params}, jnp.asarray(ids),
                               **{k: jnp.asarray(v) for k, v in kwargs(mask).items()})
    assert difference(got, hidden_states(hf, ids, mask)) <= 1e-5


def tied_llama_likes():
    """Tiny tied configs of three Llama-like families: their base model (*Model) saves no
    lm_head.weight, and neither does their *ForCausalLM."""
    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 tie_word_embeddings=True)
    return {"llama": (transformers.LlamaConfig(**sizes), "Llama"),
            "qwen3": (transformers.Qwen3Config(**sizes, head_dim=8), "Qwen3"),
            "gemma2": (transformers.Gemma2Config(**sizes, head_dim=8, query_pre_attn_scalar=8,
                                                 sliding_window=4), "Gemma2")}


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
def test_a_saved_tied_llama_like_base_model_is_head_none_and_its_causal_lm_mlm(name, tmp_path):
    """config.json's architectures decide: a tied LlamaModel / Qwen3Model / Gemma2Model gives
    head 'none' and HF's last_hidden_state (it gave 'mlm' and vocab logits, lacking
    lm_head.weight as a tied *ForCausalLM does), and the tied *ForCausalLM stays 'mlm' with
    HF's logits; init_from of the base model keeps the run's LM head, its embedding loaded."""
    hf_config, kind = tied_llama_likes()[name]
    ids = np.random.default_rng(3).integers(0, 97, (2, 9))
    for cls, head in (("Model", "none"), ("ForCausalLM", "mlm")):
        hf = randomized(getattr(transformers, kind + cls)(hf_config))
        hf.save_pretrained(tmp_path / cls)
        assert "lm_head.weight" not in finetune._safetensors(str(tmp_path / cls))()
        _, config, flat = finetune.hf_convert(str(tmp_path / cls))
        assert config.head == head
        params = traverse_util.unflatten_dict(flat, sep="/")
        got = jax.jit(build_model(config).apply)({"params": params}, jnp.asarray(ids))
        with torch.no_grad():
            out = hf(input_ids=torch.tensor(ids))
        expected = (out.last_hidden_state if head == "none" else out.logits).numpy()
        assert got.shape == expected.shape and difference(got, expected) <= 1e-4
    run = configs.experiment("gpt_tiny")
    run.init_from = f"hf:{tmp_path / 'Model'}"
    resolved = finetune.resolve_init_config(run)
    assert (resolved.model.head, resolved.model.tie_embeddings) == ("mlm", True)


# --- init_from=hf:DIR takes the architecture from DIR ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_init_from_hf_resolves_the_model_from_config_json_and_loads_every_param(minilm, scan):
    """Also into a model that scans its layers (a run setting): the checkpoint's layers are
    stacked as its params are."""
    directory, hf = minilm
    config = bert_config(directory)
    config.model.scan_layers = scan
    resolved = finetune.resolve_init_config(config)
    model = resolved.model
    assert (model.num_layers, model.d_model, model.num_heads, model.d_ff, model.max_len,
            model.norm_epsilon, model.vocab_size) == (2, 32, 4, 64, 128, 1e-12,
                                                      hf.config.vocab_size)
    assert resolved.data.num_sentinels == 0  # the pretrained vocabulary has no room for more
    # The experiment keeps its head and training settings; the input config is unchanged.
    assert (model.family, model.head, model.dropout_rate) == ("bert", "mlm", 0.1)
    assert config.model.num_layers == 4 and config.data.num_sentinels == 100
    configs.validate_config(resolved)
    built = build_model(resolved.model)
    fresh = nn.unbox(jax.jit(built.init)(jax.random.key(0),
                                         jnp.zeros((1, 8), jnp.int32))["params"])
    params, report = finetune.load_params(config.init_from, fresh,
                                          jax.tree.map(lambda x: x.sharding, fresh))
    model_config, converted = convert.from_hf(hf.config, hf.state_dict())
    if scan:
        converted = convert.scan_params(model_config, converted)
    body = set(finetune._flat(converted)) - {"pooler/kernel", "pooler/bias"}
    assert set(report.loaded) == body
    assert all(k.startswith("mlm_") for k in report.new)  # the MLM head starts fresh
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, (2, 12))
    got = built.apply({"params": params}, jnp.asarray(ids), method="encode")
    assert difference(got, hidden_states(hf, ids, np.ones_like(ids))) <= 1e-5


@pytest.mark.slow
def test_the_resolved_config_trains(minilm, tmp_path, capsys):
    """In process, as train's setup will call it: the tokenizer, vocabulary and weights fit."""
    directory, hf = minilm
    (tmp_path / "text.txt").write_text(text(7, 400), encoding="utf-8")
    config = bert_config(directory, path=str(tmp_path / "text.txt"), unit="stream")
    config.update(steps=2, batch_size=2, seq_len=16, log_every=1, eval_every=2, eval_steps=1,
                  checkpoint_every=2)
    result = train.train_and_evaluate(finetune.resolve_init_config(config), str(tmp_path / "run"))
    assert np.isfinite(result["summary"]["val_loss"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("init_from"))
    assert line == f"init_from hf:{directory}: loaded {BODY_PARAMS} params; new 5 ({HEAD}); " \
        "dropped 2 (pooler/bias, pooler/kernel)"


@pytest.mark.parametrize("key,value,says", [
    ("num_layers", 4, "2"), ("norm_epsilon", 1e-5, "1e-12"), ("d_model", 128, "32"),
    ("vocab_size", 512, None)])
def test_an_explicit_model_key_that_contradicts_config_json_is_refused(minilm, key, value, says):
    directory, hf = minilm
    says = says or str(hf.config.vocab_size)
    config = bert_config(directory)
    config.model[key] = value
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(config, explicit={f"model.{key}", "init_from"})
    assert str(error.value) == f"model.{key}={value!r}: hf:{directory}'s config.json says {says}"
    # The experiment's own value is no contradiction: DIR's replaces it.
    assert finetune.resolve_init_config(config).model[key] == \
        finetune.resolve_init_config(bert_config(directory)).model[key]
    # An explicit value equal to DIR's is accepted.
    config.model[key] = finetune.resolve_init_config(config).model[key]
    finetune.resolve_init_config(config, explicit={f"model.{key}"})


def test_a_checkpoint_of_another_family_is_refused_naming_it(minilm):
    directory, _ = minilm
    config = configs.experiment("gpt_tiny")
    config.init_from = f"hf:{directory}"
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(config)
    assert str(error.value) == (
        f"model.family='gpt': hf:{directory} is a BertModel ('bert' family) checkpoint: "
        "expected model.family='bert', e.g. --config=experiments/bert_mlm.py")


def test_num_sentinels_defaults_to_zero_and_an_explicit_excess_is_refused(minilm):
    directory, hf = minilm
    size = hf.config.vocab_size
    assert finetune.resolve_init_config(bert_config(directory)).data.num_sentinels == 0
    config = bert_config(directory, num_sentinels=100)
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(config, explicit={"data.num_sentinels"})
    assert str(error.value) == (
        f"data.num_sentinels=100: hf:{directory}'s vocabulary has {size} ids, {size} of them "
        f"its tokenizer's, so {size + 100} would not fit its embedding: expected "
        "data.num_sentinels <= 0 (0 for a pretrained vocabulary)")
    config.data.num_sentinels = 0
    assert finetune.resolve_init_config(config, explicit={"data.num_sentinels"}) \
        .data.num_sentinels == 0


def test_what_the_model_cannot_represent_is_one_line_naming_the_checkpoint(tmp_path):
    transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, position_embedding_type="relative_key")).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(bert_config(tmp_path))
    assert str(error.value) == (f"init_from='hf:{tmp_path}': BERT position_embedding_type="
                                "'relative_key': expected 'absolute'")


def test_an_imported_moe_keeps_its_routing_over_the_experiments_defaults(tmp_path):
    """top_k 3 of 4 experts, every layer sparse, dropless: not the experiment's top-2 with
    capacity buffers, which would drop tokens the checkpoint never dropped."""
    hf = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=3, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=64)
    transformers.Qwen3MoeForCausalLM(hf).save_pretrained(tmp_path)
    config = configs.experiment("gpt_tiny")
    config.init_from = f"hf:{tmp_path}"
    moe = finetune.resolve_init_config(config).model.moe
    assert (moe.num_experts, moe.top_k, moe.every_n_layers, moe.capacity_factor) == (4, 3, 1, 0)
    assert (config.model.moe.top_k, config.model.moe.capacity_factor) != (3, 0)


def test_other_init_from_values_are_returned_unchanged(tmp_path):
    config = configs.experiment("bert_mlm")
    for value in ("", "runs/bert_mlm", f"hf:{tmp_path}"):  # (no config.json there)
        config.init_from = value
        assert finetune.resolve_init_config(config) is config


# --- the command line (train.setup calls resolve_init_config) ---------------------------------


@pytest.mark.slow
def test_train_cli_with_init_from_hf_and_no_model_flags(minilm, tmp_path):
    from test_train import assert_succeeded, run_cli

    directory, _ = minilm
    (tmp_path / "text.txt").write_text(text(7, 400), encoding="utf-8")
    args = ["--config=experiments/bert_mlm.py", f"--config.init_from=hf:{directory}",
            "--config.data.tokenizer=hf", f"--config.data.path={tmp_path / 'text.txt'}",
            "--config.data.unit=stream", "--config.steps=2", "--config.batch_size=2",
            "--config.seq_len=16", "--config.log_every=1", "--config.eval_every=2",
            "--config.eval_steps=1", "--config.checkpoint_every=2"]
    result = run_cli("transformer.train", *args, f"--workdir={tmp_path / 'run'}",
                     logs=tmp_path / "logs" / "ok")
    assert_succeeded(result)
    assert f"init_from hf:{directory}: loaded {BODY_PARAMS} params; new 5 ({HEAD})" in \
        result.stdout
    result = run_cli("transformer.train", *args, "--config.model.num_layers=4",
                     f"--workdir={tmp_path / 'bad'}", logs=tmp_path / "logs" / "bad")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        f"error: model.num_layers=4: hf:{directory}'s config.json says 2"
    result = run_cli("transformer.train", *args[1:], f"--workdir={tmp_path / 'gpt'}",
                     logs=tmp_path / "logs" / "gpt")
    assert result.returncode == 2
    assert "model.family='gpt': " in result.stderr and "experiments/bert_mlm.py" in result.stderr
    assert not (tmp_path / "bad").exists() and not (tmp_path / "gpt").exists()


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary_is_refused_naming_both(minilm,
                                                                                   tmp_path):
    """With data.num_sentinels=0 said, a tokenizer of 3 ids more than the embedding was
    refused as "expected data.num_sentinels <= -3"; the line now names both sizes."""
    import shutil

    directory, hf = minilm
    size = hf.config.vocab_size
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=size - 3, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32)).save_pretrained(tmp_path)
    shutil.copy(directory / "tokenizer.json", tmp_path)
    config = configs.experiment("gpt_tiny")
    config.init_from = f"hf:{tmp_path}"
    config.data.update(tokenizer="hf", num_sentinels=0)
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(config, explicit={"data.num_sentinels"})
    assert str(error.value) == (
        f"the tokenizer at {tmp_path} has {size} ids but hf:{tmp_path}'s embedding has "
        f"{size - 3}: expected a tokenizer whose ids fit the checkpoint's vocabulary (its own "
        "tokenizer)")
