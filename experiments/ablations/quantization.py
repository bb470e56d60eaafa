"""Quantized training (model.quantization, transformer.nn.quantization through Qwix): the small
char LM's validation loss in float32, int8 and fp8 at equal steps, 3 seeds, paired against
float. Measured on a 2-core CPU: 1.780 float, 1.776 int8 (-0.004 [-0.048, +0.039]), 1.783 fp8
(+0.003 [-0.039, +0.046]): both within noise. docs/ablations.md has the table.

    python -m transformer.sweep --config=experiments/ablations/quantization.py \
        --workdir=runs/ablations/quantization --batched_seeds
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "quantization"
    config.eval_every = 600  # the validation loss at the end only: the CPU is shared
    return config


def get_sweep():
    return sweep.named({
        "float": {"model.quantization": ""},
        "int8": {"model.quantization": "int8"},
        "fp8": {"model.quantization": "fp8"},
    })


def get_seeds():
    return 3  # docs/ablations.md's table: mean ± 95% CI over seeds 0, 1, 2


def get_baseline():
    return "float"
