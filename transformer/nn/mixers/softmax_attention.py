"""Softmax attention as a token mixer: `full_attention` and `sliding_attention` layers, each
multi-head attention (`nn.attention.MultiHeadAttention`: MHA, GQA or MQA by num_kv_heads) or,
under `attention_kind="mla"`, DeepSeek's multi-head latent attention (`ATTENTION_KINDS`)."""

from __future__ import annotations

import dataclasses

from transformer.nn.attention import AttentionSettings, MultiHeadAttention
from transformer.nn.mixers import mla
from transformer.nn.mixers.base import Mixer


def _width(config) -> int:
    return config.num_heads * config.resolved_head_dim


def _kv_cache_bytes(config) -> int:
    """Keys and values of every KV head, in the compute dtype."""
    kv_heads = config.num_kv_heads or config.num_heads
    return 2 * kv_heads * config.resolved_head_dim * config.dtype.itemsize


MULTI_HEAD = Mixer(
    layer=lambda config, name: MultiHeadAttention(AttentionSettings.from_config(config),
                                                  name=name),
    param_name="self_attention",
    # The PaLM / nanoGPT count: scores and values, 2 x 2 x width FLOPs per key forward, three
    # times that with the backward; causal attention is not halved (nanoGPT's estimate_mfu).
    flops_per_token=lambda config, seq_len: 12 * _width(config) * seq_len,
    decode_state="kv cache",
    cache_bytes_per_token=_kv_cache_bytes)

# attention_kind -> the attention a full or sliding layer runs
ATTENTION_KINDS: dict[str, Mixer] = {"mha": MULTI_HEAD, "mla": mla.MIXER}


def _kind(config) -> Mixer:
    return ATTENTION_KINDS[getattr(config, "attention_kind", "mha")]


def _windowed_flops(config, seq_len: int) -> float:
    """A sliding layer's keys are the last `sliding_window` positions at most."""
    window = config.sliding_window or seq_len
    return _kind(config).flops_per_token(config, min(window, seq_len))


FULL = Mixer(
    layer=lambda config, name: _kind(config).layer(config, name),
    param_name="self_attention",
    flops_per_token=lambda config, seq_len: _kind(config).flops_per_token(config, seq_len),
    decode_state="kv cache",
    cache_bytes_per_token=lambda config: _kind(config).cache_bytes_per_token(config),
    refuses=lambda config, mesh: _kind(config).refuses(config, mesh))
def _local(config):
    """A sliding layer's config: with `rope_local_theta`, plain RoPE at that base (Gemma 3's
    local layers; the full layers keep rope_theta and its scaling)."""
    if getattr(config, "rope_local_theta", None) is None:
        return config
    return dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scale=1.0,
                               rope_scaling="linear")


SLIDING = dataclasses.replace(
    FULL, layer=lambda config, name: _kind(config).layer(_local(config), name),
    flops_per_token=_windowed_flops, local=True)
