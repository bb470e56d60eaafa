"""What the Hugging Face converters share (`convert` for GPT-2, BERT and T5, `convert_llama`
for the Llama-like families; `flat_heads` for the exporters too): a state dict that reports
missing and unused tensors, whether the LM head is tied, the head and norm layouts, the
default model config they start from, and layer stacking for scan_layers."""

from __future__ import annotations

import math
from typing import Any

import ml_collections
import numpy as np

from transformer.models import build_model, default_model_config
from transformer.nn.blocks import stack_unrolled
from transformer.nn.layers import stack_layers


class Checkpoint:
    """A state dict that remembers which tensors were read, to report what is missing or left."""

    def __init__(self, state_dict: dict[str, Any], ignored: tuple[str, ...] = (),
                 dtype=np.float32):
        self._tensors = dict(state_dict)
        self._dtype = dtype
        self._used: set[str] = set()
        self._ignored = set(ignored)  # tied copies read under another name, unused heads

    def __call__(self, name: str, transpose: bool = False) -> np.ndarray:
        if name not in self._tensors:
            raise KeyError(f"checkpoint is missing parameter {name!r} "
                           f"({len(self._tensors)} tensors present): expected the tensors its "
                           "config.json describes (a config edited since the weights were "
                           "saved, or a weights file missing)")
        self._used.add(name)
        tensor = self._tensors[name]
        if hasattr(tensor, "detach"):  # torch.Tensor
            tensor = tensor.detach().cpu().double().numpy()
        array = np.asarray(tensor, self._dtype)
        return array.T if transpose else array

    def has(self, name: str) -> bool:
        return name in self._tensors

    def check_all_used(self) -> None:
        """A one-line error naming the checkpoint's tensors no param took; empty ones hold no
        weights (DeepSeek-V3's shared expert with n_shared_experts=0 is 0 wide) and pass."""
        unused = sorted(name for name in set(self._tensors) - self._used - self._ignored
                        if math.prod(self._tensors[name].shape))
        if unused:
            raise ValueError(f"checkpoint has unexpected parameters {unused}: the converted "
                             "model has no place for them")


def head_tied(tie: bool, state_dict: dict[str, Any], embedding: str) -> bool:
    """Whether the LM head is the `embedding` tensor: config.json's tie_word_embeddings
    (`tie`), unless the checkpoint also holds an lm_head.weight that differs from it as stored.
    transformers 5 then unties them (with a warning) and uses the file's head; so does the
    import (tie_embeddings=False, the head from lm_head.weight)."""
    if not tie or "lm_head.weight" not in state_dict or embedding not in state_dict:
        return tie
    head, table = state_dict["lm_head.weight"], state_dict[embedding]
    if hasattr(head, "equal") and getattr(head, "dtype", 0) == getattr(table, "dtype", 1):
        return head.shape == table.shape and bool(head.equal(table))  # torch: no copies
    stored = lambda t: t.detach().cpu().double().numpy() if hasattr(t, "detach") else t
    return bool(np.array_equal(np.asarray(stored(head)), np.asarray(stored(table))))


def split_heads(kernel_DX: np.ndarray, num_heads: int) -> np.ndarray:
    """[D, N * H] -> [D, N, H] (HF splits the projection's output dim head by head)."""
    return kernel_DX.reshape(kernel_DX.shape[0], num_heads, -1)


def flat_heads(kernel_DNH: np.ndarray) -> np.ndarray:
    """[D, N, H] -> [D, N * H], HF's head-by-head output layout (the inverse of split_heads)."""
    return kernel_DNH.reshape(kernel_DNH.shape[0], -1)


def norm_params(ckpt, prefix, bias=True, weight="weight", bias_name="bias"):
    params = {"scale": ckpt(f"{prefix}.{weight}")}
    if bias:
        params["bias"] = ckpt(f"{prefix}.{bias_name}")
    return params


def model_config(**overrides) -> ml_collections.ConfigDict:
    config = default_model_config()
    config.update(overrides)
    return config



def maybe_scan(config, params, *stacks):
    """Stack per-layer params along a leading axis when the config scans layers."""
    if not config.scan_layers:
        return params
    params = dict(params)
    for name in stacks:
        if config.family == "gpt":  # layer periods and first dense layers: the stack's layout
            params[name] = stack_unrolled(build_model(config).config, params[name])
            continue
        layers = config.num_decoder_layers if name == "decoder" and config.num_decoder_layers \
            else config.num_layers
        params[name] = stack_layers(params[name], layers)
    return params
