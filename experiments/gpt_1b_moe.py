"""experiments/gpt_1b.py with mixture-of-experts feed-forward layers: every other layer's
feed-forward becomes 8 experts of the same width, each token through its top 2 (capacity factor
1.25), so a token passes through 1.7B of the 4.1B params.

As it stands the experts are sharded like everything else (fsdp over every chip); an expert
mesh axis splits them instead, e.g. 4 (each chip then holds 2 experts of every MoE layer, and
tokens reach them by all-to-all), with fsdp over the rest:

    python -m launch.aot --config=experiments/gpt_1b_moe.py --topology=v5p-32 \
        --config.mesh.expert=4
"""

from transformer.configs import experiment


def get_config():
    config = experiment("gpt_1b")
    config.experiment = "gpt_1b_moe"
    config.model.moe.update(num_experts=8, top_k=2, every_n_layers=2, capacity_factor=1.25)
    return config
