"""Optimizers on the small char-level GPT at equal steps (600), each over a 3-4 point
learning-rate grid around its usual setting (widened where the best was at an edge): AdamW (the
baseline), Adafactor, Lion, Muon (its hidden matrices; AdamW at 2e-3 on the rest), SGD with
Nesterov momentum and schedule-free AdamW (constant rate, evaluated at its averaged params). The
same warmup (50 steps) and cosine decay for all but schedule-free, global-norm clipping at 1.0,
3 seeds.

    python -m transformer.sweep --config=experiments/ablations/optimizers.py \
        --workdir=runs/ablations/optimizers --batched_seeds

A variant's `lr` is the rate its grid varies (Muon's: muon_learning_rate). The table in
docs/experiments.md takes each optimizer at its best grid point (the lowest mean validation loss).
"""

from transformer import sweep
from transformer.configs import small_char_lm

# (name, the rate the grid varies, its values, other settings)
GRIDS = (
    ("adamw", "learning_rate", (1e-3, 2e-3, 4e-3), {}),
    ("adafactor", "learning_rate", (3e-3, 1e-2, 3e-2, 1e-1), {"optimizer.weight_decay": 0.0}),
    ("lion", "learning_rate", (1e-4, 3e-4, 1e-3), {"optimizer.weight_decay": 0.3}),
    ("muon", "muon_learning_rate", (0.01, 0.02, 0.05), {}),
    ("sgd", "learning_rate", (0.03, 0.1, 0.3, 1.0), {"optimizer.nesterov": True,
                                               "optimizer.weight_decay": 0.0}),
    ("schedule_free_adamw", "learning_rate", (1e-3, 2e-3, 4e-3, 8e-3),
     {"optimizer.decay": "constant", "optimizer.b1": 0.9}),
)


def get_config():
    config = small_char_lm()
    config.experiment = "optimizers"
    return config


def get_sweep():
    return sweep.named({
        f"{name}_lr={value:g}": {"optimizer.name": name, f"optimizer.{key}": value, **more}
        for name, key, values, more in GRIDS for value in values})


def get_seeds():
    return 3


def get_baseline():
    return "adamw_lr=0.002"
