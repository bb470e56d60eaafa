"""Fine-tune BERT (experiments/bert_mlm.py's architecture) as a sequence classifier: a pooled
[CLS] head over the encoder, on a labeled task (transformer.data.tasks).

Pretrain with the same validation fraction (so pretraining never reads a test paragraph), then
fine-tune from it, and evaluate accuracy, macro-F1 and the confusion matrix on the test split:

    python -m transformer.train --config=experiments/bert_mlm.py --workdir=runs/bert_mlm \
        --config.data.validation_fraction=0.15
    python -m transformer.train --config=experiments/bert_finetune_cls.py \
        --workdir=runs/bert_cls --config.init_from=runs/bert_mlm
    python -m transformer.evaluate --workdir=runs/bert_cls --split=test

`get_config("speakers")` classifies speakers of play text instead (pass
--config.data.path=tinyshakespeare.txt to both runs). `--config.init_from=` trains from scratch.
"""

from transformer import configs


def get_config(task: str = "modules"):
    config = configs.experiment("bert_mlm")
    config.experiment = "bert_finetune_cls"
    configs.finetune_task(config, task)
    config.init_from = "runs/bert_mlm"  # the pretraining run's default workdir; "": from scratch
    config.update(steps=400, batch_size=16, seq_len=128)
    config.model.update(head="classify", num_classes=0)  # 0: the task's classes
    config.data.objective = "classification"
    config.optimizer.update(learning_rate=3e-4, warmup_steps=40)
    return config
