"""nanoGPT's shakespeare_char recipes: a character-level GPT on tinyshakespeare.

GPU recipe (6 layers, 6 heads, 384 wide, context 256, batch 64, 5000 steps, bfloat16):

    python -m transformer.train --config=experiments/gpt_shakespeare_char.py \
        --config.data.path=PATH/tinyshakespeare.txt --workdir=runs/shakespeare_char

CPU recipe (4 layers, 4 heads, 128 wide, context 64, batch 12, 2000 steps):

    python -m transformer.train --config=experiments/gpt_shakespeare_char.py:cpu \
        --config.data.path=PATH/tinyshakespeare.txt --workdir=runs/shakespeare_char_cpu

`benchmarks/nanogpt_protocol.py` trains the CPU recipe next to nanoGPT's and scores both on the
same validation windows; its docstring lists what still differs between the two recipes.
"""

from transformer.configs import base_config


def get_config(variant: str = "gpu"):
    if variant not in ("gpu", "cpu"):
        raise ValueError(f"variant={variant!r}: expected 'gpu' or 'cpu' (config file argument)")
    config = base_config()
    config.experiment = f"shakespeare_char_{variant}"
    config.data.tokenizer = "char"
    config.data.num_sentinels = 0
    config.data.unit = "stream"  # nanoGPT's data: one text, validation its last 10%
    config.data.validation_fraction = 0.1
    config.model.update(family="gpt", position="learned", norm="layernorm", norm_placement="pre",
                        activation="gelu",  # nanoGPT's nn.GELU(): exact (erf), not tanh
                        tie_embeddings=True, use_bias=False,
                        init_std=0.02)
    config.optimizer.update(learning_rate=1e-3, warmup_steps=100, min_learning_rate_ratio=0.1,
                            b2=0.99, weight_decay=0.1, grad_clip_norm=1.0, decay="cosine")
    if variant == "gpu":
        config.update(steps=5000, batch_size=64, seq_len=256, eval_every=250, eval_steps=50,
                      log_every=10, checkpoint_every=1000)
        # bfloat16 compute (float32 params, softmax and loss), as nanoGPT's train.py autocasts
        # on a GPU. nanoGPT's dropout 0.2 also drops attention weights (inside SDPA): so do we,
        # which runs the dense kernel rather than cuDNN (on an H100, 1.44M tokens/s against
        # 1.63M-2.31M without it; validation loss then tracks nanoGPT's, see docs/performance.md).
        config.model.update(num_layers=6, num_heads=6, d_model=384, d_ff=1536, max_len=256,
                            dropout_rate=0.2, attention_dropout_rate=0.2, dtype="bfloat16")
    else:
        config.update(steps=2000, batch_size=12, seq_len=64, eval_every=250, eval_steps=50,
                      log_every=50, checkpoint_every=500)
        config.model.update(num_layers=4, num_heads=4, d_model=128, d_ff=512, max_len=64,
                            dropout_rate=0.0)
    return config
