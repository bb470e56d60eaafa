"""Supervised fine-tuning on chat data (`data.objective="sft"`, transformer.data.chat): a
decoder LM, e.g. a Llama-shaped Hugging Face checkpoint, trained on conversations in JSONL
({"messages": [{"role": ..., "content": ...}, ...]} per line) rendered with its tokenizer's
chat template, the loss on the assistant's tokens only.

    python -m transformer.train --config=experiments/sft_chat.py[:cpu] --workdir=runs/sft_chat \
        --config.init_from=hf:/models/SmolLM2-135M-Instruct \
        --config.data.path=chat_train.jsonl --config.data.validation_path=chat_val.jsonl
    python -m transformer.generate --workdir=runs/sft_chat --temperature=0 \
        --chat='[{"role": "user", "content": "What is the capital of France?"}]'

init_from may also be a training workdir whose tokenizer is a Hugging Face one with a chat
template. The architecture comes from the checkpoint; this file gives the training settings.
`sft_chat.py:cpu` sizes the run for a laptop CPU (100 steps of 8 x 256 tokens, a few minutes
on a small base): a check that the data, template and masking work before the real run.
"""

from transformer.configs import experiment


def get_config(variant: str = "full"):
    if variant not in ("full", "cpu"):
        raise ValueError(f"variant={variant!r}: expected 'full' or 'cpu' (config file argument)")
    config = experiment("gpt_tiny")  # a decoder; init_from gives its architecture
    config.experiment = "sft_chat"
    config.init_from = "hf:models/chat"  # a save_pretrained directory with its tokenizer
    config.update(steps=500, batch_size=16, seq_len=1024, log_every=10, eval_every=100,
                  eval_steps=50, checkpoint_every=250, keep_checkpoints=1)
    if variant == "cpu":
        config.update(steps=100, batch_size=8, seq_len=256, eval_every=50, eval_steps=5,
                      checkpoint_every=50)
    config.model.dropout_rate = 0.0
    config.data.update(objective="sft", tokenizer="hf", num_sentinels=0,
                       validation_fraction=0.05, sft_truncate=False)
    config.optimizer.update(learning_rate=2e-5, warmup_steps=25, weight_decay=0.0)
    return config
