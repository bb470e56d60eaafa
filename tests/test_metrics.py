"""FLOPs and MFU accounting (training.metrics): the formula against a hand count, the peak
table by device kind, and the cached CPU measurement."""

import json
import os
import re
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from transformer import configs
from transformer.models import build_model
from transformer.training import metrics

# 2 layers, width 64, 4 heads, MLP 256, byte vocabulary of 256, learned positions up to 64.
HAND_PARAMS = {
    "embed": 256 * 64,
    "positions": 64 * 64,
    # q, k, v, out kernels + their biases; MLP in + out kernels + biases; two LayerNorms
    "per layer": 4 * 64 * 64 + 4 * 64 + 64 * 256 + 256 + 256 * 64 + 64 + 2 * (64 + 64),
    "final norm": 64 + 64,
}


def small_config(**model):
    config = configs.base_config()
    config.seq_len = 32
    config.model.update(family="gpt", vocab_size=256, num_layers=2, d_model=64, num_heads=4,
                        d_ff=256, position="learned", max_len=64, use_bias=True, **model)
    return config


def count_params(config) -> int:
    variables = build_model(config.model).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return sum(x.size for x in jax.tree.leaves(nn.unbox(variables["params"])))


def test_flops_per_token_is_6n_plus_attention_against_a_hand_count():
    config = small_config()
    total = HAND_PARAMS["embed"] + HAND_PARAMS["positions"] + 2 * HAND_PARAMS["per layer"] + \
        HAND_PARAMS["final norm"]
    assert count_params(config) == total == 120_576
    # N counts the matmul params: not the position table, which is only looked up; the tied
    # token embedding is the output head's matmul too.
    n = total - HAND_PARAMS["positions"]
    attention = 12 * 2 * (4 * 16) * 32  # 12 L (heads x head_dim) T, causal not halved
    assert metrics.flops_per_token(config, total) == 6 * n + attention == 748_032
    # Untied: the head's kernel (64 x 256) is a matmul, the embedding a lookup: same N.
    untied = small_config(tie_embeddings=False)
    assert metrics.flops_per_token(untied, count_params(untied)) == 748_032


def forward_matmul_flops(config, rows: int = 2) -> tuple[float, dict]:
    """(the matmul FLOPs per token of the model's forward on [rows, seq_len] tokens, counted
    in its program by `metrics.program_matmul_flops`; its params)."""
    model, tokens = build_model(config.model), jnp.zeros((rows, config.seq_len), jnp.int32)
    params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(params).jaxpr
    return metrics.program_matmul_flops(jaxpr) / (rows * config.seq_len), params


@pytest.mark.parametrize("family,head", [("gpt", "mlm"), ("gpt", "classify"), ("bert", "mlm"),
                                         ("bert", "classify"), ("lstm", "mlm")])
def test_the_flops_are_3_x_the_matmuls_the_forward_runs_whatever_the_head(family, head):
    """6 N + attention is 3 x the forward's matmuls, counted in its program, but for the params
    no matmul runs on every token: the norms' and biases' (charged 6 each, as nanoGPT does),
    BERT's token-type table (a lookup that N still counts) and a class head's kernels (pooler,
    classifier: they run once a row, on the last or [CLS] vector, charged 6 a token like the
    rest). A class head never multiplies by the tied token embedding: not in N. The LSTM never
    reads small_config's position="learned": it has no position table to leave out of N."""
    config = small_config(head=head, num_classes=3 if head == "classify" else 0)
    config.model.family = family
    forward, params = forward_matmul_flops(config)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    vectors = sum(x.size for path, x in leaves if path[-1].key.endswith(("bias", "scale")))
    per_row = sum(x.size for path, x in leaves if path[-1].key == "kernel" and
                  path[0].key in ("classifier", "pooler"))
    types = params["type_embed"]["embedding"].size if family == "bert" else 0
    assert (per_row > 0) == (head == "classify")
    n = sum(x.size for _, x in leaves)
    assert metrics.flops_per_token(config, n) == pytest.approx(
        3 * forward + 6 * (vectors + types) + 6 * per_row * (1 - 1 / config.seq_len), rel=1e-12)


def step_matmul_flops(remat_policy: str, batch: dict, freeze: str = "") -> float:
    """`metrics.hardware_flops_per_token` of small_config's train step (SGD: no matmuls of
    its own) under `remat_policy` (and optimizer.freeze), counted in the step's program."""
    import numpy as np
    import optax

    from transformer.training.state import TrainState
    from transformer.training.step import make_train_step

    config = small_config(remat_policy=remat_policy)
    config.batch_size, config.seq_len = batch["inputs"].shape
    config.optimizer.freeze = freeze
    model = build_model(config.model)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))[
        "params"])
    optimizer = optax.sgd(0.1)
    state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                       np.asarray(-1, np.int32))
    step = jax.jit(make_train_step(model, config, optimizer))
    return metrics.hardware_flops_per_token(config, -1.0, step, state, batch)


def test_hardware_flops_are_the_matmuls_the_step_runs_under_each_remat_policy():
    """Without rematerialisation the hardware runs the model FLOPs (it returns those). Under
    it, the step's program is counted: with nothing saved, the backward recomputes the
    forward but for what no gradient needs (each block's last matmul, the head); saving the
    matmuls without batch axes, it recomputes attention's scores and values (dots with batch
    axes), and no other matmul. (Without remat the program runs 3 x the forward, 6 N but the
    norms' and biases' params.)"""
    from test_moe import text_batch

    batch = text_batch(rows=2, length=32, vocab=256)
    assert step_matmul_flops("none", batch) == -1.0  # the model FLOPs passed in
    # The forward's matmuls per token, by hand (width 64, MLP 256, T 32, 2 layers, vocab 256):
    projections, mlp_in, mlp_out = 4 * 2 * 64 * 64, 2 * 64 * 256, 2 * 256 * 64
    attention = 2 * (2 * 32 * 64)  # q k^T and p v over the 32 keys
    head = 2 * 64 * 256
    forward = 2 * (projections + mlp_in + mlp_out + attention) + head
    assert forward == 245_760
    # nothing saved: the forward again, but for the MLP's output matmul and the head
    assert step_matmul_flops("full", batch) == 3 * forward + forward - 2 * mlp_out - head
    assert step_matmul_flops("dots_no_batch", batch) == 3 * forward + 2 * attention
    # frozen MLPs: their weight gradients are never computed (both layers' wi and wo); the
    # gradient through them still is
    assert step_matmul_flops("full", batch, freeze="mlp/") == \
        step_matmul_flops("full", batch) - 2 * (mlp_in + mlp_out)


def test_a_pipelined_step_counts_its_programs_matmuls_without_remat_too(monkeypatch):
    """Pipelining runs every stage through the bubble's iterations: the hardware FLOPs are the
    traced program's under any remat policy, not the model FLOPs only where remat is off."""
    config = small_config()
    config.batch_size, config.seq_len = 2, 4
    step = jax.jit(lambda a, b: a @ b)  # 2 x 8 x 16 x 32 FLOPs
    args = (jnp.ones((8, 16)), jnp.ones((16, 32)))
    assert metrics.hardware_flops_per_token(config, -1.0, step, *args) == -1.0
    config.mesh.stage = 2
    assert metrics.hardware_flops_per_token(config, -1.0, step, *args) == 2 * 8 * 16 * 32 / 8
    config.mesh.data, config.mesh.stage = 1, -1  # the stages: the devices the others leave
    assert metrics.hardware_flops_per_token(config, -1.0, step, *args) == -1.0  # 1 device
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    assert metrics.hardware_flops_per_token(config, -1.0, step, *args) == 2 * 8 * 16 * 32 / 8


def test_the_attention_gate_counts_in_n_so_in_the_flops():
    plain, gated = small_config(), small_config(attention_gate="element")
    extra = 2 * (64 * 4 * 16 + 4 * 16)  # per layer: the gate kernel [D, N, H] and its bias
    assert count_params(gated) == count_params(plain) + extra
    assert metrics.flops_per_token(gated, count_params(gated)) == \
        metrics.flops_per_token(plain, count_params(plain)) + 6 * extra


def test_a_sliding_layer_counts_the_keys_in_its_window():
    """seq_len 32: a layer windowed to 8 keys spends 12 D 8 per token, a full one 12 D 32."""
    width = 4 * 16
    full = metrics.flops_per_token(small_config(), 0)
    windowed = small_config(sliding_window=8, sliding_window_pattern=2)
    assert metrics.flops_per_token(windowed, 0) - full == 12 * width * (8 - 32)
    wide = small_config(sliding_window=64)  # a window past seq_len sees seq_len keys
    assert metrics.flops_per_token(wide, 0) == full


@pytest.mark.parametrize("kind,dtype,expected", [
    ("TPU v4", "float32", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5p", "bfloat16", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "float32", 156e12),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", "float32", 494e12),
])
def test_accelerator_peaks_come_from_the_published_table(kind, dtype, expected):
    device = types.SimpleNamespace(platform="tpu" if "TPU" in kind else "gpu",
                                   device_kind=kind, process_index=0)
    peak, source = metrics.peak_flops(small_config(dtype=dtype), [device])
    assert peak == expected and kind in source and "published" in source


def test_an_unknown_accelerator_gets_no_mfu_and_a_configured_peak_wins():
    device = types.SimpleNamespace(platform="tpu", device_kind="TPU v9", process_index=0)
    peak, source = metrics.peak_flops(small_config(), [device])
    assert peak is None and "TPU v9" in source and "peak_flops_per_device" in source
    config = small_config()
    config.peak_flops_per_device = 1e12
    assert metrics.peak_flops(config, [device]) == (1e12, "config.peak_flops_per_device")


def test_the_cpu_peak_is_the_best_measurement_seen_and_shared_by_its_devices(tmp_path,
                                                                             monkeypatch):
    """A first measurement taken on a busy machine (here: a clock 3000 s slow a reading, so that
    the real measurement beats it 100 times over on a loaded CI machine too: 3 s failed beside
    the suite) is outdone by the next start's, which the cache then keeps; a later busy start
    does not lower it."""
    cache = tmp_path / "cpu_peak.json"
    clock = metrics.time.perf_counter
    slow = iter(range(10**6))
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock() + 3000 * next(slow))
    busy = metrics.measured_cpu_peak(size=256, repeats=2, cache=str(cache))
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    best, now = metrics.cpu_peak(size=256, cache=str(cache))
    assert best == now > 100 * busy and now > 1e8  # any CPU does > 0.1 GFLOP/s
    assert json.loads(cache.read_text()) == {metrics._host_id(): best}
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock() + 3000 * next(slow))
    assert metrics.cpu_peak(size=256, cache=str(cache)) == (best, pytest.approx(busy, rel=0.1))
    assert json.loads(cache.read_text()) == {metrics._host_id(): best}
    monkeypatch.setattr(metrics, "cpu_peak", lambda: (best, busy))
    cpus = [types.SimpleNamespace(platform="cpu", device_kind="cpu", process_index=0)] * 4
    peak, source = metrics.peak_flops(small_config(), cpus)
    assert peak == pytest.approx(best / 4) and "shared by 4 CPU device(s)" in source
    assert f"{best / 1e9:.0f} GFLOP/s (this start: {busy / 1e9:.0f})" in source


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: {family}
model\t\t: {model}
model name\t: AMD EPYC
stepping\t: 1

processor\t: 1
cpu family\t: 1
model\t\t: 1
model name\t: other
"""


def test_the_cpu_peak_is_cached_per_cpu_generation_not_only_its_model_name(tmp_path,
                                                                          monkeypatch):
    """Two cloud VMs whose CPUs are both "AMD EPYC" (Zen 3: family 25 model 1, Zen 5: family
    26 model 2) sharing a home keep a peak each; without the numbers, the name alone."""
    keys = []
    for family, model in ((25, 1), (26, 2)):
        cpuinfo = tmp_path / f"cpuinfo_{family}"
        cpuinfo.write_text(CPUINFO.format(family=family, model=model))
        monkeypatch.setattr(metrics, "CPUINFO", str(cpuinfo))
        keys.append(metrics._host_id())
    assert keys[0] != keys[1]
    assert keys[1].startswith("AMD EPYC (family 26, model 2) | ")
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\n")
    assert metrics._host_id().startswith("AMD EPYC | ")


@pytest.mark.slow
def test_the_cpu_peak_cache_moves_with_its_variable_and_the_suite_keeps_out_of_home(tmp_path):
    """A peak measured while the suite loads every core must not become the user's: the
    suite's processes (this one and the CLI runs it starts) cache in a temporary file."""
    home = os.path.join(os.path.expanduser("~"), ".cache", "transformer", "cpu_peak.json")
    assert metrics.CPU_PEAK_CACHE == os.environ["TRANSFORMER_CPU_PEAK_CACHE"] != home
    code = "from transformer.training import metrics; print(metrics.CPU_PEAK_CACHE)"
    moved = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "TRANSFORMER_CPU_PEAK_CACHE": str(tmp_path / "p")},
                           check=True)
    assert moved.stdout.strip() == str(tmp_path / "p")
    unset = {k: v for k, v in os.environ.items() if k != "TRANSFORMER_CPU_PEAK_CACHE"}
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=unset, check=True)
    assert default.stdout.strip() == home


@pytest.mark.slow
def test_the_metrics_logger_leaves_torch_and_the_cloud_clients_unloaded_and_importable(tmp_path):
    """tensorboardX imports torch (2 s of every command's start) only to take torch tensors,
    and boto3 / google.cloud.storage (0.65 s) only for s3:// and gs:// log directories: a
    local logger loads it without them; a gs:// logger after it in the same process gets
    tensorboardX's gs:// writer working, and torch still imports afterwards."""
    code = ("import sys; from transformer.training import metrics\n"
            "logger = metrics.MetricsLogger(sys.argv[1], True)\n"
            "logger.write(1, 'train', {'loss': 1.0})\n"
            "print(*(m in sys.modules for m in ('torch', 'boto3', 'google.cloud.storage')))\n"
            "metrics.summary_writer_class(remote=True)\n"
            "from tensorboardX import record_writer\n"
            "print(record_writer.GCS_ENABLED, 'google.cloud.storage' in sys.modules)\n"
            "import torch; print(callable(torch.ones))\n")
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                           text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    assert child.stdout.split() == ["False"] * 3 + ["True"] * 3, child.stdout + child.stderr
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_run_under_rematerialisation_logs_hfu_from_its_programs_matmuls(tmp_path, capsys):
    """The training loop counts its own step (the count itself: the test above): under full
    remat hfu / mfu is the recomputed forward's share, one number for the run, in the records
    and the log lines (after MFU); a run without remat logs no hfu."""
    import json

    from test_train import tiny_config

    from transformer import train

    for remat in ("full", "none"):
        config = tiny_config(steps=3, log_every=1)
        config.model.remat_policy = remat
        train.train_and_evaluate(config, str(tmp_path / remat))
        records = [json.loads(line) for line in
                   (tmp_path / remat / "metrics.jsonl").read_text().splitlines()]
        timed = [r for r in records if r["split"] == "train" and "mfu" in r]
        assert timed and all(("hfu" in r) == (remat == "full") for r in timed)
        out = capsys.readouterr().out
        lines = re.findall(r"^step \d+/3 .* MFU (\d+)% (?:HFU (\d+)% )?ETA", out, re.M)
        assert [(f"{r['mfu']:.0%}", f"{r['hfu']:.0%}" if "hfu" in r else "") for r in timed] == \
            [(f"{mfu}%", f"{hfu}%" if hfu else "") for mfu, hfu in lines]
        if remat == "full":  # a third more, less the matmuls no gradient needs recomputed
            ratios = {round(r["hfu"] / r["mfu"], 9) for r in timed}
            assert len(ratios) == 1 and 1.0 < ratios.pop() < 4 / 3, timed


def test_loops_count_by_their_trip_count_or_not_at_all():
    """A scan's matmuls times its length, a shard_map's times its devices; a while loop's trip
    count is not in the program: its matmuls make the count unknown (None), and a while loop
    without any (index arithmetic) counts nothing."""
    x = jnp.ones((4, 8))
    w = jnp.ones((8, 8))
    one = 2 * 4 * 8 * 8

    def count(fn, *args):
        return metrics.program_matmul_flops(jax.make_jaxpr(fn)(*args).jaxpr)

    assert count(lambda x: jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0],
                 x) == 5 * one
    dynamic = lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: c @ w, x)
    assert count(dynamic, x, 3) is None
    assert count(lambda x, n: (x @ w, jax.lax.fori_loop(0, n, lambda i, c: c + i, 0))[0],
                 x, 3) == one
    mesh = jax.sharding.AbstractMesh((4,), ("data",))  # each of 4 shards multiplies a row
    split = jax.shard_map(lambda a: a @ w, mesh=mesh, in_specs=jax.P("data"),
                          out_specs=jax.P("data"))
    rows = jax.ShapeDtypeStruct((4, 8), jnp.float32,
                                sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))
    assert count(split, rows) == one


def t5_config(experts: int = 0):
    """A tiny T5: 2 encoder layers, 1 decoder layer, width 32 (2 heads of 16), gated MLP 64
    wide, no biases, RMSNorm scales, 32 relative-position buckets, tied vocabulary of 64."""
    config = configs.base_config()
    config.seq_len = 16
    config.model.update(family="t5", vocab_size=64, num_layers=2, num_decoder_layers=1,
                        d_model=32, num_heads=2, d_ff=64, position="t5", norm="rmsnorm",
                        norm_placement="pre", activation="geglu", use_bias=False,
                        tie_embeddings=True, dropout_rate=0.0)
    config.model.moe.num_experts = experts  # top_k 2
    config.data.objective = "span_corruption"
    return config


def t5_batch(rows: int, inputs: int, targets: int) -> dict:
    tokens = lambda n: jnp.arange(rows * n, dtype=jnp.int32).reshape(rows, n) % 60 + 3
    return {"encoder_inputs": tokens(inputs), "decoder_inputs": tokens(targets),
            "targets": tokens(targets), "weights": jnp.ones((rows, targets), jnp.float32)}


def t5_abstract(config, batch):
    from transformer.parallel import sharding
    from transformer.training import state as state_lib

    return state_lib.initial_state(config, build_model(config.model), sharding.make_mesh(
        config.mesh, jax.devices()[:1]), batch)[0]


@pytest.mark.parametrize("experts", [0, 4])
def test_an_encoder_decoder_counts_each_stack_at_its_own_length_against_a_hand_count(experts):
    """S = 16 encoder tokens a row (what tok/s counts), T = 6 decoder tokens (the batch's):
    6 N_enc S + 6 N_dec T + the encoder's attention at S, the decoder's self-attention at T
    and its cross-attention over the S keys for each of the T tokens, per S tokens. N_enc: the
    encoder stack and the cross-attention's key and value (they project the encoder's S
    rows); N_dec: the rest of the decoder and the tied head; the relative-position tables
    are lookups. With 4 experts, top 2, a token passes through 2 experts' MLPs and the
    router."""
    from transformer.training import state as state_lib

    config, s, t, width = t5_config(experts), 16, 6, 32
    attention, mlp = 4 * 32 * 32, 3 * 32 * 64  # q, k, v, out; gate, up, down
    active_mlp = 32 * 4 + 2 * mlp if experts else mlp  # the router and 2 of 4 experts
    table, head = 32 * 2, 64 * 32  # each stack's buckets x heads; the tied embedding
    encoder = 2 * (attention + 2 * 32 + active_mlp) + 32  # + 2 norms a layer, final norm
    decoder = 2 * attention + 3 * 32 + active_mlp + 32  # self, cross; 3 norms; final norm
    cross_kv = 2 * 32 * 32  # the decoder's, on the encoder side
    abstract = t5_abstract(config, t5_batch(2, s, t))
    assert state_lib.active_params(abstract, config, metrics.ENCODER_SIDE) == \
        encoder + table + cross_kv
    assert state_lib.active_params(abstract, config) == encoder + decoder + 2 * table + head
    flops = 6 * (encoder + cross_kv) + 2 * 12 * width * s + (
        6 * (decoder - cross_kv + head) + 12 * width * t + 12 * width * s) * t / s
    assert flops == (184_128 if not experts else 273_504)
    assert metrics.model_flops_per_token(config, abstract, t5_batch(2, s, t)) == flops
    # a summary's count (transformer.scaling), without the split: the decoder at S as before
    total = state_lib.active_params(abstract, config)
    assert metrics.flops_per_token(config, total) == \
        6 * total + 2 * 12 * width * s + 2 * 12 * width * s


@pytest.mark.parametrize("freeze", ["", "^encoder/"])
def test_the_encoder_decoder_step_runs_the_matmuls_it_is_charged(freeze):
    """The dense T5's train step (SGD: no matmuls of its own) runs 3 x its forward's matmuls:
    the model FLOPs but 6 x the norm scales' params, at each stack's length (the decoder's
    rows shorter than the encoder's). With its encoder frozen (optimizer.freeze) the encoder's
    weight gradients are never computed, and each of its params counts 4, not 6 (the
    gradient through it still runs: the shared token table below it trains)."""
    import numpy as np
    import optax

    from transformer.training.state import TrainState
    from transformer.training.step import make_train_step

    config, s, t = t5_config(), 16, 6
    config.batch_size = 2
    config.optimizer.freeze = freeze
    batch = t5_batch(2, s, t)
    model, optimizer = build_model(config.model), optax.sgd(0.1)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), batch["encoder_inputs"],
                                          batch["decoder_inputs"])["params"])
    state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                       np.asarray(-1, np.int32))
    step = jax.jit(make_train_step(model, config, optimizer))
    counted = metrics.program_matmul_flops(step.trace(state, batch).jaxpr.jaxpr)
    # the norm scales' params: the encoder's (counting 4 where frozen); the decoder's, at T
    norms = (4 if freeze else 6) * (2 * 2 * 32 + 32) + 6 * (3 * 32 + 32) * t / s
    assert counted / (2 * s) == pytest.approx(
        metrics.model_flops_per_token(config, t5_abstract(config, batch), batch) - norms,
        rel=1e-12)


def image_text_config(family: str, **model):
    """A tiny CLIP / captioner / ViT on 8 x 8 images in 2 x 2 patches (16 patches, + [CLS] where
    it pools by it), width 32 (2 heads of 16), 2 layers, 24 text tokens a row."""
    config = configs.base_config()
    config.seq_len = 17 if family == "vit" else 24  # a ViT's seq_len is its image tokens
    config.model.update(family=family, num_layers=2, d_model=32, num_heads=2, d_ff=64,
                        image_size=8, patch_size=2, channels=1, vocab_size=300,
                        projection_dim=16, num_classes=10, **model)
    return config


@pytest.mark.parametrize("family,model", [
    ("clip", {"pooling": "cls", "position": "none"}),
    ("clip", {"pooling": "mean", "patch_position": "learned"}),
    ("captioner", {"position": "learned"}),
    ("vit", {"pooling": "cls"}),
])
def test_image_text_models_are_charged_3_x_their_forward_with_each_tower_at_its_length(
        family, model):
    """tok/s counts B x seq_len (the text tokens) a step, so flops_per_token x seq_len is a
    row's (an image's and its text's) model FLOPs: 3 x the matmuls its forward runs, with the
    image tower's at its S tokens (not the text's T), the captioner's cross-attention key and
    value on the patches and its scores T x S, CLIP's projections once a row, and no lookup
    table (positions, [CLS], CLIP's text tokens) in N. What remains over 3 x the forward is
    the convention's: each norm scale and bias charged 6 a token of its tower though no matmul
    runs on it (at most 6 x vectors x max(S, T) a row), and the [CLS] row charged the patch
    embedding's kernel. CLIP's B x B logits are charged too (3 x 2 B P a row)."""
    config = image_text_config(family, **model)
    rows, t = 2, config.seq_len
    config.batch_size = rows
    images = jnp.zeros((rows, 8, 8, 1))
    tokens = jnp.ones((rows, t), jnp.int32)
    args = {"clip": (images, tokens, tokens), "captioner": (images, tokens)}.get(
        family, (images,))
    module = build_model(config.model)
    params = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), *args)["params"])
    jaxpr = jax.make_jaxpr(lambda p: module.apply({"params": p}, *args))(params).jaxpr
    forward = metrics.program_matmul_flops(jaxpr) / rows
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    vectors = sum(x.size for path, x in leaves if path[-1].key.endswith(("bias", "scale")))
    charged = metrics.flops_per_token(config, sum(x.size for _, x in leaves)) * t
    s = 16 + (config.model.pooling == "cls" and family != "captioner")
    cls_row = 6 * 4 * 32 if s == 17 else 0  # the patch kernel [p p C, D] on [CLS] too
    # the ViT's generic count charges its class head's kernel (once a row) and [CLS] a token
    vit = 6 * (32 * 10 * (t - 1) + 32 * t) if family == "vit" else 0
    assert 0 <= charged - 3 * forward <= 6 * vectors * max(s, t) + cls_row + vit
    assert charged / (3 * forward) == pytest.approx(1, rel=0.1)
    if family != "vit":  # a run's count, of its params' split, is the summary's
        abstract = t5_abstract(config, None)
        assert metrics.model_flops_per_token(config, abstract, {}) * t == charged
    if family == "clip":  # twice the rows: each row's logits against twice the texts
        wide = (images.repeat(2, 0), tokens.repeat(2, 0), tokens.repeat(2, 0))
        more = metrics.program_matmul_flops(jax.make_jaxpr(lambda p: module.apply(
            {"params": p}, *wide))(params).jaxpr) / (2 * rows) - forward
        config.batch_size = 2 * rows
        assert more == 2 * rows * 16 and 3 * more == pytest.approx(metrics.flops_per_token(
            config, sum(x.size for _, x in leaves)) * t - charged, rel=1e-12)


def test_a_ragged_dot_and_its_gradients_count_each_row_against_its_own_group():
    """The experts' matmul (`ragged_dot`: each row times its group's [in, out] block) costs
    2 M in out forward and twice that backward, as one dense matmul of the rows: its weight
    gradient [G, in, out] sums each group's rows into its block (it was counted G times)."""
    import jax
    import jax.numpy as jnp

    rows, width, out, groups = 64, 8, 16, 4
    x, w = jnp.ones((rows, width)), jnp.ones((groups, width, out))
    sizes = jnp.asarray([10, 30, 0, 24], jnp.int32)

    def loss(x, w):
        return jax.lax.ragged_dot(x, w, sizes).sum()

    def count(fn):
        return metrics.program_matmul_flops(jax.make_jaxpr(fn)(x, w).jaxpr)

    assert count(loss) == 2 * rows * width * out
    assert count(jax.grad(loss, argnums=(0, 1))) == 3 * 2 * rows * width * out


@pytest.mark.parametrize("tie", [True, False])
def test_a_frozen_param_counts_4_flops_a_token_and_a_frozen_lookup_table_none(tie):
    """optimizer.freeze: a frozen matmul param runs its forward and the gradient through it,
    no weight gradient (4 of 6 N); the token table frozen counts so where a tied head
    multiplies by it, and not at all where it is only looked up (untied)."""
    from transformer.parallel import sharding
    from transformer.training import state as state_lib

    def flops(freeze):
        config = small_config(tie_embeddings=tie)
        config.optimizer.freeze = freeze
        abstract = state_lib.initial_state(config, build_model(config.model), sharding.make_mesh(
            config.mesh, jax.devices()[:1]))[0]
        return metrics.model_flops_per_token(config, abstract, {})

    mlp = 2 * (64 * 256 + 256 + 256 * 64 + 64)  # both layers' wi, wo and their biases
    assert flops("mlp/") == pytest.approx(flops("") - 2 * mlp, rel=1e-12)
    table = 256 * 64
    assert flops("^embed/") == pytest.approx(flops("") - 2 * table * tie, rel=1e-12)
    assert flops("position_embedding") == flops("")  # learned positions: looked up


def test_an_einsum_that_contracts_nothing_is_no_matmul():
    """Mamba 2's decay scalings are einsums without a summed index, elementwise products that
    XLA runs as dot_generals: HFU counted 2 FLOPs an output for each (+1,536 FLOPs a token of
    the SSD in a probe); a real matmul beside one still counts."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    scaled = lambda x: jnp.einsum("bd,bd->bd", x, x)
    jaxpr = jax.make_jaxpr(lambda x: scaled(x) @ w)(x).jaxpr
    assert "dot_general" in str(jax.make_jaxpr(scaled)(x))  # (the product is a dot_general)
    assert metrics.program_matmul_flops(jaxpr) == 2 * 4 * 8 * 8
