"""The default experiment: a small byte-level GPT on the embedded corpus (Python's own docs and
standard library), sized to train in a minute or two on a 2-core CPU (README.md: 1 minute 13
seconds on a Zen 5 AMD EPYC).

    python -m transformer.train --config=experiments/gpt_tiny.py --workdir=runs/gpt_tiny
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "gpt_tiny"
    config.steps = 900
    config.batch_size = 16
    config.seq_len = 128
    config.eval_every = 300
    config.checkpoint_every = 300
    config.model.update(family="gpt", num_layers=4, d_model=128, num_heads=4, d_ff=512,
                        position="rope", norm="layernorm", activation="gelu_tanh",
                        dropout_rate=0.0, tie_embeddings=True, init_std=0.02)
    config.data.tokenizer = "byte"
    config.optimizer.learning_rate = 2e-3
    config.optimizer.warmup_steps = 50
    return config
