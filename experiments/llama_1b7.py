"""A Llama-style 1.71B-parameter decoder for a Cloud TPU slice (v5p-32 or larger): experiments/
gpt_1b.py with Llama's block (RMSNorm, SwiGLU 8192 wide, no biases), a 50,304-token tied
vocabulary and the same shape otherwise: 24 layers x 2048 wide, 16 heads, RoPE, batch 128 x 2048,
bfloat16 compute with float32 params, scanned layers with full rematerialisation, FSDP over every
chip. benchmarks/aot_vs_maxtext.py compiles it against MaxText's llama2 decoder of the same size.

    python -m launch.aot --config=experiments/llama_1b7.py --topology=v5p-32 \
        [--config.model.attention_impl=dense]

Parameters: 24 x (4 x 2048^2 attention + 3 x 2048 x 8192 SwiGLU + 2 x 2048 norms)
+ 50,304 x 2048 embedding + 2048 final norm = 1,713,735,680.
"""

from transformer.configs import experiment


def get_config():
    config = experiment("gpt_1b")
    config.experiment = "llama_1b7"
    config.model.update(norm="rmsnorm", activation="swiglu", use_bias=False, position="rope",
                        tie_embeddings=True)
    # 50,176 pieces + 100 sentinels, padded to a multiple of 128 (GPT-2's 50,257 padded alike).
    config.model.vocab_size = 50_304
    config.data.vocab_size = 50_176
    return config
