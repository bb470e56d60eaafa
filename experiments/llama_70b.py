"""A Llama-3-70B-shaped decoder (70.55B params) that needs pipeline parallelism on v5p-32s:
experiments/llama_1b7.py's block (RMSNorm, SwiGLU, RoPE, no biases) at 80 layers x 8192 wide,
64 query heads and 8 key/value heads of 128, SwiGLU 28,672 wide, an untied 128,256-token
vocabulary, batch 128 x 2048, bfloat16 compute with float32 params and AdamW moments, scanned
layers with full rematerialisation. Its params and moments alone take 49.3 GiB of each chip's
95.74 GiB with fsdp over one v5p-32's 16 chips, and the step does not fit there; on two v5p-32
slices with pipeline stages across them (mesh.stage=2, over DCN) and fsdp 16 inside each, it
does (docs/cloud-tpu.md). benchmarks/aot_vs_maxtext.py (`--shape=pipeline`) compiles it against
MaxText's pipeline of the same shape.

    python -m launch.aot --config=experiments/llama_70b.py --topology=v5p-32
    python -m launch.aot --config=experiments/llama_70b.py --topology=v5p-32 --num_slices=2 \
        --config.mesh.stage=2 --config.pipeline.microbatches=8

Parameters: 80 x (2 x 8192^2 + 2 x 8192 x 1024 attention + 3 x 8192 x 28,672 SwiGLU + 2 x 8192
norms) + 2 x 128,256 x 8192 embeddings + 8192 final norm = 70,553,706,496.
"""

from transformer.configs import experiment


def get_config():
    config = experiment("llama_1b7")
    config.experiment = "llama_70b"
    config.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                        d_ff=28_672, tie_embeddings=False)
    # Llama 3's 128,000 pieces + 256 special tokens (100 of them our sentinels).
    config.model.vocab_size = 128_256
    config.data.vocab_size = 128_000
    return config
