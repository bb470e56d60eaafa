"""Attention and block variants on the small char-level GPT at equal steps (600), at its usual
learning rate (2e-3) and at 3x it (6e-3), where QK-norm's claim is stability (Dehghani et al.
2023; OLMo 2; Qwen3): the baseline (pre-LN, RoPE), QK-norm (RMSNorm over each head's q and k
before RoPE), Gemma 2's soft-caps (attention logits at 50, output logits at 30) and the parallel
block (GPT-J, PaLM: x + attn(LN(x)) + mlp(LN(x))). 3 seeds.

    python -m transformer.sweep --config=experiments/ablations/attention_variants.py \
        --workdir=runs/ablations/attention_variants --batched_seeds
"""

from transformer import sweep
from transformer.configs import small_char_lm

VARIANTS = {
    "baseline": {},
    "qk_norm": {"model.qk_norm": True},
    "softcap": {"model.attention_softcap": 50.0, "model.final_logit_softcap": 30.0},
    "parallel_block": {"model.parallel_block": True},
}


def get_config():
    config = small_char_lm()
    config.experiment = "attention_variants"
    return config


def get_sweep():
    rate = get_config().optimizer.learning_rate
    return sweep.named({
        f"{name}{suffix}": {**overrides, "optimizer.learning_rate": rate * factor}
        for suffix, factor in (("", 1), ("_lr3x", 3)) for name, overrides in VARIANTS.items()})


def get_seeds():
    return 3


def get_baseline():
    return "baseline"
