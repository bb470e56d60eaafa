"""Transformer vs LSTM language model at equal parameter count and equal steps: the small
char-level GPT (4 layers, 128 wide) against a 2-layer LSTM whose width (220) gives about as
many parameters.

    python -m transformer.sweep --config=experiments/ablations/transformer_vs_lstm.py \
        --workdir=runs/ablations/transformer_vs_lstm
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "transformer_vs_lstm"
    return config


def get_sweep():
    return sweep.named({
        "transformer": {"model.family": "gpt"},
        "lstm": {"model.family": "lstm", "model.num_layers": 2, "model.d_model": 220,
                 "model.position": "none"},  # (an LSTM has no positions; 220 / 4 heads is odd)
    })


def get_seeds():
    return 3  # docs/ablations.md's table: mean ± 95% CI over seeds 0, 1, 2


def get_baseline():
    return "transformer"
