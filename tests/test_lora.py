"""LoRA and QLoRA (transformer.nn.lora): the adapters' forward against a float64 reference, step 0
equal to the base, a frozen base with no optimizer state, QLoRA close to LoRA, and end to end
through the CLI on an imported tiny Llama: checkpoints of the adapters alone naming their base
(a different base is refused in one line), resume, a mesh equal to one device, and both
exports loaded by transformers and peft with our logits."""

import contextlib
import subprocess
import sys

import flax.linen as nn
import forkserver
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from test_train import cli_env

from transformer import generate
from transformer.configs import base_config, validate_config
from transformer.models import build_model, family_of
from transformer.nn import lora
from transformer.nn.config import TransformerConfig
from transformer.nn.layers import MLP
from transformer.nn.lora import LoraConfig
from transformer.parallel import sharding
from transformer.training import finetune, optim
from transformer.training import state as state_lib
from transformer.training.state import initial_state
from transformer.training.step import make_train_step

LLAMA_MODEL = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
                   vocab_size=64, position="rope", norm="rmsnorm", activation="swiglu",
                   use_bias=False, tie_embeddings=False)


def small_config(rank=4, base_quantization="", alpha=8.0):
    config = base_config()
    config.update(batch_size=2, seq_len=16, steps=10, init_from="hf:unused")
    config.model.update(**LLAMA_MODEL)
    config.model.lora.update(rank=rank, alpha=alpha, base_quantization=base_quantization)
    config.optimizer.warmup_steps = 0
    return config


def lm_batch(seed=0, rows=2, length=16, vocab=64):
    ids = np.random.RandomState(seed).randint(0, vocab, (rows, length)).astype(np.int32)
    return {"inputs": ids, "targets": np.roll(ids, -1, 1),
            "weights": np.ones((rows, length), np.float32),
            "segment_ids": np.ones((rows, length), np.int32),
            "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1))}


def init(config, seed=0):
    model = build_model(config.model)
    optimizer = optim.make_optimizer(config)
    abstract, shardings, make = initial_state(config, model, sharding.make_mesh(config.mesh),
                                              optimizer=optimizer)
    return model, optimizer, make(jax.random.key(seed))


def flat(tree):
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(dict(tree)).items()}


def logits(model, params, ids):
    """The model's logits, compiled (eager Linen runs op by op)."""
    return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids)))


@pytest.fixture(scope="module")
def trained():
    """(config, model, state at step 0, state after 3 steps) of a rank-4 LoRA model."""
    config = small_config()
    model, optimizer, state = init(config)
    step = jax.jit(make_train_step(model, config, optimizer))
    after = state
    for i in range(3):
        after, _ = step(after, lm_batch(i))
    return config, model, state, after


def test_the_base_stays_bitwise_frozen_and_every_adapter_trains(trained):
    _, _, before, after = trained
    old, new = flat(before.params), flat(after.params)
    base = [k for k in old if not lora.is_adapter(k)]
    adapters = [k for k in old if lora.is_adapter(k)]
    assert len(adapters) == 2 * 7 * 2  # A and B of q/k/v/out, gate/up/down, in 2 layers
    for key in base:
        np.testing.assert_array_equal(np.asarray(new[key]), np.asarray(old[key]), err_msg=key)
    for key in adapters:
        assert not np.array_equal(np.asarray(new[key]), np.asarray(old[key])), key


def test_the_optimizer_state_holds_only_adapter_sized_arrays(trained):
    config, _, state, _ = trained
    adapter_shapes = {v.shape for k, v in flat(state.params).items() if lora.is_adapter(k)}
    base_shapes = {v.shape for k, v in flat(state.params).items() if not lora.is_adapter(k)}
    leaves = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x)]
    assert leaves and all(x.shape in adapter_shapes for x in leaves)
    assert not {x.shape for x in leaves} & (base_shapes - adapter_shapes)
    # Adam's two moments of each adapter, and nothing else but scalar counts.
    adapter_bytes = sum(v.nbytes for k, v in flat(state.params).items() if lora.is_adapter(k))
    assert sum(x.nbytes for x in leaves) == 2 * adapter_bytes
    full = small_config(rank=0)
    _, _, full_state = init(full)
    assert lora.device_bytes(full_state.opt_state) > 5 * lora.device_bytes(state.opt_state)


def test_b_starts_at_zero_so_step_zero_is_the_base_model(trained):
    _, model, state, _ = trained
    assert all(not np.asarray(v).any() for k, v in flat(state.params).items()
               if k.endswith("_lora_b"))
    base_model = build_model(small_config(rank=0).model)
    base = lora.merge({}, lora.trainable(state.params)[1])
    ids = lm_batch(5)["inputs"]
    np.testing.assert_allclose(logits(model, state.params, ids),
                               logits(base_model, base, ids), rtol=0, atol=1e-6)


def test_the_adapted_mlp_is_w_plus_alpha_over_rank_a_b_in_float64():
    config = TransformerConfig(num_layers=1, d_model=8, num_heads=2, d_ff=16, activation="relu",
                               use_bias=False, lora=LoraConfig(rank=3, alpha=6.0, targets="wi|wo"))
    mlp = MLP(config)
    x = np.random.RandomState(0).randn(2, 5, 8).astype(np.float32)
    params = nn.unbox(mlp.init(jax.random.key(0), x)["params"])
    rng = np.random.RandomState(1)  # B nonzero, as after training
    params = jax.tree.map(lambda p: rng.randn(*p.shape).astype(np.float32), params)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    scale = 6.0 / 3
    wi = p["wi"] + scale * p["wi_lora_a"] @ p["wi_lora_b"]
    wo = p["wo"] + scale * p["wo_lora_a"] @ p["wo_lora_b"]
    expected = np.maximum(x.astype(np.float64) @ wi, 0) @ wo
    got = np.asarray(mlp.apply({"params": params}, x), np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_merged_params_give_the_adapted_models_logits(trained):
    """Every target, the attention's 3-D kernels included: the plain model on
    W + (alpha / rank) A B (the merged export) equals the adapted model."""
    _, model, state, _ = trained
    rng = np.random.RandomState(2)
    params = {k: rng.randn(*v.shape).astype(np.float32) * 0.1 if k.endswith("_lora_b") else v
              for k, v in flat(state.params).items()}
    params = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in params.items()})
    merged = lora.merged_params(params, LoraConfig(rank=4, alpha=8.0))
    assert not any(lora.is_adapter(k) for k in flat(merged))
    plain = build_model(small_config(rank=0).model)
    ids = lm_batch(6)["inputs"]
    adapted = logits(model, params, ids)
    assert np.abs(adapted - logits(plain, lora.merge({}, lora.trainable(params)[1]), ids)).max() \
        > 1e-2  # the adapters matter
    np.testing.assert_allclose(logits(plain, merged, ids), adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_scanned_stack_gets_stacked_adapters_and_merges_per_layer():
    config = small_config(base_quantization="int8")
    config.model.update(scan_layers=True, dropout_rate=0.0, attention_dropout_rate=0.0,
                        lora=dict(config.model.lora.to_dict(), dropout=0.1))
    model, optimizer, state = init(config)
    params = flat(state.params)
    assert params["decoder/layers/self_attention/query_lora_a"].shape == (2, 32, 4)
    assert params["decoder/layers/self_attention/query/scale"].shape == (2, 1, 4, 8)
    rng = np.random.RandomState(3)
    params = traverse_util.unflatten_dict({
        tuple(k.split("/")): rng.randn(*v.shape).astype(np.float32) * 0.1
        if k.endswith("_lora_b") else v for k, v in params.items()})
    plain_config = small_config(rank=0)
    plain_config.model.scan_layers = True
    merged = lora.merged_params(params, LoraConfig(rank=4, alpha=8.0))
    ids = lm_batch(8)["inputs"]
    np.testing.assert_allclose(logits(build_model(plain_config.model), merged, ids),
                               logits(model, params, ids), rtol=1e-4, atol=1e-4)
    # LoRA's dropout is on while training (config.model.dropout_rate is 0 here).
    family = family_of(config)
    losses = [float(family.loss_and_metrics(model, config, params, lm_batch(0),
                                            jax.random.key(0), deterministic=d)[0])
              for d in (True, False)]
    assert np.isfinite(losses).all() and losses[0] != losses[1]


def test_qlora_keeps_int8_kernels_and_its_forward_is_close_to_loras(trained):
    config, model, state, _ = trained
    q_config = small_config(base_quantization="int8")
    q_model, _, q_state = init(q_config)  # the same seed: the same float init, quantized
    kernels = {k: v for k, v in flat(q_state.params).items() if k.endswith("/qvalue")}
    assert len(kernels) == 7 * 2 and all(v.dtype == jnp.int8 for v in kernels.values())
    # Its params are LoRA's: a kernel's per-channel scales are not params (the count, the
    # active params and so MFU counted them)
    assert state_lib.num_params(q_state) == state_lib.num_params(state) == lora.counts(
        q_state.params)[0]
    assert state_lib.active_params(q_state, q_config) == state_lib.active_params(state, config)
    ids = lm_batch(7)["inputs"]
    ours, theirs = logits(q_model, q_state.params, ids), logits(model, state.params, ids)
    assert 0 < np.abs(ours - theirs).mean() / np.abs(theirs).mean() < 0.03
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 0.1
    # Each int8 kernel dequantizes to within half a step of its float kernel (a scale per
    # output channel: q/k/v's [1, heads, kv]).
    query = flat(q_state.params)["decoder/layers_0/self_attention/query/scale"]
    assert query.shape == (1, 4, 8)
    floats = flat(state.params)
    for key, qvalue in kernels.items():
        name = key[:-len("/qvalue")]
        scale = np.asarray(flat(q_state.params)[f"{name}/scale"])
        error = np.abs(np.asarray(qvalue, np.float32) * scale - np.asarray(floats[name]))
        assert (error / scale).max() <= 0.5 + 1e-3, (name, (error / scale).max())
    assert lora.device_bytes(q_state.params) < 0.6 * lora.device_bytes(state.params)
    q_total, q_trainable = lora.counts(q_state.params)
    assert (q_total, q_trainable) == lora.counts(state.params)


def test_the_fingerprint_names_the_base_not_the_adapters(trained):
    _, _, before, after = trained
    assert lora.fingerprint(before.params) == lora.fingerprint(after.params)
    changed = jax.tree.map(lambda x: x, before.params)
    changed["embed"]["embedding"] = changed["embed"]["embedding"].at[0, 0].add(1e-3)
    assert lora.fingerprint(changed) != lora.fingerprint(before.params)


def test_adapters_take_their_kernels_logical_axes():
    config = small_config()
    model = build_model(config.model)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                              jnp.zeros((1, 8), jnp.int32))["params"])
    layer = boxed["decoder"]["layers_0"]
    attention, mlp = layer["self_attention"], layer["mlp"]
    assert attention["key_lora_a"].names == ("embed", "lora")
    assert attention["key_lora_b"].names == ("lora", "kv_heads", "kv")
    assert attention["out_lora_a"].names == ("heads", "kv", "lora")
    assert attention["out_lora_b"].names == ("lora", "embed")
    assert mlp["wo_lora_a"].names == ("mlp", "lora") and mlp["wo_lora_b"].names == ("lora",
                                                                                     "embed")


@pytest.mark.parametrize("key,value,says", [
    ("model.lora.rank", -1, "model.lora.rank=-1: expected an int >= 0"),
    ("model.lora.base_quantization", "nf4", "model.lora.base_quantization='nf4': expected "
                                            "one of ('', 'int8')"),
    ("model.lora.targets", "(", "model.lora.targets='(': expected a regular expression"),
    ("init_from", "", "model.lora.rank=4: expected init_from"),
    # Muon takes only the hidden matrices, which LoRA freezes: it would update nothing
    ("optimizer.name", "muon", "optimizer.name='muon' with model.lora.rank=4: Muon "),
])
def test_bad_lora_settings_are_one_line_errors(key, value, says, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    config = small_config()
    config.init_from = f"hf:{tmp_path}"
    config.update_from_flattened_dict({key: value})
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith(says) and "\n" not in str(error.value)


def test_qlora_without_lora_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    config = small_config(rank=0, base_quantization="int8")
    config.init_from = f"hf:{tmp_path}"
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith("model.lora.base_quantization='int8': expected "
                                       "model.lora.rank > 0")


@pytest.mark.parametrize("key,value", [("targets", "mlp/wi$"), ("alpha", 3.0), ("dropout", 0.1)])
def test_lora_settings_without_a_rank_are_refused(key, value, tmp_path):
    """rank 0 trains the whole model: adapter settings there would be silently ignored."""
    (tmp_path / "config.json").write_text("{}")
    config = small_config(rank=0, alpha=16.0)
    config.init_from = f"hf:{tmp_path}"
    validate_config(config)  # (the defaults: a full fine-tune)
    config.model.lora[key] = value
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith(f"model.lora.{key}={value!r} with model.lora.rank=0 ")
    assert "\n" not in str(error.value)


def test_init_from_a_peft_adapter_folder_says_to_merge_it(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    config = small_config()
    config.init_from = f"hf:{tmp_path}"
    with pytest.raises(FileNotFoundError) as error:
        validate_config(config)
    assert str(error.value).startswith(f"init_from='hf:{tmp_path}': expected a save_pretrained ")
    assert "this is a peft adapter folder" in str(error.value)
    assert "merge_and_unload()" in str(error.value) and "\n" not in str(error.value)


def test_a_model_with_a_peft_adapter_beside_it_is_refused_by_every_import(tmp_path):
    """transformers' from_pretrained(DIR) applies an adapter saved beside the model; our import
    would read the base alone: validate_config, the architecture read at startup,
    transformer.load and generate's (and the harness's) workdir=hf:DIR refuse it in one line,
    naming the merge and the setting as the user gave it (it said init_from= for them all)."""
    import transformer

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path))
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and (tmp_path / "config.json").is_file()
    config = small_config()
    config.init_from = f"hf:{tmp_path}"
    says = "{} holds a peft adapter (adapter_config.json)"
    for read, source in ((validate_config, f"init_from='hf:{tmp_path}'"),
                         (finetune.resolve_init_config, f"init_from='hf:{tmp_path}'"),
                         (lambda _: transformer.load(f"hf:{tmp_path}"), f"'hf:{tmp_path}'"),
                         (lambda _: generate.load_workdir(f"hf:{tmp_path}"),
                          f"workdir='hf:{tmp_path}'")):
        with pytest.raises(ValueError) as error:
            read(config)
        assert str(error.value).startswith(says.format(source)) and "\n" not in str(
            error.value)
        assert "merge_and_unload().save_pretrained(OUT)" in str(error.value)


# --- end to end: an imported tiny Llama, the CLI, transformers and peft ----------------------


def tiny_llama(directory, seed=0):
    """A randomized tiny LlamaForCausalLM saved with save_pretrained."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(directory)
    return directory


def lora_flags(base, steps, *extra):
    return ["--config=experiments/gpt_tiny.py", f"--config.init_from=hf:{base}",
            "--config.model.lora.rank=4", f"--config.steps={steps}", "--config.batch_size=4",
            "--config.seq_len=16", "--config.log_every=1", f"--config.eval_every={steps}",
            "--config.eval_steps=1", "--config.checkpoint_every=2",
            "--config.optimizer.warmup_steps=0", "--config.data.num_sentinels=0", *extra]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(base dir, workdir, stdout) of 3 LoRA steps on a tiny imported Llama."""
    from test_train import assert_succeeded, run_cli

    root = tmp_path_factory.mktemp("lora")
    base = tiny_llama(root / "base")
    result = run_cli("transformer.train", *lora_flags(base, 3), f"--workdir={root / 'run'}",
                     logs=root / "logs")
    assert_succeeded(result)
    return base, root / "run", result.stdout


@pytest.mark.slow
def test_a_lora_run_starts_with_its_sizes_and_checkpoints_only_adapters(lora_run):
    from transformer.training import checkpoint

    _, workdir, stdout = lora_run
    line = next(x for x in stdout.splitlines() if x.startswith("lora: "))
    assert line.startswith("lora: rank 4, ") and "trainable" in line and \
        "optimizer state" in line, line
    _, metadata = checkpoint.params_metadata(str(workdir))
    assert metadata and all(lora.is_adapter(k) for k in metadata), sorted(metadata)[:4]
    base = checkpoint.saved_lora_base(str(workdir), 3)
    assert base["init_from"].startswith("hf:") and len(base["fingerprint"]) == 16


@pytest.mark.slow
def test_resume_reads_the_base_again_and_refuses_another_in_one_line(lora_run, tmp_path):
    import shutil

    from test_train import assert_succeeded, run_cli, train_losses

    base, workdir, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    shutil.rmtree(copy / "checkpoints" / "3")  # resume from step 2
    result = run_cli("transformer.train", *lora_flags(base, 3), f"--workdir={copy}",
                     logs=tmp_path / "resume")
    assert_succeeded(result)
    assert train_losses(copy)[3] == pytest.approx(train_losses(workdir)[3], rel=1e-5)
    # The base directory now holds other weights (retrained, replaced): refused in one line.
    other = tiny_llama(tmp_path / "other", seed=1)
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    try:
        shutil.copyfile(other / "model.safetensors", weights)
        result = run_cli("transformer.train", *lora_flags(base, 4), f"--workdir={copy}",
                         logs=tmp_path / "other_logs")
    finally:
        weights.write_bytes(original)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: LoRA checkpoint step 3: its adapters were trained on base "
                           f"hf:{base} (fingerprint ") and "which now holds other params" in last


@pytest.mark.slow
def test_a_lora_run_on_an_fsdp_tensor_mesh_equals_one_device(lora_run, tmp_path):
    import subprocess
    import sys

    from test_train import REPO, cli_env, describe, train_losses

    base, workdir, _ = lora_run
    flags = lora_flags(base, 3, "--config.mesh.data=1", "--config.mesh.fsdp=2",
                       "--config.mesh.tensor=2")
    result = forkserver.run([sys.executable, "-m", "transformer.train", *flags,
                             f"--workdir={tmp_path / 'mesh'}"], cwd=REPO, env=cli_env(4),
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, describe(result)
    assert "fsdp=2" in result.stdout and "tensor=2" in result.stdout
    ours, one = train_losses(tmp_path / "mesh"), train_losses(workdir)
    assert ours.keys() == one.keys()
    for step in one:
        assert ours[step] == pytest.approx(one[step], rel=1e-5), step


@pytest.mark.slow
def test_both_exports_give_our_logits_in_transformers_and_peft(lora_run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_train import assert_succeeded, run_cli

    from transformer.training import finetune

    base, workdir, _ = lora_run
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert_succeeded(run_cli("transformer.export", f"--workdir={workdir}",
                             f"--output={merged}", "--merge_lora", logs=tmp_path))
    result = run_cli("transformer.export", f"--workdir={workdir}", f"--output={adapter}",
                     logs=tmp_path)
    assert_succeeded(result)
    assert "as a peft LoRA adapter" in result.stdout
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
    saved = finetune.restore_params(str(workdir))
    ids = np.random.RandomState(0).randint(0, 300, (2, 12))
    ours = logits(build_model(saved.config.model), saved.params, ids)
    with torch.no_grad():
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
        got_merged = hf_merged(input_ids=torch.tensor(ids)).logits.numpy()
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
        got_base = hf_base(input_ids=torch.tensor(ids)).logits.numpy()
        with_adapter = peft.PeftModel.from_pretrained(hf_base, adapter).eval()
        got_peft = with_adapter(input_ids=torch.tensor(ids)).logits.numpy()
    scale = np.abs(ours).max()
    assert np.abs(got_base - ours).max() > 1e-3 * scale  # the adapters changed the model
    assert np.abs(got_merged - ours).max() <= 1e-5 * scale
    assert np.abs(got_peft - ours).max() <= 1e-5 * scale
    result = run_cli("transformer.export", f"--workdir={workdir}",
                     f"--output={tmp_path / 'again'}", "--merge_lora", "--step=2",
                     logs=tmp_path)
    assert_succeeded(result)


@pytest.mark.slow
@pytest.mark.parametrize("targets,adapted", [
    (r"layers_0/self_attention/(query|value)$", {"0.self_attn.q_proj", "0.self_attn.v_proj"}),
    (r"layers_0/self_attention/query$|layers_1/mlp/wo$", {"0.self_attn.q_proj",
                                                          "1.mlp.down_proj"}),
    (r"self_attention/value$", {"0.self_attn.v_proj", "1.self_attn.v_proj"})])
def test_a_peft_adapter_of_some_layers_loads_onto_exactly_those_modules(targets, adapted,
                                                                         tmp_path):
    """Adapters on some layers (or no layers x modules grid): peft attaches LoRA to exactly the
    adapted modules, with no missing keys (an extra zero adapter would train with
    is_trainable=True), and gives our logits."""
    import warnings

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformer import export as export_cli
    from transformer.hf import export

    config = small_config()
    config.model.lora.targets = targets
    model, _, state = init(config)
    rng = np.random.RandomState(4)
    params = jax.tree_util.tree_map_with_path(
        lambda path, v: rng.randn(*v.shape).astype(np.float32) * 0.1
        if path[-1].key.endswith("_lora_b") else np.asarray(v), state.params)
    hf_config, tensors = export.to_hf(export.base_model_config(config.model),
                                      lora.merge({}, lora.trainable(params)[1]))
    base = transformers.LlamaForCausalLM(hf_config).eval()
    base.load_state_dict({k: torch.tensor(v) for k, v in tensors.items()}, strict=True)
    export_cli._peft_files(config, params, str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tuned = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    assert not [w for w in caught if "missing" in str(w.message)], [str(w.message)
                                                                    for w in caught]
    attached = {name.removeprefix(export.PEFT_PREFIX) for name, module in
                tuned.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert attached == adapted
    ids = lm_batch(9)["inputs"]
    with torch.no_grad():
        theirs = tuned(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = logits(model, params, ids)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-5 * np.abs(ours).max())


@pytest.mark.slow
def test_a_hybrid_takes_adapters_on_its_softmax_attention_and_a_bare_target_is_refused():
    """Gated DeltaNet layers take no adapters: the default targets leave them out (their
    `linear_attention/query` once matched `attention/query` silently), and a regex that
    matches them is one line before anything trains."""
    config = small_config()
    config.model.update(num_layers=4, layer_types="linear_attention*3,full_attention")
    _, _, state = init(config)
    adapted = {k[:-len("_lora_a")] for k in flat(state.params) if k.endswith("_lora_a")}
    assert "decoder/layers_3/self_attention/query" in adapted
    assert not any("linear_attention" in k for k in adapted)
    assert "decoder/layers_0/mlp/wi_gate" in adapted
    config.model.lora.targets = r"attention/(query|key)$"
    with pytest.raises(ValueError, match=r"^model.lora.targets='attention/\(query\|key\)\$' "
                                         r"matches decoder/layers_0/linear_attention/key \(and "
                                         r"5 more\), which takes no adapter"):
        init(config)


@pytest.mark.slow
def test_a_workdir_base_that_trains_on_keeps_the_step_the_adapters_were_trained_on(tmp_path):
    """init_from=BASE (its latest step, 2) records BASE@2 as the adapters' base: once BASE
    trains on to step 4, evaluate and the resumed run still read step 2, where they refused
    the newer params; once that step is gone, the line names the adapters' base."""
    import json

    from test_train import assert_succeeded, run_cli, tiny_flags

    from transformer.training import checkpoint

    base, run = tmp_path / "base", tmp_path / "lora"
    common = ["--config=experiments/gpt_tiny.py", "--config.data.num_sentinels=0"]
    assert_succeeded(run_cli("transformer.train", *common, *tiny_flags(2), f"--workdir={base}",
                             logs=tmp_path / "base_logs"))
    lora_args = [*common, f"--config.init_from={base}", "--config.model.lora.rank=2",
                 f"--workdir={run}"]
    assert_succeeded(run_cli("transformer.train", *lora_args, *tiny_flags(2),
                             logs=tmp_path / "lora_logs"))
    assert checkpoint.saved_lora_base(str(run), 2)["init_from"] == f"{base}@2"
    assert_succeeded(run_cli("transformer.train", *common, *tiny_flags(4), f"--workdir={base}",
                             logs=tmp_path / "base_on"))
    result = run_cli("transformer.evaluate", f"--workdir={run}", logs=tmp_path / "eval")
    assert_succeeded(result)
    assert json.loads(result.stdout[result.stdout.index("{"):])["step"] == 2
    assert_succeeded(run_cli("transformer.train", *lora_args, *tiny_flags(3),
                             logs=tmp_path / "resume"))
    # that step gone (pruned, cleaned up): one line naming the adapters' base, where it read
    # as the LoRA workdir's own step=2 missing
    (base / "checkpoints" / "2").rename(tmp_path / "aside")
    result = run_cli("transformer.evaluate", f"--workdir={run}", logs=tmp_path / "eval_gone")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: the LoRA checkpoint's base init_from={base}@2: step=2: expected one of the "
        "saved steps [4] (the adapters need the base they were trained on)"], result.stderr


def test_a_deleted_base_is_named_as_the_adapters_base(tmp_path):
    """Resuming a LoRA run whose base workdir is gone says it is the base that is missing."""
    config = small_config()
    config.init_from = str(tmp_path / "deleted_base")
    model = build_model(config.model)
    abstract, shardings, make = initial_state(config, model, sharding.make_mesh(config.mesh))
    state = make(jax.random.key(0))
    with pytest.raises(FileNotFoundError, match=r"^the LoRA checkpoint's base init_from=.*"
                                                r"deleted_base: .*holds no checkpoints.* \(the "
                                                r"adapters need the base they were trained on\)"):
        finetune.with_lora_base(config, state.params, abstract.params, shardings.params,
                                {"init_from": config.init_from, "fingerprint": "x"})


def test_a_lora_model_with_params_its_base_lacks_is_refused_in_one_line(tmp_path):
    """A classifier head is new on an LM base: LoRA would freeze it at its random init, so a
    LoRA model is refused, naming the head; without LoRA the same base loads, the head new."""
    base = tiny_llama(tmp_path / "base")
    reports = []
    for rank in (0, 4):
        config = small_config(rank=rank)
        config.model.update(vocab_size=300, head="classify", num_classes=3)
        abstract, shardings, make = initial_state(config, build_model(config.model),
                                                  sharding.make_mesh(config.mesh))
        with pytest.raises(ValueError) if rank else contextlib.nullcontext() as error:
            reports.append(finetune.load_params(f"hf:{base}", make(jax.random.key(0)).params,
                                                shardings.params)[1])
    assert reports[0].new == ["classifier/bias", "classifier/kernel"]
    message = str(error.value)
    assert message.startswith(f"model.lora.rank=4 with params init_from hf:{base} does not "
                              "supply (classifier/bias, classifier/kernel): LoRA trains the "
                              "adapters only") and "\n" not in message


@pytest.mark.slow
def test_a_lora_classifier_on_an_lm_base_stops_before_writing_anything(tmp_path):
    """Through the CLI: one error line naming the head, and no workdir."""
    from test_train import run_cli

    base = tiny_llama(tmp_path / "base")
    flags = lora_flags(base, 2)
    flags[0] = "--config=experiments/gpt_finetune_cls.py"
    result = run_cli("transformer.train", *flags, f"--workdir={tmp_path / 'run'}",
                     logs=tmp_path / "logs")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not supply (classifier/bias, classifier/kernel)" in \
        errors[0], result.stderr[-2000:]
    assert not (tmp_path / "run").exists() and "step 1" not in result.stdout


def test_a_qlora_run_exports_merged_or_not_at_all(monkeypatch, tmp_path):
    """A QLoRA run's adapters fit the int8-rounded base: a peft adapter on the float base would
    be off, so the export asks for --merge_lora, before reading or writing anything."""
    from transformer import export

    config = small_config(base_quantization="int8")
    monkeypatch.setattr(export.checkpoint_lib, "saved_run", lambda workdir, step: (3, config))
    with pytest.raises(ValueError, match=r"is a QLoRA run \(model.lora.base_quantization="
                                         r"'int8'\): .* expected --merge_lora"):
        export.export_workdir(str(tmp_path / "run"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_model_without_quantized_kernels_never_imports_qwix():
    """Importing Qwix takes about 1 s (it loads flax.nnx and IPython). Every projection passes
    through lora.project, so a plain model's trace, which every command does at start-up, must
    not pay it. Checked in a fresh process: this one may have imported it already."""
    code = """if True:
        import sys
        import jax
        from transformer.configs import base_config
        from transformer.models import build_model
        config = base_config()
        config.model.update(family="gpt", num_layers=1, d_model=16, num_heads=2, d_ff=32,
                            vocab_size=32)
        config.model.lora.rank = 2  # with adapters: every lora.project path
        model = build_model(config.model)
        jax.eval_shape(model.init, jax.random.key(0), jax.numpy.zeros((1, 8), "int32"))
        assert "qwix" not in sys.modules, "a plain model's trace imported qwix"
    """
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=cli_env())  # on CPU, this checkout's transformer/
    assert child.returncode == 0, child.stderr[-3000:]


# --- multi-head latent attention and mixtures of experts (DeepSeek-V3) ----------------------

MLA = dict(attention_kind="mla", num_kv_heads=None,
           mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8))


def mla_config(q_lora_rank=16, **lora_settings):
    config = small_config(**lora_settings)
    config.model.update(**MLA)
    config.model.mla.q_lora_rank = q_lora_rank
    return config


@pytest.mark.parametrize("q_lora_rank,query", [(16, ("q_a", "q_b")), (0, ("query",))])
def test_an_mla_models_default_adapters_cover_its_query_and_key_value_projections(
        q_lora_rank, query):
    """The default targets adapt MLA's query (q_a and q_b, or query at q_lora_rank 0), its
    key/value down-projection kv_a and out, not only out; merged, they give its logits."""
    config = mla_config(q_lora_rank)
    model, _, state = init(config)
    adapted = {k[:-len("_lora_a")] for k in flat(state.params) if k.endswith("_lora_a")}
    assert {k.rsplit("/", 1)[1] for k in adapted if "/layers_0/self_attention/" in k} == \
        {*query, "kv_a", "out"}
    rng = np.random.RandomState(4)  # B nonzero, as after training
    params = traverse_util.unflatten_dict({
        tuple(k.split("/")): rng.randn(*v.shape).astype(np.float32) * 0.1
        if k.endswith("_lora_b") else v for k, v in flat(state.params).items()})
    plain = build_model(mla_config(q_lora_rank, rank=0).model)
    ids = lm_batch(10)["inputs"]
    adapted_logits = logits(model, params, ids)
    base = lora.merge({}, lora.trainable(params)[1])
    assert np.abs(adapted_logits - logits(plain, base, ids)).max() > 1e-2
    merged = lora.merged_params(params, LoraConfig(rank=4, alpha=8.0))
    np.testing.assert_allclose(logits(plain, merged, ids), adapted_logits, rtol=1e-4,
                               atol=1e-4)


# each MLA kernel's int8 scale: one per output channel, the contracted dims reduced to 1
MLA_SCALES = {"q_a": (1, 16), "q_b": (1, 4, 12), "kv_a": (1, 20), "out": (1, 1, 32)}


@pytest.mark.parametrize("name", sorted(MLA_SCALES))
def test_qlora_quantizes_every_mla_kernel_per_output_channel(name):
    """QLoRA on one MLA kernel at a time: a scale per output channel (q_b's once had one per
    element, every value +-127, and its forward was the float one); the forward differs from
    the float model's by int8 rounding and equals the float model on a float64 dequantization."""
    targets = f"self_attention/{name}$"
    config = mla_config()
    config.model.lora.targets = targets
    q_config = mla_config(base_quantization="int8")
    q_config.model.lora.targets = targets
    model, _, state = init(config)
    q_model, _, q_state = init(q_config)  # the same seed: the same float init, quantized
    quantized = {k[:-len("/qvalue")]: v for k, v in flat(q_state.params).items()
                 if k.endswith("/qvalue")}
    assert sorted(quantized) == [f"decoder/layers_{i}/self_attention/{name}" for i in (0, 1)]
    floats, dequantized = flat(state.params), dict(flat(state.params))
    for key, qvalue in quantized.items():
        scale = np.asarray(flat(q_state.params)[f"{key}/scale"], np.float64)
        assert scale.shape == MLA_SCALES[name] and scale.size < qvalue.size
        hand = np.asarray(qvalue, np.float64) * scale
        steps = np.abs(hand - np.asarray(floats[key], np.float64)) / scale
        assert steps.max() <= 0.5 + 1e-3 and np.abs(np.asarray(qvalue)).max() == 127
        dequantized[key] = hand.astype(np.float32)
    ids = lm_batch(11)["inputs"]
    ours, theirs = logits(q_model, q_state.params, ids), logits(model, state.params, ids)
    assert 1e-5 < np.abs(ours - theirs).max() / np.abs(theirs).max() < 0.05
    by_hand = logits(model, traverse_util.unflatten_dict(
        {tuple(k.split("/")): v for k, v in dequantized.items()}), ids)
    np.testing.assert_allclose(ours, by_hand, rtol=0, atol=1e-5 * np.abs(by_hand).max())


def test_moving_moe_balance_biases_is_refused_for_a_lora_run_but_not_by_default(tmp_path):
    """moe.bias_update_rate > 0 would move the frozen base's balance biases (which a LoRA
    checkpoint does not keep, and whose fingerprint then differs): one line at validation. An
    imported DeepSeek-V3 keeps its biases fixed (rate 0), so LoRA on it validates as it is."""
    from test_hf_deepseek import deepseek  # (skips without torch)

    from transformer.hf import convert

    (tmp_path / "config.json").write_text("{}")
    hf = deepseek()
    imported, _ = convert.from_hf(hf.config, hf.state_dict())
    assert imported.moe.balance_bias and imported.moe.bias_update_rate == 0
    config = small_config()
    config.init_from = f"hf:{tmp_path}"
    config.model.moe.update(imported.moe.to_dict())
    validate_config(config)
    config.model.moe.bias_update_rate = 0.001
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value).startswith(
        "model.moe.bias_update_rate=0.001 with model.lora.rank=4: expected 0 "
        "(--config.model.moe.bias_update_rate=0;") and "\n" not in str(error.value)
