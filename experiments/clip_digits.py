"""CLIP on scikit-learn's 8x8 digits: a ViT image tower and a byte-level text tower trained
contrastively on (image, caption) pairs, the captions drawn from templates ("a photo of the
digit three", "a handwritten 3", ...). Both towers are projected to 64 dimensions and
L2-normalised; the logits are a learned temperature (clipped at 100) times the cosine
similarity; the loss is the symmetric cross-entropy over the batch. Validation and test
accuracy is zero-shot: the class whose caption ("a photo of the digit N") is closest.

The image tower pools by the mean over patches. With [CLS] pooling (and a 0.02-std patch
projection) every image started out with nearly the same embedding, and the loss stayed at
log(batch) (10% zero-shot).

    python -m transformer.train --config=experiments/clip_digits.py --workdir=runs/clip_digits
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "clip_digits"
    config.update(steps=2000, batch_size=64, seq_len=32, log_every=50, eval_every=500,
                  eval_steps=100, checkpoint_every=1000, keep_checkpoints=1)
    config.model.update(family="clip", num_layers=3, d_model=64, num_heads=4, d_ff=128,
                        position="none", norm="layernorm", norm_placement="pre",
                        activation="gelu", dropout_rate=0.0, init_std=0.02, image_size=8,
                        patch_size=2, channels=1, pooling="mean", patch_position="sinusoidal_2d",
                        projection_dim=64)
    config.data.update(objective="contrastive", validation_fraction=0.15, num_sentinels=0)
    config.optimizer.update(learning_rate=1e-3, warmup_steps=100, weight_decay=0.1)
    return config
