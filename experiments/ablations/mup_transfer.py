"""muP hyperparameter transfer (Tensor Programs V): the learning rate swept at three widths
(d_model 64, 128, 256; 4 heads; d_ff 4 x width; init_std 0.02) of the small char-level GPT, 300
steps, under the standard parametrization and under muP with base width 64. Under muP the best
rate should stay put as the width grows (within one grid step); under the standard one it
should shift down. 1 seed.

    python -m transformer.sweep --config=experiments/ablations/mup_transfer.py \
        --workdir=runs/ablations/mup_transfer
"""

from transformer import sweep
from transformer.configs import small_char_lm

WIDTHS = (64, 128, 256)
RATES = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def get_config():
    config = small_char_lm()
    config.experiment = "mup_transfer"
    config.update(steps=300, eval_every=150, checkpoint_every=300)
    config.model.update(mup_base_width=64, init_std=0.02)
    config.optimizer.update(warmup_steps=30)
    return config


def get_sweep():
    return sweep.named({
        f"{parametrization}_w{width}_lr={rate:g}": {
            "model.parametrization": parametrization, "model.d_model": width,
            "model.d_ff": 4 * width, "optimizer.learning_rate": rate}
        for parametrization in ("standard", "mup") for width in WIDTHS for rate in RATES})
