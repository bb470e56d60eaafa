"""Token mixers, one file each, behind one registry: `MIXERS` maps a layer type (the names of
Hugging Face's `layer_types`) to its `base.Mixer` record. Adding a mixer is a new file defining
its layer and record, and one line here (plus its config group in `nn.config`, if it has keys).
"""

from transformer.nn.mixers import gated_deltanet, mamba2, short_conv, softmax_attention
from transformer.nn.mixers.base import Mixer

MIXERS: dict[str, Mixer] = {
    "full_attention": softmax_attention.FULL,
    "sliding_attention": softmax_attention.SLIDING,
    "linear_attention": gated_deltanet.MIXER,
    "mamba2": mamba2.MIXER,
    "conv": short_conv.MIXER,
}
ATTENTION_KINDS = softmax_attention.ATTENTION_KINDS
# Layer types whose decode state does not grow with the context (recurrent mixers).
RECURRENT = tuple(name for name, m in MIXERS.items() if m.decode_state == "recurrent state")


def summary(config) -> str | None:
    """The start line of a stack whose layers are not all multi-head attention (None if they
    are): its layer types in order, and the decode cache per token beside what multi-head
    attention (GQA at these heads) would hold.

    >>> from transformer.nn.config import TransformerConfig
    >>> line = summary(TransformerConfig(num_layers=4, sliding_window=8,
    ...                                  layer_types="sliding_attention*3,full_attention"))
    >>> line.split("; ")  # 4 layers x K and V x 4 heads x 16 x 4 bytes
    ['layers: sliding_attention x3, full_attention (x1 repeating)', \
'decode cache 2,048 B per token (multi-head attention: 2,048 B)']
    """
    layers = [config.layer_type(i) for i in range(config.num_layers)]
    if set(layers) <= {"full_attention", "sliding_attention"} and (
            getattr(config, "attention_kind", "mha") == "mha") and not config.layer_types:
        return None
    pattern = config.layer_pattern
    runs = []
    for name in pattern:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    kind = getattr(config, "attention_kind", "mha")
    named = lambda name: f"{name} ({kind})" if kind != "mha" and name in (
        "full_attention", "sliding_attention") else name
    order = ", ".join(f"{named(name)} x{n}" if n > 1 else named(name) for name, n in runs)
    repeat = f" (x{config.num_layers // len(pattern)} repeating)"
    cache = sum(config.mixer(i).cache_bytes_per_token(config) for i in range(len(layers)))
    mha = softmax_attention.MULTI_HEAD.cache_bytes_per_token(config) * config.num_layers
    recurrent = sum(MIXERS[name].decode_state == "recurrent state" for name in layers)
    state = f", {recurrent} layers with a constant-size state" if recurrent else ""
    return (f"layers: {order}{repeat}; decode cache {cache:,} B per token{state} "
            f"(multi-head attention: {mha:,} B)")
