"""Fine-tune T5 (experiments/t5_span.py's architecture) text-to-text: the encoder reads the
text, the decoder writes the class's name ("typing", "ROMEO"). Evaluated by exact match
(greedy decoding gives the name exactly) and by rank classification (the class whose name the
model scores highest: accuracy, macro-F1, confusion matrix).

    python -m transformer.train --config=experiments/t5_span.py --workdir=runs/t5_span \
        --config.data.validation_fraction=0.15
    python -m transformer.train --config=experiments/t5_finetune_text2text.py \
        --workdir=runs/t5_text2text --config.init_from=runs/t5_span
    python -m transformer.evaluate --workdir=runs/t5_text2text --split=test

`get_config("speakers")` names speakers of play text (--config.data.path=... for both).
"""

from transformer import configs


def get_config(task: str = "modules"):
    config = configs.experiment("t5_span")
    config.experiment = "t5_finetune_text2text"
    configs.finetune_task(config, task)
    config.init_from = "runs/t5_span"  # the pretraining run's default workdir; "": from scratch
    config.update(steps=400, batch_size=16, seq_len=128)
    config.data.objective = "text2text"
    config.optimizer.update(learning_rate=3e-4, warmup_steps=40)
    return config
