"""KV-cache decoding speed against Hugging Face transformers, same model and weights.

    python benchmarks/decode.py [--batch_sizes=1,8] [--new_tokens=128] [--prompt_len=16]
        [--layers=6 --d_model=384 --heads=6 --vocab=50257 --context=256] [--repeats=3]
        [--hf_device=cpu]

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
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from absl import app, flags

from transformer import generate
from transformer.hf import convert
from transformer.models import build_model

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

    line = (f"Memory-bandwidth ceiling at batch 1: {weight_bytes / 1e6:.0f} MB of weights read "
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


def main(argv) -> None:
    import torch

    del argv
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
    app.run(main)
