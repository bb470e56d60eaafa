"""Linear-attention hybrids at long context: the small char-level GPT (4 layers, 128 wide, 600
steps, 3 seeds) at `seq_len` tokens a row (512 by default; `hybrids.py:4096` for 4k), 1,024
tokens a step (fewer rows as rows get longer; at least one), against all full attention:

- Gated DeltaNet in 1 of 4 layers, 3 of 4 (Qwen3-Next's and Kimi Linear's ratio, the full
  layer last) and all 4;
- all Mamba 2.

The Gated DeltaNet paper (Yang et al. 2025) and Qwen3-Next claim hybrids match or beat full
attention at equal steps; linear-only stacks trail it on recall.

    python -m transformer.sweep --config=experiments/ablations/hybrids.py \\
        --workdir=runs/ablations/hybrids --batched_seeds
"""

import re

from transformer import sweep
from transformer.configs import small_char_lm

LINEAR = {"model.linear_attention.key_head_dim": 32, "model.linear_attention.value_head_dim": 32}


def get_config(seq_len: str = "512"):
    """The model at `seq_len` tokens a row, 1,024 tokens a step. Set the length here
    (`hybrids.py:4096`): `--config.seq_len` alone keeps 512's rows a step and model.max_len."""
    length = int(seq_len) if re.fullmatch(r"[+-]?\d+", str(seq_len).strip()) else seq_len
    if not isinstance(length, int) or length < 2:  # before 1024 // length divides by it
        raise ValueError(f"seq_len={length!r}: expected an int >= 2 (config file argument)")
    config = small_char_lm()
    config.experiment = f"hybrids_{length}"
    config.update(seq_len=length, batch_size=max(1, 1024 // length))
    config.model.max_len = length
    return config


def get_sweep():
    return sweep.named({
        "full": {},
        "linear_1_in_4": {**LINEAR, "model.layer_types": "full_attention*3,linear_attention"},
        "linear_3_in_4": {**LINEAR, "model.layer_types": "linear_attention*3,full_attention"},
        "linear_all": {**LINEAR, "model.layer_types": "linear_attention"},
        "mamba2_all": {"model.layer_types": "mamba2", "model.mamba2.head_dim": 32,
                       "model.mamba2.state_size": 32},
    })


def get_seeds():
    return 3


def get_baseline():
    return "full"
