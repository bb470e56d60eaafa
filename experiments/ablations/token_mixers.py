"""The token mixers of 2025-26 on the small char-level GPT (4 layers, 128 wide, 600 steps, 3
seeds), against multi-head attention:

- mha (baseline), gqa (4 query heads to 2 KV heads) and MLA (DeepSeek-V2: a 64-wide KV latent,
  nope/rope/value head dims 32/16/32, about the params of MHA): DeepSeek-V2's claim is that
  MLA matches or beats MHA with a far smaller decode cache (the start line gives its bytes);
- attention sinks (gpt-oss), also on a model with a 16-token sliding window, trained at 64
  tokens and evaluated at 64..512 (StreamingLLM: a sink keeps a windowed model stable past its
  trained length);
- gated attention, per head and per element (Qwen3-Next, Qiu et al. 2025).

The linear-attention hybrids train at longer rows: experiments/ablations/hybrids.py.

    python -m transformer.sweep --config=experiments/ablations/token_mixers.py \
        --workdir=runs/ablations/token_mixers --batched_seeds
"""

from transformer import sweep
from transformer.configs import small_char_lm

MLA = {"model.attention_kind": "mla", "model.mla.kv_lora_rank": 64, "model.mla.q_lora_rank": 0,
       "model.mla.qk_nope_head_dim": 32, "model.mla.qk_rope_head_dim": 16,
       "model.mla.v_head_dim": 32}
WINDOW = {"model.sliding_window": 16}


def get_config():
    config = small_char_lm()
    config.experiment = "token_mixers"
    config.eval_seq_lens = (64, 128, 256, 512)
    return config


def get_sweep():
    return sweep.named({
        "mha": {},
        "gqa": {"model.num_kv_heads": 2},
        "mla": MLA,
        "sinks": {"model.attention_sinks": True},
        "window16": WINDOW,
        "window16_sinks": {**WINDOW, "model.attention_sinks": True},
        "gate_head": {"model.attention_gate": "head"},
        "gate_element": {"model.attention_gate": "element"},
    })


def get_seeds():
    return 3


def get_baseline():
    return "mha"
