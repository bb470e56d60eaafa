"""LoRA and QLoRA: low-rank adapters on a frozen base (`model.lora`).

A targeted projection y = x W becomes y = x W + (alpha / rank) dropout(x) A B, with A
[*in, rank] (fan-in uniform, as peft's) and B [rank, *out] (zeros: step 0 is the base model).
A and B are params `NAME_lora_a` / `NAME_lora_b` beside the kernel `NAME`, and take its logical
axes (A: its input axes and "lora", B: "lora" and its output axes), so they shard as it does.
`model.lora.targets` is a regex over the kernel's "/"-joined param path (default: softmax
attention's query/key/value/out, multi-head latent attention's q_a/q_b/kv_a (or query)/out, the
MLP's wi/wi_gate/wi_up/wo).

Only the adapters train: the optimizer has no state for the rest (`training.optim`), and the
train step differentiates only the adapters (`step.trained_value_and_grad`). A run's
checkpoints hold the adapters and name their base (init_from and `fingerprint`), read again on
resume (`transformer.training.checkpoint`). QLoRA (`model.lora.base_quantization="int8"`)
stores the frozen targeted kernels quantized by Qwix (`qwix.quantize`: int8 values, a float
scale per output channel), kept as plain {"qvalue", "scale"} params, and dequantizes them on
the fly (`qwix.dequantize`, in `project`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from transformer.utils import fileio, keys

# Softmax attention's projections, MLA's included (q_a, q_b, kv_a; its k_b / v_b take no
# adapters), not a linear_attention layer's (it takes none)
DEFAULT_TARGETS = (r"(self|cross)_attention/(query|key|value|out|q_a|q_b|kv_a)$"
                   r"|mlp/(wi|wi_gate|wi_up|wo)$")
ADAPTER = re.compile(r"_lora_[ab]$")  # an adapter param's name
BASE_QUANTIZATIONS = ("", "int8")  # (int4 params fail optax's p + 0 update: no promotion)
AXIS = "lora"  # the rank axis's logical name (replicated: sharding.LOGICAL_AXIS_RULES)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA / QLoRA settings of a model (`model.lora.*`); `rank=0`: no adapters."""

    rank: int = keys.key(
        0, "LoRA adapters' rank on the kernels `model.lora.targets` matches; 0: no adapters "
        "(the whole model trains). Needs `init_from`.",
        keys.int_(ge=0, note="0: no adapters, the whole model trains"))
    alpha: float = keys.key(
        16.0, "The adapters' output is scaled by alpha / rank (peft's lora_alpha).",
        keys.number(gt=0))
    targets: str = keys.key(
        DEFAULT_TARGETS, "Regex over the kernels' param paths (`decoder/layers_0/mlp/wi`) that "
        "get adapters; default attention's q/k/v/out (MLA's q_a/q_b/kv_a/out) and the MLP's.",
        (lambda v: isinstance(v, str) and bool(v) and keys.is_regex(v),
         "a regular expression of kernel param names"))
    dropout: float = keys.key(0.0, "Dropout on the adapters' input during training.",
                              keys.number(ge=0, lt=1), structural=False, export_neutral=True)
    base_quantization: str = keys.key(
        "", "QLoRA: the frozen targeted kernels stored as Qwix int8 (a scale per output "
        "channel), dequantized on the fly; \"\": float.", keys.one_of(BASE_QUANTIZATIONS))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# How to import a peft adapter (adapter_config.json) of an `init_from=hf:DIR`
MERGE = ("merge the adapters into their base with PeftModel.from_pretrained(base, DIR)"
         ".merge_and_unload().save_pretrained(OUT), then init_from=hf:OUT")
# What a peft adapter folder (adapter_config.json, no config.json) adds to its error: the base
# model it adapts is not in it.
PEFT_FOLDER = f" (this is a peft adapter folder: {MERGE})"


def check_not_peft(directory: str, source: str | None = None) -> None:
    """One line if the Hugging Face `directory` (init_from=hf:DIR) holds a peft adapter
    (adapter_config.json) beside its model: transformers' from_pretrained(DIR) applies it over
    the weights, which `transformer.hf.convert` reads alone (another model, silently).
    `source`: what the line names (default `init_from='hf:DIR'`)."""
    if fileio.path(directory).joinpath("adapter_config.json").is_file():
        source = source or f"init_from='hf:{directory}'"
        raise ValueError(f"{source} holds a peft adapter (adapter_config.json),"
                         " which transformers applies over its model and this import would "
                         f"leave out: expected a directory without one ({MERGE})")


def validate(config) -> None:
    """One-line errors for `config.model.lora`: LoRA adapts a pretrained base (init_from), which
    its checkpoints name and which stays frozen (MoE balance biases included, and Muon's
    hidden matrices); QLoRA is LoRA's; without a rank (the whole model trains) the adapters'
    other settings would be ignored."""
    group = config.model.get("lora") or {}
    if group.get("rank") and not config.get("init_from"):
        raise ValueError(f"model.lora.rank={group.rank}: expected init_from (a pretrained "
                         "workdir or hf:DIR) for the adapters' frozen base")
    if group.get("base_quantization") and not group.get("rank"):
        raise ValueError(f"model.lora.base_quantization={group.base_quantization!r}: expected "
                         "model.lora.rank > 0 (QLoRA quantizes LoRA's frozen base)")
    for name in ("targets", "alpha", "dropout"):
        default = getattr(LoraConfig(), name)
        if not group.get("rank") and group.get(name, default) != default:
            raise ValueError(f"model.lora.{name}={group[name]!r} with model.lora.rank=0 (no "
                             "adapters: the whole model trains): expected model.lora.rank > 0, "
                             f"or model.lora.{name} left at {default!r}")
    # (optim.muon is the one optimizer whose rule takes only the hidden matrices, by their axes)
    if group.get("rank") and config.optimizer.get("name") == "muon":
        raise ValueError(f"optimizer.name='muon' with model.lora.rank={group.rank}: Muon "
                         "orthogonalizes the hidden weight matrices, which LoRA freezes (the "
                         "adapters would train with AdamW, optimizer.muon_learning_rate unused):"
                         " expected optimizer.name='adamw' (or another) for a LoRA fine-tune")
    rate = (config.model.get("moe") or {}).get("bias_update_rate")
    if group.get("rank") and rate:  # the step would move the frozen base's balance biases
        raise ValueError(f"model.moe.bias_update_rate={rate!r} with model.lora.rank="
                         f"{group.rank}: expected 0 (--config.model.moe.bias_update_rate=0; "
                         "an adapter run keeps its base's MoE balance biases frozen), or "
                         "model.lora.rank=0 to fine-tune the whole model with them moving")


def check_targets(params, lora: LoraConfig) -> None:
    """One line if `lora.targets` matches a param that got no adapter (a token mixer or a
    norm without LoRA: nothing would train there, silently). `params`: a model's, unboxed.

    >>> check_targets({"mlp": {"wi": 0, "wi_lora_a": 0, "wi_lora_b": 0}, "norm": {"scale": 0}},
    ...               LoraConfig(rank=2, targets="wi$|scale$"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: model.lora.targets='wi$|scale$' matches norm/scale, which takes no adapter ...
    """
    leaves = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
              for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    paths = set(leaves)
    bare = sorted(p for p in paths if not ADAPTER.search(p) and re.search(lora.targets, p)
                  and f"{p}_lora_a" not in paths)
    if bare:
        more = f" (and {len(bare) - 1} more)" if len(bare) > 1 else ""
        raise ValueError(f"model.lora.targets={lora.targets!r} matches {bare[0]}{more}, which "
                         "takes no adapter (LoRA adapts softmax attention's and the MLP's "
                         "projections): expected a regex that leaves it out")
    adapted = sorted(p[:-len("_lora_a")] for p in paths if p.endswith("_lora_a"))
    if not adapted:
        raise ValueError(f"model.lora.targets={lora.targets!r} matches no kernel, so nothing "
                         "would train: expected a regex over kernel paths such as "
                         "decoder/layers_0/mlp/wi")
    # a kernel's full rank: the smaller of its input and output sizes (A [in..., r], B [r, out...])
    full = {p: min(math.prod(leaves[f"{p}_lora_a"].shape[:-1]),
                   math.prod(leaves[f"{p}_lora_b"].shape[1:])) for p in adapted}
    smallest = min(full, key=full.get)
    if lora.rank > full[smallest]:
        raise ValueError(f"model.lora.rank={lora.rank}: expected <= {full[smallest]}, the full "
                         f"rank of {smallest} (a larger rank adds parameters, not capacity)")


def enabled(config) -> bool:
    """Whether a run config (or its model group) trains adapters."""
    lora = getattr(config, "model", config).get("lora")
    return bool(lora and lora.get("rank"))


def is_adapter(name: str) -> bool:
    return bool(ADAPTER.search(name))


def is_quantized(x) -> bool:
    """Whether a param is a QLoRA kernel: {"qvalue": ints, "scale": floats}."""
    return isinstance(x, dict) and set(x) == {"qvalue", "scale"}


def _dequantized(kernel):
    if not is_quantized(kernel):
        return kernel
    import qwix  # here: about 1 s to import (flax.nnx, IPython), for QLoRA runs only

    qtype = jnp.dtype(kernel["qvalue"].dtype).name
    return qwix.dequantize(qwix.QArray(kernel["qvalue"], kernel["scale"], None, qtype))


def _quantized(value, qtype: str, channelwise) -> dict:
    import qwix

    q = qwix.quantize(value, qtype, channelwise_axes=channelwise)
    return {"qvalue": q.qvalue, "scale": q.scale}


# The model path of a unit applied on its own (a pipeline stage's blocks, `parent=None`, whose
# scope paths start at the unit): `project` matches targets against the model's param paths.
_APPLIED_AT: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("lora_applied_at",
                                                                              default=())


@contextlib.contextmanager
def applied_at(path: tuple[str, ...]):
    """Within it, the modules applied on their own sit at `path` in the model (their params'
    place there): a `targets` regex naming the stack (`decoder/layers/`) matches them as it
    matches the stack's own."""
    token = _APPLIED_AT.set(tuple(path))
    try:
        yield
    finally:
        _APPLIED_AT.reset(token)


def project(module: nn.Module, name: str, x, kernel, names: tuple, contract: int,
            lora: LoraConfig, dtype, param_dtype, deterministic: bool, matmul):
    """x times the kernel param `name` (contracting its first `contract` dims; `names` its
    logical axes), plus `name`'s adapter if `lora` targets it: the one place a projection
    (attention's q/k/v/out, the MLP's kernels) meets LoRA. A QLoRA base kernel
    (`is_quantized`) is dequantized first. `matmul`: transformer.nn.attention's."""
    kernel = _dequantized(kernel)
    y = matmul(x, kernel, contract, dtype=dtype)
    path = "/".join((*_APPLIED_AT.get(), *module.scope.path, name))
    if not lora.rank or not re.search(lora.targets, path):
        return y
    in_shape, out_shape = kernel.shape[:contract], kernel.shape[contract:]
    # peft's kaiming_uniform(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform",
                                              in_axis=tuple(range(contract)), out_axis=-1)
    a = module.param(f"{name}_lora_a", nn.with_logical_partitioning(
        a_init, (*names[:contract], AXIS)), (*in_shape, lora.rank), param_dtype)
    b = module.param(f"{name}_lora_b", nn.with_logical_partitioning(
        nn.initializers.zeros, (AXIS, *names[contract:])), (lora.rank, *out_shape), param_dtype)
    if lora.dropout:
        x = nn.Dropout(lora.dropout)(x, deterministic=deterministic)
    low = matmul(x, a, contract, dtype=dtype)
    return y + lora.scale * matmul(low, b, 1, dtype=dtype)


def trainable(params) -> tuple[dict, dict]:
    """(adapters, the rest) of a params tree, each a flat {path tuple: leaf} dict."""
    flat = traverse_util.flatten_dict(dict(params))
    adapters = {k: v for k, v in flat.items() if is_adapter(k[-1])}
    return adapters, {k: v for k, v in flat.items() if k not in adapters}


def adapters_only(params):
    """The params tree of the adapters alone (what a LoRA checkpoint holds)."""
    return traverse_util.unflatten_dict(trainable(params)[0])


def merge(adapters: dict, rest: dict):
    """The params tree of `trainable`'s two halves."""
    return traverse_util.unflatten_dict({**rest, **adapters})


def zero_grads(tree):
    """Zero gradients shaped as `tree`'s leaves (float32 for QLoRA's int8 values)."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype if jnp.issubdtype(
        p.dtype, jnp.floating) else jnp.float32), tree)


def frozen_regex(freeze: str) -> str:
    """optimizer.freeze extended to every param that is not an adapter."""
    base = r"^(?!.*_lora_[ab](/|$))"  # ("/": a boxed param's path goes on to its value)
    return f"(?:{freeze})|{base}" if freeze else base


def quantize_base(boxed, lora: LoraConfig):
    """QLoRA: the boxed params tree (`nn.Partitioned` leaves, as the model's init returns
    them) with each targeted kernel replaced by its Qwix quantization (a scale per output
    channel; a layer stack's axis is per-layer), {"qvalue", "scale"}, both with the kernel's
    logical axes."""
    if not lora.base_quantization:
        return boxed
    flat = traverse_util.flatten_dict(dict(boxed), is_leaf=_is_box)
    out = {}
    for key, box in flat.items():
        a, b = (flat.get(key[:-1] + (f"{key[-1]}_lora_{x}",)) for x in "ab")
        if a is None:  # not an adapted kernel
            out[key] = box
            continue
        reduced = _input_axes(a.names, b.names)
        q = _quantized(box.value, lora.base_quantization,
                       [i for i in range(len(box.names)) if i not in reduced])
        out[key] = {k: box.replace_boxed(v) for k, v in q.items()}
    return traverse_util.unflatten_dict(out)


def quantize_like(value, like, sharding):
    """`value` (a float kernel) quantized as the QLoRA kernel `like` is (its int type, its
    scales' axes), laid out by `sharding` (the kernel's {"qvalue", "scale"} shardings)."""
    qvalue, scale = like["qvalue"], like["scale"]
    channelwise = [i for i, (q, s) in enumerate(zip(qvalue.shape, scale.shape, strict=True))
                   if q == s]
    qtype = jnp.dtype(qvalue.dtype).name
    fn = lambda v: _quantized(jnp.asarray(v, scale.dtype), qtype, channelwise)
    return jax.jit(fn, out_shardings=sharding)(value)


def _is_box(*args) -> bool:
    x = args[-1]  # (x) or flatten_dict's (path, x)
    return isinstance(x, nn.Partitioned)


def _input_axes(a_names: tuple, b_names: tuple) -> list[int]:
    """The dims a kernel contracts, read off its adapters' logical axes as `project` lays
    them out: A (*stack, *input, "lora") and B (*stack, "lora", *output), a layer stack's
    axes leading all three. So the input dims run from B's rank axis to A's.

    >>> _input_axes(("layers", "latent", "lora"), ("layers", "lora", "heads", "kv"))
    [1]
    """
    return list(range(b_names.index(AXIS), a_names.index(AXIS)))


def fingerprint(params) -> str:
    """A short hash of the base (non-adapter) params: their names, shapes, dtypes and values
    (read on the host; QLoRA's quantized kernels by their int values and scales)."""
    digest = hashlib.sha256()
    _, rest = trainable(params)
    for key in sorted(rest):
        for leaf in jax.tree.leaves(rest[key]):
            value = np.asarray(jax.device_get(leaf))
            digest.update(f"{'/'.join(key)}:{value.shape}:{value.dtype};".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()[:16]


def counts(params, freeze: str = "") -> tuple[int, int]:
    """(total params, trainable adapter params: those the regex `freeze`, optimizer.freeze,
    leaves out) of a params tree (arrays or abstract); a QLoRA kernel counts its values (not
    its scales)."""
    flat = traverse_util.flatten_dict(dict(params), is_leaf=lambda _, x: is_quantized(x))
    return sum(map(stored_size, flat.values())), sum(
        stored_size(v) for k, v in flat.items()
        if is_adapter(k[-1]) and not (freeze and re.search(freeze, "/".join(k))))


def stored_size(param) -> int:
    """A param's count: a QLoRA kernel's values (not its scales), else its size."""
    return int(np.prod((param["qvalue"] if is_quantized(param) else param).shape))


def merged_params(params, lora: LoraConfig):
    """The params with every adapter folded into its kernel, W + (alpha / rank) A B (QLoRA
    kernels dequantized), and the adapters removed: a plain model's params (export)."""
    flat = traverse_util.flatten_dict(dict(params), is_leaf=lambda _, x: is_quantized(x))
    out = {}
    for key, value in flat.items():
        if is_adapter(key[-1]):
            continue
        kernel = _dequantized(value)
        a = flat.get(key[:-1] + (f"{key[-1]}_lora_a",))
        if a is not None:
            b = flat[key[:-1] + (f"{key[-1]}_lora_b",)]
            kernel = kernel + lora.scale * _delta(a, b, kernel.shape).astype(kernel.dtype)
        out[key] = kernel
    return traverse_util.unflatten_dict(out)


def _delta(a, b, shape):
    """A B as the kernel's shape; a layer stack (a leading axis on both) stays batched."""
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if a.ndim + b.ndim - 2 > len(shape):
        return jax.vmap(lambda x, y: _delta(x, y, shape[1:]))(a32, b32)
    return jnp.tensordot(a32, b32, axes=1).reshape(shape)


def device_bytes(tree) -> int:
    """The bytes of `tree`'s arrays on one device (the first's shards), measured."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and leaf.ndim:
            device = leaf.addressable_shards[0].device
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
        elif hasattr(leaf, "nbytes"):
            total += leaf.nbytes
    return total


def summary(config, state) -> str:
    """The line a LoRA run starts with: its params, total and trainable, and the bytes of its
    optimizer state and params on one device, measured from the arrays."""
    from transformer.parallel.sharding import format_bytes

    total, adapters = counts(state.params, config.optimizer.get("freeze", ""))
    group = config.model.lora
    base = f", base {group.base_quantization}" if group.base_quantization else ""
    return (f"lora: rank {group.rank}{base}, {total:,} params, {adapters:,} trainable "
            f"({100 * adapters / total:.2f}%); per device: optimizer state "
            f"{format_bytes(device_bytes(state.opt_state))}, params "
            f"{format_bytes(device_bytes(state.params))}")
