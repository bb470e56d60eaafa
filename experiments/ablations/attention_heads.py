"""Attention heads at a fixed width of 128: 1 vs 4 vs 8 heads, then 8 query heads sharing 2 K/V
heads (GQA) or 1 (MQA).

    python -m transformer.sweep --config=experiments/ablations/attention_heads.py \
        --workdir=runs/ablations/attention_heads
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "attention_heads"
    return config


def get_sweep():
    return sweep.named({
        "heads_1": {"model.num_heads": 1},
        "heads_4": {"model.num_heads": 4},
        "heads_8": {"model.num_heads": 8},
        "gqa_8q_2kv": {"model.num_heads": 8, "model.num_kv_heads": 2},
        "mqa_8q_1kv": {"model.num_heads": 8, "model.num_kv_heads": 1},
    })


def get_seeds():
    return 3  # docs/ablations.md's table: mean ± 95% CI over seeds 0, 1, 2


def get_baseline():
    return "heads_4"
