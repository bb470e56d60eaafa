"""Learning-rate schedules on the small char-level GPT at equal tokens (600 steps of 16 x 64),
AdamW at 2e-3 after the same 50-step warmup: cosine to 10% (the baseline), warmup-stable-decay
(the last 20% linear to 10%: MiniCPM; Hägele et al. 2024), constant, and inverse square root
(Vaswani et al.; T5). 3 seeds.

    python -m transformer.sweep --config=experiments/ablations/schedules.py \
        --workdir=runs/ablations/schedules --batched_seeds
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "schedules"
    return config


def get_sweep():
    return sweep.named({
        "cosine": {"optimizer.decay": "cosine"},
        "wsd": {"optimizer.decay": "wsd", "optimizer.decay_fraction": 0.2,
                "optimizer.decay_shape": "linear"},
        "wsd_1-sqrt": {"optimizer.decay": "wsd", "optimizer.decay_fraction": 0.2,
                       "optimizer.decay_shape": "1-sqrt"},
        "constant": {"optimizer.decay": "constant"},
        "inverse_sqrt": {"optimizer.decay": "inverse_sqrt"},
    })


def get_seeds():
    return 3


def get_baseline():
    return "cosine"
