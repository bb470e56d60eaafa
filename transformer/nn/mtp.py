"""Multi-token prediction (DeepSeek-V3, sec. 2.2): D sequential modules after a decoder LM's
stack, module k predicting the token k + 1 places ahead of each position.

Module k (from 1) at position i reads the hidden state h^{k-1}_i (the stack's output after its
final norm for k = 1, module k - 1's block output after) and the embedding of token t_{i+k}:

    h'_i = W [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]        W: [2 D, D]
    h^k_i = Block(h'_i)                                          one block of the stack's kind
    logits^k_i = Head(Norm(h^k_i))                               the LM's own output head

and is trained to predict t_{i+k+1}; the loss is loss_weight / D times the sum of the D
cross-entropies (`mtp_loss`). The concatenation order (embedding first) and the inputs are
those of DeepSeek-V3's released MTP weights (`model.layers.61.{enorm, hnorm, eh_proj}`).
At inference the modules draft tokens for speculative decoding
(`transformer.generation.speculative`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn import objectives
from transformer.nn.attention import matmul, projection_init
from transformer.utils.keys import check_fields, int_, key, number

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (`model.mtp.*`); depth 0: none."""

    depth: int = key(0, "Modules after the stack, module k predicting the token k + 1 ahead "
                     "(DeepSeek-V3: 1); 0: next-token prediction only.",
                     int_(ge=0, note="0: none"))
    loss_weight: float = key(0.3, "The modules' mean cross-entropy times this joins the loss "
                             "(DeepSeek-V3: 0.3, then 0.1).", number(ge=0), structural=False,
                             export_neutral=True)

    # what its keys act only with (`utils.keys.Key.needs`), given the stack's config
    NEEDS = (lambda cfg: cfg.mtp.depth > 0, "model.mtp.depth > 0")

    def __post_init__(self):
        check_fields(self, prefix="mtp.")


def future_tokens(targets_BT: Array, weights_BT: Array, k: int) -> tuple[Array, Array, Array]:
    """Module k's (inputs, targets, weights) from the next-token targets (position i's target is
    t_{i+1}): inputs t_{i+k} = targets shifted left by k - 1, targets t_{i+k+1} shifted by k,
    weights shifted by k and 0 where the shift runs off the end. Module 1 on a row of 4:

    >>> inputs, targets, weights = future_tokens(jnp.array([[6, 7, 8, 9]]),
    ...                                          jnp.array([[1.0, 1.0, 1.0, 0.0]]), 1)
    >>> inputs.tolist(), targets.tolist(), weights.tolist()
    ([[6, 7, 8, 9]], [[7, 8, 9, 0]], [[1.0, 1.0, 0.0, 0.0]])
    """
    return (shift_left(targets_BT, k - 1), shift_left(targets_BT, k),
            shift_left(weights_BT, k))


def shift_left(x_BT: Array, n: int) -> Array:
    """x[:, t + n] at t, zeros past the end (whatever n against T)."""
    return jnp.pad(x_BT, ((0, 0), (0, n)))[:, n:]


def same_document(segment_ids_BT: Array | None, k: int, weights_BT: Array) -> Array:
    """`weights_BT` (module k's, `future_tokens`) kept where position i + k is in position i's
    document: a packed row's module never predicts across a document boundary."""
    if segment_ids_BT is None:
        return weights_BT
    return weights_BT * (shift_left(segment_ids_BT, k) == segment_ids_BT)


def module_targets(batch, k: int) -> tuple[Array, Array]:
    """Module k's (targets, weights) [B, T] on a batch of next-token targets and weights (and
    segment_ids when packed): `future_tokens`' kept inside each document (`same_document`)."""
    _, targets_BT, weights_BT = future_tokens(batch["targets"], batch["weights"], k)
    return targets_BT, same_document(batch.get("segment_ids"), k, weights_BT)


def token_counts(batch, depth: int) -> Array:
    """[D]: module k's count of targets (the sum of its weights) in a batch, k = 1 .. D."""
    return jnp.stack([jnp.sum(module_targets(batch, k)[1], dtype=jnp.float32)
                      for k in range(1, depth + 1)])


def mtp_loss(logits_DBTV: Array, batch, loss_weight: float, *, label_smoothing: float = 0.0,
             denominators: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """(loss_weight x the mean over the D modules of their cross-entropies, metrics
    {"mtp_loss/<k>": module k's cross-entropy}) for the modules' logits [D, B, T, V] on a batch
    of next-token targets and weights (and segment_ids when packed). Module k's cross-entropy
    is the mean over its targets, or with `denominators` [D] their sum over denominators[k - 1]
    (0 where that is 0: gradient accumulation's, `Family.loss_and_metrics`)."""
    losses, metrics = [], {}
    for k in range(1, logits_DBTV.shape[0] + 1):
        targets_BT, weights_BT = module_targets(batch, k)
        loss, m = objectives.cross_entropy(logits_DBTV[k - 1], targets_BT, weights_BT,
                                           label_smoothing=label_smoothing)
        ce = m["loss"]
        if denominators is not None:
            # cross_entropy's mean is sum / max(count, 1); a 0 denominator has no targets
            # (sum 0), and a where on the divisor keeps 0 / 0 out of the value and gradient.
            denominator = denominators[k - 1]
            scale = (jnp.maximum(m["num_tokens"], 1.0)
                     / jnp.where(denominator > 0, denominator, 1.0))
            loss, ce = loss * scale, ce * scale
        losses.append(loss)
        metrics[f"mtp_loss/{k}"] = ce
    return loss_weight * jnp.mean(jnp.stack(losses)), metrics


class MTPModule(nn.Module):
    """One multi-token prediction module (params embedding_norm, hidden_norm, projection,
    layers_0, final_norm): (h^{k-1} [B, T, D], Emb(t_{i+k}) [B, T, D]) -> (h^k, Norm(h^k)).
    `block(name)` builds the block (a `TransformerBlock` of the stack's last layer's kind,
    applied to (x, *block_args)); it is named as an unrolled stack's layer, so the MoE
    bookkeeping reads it as `mtp_<k - 1>`'s layer 0 (module k's params are `mtp_<k - 1>`,
    counted from 0 as the stack's layers are; its loss is `mtp_loss/<k>`). `norm` is
    `layers.norm_layer` (passed in: the layers import this module's config).
    """

    config: Any  # TransformerConfig
    norm: Callable[[Any, str], nn.Module]

    @nn.compact
    def __call__(self, hidden_BTD, embedded_BTD, block: Callable[[str], nn.Module], block_args):
        cfg = self.config
        rms = dataclasses.replace(cfg, norm="rmsnorm")
        joined = jnp.concatenate([self.norm(rms, "embedding_norm")(embedded_BTD),
                                  self.norm(rms, "hidden_norm")(hidden_BTD)], axis=-1)
        # a hidden matrix: init as theirs (muP's 1 / sqrt(m) included), in muP's group
        # (optim.HIDDEN_AXES knows `projection`)
        kernel = self.param("projection", nn.with_logical_partitioning(
            projection_init(cfg.init_std, 0, 1, cfg.init_scale()), ("projection", "embed")),
            (2 * cfg.d_model, cfg.d_model), cfg.param_dtype)
        # through projection_dot, so model.quantize_head quantizes it as the head
        x_BTD = matmul(joined, kernel, dtype=cfg.dtype)
        x_BTD = block("layers_0")(x_BTD, *block_args)
        return x_BTD, self.norm(cfg, "final_norm")(x_BTD)
