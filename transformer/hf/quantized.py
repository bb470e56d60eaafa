"""Quantized Hugging Face checkpoints read as float weights. MXFP4 is what gpt-oss's hub files
hold for the experts (`"quantization_config": {"quant_method": "mxfp4"}`); it is dequantized
here as transformers does on a machine without its Triton kernels. Any other method is refused
in one line, naming it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

# The 16 FP4 (E2M1) values, indexed by their 4-bit code: sign bit, 2 exponent bits, 1 mantissa.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
DEQUANTIZED = ("mxfp4",)


def method(hf_config) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (None when it is not quantized)."""
    quantized = getattr(hf_config, "quantization_config", None)
    if not quantized:
        return None
    name = quantized.get("quant_method") if isinstance(quantized, dict) else \
        getattr(quantized, "quant_method", quantized)
    return str(getattr(name, "value", name))  # transformers' QuantizationMethod is an enum


def mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor an MXFP4 pair stands for. `blocks` [..., R, G, 16] uint8 holds two
    FP4 codes a byte, the low nibble first; `scales` [..., R, G] uint8 one power of two
    (E8M0: the exponent plus 127) for each group of 32 values along a row. The result is
    [..., G * 32, R]: rows become columns, as the unquantized tensor is stored
    (transformers' `gate_up_proj` is [E, D, 2F], its quantized rows [E, 2F, D / 32, 16]).

    >>> byte = 0x21  # codes 1 (0.5) then 2 (1.0); the other 30 values are 0
    >>> mxfp4(np.array([[[byte] + [0] * 15]], np.uint8), np.array([[128]], np.uint8))[:3, 0]
    array([1., 2., 0.], dtype=float32)
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                         f"{scales.dtype}{list(scales.shape)}: expected uint8 [..., G, 16] and "
                         "uint8 [..., G]")
    values = np.stack([FP4_E2M1[blocks & 0x0F], FP4_E2M1[blocks >> 4]], axis=-1)
    values = values.reshape(*scales.shape, 32) * np.ldexp(
        np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)


def dequantized(hf_config, read: Callable[[], Mapping[str, np.ndarray]],
                source: str) -> dict[str, np.ndarray]:
    """The state dict `read()` returns, each MXFP4 pair `NAME_blocks`, `NAME_scales` replaced
    by the float32 tensor `NAME`. A quantization method other than MXFP4 is refused in one
    line before `read` runs; `source` names the checkpoint in it."""
    name = method(hf_config)
    if name is not None and name not in DEQUANTIZED:
        raise ValueError(f"{source}: quantization_config ({name!r}): expected unquantized or "
                         f"{', '.join(DEQUANTIZED)} weights (load it with transformers, "
                         "dequantized, and save_pretrained that)")
    tensors = dict(read())
    if name is None:
        return tensors
    pairs = [key[:-len("_blocks")] for key in tensors if key.endswith("_blocks")]
    for key in pairs:
        if key + "_scales" not in tensors:
            raise ValueError(f"{source}: {key}_blocks has no {key}_scales: expected MXFP4 "
                             "blocks and scales in pairs")
        try:
            tensors[key] = mxfp4(tensors.pop(key + "_blocks"), tensors.pop(key + "_scales"))
        except ValueError as error:
            raise ValueError(f"{source}: {key}: {error}") from None
    return tensors
