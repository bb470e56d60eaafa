"""A Vision Transformer on scikit-learn's 8x8 handwritten digits (1,797 images, no download):
2x2 patches (16 patch tokens + [CLS]), 2-D sinusoidal patch positions, the unchanged
bidirectional encoder stack, and a classifier on [CLS].

    python -m transformer.train --config=experiments/vit_digits.py --workdir=runs/vit_digits
    python -m transformer.evaluate --workdir=runs/vit_digits --split=test

The run ends with the test split's accuracy and macro-F1; evaluate also draws its confusion
matrix.
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "vit_digits"
    # seq_len counts the patch tokens (+ [CLS]), so tokens/s in the logs is patch tokens/s.
    config.update(steps=4000, batch_size=64, seq_len=17, log_every=50, eval_every=500,
                  eval_steps=100, checkpoint_every=1000, keep_checkpoints=1)
    config.model.update(family="vit", num_layers=4, d_model=64, num_heads=4, d_ff=128,
                        position="none", norm="layernorm", norm_placement="pre",
                        activation="gelu", dropout_rate=0.1, init_std=0.02, image_size=8,
                        patch_size=2, channels=1, pooling="cls", patch_position="sinusoidal_2d",
                        num_classes=10)
    config.data.update(objective="image_classification", validation_fraction=0.15)
    config.optimizer.update(learning_rate=1e-3, warmup_steps=100, weight_decay=0.1)
    return config
