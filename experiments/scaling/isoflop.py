"""IsoFLOP sweep (Chinchilla approach 2 and 3) of the small char-level GPT on the embedded corpus.

Each compute budget C in BUDGETS trains every model size in SIZES for the steps that spend C:
steps = C / (flops_per_token(config, N) * batch_size * seq_len), with
`training.metrics.flops_per_token` (6 N_matmul + 12 L D T) and N the model's exact param count.

    taskset -c 1 nice -n 5 python -m transformer.sweep --config=experiments/scaling/isoflop.py \
        --workdir=runs/scaling/isoflop
    python -m transformer.scaling --workdir=runs/scaling/isoflop

The 20 runs take about 40 minutes on one core (38 minutes of training, measured while another
job shared the 2-core machine); the fit about 15 seconds.
`transformer.scaling` reads BUDGETS from this file and assigns every finished run to the budget
nearest (in log C) to the C it recomputes from its summary (num_params, step).
"""

import functools

from transformer import sweep
from transformer.configs import small_char_lm

# Compute budgets, model FLOPs (transformer.training.metrics.flops_per_token x tokens trained).
BUDGETS = (1e12, 2.5e12, 6e12, 1.5e13)
# Model sizes: depth, width, heads and feed-forward width grow together (d_ff = 4 d_model).
SIZES = {
    "d32_l1": {"num_layers": 1, "d_model": 32, "num_heads": 2, "d_ff": 128},
    "d48_l2": {"num_layers": 2, "d_model": 48, "num_heads": 2, "d_ff": 192},
    "d64_l3": {"num_layers": 3, "d_model": 64, "num_heads": 4, "d_ff": 256},
    "d96_l4": {"num_layers": 4, "d_model": 96, "num_heads": 4, "d_ff": 384},
    "d128_l5": {"num_layers": 5, "d_model": 128, "num_heads": 4, "d_ff": 512},
}


def get_config():
    config = small_char_lm()
    config.experiment = "isoflop"
    # Short runs: evaluate once, at the end, on enough windows for a stable loss.
    config.update(log_every=50, eval_every=100_000, eval_steps=80, checkpoint_every=100_000,
                  keep_checkpoints=1)
    return config


@functools.cache
def _sized(size: str):
    """Model size `size`'s config, its vocab_size the tokenizer's as training fills it in
    (`scaling.counted_config`: an untied or MTP size's FLOPs depend on it). Read only."""
    from transformer import scaling

    config = get_config()
    config.model.update(SIZES[size])
    return scaling.counted_config(config)


@functools.cache
def num_params(size: str) -> int:
    """The exact param count of model size `size` (abstract init: nothing is computed)."""
    import jax

    from transformer.models import build_model, family_of
    from transformer.training.state import example_batch

    config = _sized(size)
    args = family_of(config).init_args(example_batch(config))
    shapes = jax.eval_shape(build_model(config.model).init, jax.random.key(0), *args)
    return sum(x.size for x in jax.tree.leaves(shapes["params"]))


def steps_for(budget: float, size: str) -> int:
    """Training steps that spend `budget` FLOPs on model size `size`."""
    from transformer.training.metrics import flops_per_token

    config = _sized(size)
    tokens_per_step = config.batch_size * config.seq_len
    return max(1, round(budget / (flops_per_token(config, num_params(size)) * tokens_per_step)))


def _variant(budget: float, size: str) -> dict:
    steps = steps_for(budget, size)
    overrides = {f"model.{key}": value for key, value in SIZES[size].items()}
    # The tokens per step the steps spend the budget at: set here, so that a --config.batch_size
    # or seq_len, which would spend another budget, is refused (transformer.sweep).
    config = get_config()
    # Warmup: 5% of the steps (at least 1).
    return {**overrides, "steps": steps, "optimizer.warmup_steps": max(1, steps // 20),
            "eval_every": steps, "checkpoint_every": steps,
            "batch_size": config.batch_size, "seq_len": config.seq_len}


def get_sweep():
    return sweep.named({f"C{budget:.2g}_{size}".replace("+", ""): _variant(budget, size)
                        for budget in BUDGETS for size in SIZES})
