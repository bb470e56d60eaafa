"""Prefix-LM pretraining: bidirectional attention over a random prefix of each row, loss on
the continuation only.

    python -m transformer.train --config=experiments/prefix_lm.py --workdir=runs/prefix_lm
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "prefix_lm"
    config.update(steps=1000, batch_size=16, seq_len=128)
    config.model.update(family="prefix_lm", num_layers=4, d_model=128, num_heads=4, d_ff=512,
                        position="rope", activation="gelu_tanh", init_std=0.02)
    config.data.objective = "prefix_lm"
    return config
