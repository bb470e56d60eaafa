"""A Mixtral-style mixture-of-experts decoder, 2.17B active params of 7.15B, for a Cloud TPU
slice (v5p-32): experiments/llama_1b7.py (24 x 2048, 16 heads, RMSNorm, RoPE, tied 50,304
vocabulary, batch 128 x 2048) with every feed-forward 8 SwiGLU experts 5632 wide, each token
through its top 2 with Mixtral's renormalised gates, dropless (capacity_factor 0: tokens
sorted by expert and `jax.lax.ragged_dot`, no slots). With expert parallelism 4 x fsdp over
the rest, on v5p-32's 16 chips each chip holds 2 experts of every layer and the tokens reach
them by `ragged_all_to_all` (transformer.nn.moe.sharded_experts). benchmarks/aot_vs_maxtext.py
compiles it against MaxText's mixtral decoder of the same shape. (Without `mesh.expert` the
experts are sharded like everything else, fsdp over every chip.)

    python -m launch.aot --config=experiments/mixtral_2b.py --topology=v5p-32 \
        --config.mesh.expert=4

Parameters: 24 x (4 x 2048^2 attention + 2048 x 8 router + 8 x 3 x 2048 x 5632 experts + 2 x 2048
norms) + 50,304 x 2048 embedding + 2048 final norm = 7,149,946,880; active per token (2 of 8
experts): 2,167,113,728.
"""

from transformer.configs import experiment


def get_config():
    config = experiment("llama_1b7")
    config.experiment = "mixtral_2b"
    config.model.d_ff = 5632
    config.model.moe.update(num_experts=8, top_k=2, every_n_layers=1, capacity_factor=0.0,
                            normalize_gates=True)
    return config
