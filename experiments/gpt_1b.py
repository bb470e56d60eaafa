"""A 1.3B-parameter GPT for a Cloud TPU slice (v5p-32, v6e-8 or larger): 24 layers x 2048 wide,
2048-token context, global batch 128 (262k tokens), bfloat16 compute with float32 params,
scanned layers with full rematerialisation, and FSDP over every chip.

Check that it fits, then launch (docs/cloud-tpu.md):

    python -m launch.aot --config=experiments/gpt_1b.py --topology=v5p-32
    python -m launch.tpu run --name=gpt1b --project=P --zone=us-east5-a --accelerator=v5p-32 \
        --spot --restart_on_preemption -- --config=experiments/gpt_1b.py \
        --workdir=gs://BUCKET/runs/gpt1b --config.data.path=/mnt/data/corpus

`data.path` must be readable on every worker (the shipped working tree, or a bucket mounted
with gcsfuse); the embedded corpus (the default) is only good for a smoke test. A SentencePiece
BPE tokenizer with 32,000 pieces is trained on it by process 0 and saved in the workdir.
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "gpt_1b"
    config.steps = 20_000
    config.batch_size = 128
    config.seq_len = 2048
    config.log_every = 10
    config.eval_every = 1000
    config.eval_steps = 20
    config.checkpoint_every = 500
    config.model.update(family="gpt", num_layers=24, d_model=2048, num_heads=16, d_ff=8192,
                        max_len=2048, position="rope", norm="layernorm",
                        activation="gelu_tanh", dropout_rate=0.0, tie_embeddings=True,
                        init_std=0.02, scan_layers=True, remat_policy="full",
                        dtype="bfloat16", param_dtype="float32")
    # 32,000 pieces + 100 sentinels, padded to a multiple of 128 for the TPU's matrix units.
    config.model.vocab_size = 32_128
    config.data.tokenizer = "sentencepiece_bpe"
    config.data.vocab_size = 32_000
    config.optimizer.update(learning_rate=3e-4, warmup_steps=2000, b2=0.95)
    config.mesh.update(data=1, fsdp=-1)
    return config
