"""Accelerator attention kernels behind one name: dense, chunked, splash (TPU), cudnn (GPU).

Every implementation computes what `dense_attention.dot_product_attention` computes: query
[B, T, N, H], key / value [B, S, K, H] (GQA / MQA when K < N), a `masks.Mask` spec, output
[B, T, N, H], and a query row with no allowed key returns zeros.

Each kernel declares in `KERNELS` the `FEATURES` it takes (bias, soft-cap, dropout, returned
weights, mask arrays, per-example masks, GQA, attention sinks) and what else it needs
(`Kernel.requires`: platform, lengths, head_dim, dtype). `select(impl, ...)` reads that table:
an explicit choice that cannot run the inputs raises a one-line ValueError naming the kernel
and the reason; "auto" picks the first kernel of `AUTO_ORDER` that the call prefers and that
can run it (never for a feature it takes only when named):

    kernel     preferred when          takes
    ---------  ----------------------  ------------------------------------------------------
    splash     platform tpu            soft-cap, GQA, sinks (mask arrays, per-example masks other
                                       than segments / padding only when named: a dense mask);
                                       q_len and kv_len multiples of 128, tpu (or interpret),
                                       one device or a mesh in context (then per device)
    cudnn      platform gpu            masks, GQA; head_dim <= 128 and a multiple of 8,
                                       fp16 / bf16, platform gpu
    chunked    q_len x kv_len >=       everything but dropout and returned weights
               threshold^2 (self-
               attention: T >= it)
    dense      always                  everything (on CPU in query blocks that skip the keys a
                                       Mask never allows)
    reference  never (named only)      everything: the plain float32 formula, for prototyping

Mask lowering for splash: static masks (Full, Causal, SlidingWindow, ChunkedCausal, And/Or of
them) become splash's lazy masks; Segment and Padding become `SegmentIds` (and-ed with the static
part in the kernel); any other per-example mask (PrefixLM, Or with a per-example part, a dense
boolean array) goes through splash's dynamic-mask path, which materialises a boolean
[N, T, S] mask per example and is therefore never chosen by "auto". For cuDNN see
`cudnn_attention.cudnn_arguments`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from transformer.nn.chunked_attention import check_qkv
from transformer.nn.masks import (
    And,
    Causal,
    ChunkedCausal,
    Full,
    Mask,
    Or,
    Padding,
    Segment,
    SlidingWindow,
    as_dense,
)
from transformer.parallel import sharding

Array = jax.Array


# Splash's key blocks, and its query blocks when segment ids are used, are multiples of 128; this
# module asks both sequence lengths to be multiples of it.
_LANES = 128
_CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)


# -----------------------------------------------------------------------------
# Selection


def target_platform() -> str:
    """The platform ("cpu" / "gpu" / "tpu") of the devices the computation being traced is for.

    Under a mesh (`jax.set_mesh`) that is the mesh's devices, which for `launch.aot` are the TPU
    topology's even on a CPU host; otherwise the default backend.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()


_selected: list[list[str]] = []


@contextlib.contextmanager
def recording():
    """Collects the implementation `select` resolves for each attention traced inside.

    >>> with recording() as chosen:
    ...     _ = select("auto", platform="cpu", mask=None, bias=None, dropout=0.0, q_len=8,
    ...                kv_len=8, head_dim=16)
    >>> chosen
    ['dense']
    """
    chosen: list[str] = []
    _selected.append(chosen)
    try:
        yield chosen
    finally:
        _selected.remove(chosen)


def _splash_lowering(mask) -> str:
    """How splash takes `mask`: "static", "segments" (static part + SegmentIds) or "dense"."""
    if mask is None or (isinstance(mask, Mask) and mask.is_static):
        return "static"
    if not isinstance(mask, Mask):
        return "dense"  # a boolean array
    parts = mask.parts if isinstance(mask, And) else (mask,)
    dynamic = [p for p in parts if not p.is_static]
    segments = [p for p in dynamic if isinstance(p, Segment)]
    if len(segments) <= 1 and all(isinstance(p, Segment | Padding) for p in dynamic):
        return "segments"
    return "dense"


# -----------------------------------------------------------------------------
# The kernels' table: what each one takes


FEATURES = {  # feature -> how a kernel without it is refused (in the order they are checked)
    "dropout": "has no attention dropout (dropout={dropout})",
    "weights": "returns no attention weights",
    "bias": "takes no bias (ALiBi / T5)",
    "bias_fn": "takes no bias (ALiBi / T5)",
    "softcap": "has no logit soft-cap (attention_softcap={softcap})",
    "mask_array": "takes no dense mask array",
    "example_mask": "takes no per-example mask but segment ids and padding (prefix-LM)",
    "gqa": "has no grouped-query attention",
    "sinks": "has no attention sinks",
}
# Features a call turns on by itself (training's dropout, a request for the weights), not the
# config: `select(..., fall_back=True)` then leaves a kernel without them for one with them.
PER_CALL = ("dropout", "weights")


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """What one attention call asks of a kernel (`features()`) and its shapes and platform."""

    platform: str
    mask: Any = None
    bias: Any = None  # None, an array, or a function of (query, key) indices
    dropout: float = 0.0
    q_len: int = 1
    kv_len: int = 1
    head_dim: int = 64
    interpret: bool = False
    dtype: Any = None
    devices: int = 1
    softcap: float = 0.0
    weights: bool = False
    gqa: bool = False
    chunk_threshold: int = 2048
    split: int = 1  # devices along a `sequence` mesh axis
    sinks: bool = False  # a learned sink logit per head (attention_sinks)

    def features(self) -> tuple[str, ...]:
        """The `FEATURES` this call uses, in their order."""
        used = dict(dropout=bool(self.dropout), weights=self.weights,
                    bias=self.bias is not None and not callable(self.bias),
                    bias_fn=callable(self.bias), softcap=bool(self.softcap),
                    mask_array=self.mask is not None and not isinstance(self.mask, Mask),
                    example_mask=isinstance(self.mask, Mask) and _splash_lowering(
                        self.mask) == "dense",
                    gqa=self.gqa, sinks=self.sinks)
        return tuple(f for f in FEATURES if used.get(f))


def _no_requirement(call: Call) -> str | None:
    return None


def _splash_requires(call: Call) -> str | None:
    if call.platform != "tpu" and not call.interpret:
        return f"needs platform tpu (got {call.platform}); pass interpret=True to emulate it"
    if call.q_len % _LANES or call.kv_len % _LANES:
        return f"needs q_len and kv_len multiples of {_LANES} (got {call.q_len}, {call.kv_len})"
    if call.devices > 1:
        return (f"spans {call.devices} devices without a mesh to shard_map over; set one with "
                "jax.set_mesh")
    return None


def _per_device_requires(call: Call) -> str | None:
    if call.split <= 1:
        return "runs only under a sequence mesh axis"
    if call.q_len % call.split or call.kv_len % call.split:
        return f"needs lengths divisible by sequence={call.split} (got {call.q_len}, {call.kv_len})"
    return None


def _cudnn_requires(call: Call) -> str | None:
    if call.platform != "gpu":
        return f"needs platform gpu (got {call.platform})"
    if call.head_dim > 128 or call.head_dim % 8:
        return f"needs head_dim <= 128 and a multiple of 8 (got {call.head_dim})"
    if call.dtype is not None and jnp.dtype(call.dtype) not in [
            jnp.dtype(d) for d in _CUDNN_DTYPES]:
        return f"needs float16 or bfloat16 inputs (got {jnp.dtype(call.dtype).name})"
    return None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One attention kernel's declaration: the `FEATURES` it takes, those it takes only when
    named (`auto` never picks it for them: splash materialises a per-example mask), what else
    it needs of the call (`requires`: a reason, or None), and when `auto` prefers it."""

    features: frozenset[str]
    named_only: frozenset[str] = frozenset()
    requires: Callable[[Call], str | None] = _no_requirement
    preferred: Callable[[Call], bool] = lambda call: False


# The kernels under a `sequence` mesh axis ("... per device") are chosen in `attention.attend`;
# they run only Mask specs (no mask array) and biases as functions of indices.
KERNELS = {
    "dense": Kernel(frozenset(FEATURES), preferred=lambda call: True),
    "chunked": Kernel(frozenset({"bias", "bias_fn", "softcap", "mask_array", "example_mask",
                                 "gqa", "sinks"}),
                      # the score block T x S, not S alone: a decode step's few queries
                      # against a long cache have small scores, and dense reads the cache
                      # 1.4-1.8x as fast there (docs/performance.md, decoding per mixer)
                      preferred=lambda call: call.q_len * call.kv_len >= call.chunk_threshold**2),
    "splash": Kernel(frozenset({"softcap", "gqa", "sinks"}),
                     named_only=frozenset({"mask_array", "example_mask"}),
                     requires=_splash_requires, preferred=lambda call: call.platform == "tpu"),
    "cudnn": Kernel(frozenset({"mask_array", "example_mask", "gqa"}), requires=_cudnn_requires,
                    preferred=lambda call: call.platform == "gpu"),
    "reference": Kernel(frozenset(FEATURES)),
    # splash per device also asks `sequence_parallel.splash_reason` (strategy, and the masks it
    # can lay out per device: static parts, segment ids, a zig-zag order), before this table
    "splash per device": Kernel(frozenset({"softcap", "gqa", "example_mask"}),
                                requires=_per_device_requires),
    "chunked per device": Kernel(frozenset({"bias_fn", "softcap", "gqa", "example_mask",
                                            "sinks"}),
                                 requires=_per_device_requires),
}
AUTO_ORDER = ("splash", "cudnn", "chunked", "dense")  # `auto`: the first preferred that can run
IMPLS = ("auto", *(name for name in KERNELS if " " not in name))


def refusal(impl: str, call: Call, *, auto: bool = False) -> str | None:
    """Why kernel `impl` cannot run `call` (None: it can), from its `KERNELS` entry; `auto`:
    also its `named_only` features."""
    if impl == "auto":
        return None
    if impl not in KERNELS:
        return f"is not one of {IMPLS}"
    kernel = KERNELS[impl]
    takes = kernel.features if auto else kernel.features | kernel.named_only
    for feature in call.features():
        if feature not in takes:
            return FEATURES[feature].format(dropout=call.dropout, softcap=call.softcap)
    return kernel.requires(call)


def supports(impl: str, *, mask: Mask | Array | None, bias: Any, dropout: float, q_len: int,
             kv_len: int, head_dim: int, platform: str, **rest) -> bool:
    """Whether `impl` can compute attention for these inputs on `platform` ("cpu"/"gpu"/"tpu").

    `rest`: the other fields of `Call`: `interpret=True` (splash would run in Pallas interpret
    mode), `dtype` (the query dtype; cuDNN takes only float16 / bfloat16), `devices` (how many
    devices the computation spans outside a mesh: splash shard_maps over a mesh set with
    `jax.set_mesh`, and cannot split over devices without one), `softcap`, `weights`, `gqa`.
    """
    call = Call(platform, mask=mask, bias=bias, dropout=dropout, q_len=q_len, kv_len=kv_len,
                head_dim=head_dim, **rest)
    return refusal(impl, call) is None


def select(impl: str, *, platform: str, mask: Mask | Array | None, bias: Any, dropout: float,
           q_len: int, kv_len: int, head_dim: int, fall_back: bool = False, **rest) -> str:
    """Resolves `impl` (one of `IMPLS`) to a concrete kernel by the `KERNELS` table (see the
    module docstring); `rest` as for `supports`, plus `chunk_threshold`.

    An explicit impl that cannot run the inputs raises ValueError naming it and the reason;
    with `fall_back`, a call that uses `PER_CALL` features resolves a kernel that cannot run it
    as "auto" instead (which picks dense for them).
    """
    call = Call(platform, mask=mask, bias=bias, dropout=dropout, q_len=q_len, kv_len=kv_len,
                head_dim=head_dim, **rest)
    reason = refusal(impl, call)
    if reason is not None and fall_back and set(PER_CALL) & set(call.features()):
        impl, reason = "auto", None
    if reason is not None:
        can = [name for name in ("chunked", "dense") if refusal(name, call) is None]
        fallback = " or ".join(repr(name) for name in can)
        raise ValueError(f"impl={impl!r} {reason}; use impl={fallback} or 'auto'")
    if impl == "auto":
        impl = next((name for name in AUTO_ORDER if KERNELS[name].preferred(call)
                     and refusal(name, call, auto=True) is None), None)
        if impl is None:
            raise ValueError(f"impl='auto': no kernel of {AUTO_ORDER} takes {call.features()}")
    record(impl)
    return impl


def record(kernel: str) -> None:
    """Notes `kernel` in every open `recording()` (MoE layers note their dispatch path too, as
    "moe dispatch: ...")."""
    for chosen in _selected:
        chosen.append(kernel)


def split_moe(chosen) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(attention kernels, MoE dispatch paths) of a `recording()`, each sorted and distinct.

    >>> split_moe(["dense", "moe dispatch: ragged", "dense"])
    (('dense',), ('moe dispatch: ragged',))
    """
    moe = {c for c in chosen or () if c.startswith("moe dispatch")}
    return tuple(sorted(set(chosen or ()) - moe)), tuple(sorted(moe))


# -----------------------------------------------------------------------------
# Shared helpers


def _parts(mask) -> tuple:
    if mask is None:
        return ()
    return mask.parts if isinstance(mask, And) else (mask,)


def rows_with_keys(mask, q_len: int, kv_len: int) -> Array | np.ndarray | None:
    """bool [B or 1, T, N or 1] "this query row has an allowed key", or None if every row has.

    The built-in static masks with q_len <= kv_len always allow the diagonal key, so they need no
    check. Otherwise this is a reduction of the dense predicate (NumPy at trace time for static
    masks; for per-example masks an XLA reduction, fused rather than stored).
    """
    if mask is None:
        return None
    if isinstance(mask, Mask) and mask.is_static:
        if q_len <= kv_len and _allows_diagonal(mask):
            return None
        return _static_dense(mask, q_len, kv_len).any(-1)[None, :, None]
    return as_dense(mask, q_len, kv_len).any(-1).transpose(0, 2, 1)


def _allows_diagonal(mask: Mask) -> bool:
    """True if the static spec provably allows key q + (kv_len - q_len) for every query q."""
    if isinstance(mask, And | Or):
        return all(_allows_diagonal(p) for p in mask.parts)
    return isinstance(mask, Full | Causal | SlidingWindow | ChunkedCausal)


def zero_empty_rows(out_BTNH: Array, rows) -> Array:
    if rows is None:
        return out_BTNH
    return jnp.where(jnp.asarray(rows)[..., None], out_BTNH, 0).astype(out_BTNH.dtype)


def _static_dense(mask: Mask, q_len: int, kv_len: int) -> np.ndarray:
    """A static mask as a NumPy bool [T, S] (evaluated at trace time, never traced)."""
    allowed = mask._allowed(np.arange(q_len), np.arange(kv_len), q_len, kv_len)
    return np.broadcast_to(np.asarray(allowed, bool), (1, 1, q_len, kv_len))[0, 0]


# -----------------------------------------------------------------------------
# Splash attention (TPU Pallas kernel)


def _splash_mask(mask: Mask | None, q_len: int, kv_len: int, q_order: np.ndarray | None = None):
    """A static mask spec -> a 2-D splash mask of shape (q_len, kv_len).

    `q_order` [q_len]: row i is query `q_order[i]` of `mask` (a zig-zag query layout under the
    sequence axis; keys stay in order). Splash's lazy masks take it as their `q_sequence`, the
    query positions the kernel evaluates the mask at; other masks are built row-permuted.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape, offset = (q_len, kv_len), kv_len - q_len  # ours: bottom-right aligned
    if mask is None or isinstance(mask, Full):
        return sm.FullMask(shape)
    if isinstance(mask, Causal):
        lazy = sm.CausalMask(shape, offset=offset)
    elif isinstance(mask, SlidingWindow):
        lazy = sm.LocalMask(shape, (mask.left, mask.right), offset=offset)
    elif isinstance(mask, ChunkedCausal) and offset == 0:  # splash's has no offset
        lazy = sm.ChunkedCausalMask(shape, mask.chunk_size)
    elif isinstance(mask, And | Or):
        parts = [_splash_mask(p, q_len, kv_len, q_order) for p in mask.parts]
        result = parts[0]
        for part in parts[1:]:
            result = result & part if isinstance(mask, And) else result | part
        return result
    else:
        dense = _static_dense(mask, q_len, kv_len)
        return sm.NumpyMask(np.ascontiguousarray(dense if q_order is None else dense[q_order]))
    if q_order is not None:
        lazy.q_sequence = np.asarray(q_order, np.int32)
    return lazy


def _segment_ids(parts, batch: int, q_len: int, kv_len: int) -> tuple[Array, Array]:
    """Segment and Padding parts -> int32 ids q [B, T], kv [B, S]; the kernel allows a key iff
    its id equals the query's.

    Masked keys (segment id 0, past `kv_lengths`) get id 0, which no allowed query has. Masked
    queries (segment id 0, past `q_lengths`) have no allowed key: their rows are zeroed after
    the kernel, so their ids do not matter.
    """
    q_ids = jnp.ones((batch, q_len), jnp.int32)
    kv_ids = jnp.ones((batch, kv_len), jnp.int32)
    for part in parts:
        if isinstance(part, Segment):
            seg_q = jnp.asarray(part.q_segment_ids, jnp.int32)
            seg_kv = seg_q if part.kv_segment_ids is None else jnp.asarray(
                part.kv_segment_ids, jnp.int32)
            q_ids = jnp.broadcast_to(seg_q, q_ids.shape)
            kv_ids = jnp.where(kv_ids != 0, jnp.broadcast_to(seg_kv, kv_ids.shape), 0)
        elif part.kv_lengths is not None:  # Padding
            valid = jnp.arange(kv_len)[None] < jnp.asarray(part.kv_lengths)[:, None]
            kv_ids = jnp.where(valid, kv_ids, 0)
    return q_ids, kv_ids


def _block(length: int, target: int) -> int:
    """The largest multiple of 128 that divides `length` and is <= max(target, 128)."""
    block = max(_LANES, target - target % _LANES)
    while length % block:
        block -= _LANES
    return block


def splash_attention(query: Array, key: Array, value: Array, mask: Mask | Array | None = None,
                     *, scale: float | None = None, block_size: int = 512,
                     interpret: bool = False, softcap: float = 0.0,
                     sinks: Array | None = None) -> Array:
    """Attention with the Pallas TPU splash kernel; same conventions and result as
    `dot_product_attention(query, key, value, mask, scale=scale)`.

    Args:
      query: [B, T, N, H]; key, value: [B, S, K, H], N a multiple of K (K == 1 uses the MQA
        kernel). T and S must be multiples of 128.
      mask: a `masks.Mask`, a boolean array broadcastable to [B, N, T, S], or None. See the module
        docstring for how it is lowered.
      scale: logit scale (default H ** -0.5); applied to the query before the kernel.
      block_size: target query / key block (the largest multiple of 128 <= it dividing T / S).
      interpret: run the kernel in Pallas interpret mode (any backend; slow, for tests).
      softcap: > 0 soft-caps the scaled logits (splash's `attn_logits_soft_cap`).
      sinks: [N] sink logits in each row's softmax denominator (splash's own `sinks`).

    Query rows with no allowed key return zeros (the kernel itself would return an average of
    masked values or NaN there, so those rows are zeroed explicitly). Differentiable (splash's
    custom VJP). Under a mesh (`jax.set_mesh`) of more than one device the kernel runs per device
    in `shard_map`: batch split as the rules table splits "activation_batch", heads as it splits
    "activation_heads" (kept whole when the KV heads would not split with them), sequence whole.
    """
    check_qkv(query, key, value)
    batch, q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    reason = refusal("splash", Call(target_platform(), mask, q_len=q_len, kv_len=kv_len,
                                    head_dim=head_dim, interpret=interpret))
    if reason is not None:
        raise ValueError(f"splash_attention {reason}")
    scale = head_dim**-0.5 if scale is None else scale
    lowering = _splash_lowering(mask)
    static_mask, extras = None, ()
    if lowering == "dense":  # per-example boolean [N, T, S] masks through the dynamic path
        extras = (jnp.broadcast_to(as_dense(mask, q_len, kv_len),
                                   (batch, num_heads, q_len, kv_len)),)
    else:
        static = [p for p in _parts(mask) if p.is_static]
        dynamic = [p for p in _parts(mask) if not p.is_static]
        static_mask = None if not static else static[0] if len(static) == 1 else And(
            tuple(static))
        if dynamic:
            extras = _segment_ids(dynamic, batch, q_len, kv_len)
    local = functools.partial(_splash_local, lowering=lowering, static_mask=static_mask,
                              scale=scale, block_size=block_size, interpret=interpret,
                              softcap=softcap, has_sinks=sinks is not None)
    extras = ((sinks,) if sinks is not None else ()) + extras
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        out_BTNH = local(query, key, value, *extras)
    else:
        b, h, kv_h = _splash_partition(mesh, batch, num_heads, num_kv_heads)
        qkv_specs = (P(b, None, h, None), P(b, None, kv_h, None), P(b, None, kv_h, None))
        extra_specs = ((P(h),) if sinks is not None else ()) + (
            (P(b, h, None, None),) if lowering == "dense" else (P(b, None),) * (
                len(extras) - (sinks is not None)))
        out_BTNH = jax.shard_map(local, in_specs=qkv_specs + extra_specs,
                                 out_specs=qkv_specs[0], check_vma=False)(query, key, value,
                                                                          *extras)
    return zero_empty_rows(out_BTNH.astype(query.dtype), rows_with_keys(mask, q_len, kv_len))


def _splash_partition(mesh, batch: int, num_heads: int, num_kv_heads: int):
    """Mesh axes of the batch, query-head and KV-head dims of splash's shard_map (None: whole).

    Query heads split only together with their KV heads (or with one shared MQA head), so every
    device keeps whole GQA groups.
    """
    rules = nn.get_logical_axis_rules() or sharding.LOGICAL_AXIS_RULES
    b = sharding.mesh_spec(P("activation_batch"), (batch,), mesh, rules)[0]
    h = sharding.mesh_spec(P("activation_heads"), (num_heads,), mesh, rules)[0]
    if num_kv_heads == 1:
        return b, h, None
    if sharding.mesh_spec(P("activation_heads"), (num_kv_heads,), mesh, rules)[0] is None:
        h = None
    return b, h, h


def splash_kernel(splash_mask, *, num_heads: int, mqa: bool, q_len: int, kv_len: int,
                  block_size: int, interpret: bool, softcap: float, q_seq_shards: int = 1):
    """Splash's kernel for `splash_mask` (a 2-D splash mask shared by all heads, or a boolean
    jax array [N, T, S]) over q_len queries per device (times `q_seq_shards`: the kernel's mask
    information then covers every device's queries, split by `q_seq_shards` along its query
    blocks) and kv_len keys."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    bq, bkv = _block(q_len, block_size), _block(kv_len, block_size)
    blocks = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                           block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                           block_kv_dq=bkv)
    make = sk.make_splash_mqa if mqa else sk.make_splash_mha
    dynamic = isinstance(splash_mask, jax.Array)
    if not dynamic:
        splash_mask = sm.MultiHeadMask([splash_mask] * num_heads)
    # The query is scaled before the kernel, so its cap applies to the scaled logits.
    kernel = make(splash_mask, block_sizes=blocks, head_shards=1, q_seq_shards=q_seq_shards,
                  interpret=interpret, attn_logits_soft_cap=softcap or None)
    if dynamic:
        # The installed splash turns the MaskInfo flag `is_dynamic_mask` into a jnp array,
        # which is a tracer under jit, and then branches on it in `__call__`
        # (TracerBoolConversionError). Restore the Python bool it stands for.
        for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
            info = getattr(kernel, name)
            if info is not None:
                setattr(kernel, name, info._replace(is_dynamic_mask=True))
    return kernel


def splash_run(kernel, query, key, value, segment_ids=(), *, scale: float,
               sinks: Array | None = None) -> Array:
    """`kernel` (from `splash_kernel`) on query [B, T, N, H], key / value [B, S, K, H] (K == 1:
    an MQA kernel), optional int32 segment ids (q [B, T], kv [B, S]) and optional sink logits
    [N]; out [B, T, N, H]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    q_BNTH = (query * jnp.asarray(scale, query.dtype)).transpose(0, 2, 1, 3)
    k_BKSH, v_BKSH = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
    if kernel.kwargs["is_mqa"]:
        k_BKSH, v_BKSH = k_BKSH[:, 0], v_BKSH[:, 0]
    extra = {} if sinks is None else {"sinks": sinks}  # not batched: one per head
    if not segment_ids:
        out_BNTH = jax.vmap(lambda q, k, v: kernel(q, k, v, **extra))(q_BNTH, k_BKSH, v_BKSH)
    else:
        out_BNTH = jax.vmap(lambda q, k, v, qs, ks: kernel(
            q, k, v, segment_ids=sk.SegmentIds(q=qs, kv=ks), **extra))(q_BNTH, k_BKSH, v_BKSH,
                                                                       *segment_ids)
    return out_BNTH.transpose(0, 2, 1, 3)


def _splash_local(query, key, value, *extras, lowering, static_mask, scale, block_size,
                  interpret, softcap, has_sinks=False):
    """The splash kernel on one device's [B, T, N, H] / [B, S, K, H] shards (and its sinks
    [N], first of `extras` when `has_sinks`, then the mask inputs)."""
    sinks, extras = (extras[0], extras[1:]) if has_sinks else (None, extras)
    _, q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    make = functools.partial(splash_kernel, num_heads=num_heads, mqa=num_kv_heads == 1,
                             q_len=q_len, kv_len=kv_len, block_size=block_size,
                             interpret=interpret, softcap=softcap)
    if lowering == "dense":  # one kernel per example's [N, T, S] mask
        return jax.vmap(lambda q, k, v, m: splash_run(make(m), q[None], k[None], v[None],
                                                      scale=scale, sinks=sinks)[0])(
            query, key, value, *extras)
    kernel = make(_splash_mask(static_mask, q_len, kv_len))
    return splash_run(kernel, query, key, value, extras, scale=scale, sinks=sinks)


__all__ = ["FEATURES", "IMPLS", "KERNELS", "Call", "Kernel", "recording", "refusal",
           "rows_with_keys", "select", "splash_attention", "split_moe", "supports",
           "target_platform", "zero_empty_rows"]
