"""T5-style encoder-decoder pretraining with span corruption (density 0.15, mean span 3).

    python -m transformer.train --config=experiments/t5_span.py --workdir=runs/t5_span
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "t5_span"
    config.update(steps=1000, batch_size=16, seq_len=128)
    config.model.update(family="t5", num_layers=3, num_decoder_layers=3, d_model=128,
                        num_heads=4, d_ff=512, position="t5", norm="rmsnorm",
                        norm_placement="pre", activation="geglu", use_bias=False,
                        attention_scale=1.0, tie_embeddings=True, scale_decoder_output=True,
                        dropout_rate=0.0)
    config.data.objective = "span_corruption"
    config.optimizer.update(learning_rate=1e-3, warmup_steps=100)
    return config
