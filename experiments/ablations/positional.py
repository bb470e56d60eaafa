"""Positional encodings on the small char-level GPT: none, sinusoidal (with and without the
sqrt(d_model) embedding scale), learned, RoPE, ALiBi and T5 relative buckets, trained at 64
tokens and evaluated at 64..512 (length extrapolation).

    python -m transformer.sweep --config=experiments/ablations/positional.py \
        --workdir=runs/ablations/positional

The report's `val loss @L` columns are the validation loss with rows of L tokens. Learned
positions have no entries beyond their 64-entry table: they cannot extrapolate.
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "positional"
    config.eval_seq_lens = (64, 128, 256, 512)
    return config


def get_sweep():
    position = lambda name, **more: {"model.position": name, **more}
    return sweep.named({
        "none": position("none"),
        # As in "Attention Is All You Need": token embeddings x sqrt(d_model), then + PE.
        "sinusoidal": position("sinusoidal", **{"model.scale_embeddings": True}),
        # The same without the scale: the unit-size PE swamps the 0.02-std token embeddings.
        "sinusoidal_unscaled": position("sinusoidal"),
        "learned": position("learned"),
        "rope": position("rope"),
        "alibi": position("alibi"),
        "t5_bias": position("t5"),
    })


def get_seeds():
    return 3  # docs/ablations.md's table: mean ± 95% CI over seeds 0, 1, 2


def get_baseline():
    return "rope"
