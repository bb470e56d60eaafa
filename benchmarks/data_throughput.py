"""Input pipeline throughput vs. what the default experiment's train step consumes.

    python benchmarks/data_throughput.py [--batches=200]
    python benchmarks/data_throughput.py --batch_size=64 --seq_len=256 --families=gpt,bert

Prints tokens/s (and batches/s) of the Grain pipeline on the embedded corpus (byte and
SentencePiece BPE tokenizers, each objective) beside the train step's tokens/s for
experiments/gpt_tiny.py, and the ratio (the pipeline must deliver >= 10x). Both count token
slots (batch x seq_len, a padded row's padding included), as training's tok/s does.
`--batch_size` / `--seq_len` override the pipeline's shape (the train step keeps gpt_tiny's).

    taskset -c 0 python benchmarks/data_throughput.py --shard_tokens=20000000

times next-token rows of 64 x 1024 from modded-nanogpt token shards (written to a temp
directory, memory-mapped) instead: read as one stream, and as documents of uneven lengths
(10..2000 tokens) packed with segment ids. Target: >= 1M tokens/s on one core.
"""

import glob
import importlib.util
import pathlib
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from transformer.data import inputs, pipeline, shards, tokenizers, windows
from transformer.models import build_model
from transformer.nn import objectives

_BATCHES = flags.DEFINE_integer("batches", 200, "Batches to time per pipeline.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Pipeline batch size (default gpt_tiny's).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Pipeline sequence length (default gpt_tiny's).")
_TOKENIZERS = flags.DEFINE_list("tokenizers", ["byte", "sentencepiece_bpe"],
                                "Tokenizers to time: byte, sentencepiece_bpe.")
_FAMILIES = flags.DEFINE_list("families", ["gpt", "prefix_lm", "bert", "t5"],
                              "Model families whose objectives to time.")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", 0, "> 0: time the pipeline on token shards "
                                     "of this many tokens instead (see above).")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def default_config():
    spec = importlib.util.spec_from_file_location("gpt_tiny", ROOT / "experiments/gpt_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def train_step_tokens_per_second(config, vocab_size, steps=20):
    """A plain AdamW step of the default model (no data loading) in tokens/s."""
    config.model.vocab_size = vocab_size
    model = build_model(config.model)
    tokens = jnp.zeros((config.batch_size, config.seq_len), jnp.int32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens))["params"]
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            return objectives.cross_entropy(model.apply({"params": p}, tokens), tokens)[0]
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.block_until_ready(step(params, opt_state))  # compile
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    jax.block_until_ready(params)
    return steps * config.batch_size * config.seq_len / (time.perf_counter() - start)


def pipeline_tokens_per_second(config, tokenizer, num_batches):
    it = iter(inputs.get_dataset(config, tokenizer, "train"))
    next(it)  # warm up (first epoch shuffle, jit of the host-side objectives)
    start = time.perf_counter()
    for _ in range(num_batches):
        next(it)
    seconds = time.perf_counter() - start
    return num_batches * config.batch_size * config.seq_len / seconds, num_batches / seconds


def shard_throughput(total: int, num_batches: int) -> None:
    """Next-token rows of 64 x 1024 from memory-mapped shards: a stream, and packed documents."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as directory:
        pieces = (rng.integers(0, 50_000, size=min(1_000_000, total - i), dtype=np.int64)
                  for i in range(0, total, 1_000_000))
        shards.write_token_shards(f"{directory}/train", pieces, tokens_per_shard=10_000_000)
        tokens = shards.TokenShards(sorted(glob.glob(f"{directory}/train_*.bin")))
        lengths = rng.integers(10, 2000, size=len(tokens) // 1000)
        starts = np.cumsum(np.concatenate([[0], lengths[:-1]]))
        corpora = {"stream": windows.Corpus(tokens, stream=True),
                   "documents": windows.Corpus(tokens, starts[starts < len(tokens)])}
        print(f"{len(tokens):,} tokens in {len(tokens.paths)} shards; next-token rows of "
              f"64 x 1024, {num_batches} batches")
        print(f"{'read as':<10} {'tokens/s':>12} {'batches/s':>10}")
        for name, corpus in corpora.items():
            it = iter(pipeline.make_dataset(corpus, objective="next_token", tokenizer=None,
                                            seq_len=1024, batch_size=64, seed=0,
                                            process_index=0, process_count=1, prefetch=0))
            next(it)  # the first epoch's orders
            start = time.perf_counter()
            for _ in range(num_batches):
                next(it)
            seconds = time.perf_counter() - start
            print(f"{name:<10} {num_batches * 64 * 1024 / seconds:>12,.0f} "
                  f"{num_batches / seconds:>10,.1f}")


def main(argv):
    del argv
    if _SHARD_TOKENS.value:
        shard_throughput(_SHARD_TOKENS.value, _BATCHES.value)
        return
    config = default_config()
    byte = tokenizers.build_tokenizer("byte")
    consumed = train_step_tokens_per_second(default_config(), byte.vocab_size)
    print(f"train step (experiments/gpt_tiny.py, batch {config.batch_size} x {config.seq_len}): "
          f"{consumed:,.0f} tokens/s\n")
    config.batch_size = _BATCH_SIZE.value or config.batch_size
    config.seq_len = _SEQ_LEN.value or config.seq_len
    named = {}
    for name in _TOKENIZERS.value:
        if name == "byte":
            named[name] = byte
        elif name == "sentencepiece_bpe":
            start = time.perf_counter()
            train_texts = [d.text for d in inputs._documents(config, "train")]
            named[name] = tokenizers.build_tokenizer("sentencepiece_bpe", train_texts,
                                                     vocab_size=4096)
            print(f"(SentencePiece BPE 4096 trained on the embedded corpus in "
                  f"{time.perf_counter() - start:.0f} s)")
        else:
            raise app.UsageError(f"--tokenizers={name}: expected byte or sentencepiece_bpe")
    print(f"pipeline batch {config.batch_size} x {config.seq_len}, {_BATCHES.value} batches")
    print(f"{'tokenizer':<18} {'objective':<16} {'tokens/s':>12} {'batches/s':>10} "
          f"{'x train step':>13}")
    for name, tokenizer in named.items():
        for family in _FAMILIES.value:
            config.model.family = family
            rate, batch_rate = pipeline_tokens_per_second(config, tokenizer, _BATCHES.value)
            objective = inputs.pipeline.objective_for(config)
            print(f"{name:<18} {objective:<16} {rate:>12,.0f} {batch_rate:>10,.1f} "
                  f"{rate / consumed:>12.1f}x")


if __name__ == "__main__":
    app.run(main)
