"""The recurrent baseline: a 2-layer LSTM language model on the embedded corpus.

    python -m transformer.train --config=experiments/lstm_lm.py --workdir=runs/lstm_lm
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "lstm_lm"
    config.update(steps=1000, batch_size=16, seq_len=128)
    config.model.update(family="lstm", num_layers=2, d_model=256, tie_embeddings=True)
    config.optimizer.update(learning_rate=2e-3, warmup_steps=100)
    return config
