"""Balancing the experts: DeepSeek-V3's auxiliary-loss-free bias against the auxiliary loss
(Switch / GShard), on the small char-level GPT with 8 experts in every layer (top-2 of 8, 256
wide: the dense base's 512 active hidden units), sigmoid scores in 4 groups of which a token
uses 2 (DeepSeek-V3's routing, scaled down), capacity factor 2 (a choice past twice the mean
load is dropped, so imbalance costs tokens), 600 steps, 3 seeds:

- none: no balancing at all (the reference for how far the load drifts);
- aux_loss: the load-balancing loss at weight 0.01 (Switch's);
- aux_free: the balance bias moved by 0.001 a step, no auxiliary loss (DeepSeek-V3 sec. 2.1.2);
- aux_free_fast: the same at 0.01 a step (a 600-step run is short for 0.001).

DeepSeek-V3's claim (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"): the bias keeps
the load as balanced as the auxiliary loss, or more, at a lower validation loss, since no
gradient pulls the router away from the task. `moe_imbalance` (max over mean tokens per expert,
per layer) is in each run's metrics.jsonl.

    python -m transformer.sweep --config=experiments/ablations/moe_balance.py \\
        --workdir=runs/ablations/moe_balance --batched_seeds
"""

from transformer import sweep
from transformer.configs import small_char_lm

FREE = {"model.moe.load_balance_loss": 0.0, "model.moe.balance_bias": True}


def get_config():
    config = small_char_lm()
    config.experiment = "moe_balance"
    config.model.moe.update(num_experts=8, top_k=2, d_ff=256, capacity_factor=2.0,
                            score="sigmoid", n_group=4, topk_group=2, router_z_loss=0.0)
    return config


def get_sweep():
    return sweep.named({
        "none": {"model.moe.load_balance_loss": 0.0},
        "aux_loss": {"model.moe.load_balance_loss": 0.01},
        "aux_free": {**FREE, "model.moe.bias_update_rate": 0.001},
        "aux_free_fast": {**FREE, "model.moe.bias_update_rate": 0.01},
    })


def get_seeds():
    return 3


def get_baseline():
    return "aux_loss"
