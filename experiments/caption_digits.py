"""A tiny image captioner on scikit-learn's 8x8 digits: cross-attention from text to image
patches. The ViT encoder's 16 patch vectors are the memory of a causal byte-level decoder
(self-attention, cross-attention to the patches, MLP) that writes "a photo of the digit N".
Scored by exact match (greedy decoding writes the caption exactly: the digit is right) and by
rank classification over the ten captions (accuracy, macro-F1, confusion matrix).

    python -m transformer.train --config=experiments/caption_digits.py --workdir=runs/caption
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "caption_digits"
    config.update(steps=1500, batch_size=64, seq_len=32, log_every=50, eval_every=500,
                  eval_steps=100, checkpoint_every=1500, keep_checkpoints=1)
    config.model.update(family="captioner", num_layers=3, d_model=64, num_heads=4, d_ff=128,
                        position="learned", max_len=32, norm="layernorm",
                        norm_placement="pre", activation="gelu", dropout_rate=0.0,
                        init_std=0.02, image_size=8, patch_size=2, channels=1,
                        patch_position="sinusoidal_2d")
    config.data.update(objective="captioning", validation_fraction=0.15, num_sentinels=0)
    config.optimizer.update(learning_rate=1e-3, warmup_steps=100, weight_decay=0.1)
    return config
