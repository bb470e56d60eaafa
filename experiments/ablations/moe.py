"""Dense vs mixture-of-experts feed-forward layers at equal active parameters and equal steps.

Every variant's token passes through 512 feed-forward hidden units per MoE layer (top-k x d_ff),
as in the dense base, so the active params differ only by the routers (128 x E per MoE layer);
the MoE variants hold 4-8x the feed-forward params in all.

    python -m transformer.sweep --config=experiments/ablations/moe.py \
        --workdir=runs/ablations/moe
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "moe"
    return config


def get_sweep():
    return sweep.named({
        "dense": {},
        # Switch: top-1 of 8 experts as wide as the dense layer, in every layer.
        "top1_8x512": {"model.moe.num_experts": 8, "model.moe.top_k": 1},
        # Mixtral-style top-2 of 8 half-width experts.
        "top2_8x256": {"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.d_ff": 256},
        # GShard: experts in every other layer only.
        "top1_8x512_every2": {"model.moe.num_experts": 8, "model.moe.top_k": 1,
                              "model.moe.every_n_layers": 2},
        # Dropless routing (capacity_factor 0): no token loses its expert.
        "top1_8x512_dropless": {"model.moe.num_experts": 8, "model.moe.top_k": 1,
                                "model.moe.capacity_factor": 0.0},
    })
