"""Pretrain, then adapt, against training from scratch: the same fine-tuning run (steps, batch,
learning rate, task) started from a pretrained workdir or from random init, for BERT ([CLS]
classifier), T5 (text to text) or GPT (last-token classifier). The report's test columns give
the accuracy gap on the task's held-out test split.

Pretrain first, with the fine-tuning validation fraction so the test split stays unseen, then
sweep with --config.init_from pointing at it (default: runs/<pretraining experiment>). For
speakers of tinyshakespeare (for the embedded corpus's module task drop the data.path flags and
the ",speakers"):

    python -m transformer.train --config=experiments/bert_mlm.py --workdir=runs/bert_mlm_sh \
        --config.data.path=tinyshakespeare.txt --config.data.validation_fraction=0.15
    python -m transformer.sweep \
        --config=experiments/ablations/pretrain_vs_scratch.py:bert,speakers \
        --workdir=runs/ablations/pretrain_vs_scratch_bert \
        --config.init_from=runs/bert_mlm_sh --config.data.path=tinyshakespeare.txt

(`t5` pretrains with experiments/t5_span.py, `gpt` with experiments/gpt_tiny.py.)
"""

from transformer import configs, sweep

FINETUNE = {"bert": "bert_finetune_cls", "t5": "t5_finetune_text2text",
            "gpt": "gpt_finetune_cls"}


def get_config(args: str = "bert,modules"):
    family, _, task = args.partition(",")
    if family not in FINETUNE:
        raise ValueError(f"{args!r}: expected bert, t5 or gpt, then optionally ',speakers'")
    config = configs.experiment(FINETUNE[family], task or "modules")
    config.experiment = f"pretrain_vs_scratch_{family}"
    return config


def get_sweep():
    return sweep.named({"pretrained": {}, "scratch": {"init_from": ""}})
