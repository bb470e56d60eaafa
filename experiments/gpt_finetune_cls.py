"""Fine-tune a GPT (experiments/gpt_tiny.py's architecture) as a sequence classifier: a head on
the last token's final vector, on a labeled task (transformer.data.tasks).

    python -m transformer.train --config=experiments/gpt_tiny.py --workdir=runs/gpt_tiny \
        --config.data.validation_fraction=0.15
    python -m transformer.train --config=experiments/gpt_finetune_cls.py \
        --workdir=runs/gpt_cls --config.init_from=runs/gpt_tiny
    python -m transformer.evaluate --workdir=runs/gpt_cls --split=test

`get_config("speakers")` classifies speakers of play text (--config.data.path=... for both).
"""

from transformer import configs


def get_config(task: str = "modules"):
    config = configs.experiment("gpt_tiny")
    config.experiment = "gpt_finetune_cls"
    configs.finetune_task(config, task)
    config.init_from = "runs/gpt_tiny"  # the pretraining run's default workdir; "": from scratch
    config.update(steps=400, batch_size=16, seq_len=128)
    config.model.update(head="classify", num_classes=0)  # 0: the task's classes
    config.data.objective = "classification"
    config.optimizer.update(learning_rate=3e-4, warmup_steps=40)
    return config
