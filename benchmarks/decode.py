"""KV-cache decoding speed against Hugging Face transformers, same model and weights; and each
token mixer's decoding speed and cache size against context length (`--table=mixers`).

    python benchmarks/decode.py [--batch_sizes=1,8] [--new_tokens=128] [--prompt_len=16]
        [--layers=6 --d_model=384 --heads=6 --vocab=50257 --context=256] [--repeats=3]
        [--hf_device=cpu]
    python benchmarks/decode.py --table=mixers [--mixers=gqa,mla,gated_deltanet,mamba2]
        [--contexts=1024,8192,32768] [--kv_heads=2] [--dtype=float32] [--batch_sizes=1]
        [--new_tokens=128] [--layers=6 --d_model=384 --heads=6 --vocab=50257] [--repeats=3]

Builds a GPT-2-shaped `GPT2LMHeadModel` (seeded random weights), converts it with
`transformer.hf.convert.from_hf`, and times greedy decoding of `new_tokens` tokens from random
`prompt_len`-token prompts with `transformer.generate.decode` (prefill + jitted while loop) and
with HF `generate` (do_sample=False, min_new_tokens=new_tokens so neither stops early; torch on
2 threads, or on `--hf_device`). After a warm-up the two alternate for `repeats` runs and each
shows its best run (the least disturbed by other load on the machine); the JAX compile time
(first call minus a typical run) is shown separately. Prints tokens/s (batch x new tokens / wall
time) per batch size, the ratio, and whether both produced the same tokens.

Batch-1 decoding reads every weight once per token, so it is bound by memory bandwidth: the
script also measures the bandwidth (a jitted sum over a buffer the size of the weights) and
prints the resulting ceiling, weight bytes / bandwidth per token, next to the measured speed.

`--table=mixers` (`mixer_benchmark`): one decoder LM per token mixer (RoPE, RMSNorm, GELU MLP 4x
wide, tied embeddings, seeded random weights), every layer that mixer (`MIXER_VARIANTS`: GQA,
multi-head attention, MLA with its latent cache, Gated DeltaNet and Mamba 2 with their
constant-size states, a 3:1 Gated DeltaNet : GQA hybrid). For each context L it times greedy
decoding of the last `new_tokens` positions of an L-slot cache: `new_tokens - 1` steps of the
jitted loop `generate.decode` runs after its prefill, the first token coming from (zero)
prefill logits. The cache starts zeroed rather than prefilled: a step's cost does not
depend on what the cache holds (attention reads all L slots under its mask; a recurrent state
is the same size whatever it holds). tokens/s = batch x steps / the best run's time; bytes per
sequence are the cache's measured bytes / batch, at the compute dtype (`--dtype`). Every cell
(mixer, batch, context) compiles first; then each is timed `repeats` times in turns.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from absl import flags

from transformer import generate
from transformer.hf import convert
from transformer.models import build_model
from transformer.utils import cli

# Token mixers of the mixers table (`mixer_config` sets each up).
MIXER_VARIANTS = {
    "gqa": "GQA",
    "mha": "multi-head attention",
    "mla": "MLA",
    "gated_deltanet": "Gated DeltaNet",
    "mamba2": "Mamba 2",
    "hybrid": "3 Gated DeltaNet : 1 GQA",
}

_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes to time.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "Tokens generated per row.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per row.")
_LAYERS = flags.DEFINE_integer("layers", 6, "Transformer blocks.")
_D_MODEL = flags.DEFINE_integer("d_model", 384, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 6, "Attention heads.")
_VOCAB = flags.DEFINE_integer("vocab", 50257, "Vocabulary size.")
_CONTEXT = flags.DEFINE_integer("context", 256, "Context length (learned positions).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per setting (the best is shown).")
_THREADS = flags.DEFINE_integer("torch_threads", 2, "torch.set_num_threads.")
_HF_DEVICE = flags.DEFINE_string("hf_device", "cpu", "torch device of the HF model (cuda: the "
                                 "GPU, when comparing with ours on a GPU).")
_TABLE = flags.DEFINE_enum("table", "hf", ["hf", "mixers"], "hf: ours against HF generate; "
                           "mixers: each token mixer's tokens/s and cache bytes at --contexts.")
_MIXERS = flags.DEFINE_list("mixers", ["gqa", "mla", "gated_deltanet", "mamba2"],
                            f"Token mixers of the mixers table, of {', '.join(MIXER_VARIANTS)}.")
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "8192", "32768"], "Cache lengths of the "
                              "mixers table.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "KV heads of GQA (mixers table): a divisor of "
                                 "--heads.")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype of the mixers table (default: "
                             "bfloat16 on an accelerator, float32 on CPU).")


def seconds(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def read_time(num_bytes: int, repeats: int = 20) -> float:
    """Best time of a jitted sum over a float32 buffer of `num_bytes` (one read of each byte)."""
    buffer = jax.numpy.ones((num_bytes // 4,), jax.numpy.float32)
    total = jax.jit(lambda x: x.sum())
    total(buffer).block_until_ready()
    return min(seconds(lambda: total(buffer).block_until_ready())[0] for _ in range(repeats))


def benchmark(*, batch_sizes, new_tokens: int, prompt_len: int, layers: int, d_model: int,
              heads: int, vocab: int, context: int, repeats: int,
              hf_device: str = "cpu") -> dict:
    """Times our decoding against HF `generate` (on torch device `hf_device`) per batch size.

    Returns {"header": one line describing the setting, "rows": one dict per batch size
    (batch, ours_tokens_s, compile_s, hf_tokens_s, ratio, same, agree), "ceiling": the
    batch-1 memory-bandwidth line}; `table(result)` formats it.
    """
    import torch  # here, so that importing this module (for its flags) stays cheap
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        n_layer=layers, n_embd=d_model, n_head=heads, vocab_size=vocab, n_positions=context,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    model_config, params = convert.from_hf(hf_config, hf.state_dict())
    hf = hf.to(hf_device)
    model = build_model(model_config)
    params = jax.device_put(params)
    n, p = new_tokens, prompt_len
    num_params = sum(x.numel() for x in hf.parameters())
    threads = f"{torch.get_num_threads()} threads" if hf_device == "cpu" else hf_device
    header = (f"GPT-2 shape: {layers} layers, d_model {d_model}, {heads} heads, vocab {vocab}, "
              f"context {context} ({num_params / 1e6:.1f}M params); greedy, {p}-token prompts, "
              f"{n} new tokens; best of {repeats} runs; jax {jax.__version__} on "
              f"{jax.devices()[0].platform}, torch {torch.__version__} ({threads}), "
              f"transformers {transformers.__version__}")

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    read_seconds = read_time(weight_bytes)
    bandwidth, ceiling = weight_bytes / read_seconds, 1 / read_seconds

    rows, hf_token_seconds = [], None
    for batch in map(int, batch_sizes):
        prompts = np.random.default_rng(batch).integers(1, vocab, (batch, p))

        def run_jax(prompts=prompts):
            return generate.decode(model, params, prompts, max_new_tokens=n, eos_id=None)[0]

        first, _ = seconds(run_jax)  # compile + one run
        ids = torch.from_numpy(prompts).to(hf_device)
        mask = torch.ones_like(ids)

        def run_hf(tokens=n, ids=ids, mask=mask):
            with torch.inference_mode():  # .cpu() waits for the device
                return hf.generate(ids, attention_mask=mask, max_new_tokens=tokens,
                                   min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                   eos_token_id=0)[:, p:].cpu().numpy()

        run_hf(8)  # warm-up
        jax_times, hf_times = [], []
        for _ in range(repeats):  # alternate, so load from elsewhere hits both alike
            t, ours = seconds(run_jax)
            jax_times.append(t)
            t, theirs = seconds(run_hf)
            hf_times.append(t)
        jax_seconds, hf_seconds = min(jax_times), min(hf_times)
        if batch == 1:
            hf_token_seconds = hf_seconds / n
        rows.append(dict(batch=batch, ours_tokens_s=batch * n / jax_seconds,
                         compile_s=first - statistics.median(jax_times),
                         hf_tokens_s=batch * n / hf_seconds, ratio=hf_seconds / jax_seconds,
                         same=bool(np.array_equal(ours, theirs)),
                         agree=float((ours == theirs).mean())))

    line = (f"Memory-bandwidth ceiling at batch 1: {weight_bytes / 1e6:.2f} MB of weights read "
            f"per token at {bandwidth / 1e9:.1f} GB/s (measured) = {ceiling:,.0f} tokens/s at most")
    if hf_token_seconds:
        line += f", {ceiling * hf_token_seconds:.2f}x HF's batch-1 speed"
    return {"header": header, "rows": rows, "ceiling": line + "."}


def table(result: dict) -> str:
    """`benchmark`'s result as a markdown table and the bandwidth line."""
    lines = ["| batch | ours tokens/s | ours compile s | HF tokens/s | ratio | same tokens |",
             "| ---: | ---: | ---: | ---: | ---: | :--- |"]
    for r in result["rows"]:
        match = "yes" if r["same"] else f"no ({r['agree']:.1%} of tokens agree)"
        lines.append(f"| {r['batch']} | {r['ours_tokens_s']:,.0f} | {r['compile_s']:.1f} | "
                     f"{r['hf_tokens_s']:,.0f} | {r['ratio']:.2f}x | {match} |")
    return "\n".join(lines) + "\n\n" + result["ceiling"]


# -----------------------------------------------------------------------------
# Token mixers (--table=mixers)


def mixer_config(variant: str, *, layers: int, d_model: int, heads: int, kv_heads: int,
                 vocab: int, dtype: str):
    """The model config of `variant`'s LM (see the module docstring). head_dim = d_model / heads
    sizes each mixer: MLA's latent is 4 head_dims wide and its RoPE key half of one (DeepSeek-V3:
    512 and 64 for 128), Gated DeltaNet's and Mamba 2's heads are head_dim wide."""
    from transformer.configs import base_config

    if variant not in MIXER_VARIANTS:
        raise ValueError(f"mixer {variant!r}: expected one of {', '.join(MIXER_VARIANTS)}")
    head_dim = d_model // heads
    model = base_config().model
    model.update(family="gpt", vocab_size=vocab, num_layers=layers, d_model=d_model,
                 num_heads=heads, d_ff=4 * d_model, position="rope", norm="rmsnorm",
                 activation="gelu", use_bias=False, tie_embeddings=True, dropout_rate=0.0,
                 dtype=dtype)
    if variant in ("gqa", "hybrid"):
        model.num_kv_heads = kv_heads
    if variant == "mla":
        model.attention_kind = "mla"
        model.mla.update(q_lora_rank=0, kv_lora_rank=min(4 * head_dim, d_model),
                         qk_nope_head_dim=head_dim, qk_rope_head_dim=max(2, head_dim // 4 * 2),
                         v_head_dim=head_dim)
    if variant in ("gated_deltanet", "hybrid"):
        model.layer_types = ("linear_attention" if variant == "gated_deltanet"
                             else "linear_attention*3,full_attention")
    if variant == "mamba2":
        model.update(layer_types="mamba2")
        model.mamba2.head_dim = head_dim
    return model


def mixer_label(variant: str, model) -> str:
    """The table's name for `variant`, with the sizes that set its cache."""
    detail = {"gqa": f"{model.num_heads}:{model.num_kv_heads} heads",
              "hybrid": f"GQA {model.num_heads}:{model.num_kv_heads}",
              "mla": f"latent {model.mla.kv_lora_rank} + RoPE key {model.mla.qk_rope_head_dim}",
              "mamba2": f"state {model.mamba2.state_size}"}.get(variant)
    return MIXER_VARIANTS[variant] + (f" ({detail})" if detail else "")


def decode_run(model, params, *, batch: int, context: int, new_tokens: int) -> dict:
    """Greedy decoding of the last `new_tokens` positions of a zeroed `context`-slot cache (see
    the module docstring), by the jitted call `generate.decode` makes after its prefill
    (`programs._continue`, the state donated), called once (compiling it). Returns {timed: () ->
    seconds of one more run from a fresh state, bytes_per_seq, first_s, kernels}."""
    import jax.numpy as jnp

    from transformer.generation import loop, programs
    from transformer.generation import sampling as sampling_lib
    from transformer.models import init_cache
    from transformer.nn import kernels

    start = context - new_tokens + 1
    if start < 1:
        raise ValueError(f"new_tokens={new_tokens}: expected < the context {context}")
    program = programs._DecoderProgram(model, context)
    mode, knobs = sampling_lib._split(sampling_lib.sampling(), model.vocab_size, None, None)

    def fresh():  # the state after a prefill: a zeroed cache, the first token from zero logits
        return jax.block_until_ready(loop._start_state(
            init_cache(model, batch, context), None, jnp.zeros((batch, model.vocab_size)),
            np.full(batch, start, np.int32), 0, knobs, max_new_tokens=new_tokens, mode=mode))

    def run(state):
        return programs._continue(params, state, np.int32(new_tokens), program=program,
                                  mode=mode).tokens.block_until_ready()

    def timed() -> float:
        state = fresh()
        return seconds(lambda: run(state))[0]

    state = fresh()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(state.cache))
    with kernels.recording() as chosen:
        first, _ = seconds(lambda: run(state))
    return dict(timed=timed, bytes_per_seq=cache_bytes // batch, first_s=first,
                kernels=kernels.split_moe(chosen)[0])


def _time_in_turns(rows: list[dict], repeats: int, steps: int) -> None:
    """Times every cell's run `repeats` times, the cells in turn (so load from elsewhere hits
    them alike), and sets each cell's tokens_s (its best run) and compile_s."""
    cells = [(row["batch"], cell) for row in rows for cell in row["cells"].values()]
    times = [[] for _ in cells]
    for _ in range(repeats):
        for (_, cell), seen in zip(cells, times, strict=True):
            seen.append(cell["timed"]())
    for (batch, cell), seen in zip(cells, times, strict=True):
        del cell["timed"]
        cell.update(tokens_s=batch * steps / min(seen),
                    compile_s=cell["first_s"] - statistics.median(seen))


def decode_state(config, layer: int) -> str:
    """What layer `layer` keeps when decoding: "kv cache", "latent cache", "recurrent state"."""
    from transformer.models import transformer_config
    from transformer.nn import mixers

    stack = transformer_config(config)
    state = stack.mixer(layer).decode_state
    return mixers.ATTENTION_KINDS[stack.attention_kind].decode_state if state == "kv cache" \
        else state


def mixer_benchmark(*, mixers, contexts, batch_sizes, new_tokens: int, layers: int,
                    d_model: int, heads: int, kv_heads: int, vocab: int, repeats: int,
                    dtype: str = "") -> dict:
    """Decoding speed (`decode_run`, timed in turns) of each mixer's LM at each batch size and
    context. Returns {"header", "contexts", "rows": one dict per (mixer, batch): mixer, variant,
    state, batch, kernels, cells {context: {tokens_s, bytes_per_seq, compile_s, ...}}};
    `mixer_table(result)` formats it."""
    import jax.numpy as jnp

    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    contexts = [int(c) for c in contexts]
    rows = []
    for variant in mixers:
        config = mixer_config(variant, layers=layers, d_model=d_model, heads=heads,
                              kv_heads=kv_heads, vocab=vocab, dtype=dtype)
        model = build_model(config)
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        states = dict.fromkeys(decode_state(config, i) for i in range(layers))
        for batch in map(int, batch_sizes):
            cells = {c: decode_run(model, params, batch=batch, context=c,
                                   new_tokens=new_tokens) for c in contexts}
            rows.append(dict(mixer=mixer_label(variant, config), variant=variant, batch=batch,
                             state=" + ".join(states), cells=cells, kernels=sorted(
                                 {k for cell in cells.values() for k in cell["kernels"]})))
    _time_in_turns(rows, repeats, new_tokens - 1)
    device = jax.devices()[0]
    header = (f"{layers} layers, d_model {d_model}, {heads} heads of {d_model // heads}, vocab "
              f"{vocab}, {dtype}; greedy, the last {new_tokens} positions of each context "
              f"({new_tokens - 1} steps of the jitted loop); best of {repeats} runs, the cells "
              f"in turns; jax {jax.__version__} on {device.platform} ({device.device_kind})")
    return {"header": header, "contexts": contexts, "rows": rows}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def mixer_table(result: dict) -> str:
    """`mixer_benchmark`'s result as a markdown table: tokens/s (x GQA's at the same batch and
    context, where GQA ran) and cache bytes per sequence at each context."""
    contexts = result["contexts"]
    names = [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts]
    lines = ["| mixer | decode state | batch | " + " | ".join(f"tokens/s {n}" for n in names)
             + " | " + " | ".join(f"bytes/seq {n}" for n in names) + " | attention kernel |",
             "| :--- | :--- | ---: | " + "---: | " * 2 * len(contexts) + ":--- |"]
    gqa = {r["batch"]: r["cells"] for r in result["rows"] if r["variant"] == "gqa"}
    for r in result["rows"]:
        speeds = []
        for c in contexts:
            speed = r["cells"][c]["tokens_s"]
            base = gqa.get(r["batch"], {}).get(c)
            ratio = f" ({speed / base['tokens_s']:.2f}x)" if base and r["variant"] != "gqa" \
                else ""
            speeds.append(f"{speed:,.0f}{ratio}")
        sizes = [_bytes(r["cells"][c]["bytes_per_seq"]) for c in contexts]
        lines.append(f"| {r['mixer']} | {r['state']} | {r['batch']} | " + " | ".join(speeds)
                     + " | " + " | ".join(sizes) + f" | {', '.join(r['kernels']) or '-'} |")
    return "\n".join(lines)


def main(argv) -> None:
    del argv
    if _TABLE.value == "mixers":
        heads, kv_heads = _HEADS.value, _KV_HEADS.value
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"--kv_heads={kv_heads}: expected a divisor of --heads={heads}")
        if "hybrid" in _MIXERS.value and _LAYERS.value % 4:
            raise ValueError(f"--layers={_LAYERS.value} with the hybrid mixer: expected a "
                             "multiple of 4 (three Gated DeltaNet layers to one GQA layer)")
        result = mixer_benchmark(
            mixers=_MIXERS.value, contexts=_CONTEXTS.value, batch_sizes=_BATCH_SIZES.value,
            new_tokens=_NEW_TOKENS.value, layers=_LAYERS.value, d_model=_D_MODEL.value,
            heads=_HEADS.value, kv_heads=_KV_HEADS.value, vocab=_VOCAB.value,
            repeats=_REPEATS.value, dtype=_DTYPE.value)
        print(result["header"] + "\n\n" + mixer_table(result))
        return
    import torch

    torch.set_num_threads(_THREADS.value)
    result = benchmark(batch_sizes=_BATCH_SIZES.value, new_tokens=_NEW_TOKENS.value,
                       prompt_len=_PROMPT_LEN.value, layers=_LAYERS.value,
                       d_model=_D_MODEL.value, heads=_HEADS.value, vocab=_VOCAB.value,
                       context=_CONTEXT.value, repeats=_REPEATS.value,
                       hf_device=_HF_DEVICE.value)
    print(result["header"])
    print()
    print(table(result))


if __name__ == "__main__":
    cli.run(main)
