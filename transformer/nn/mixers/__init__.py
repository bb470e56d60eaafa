"""Token mixers, one file each, behind one registry: `MIXERS` maps a layer type (the names of
Hugging Face's `layer_types`) to its `base.Mixer` record. Adding a mixer is a new file defining
its layer and record, and one line here (plus its config group in `nn.config`, if it has keys).
"""

from transformer.nn.mixers import softmax_attention
from transformer.nn.mixers.base import Mixer

MIXERS: dict[str, Mixer] = {
    "full_attention": softmax_attention.FULL,
    "sliding_attention": softmax_attention.SLIDING,
}
ATTENTION_KINDS = softmax_attention.ATTENTION_KINDS
# Layer types whose decode state does not grow with the context (recurrent mixers).
RECURRENT = tuple(name for name, m in MIXERS.items() if m.decode_state == "recurrent state")
