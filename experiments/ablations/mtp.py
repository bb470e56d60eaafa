"""Multi-token prediction (DeepSeek-V3 sec. 2.2): depth 0 against 1 against 2 on the small
char-level GPT, 600 steps, 3 seeds, the modules' loss at weight 0.3. Validation is next-token
loss alone (the modules do not run), so the three compare directly.

DeepSeek-V3's claim: MTP improves the next-token model (their ablations: lower loss and better
benchmarks at equal tokens), and its modules make a draft that is accepted 85-90% of the time
for the second token. `benchmarks/speculative_decode.py` measures the speed-up on these runs.

    python -m transformer.sweep --config=experiments/ablations/mtp.py \\
        --workdir=runs/ablations/mtp --batched_seeds
    python benchmarks/speculative_decode.py --workdirs=runs/ablations/mtp/depth_1/seed_0,\\
        runs/ablations/mtp/depth_2/seed_0
"""

from transformer import sweep
from transformer.configs import small_char_lm


def get_config():
    config = small_char_lm()
    config.experiment = "mtp"
    config.model.update(norm="rmsnorm")  # DeepSeek's norm, as the modules' input norms are
    return config


def get_sweep():
    return sweep.named({f"depth_{d}": {"model.mtp.depth": d} for d in (0, 1, 2)})


def get_seeds():
    return 3


def get_baseline():
    return "depth_0"
