"""Pretraining objectives at equal compute (same steps, batch, rows of 64 tokens and ~4 layers
of width 128): causal LM (GPT), prefix LM, masked LM (BERT, 15% masked 80/10/10) and span
corruption (T5, 2 + 2 layers), all on the same char-level text, each evaluated on the same
held-out documents with its own loss (which the report says are not directly comparable).

    python -m transformer.sweep --config=experiments/ablations/objectives.py \
        --workdir=runs/ablations/objectives
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "objectives"
    return config


def get_sweep():
    return sweep.named({
        "causal_lm": {"model.family": "gpt"},
        "prefix_lm": {"model.family": "prefix_lm"},
        "masked_lm": {"model.family": "bert", "model.position": "learned",
                      "model.embedding_norm": True},
        # a sentinel id for each of a 64-token row's 3 noise spans
        "span_corruption": {"model.family": "t5", "model.num_layers": 2,
                            "model.num_decoder_layers": 2, "model.position": "t5",
                            "data.num_sentinels": 3},
    })


def get_seeds():
    return 3  # docs/ablations.md's table: mean ± 95% CI over seeds 0, 1, 2


def get_baseline():
    return "causal_lm"
