"""What the training, evaluation, generation and launch code needs to know about a model family.

Each family module (gpt.py, bert.py, t5.py, lstm.py, vision.py) declares its `Family` next to
its model, and `transformer.models.FAMILIES` is the one table of them. Nothing outside the
family modules branches on `model.family`: adding a family is its module plus a table entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import ml_collections

from transformer.nn import mtp as mtp_lib
from transformer.nn import objectives
from transformer.nn.blocks import expert_loads, moe_aux
from transformer.nn.config import TransformerConfig

# The model keys the training reads whatever the family (`Family.reads` need not name them).
ALWAYS_READ = ("family", "vocab_size", "lora", "quantization", "quantize_head")
_STACK_FIELDS = tuple(f.name for f in dataclasses.fields(TransformerConfig))


def transformer_config(model_config: ml_collections.ConfigDict, **overrides) -> TransformerConfig:
    """The stack architecture from a model config group (validated by TransformerConfig)."""
    values = {k: model_config[k] for k in _STACK_FIELDS if k in model_config}
    return TransformerConfig(**{**values, **overrides})


def token_loss(logits, batch, *, z_loss: float = 0.0, label_smoothing: float = 0.0,
               rows: bool = False):
    """Cross-entropy of the logits against the batch's targets, weighted by its weights (with
    `rows`, also each row's sums: `objectives.cross_entropy`)."""
    return objectives.cross_entropy(logits, batch["targets"], batch["weights"], z_loss=z_loss,
                                    label_smoothing=label_smoothing, rows=rows)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: how to build it, feed it a batch, train it, evaluate and decode it.

    name: the `model.family` value.
    build: model config group -> the Linen module.
    inputs: batch features passed positionally to `model.apply` (and to `model.init`).
    features: batch features passed by keyword.
    optional_features: batch features passed by keyword when the batch has them.
    objectives: the `data.objective`s it trains on; the first is its pretraining objective.
    loss: (logits, batch, z_loss=, label_smoothing=) -> (loss, metrics with num_tokens);
      token_loss also takes rows=True (per-row sums, for per-window evaluation).
    decoding: how it generates text: "causal" (KV cache), "prefix" (bidirectional prompt, KV
      cache), "encoder_decoder" (encode the prompt, decode with a KV cache), "recompute"
      (re-run the whole sequence per token), or None (no generation).
    attention: whether its layers attend (FLOPs accounting counts the attention scores).
    attention_maps: whether `transformer.visualize` can draw its attention weights.
    classifier: model config group -> whether the model ends in a class head (its
      `num_classes` then comes from the labeled task when 0).
    cls_token: whether it reads a text to classify as [CLS] text [SEP] (its head pools [CLS])
      rather than as <eos> text (its head reads the last token).
    stacks: the config keys that give its layer stacks' depths.
    rows_interact: whether its loss compares a batch's rows with each other (CLIP's other
      pairs are each pair's negatives): gradient accumulation, whose micro-batches would
      each compare fewer rows, is refused (`configs.validate_config`).
    reads: the model keys its module reads, for a family that reads fewer than a transformer
      (None: all of them; refused without attention); the run warns of any other key set off
      its default (`training.startup.unintended_settings`), which would change nothing.
      `ALWAYS_READ` (the family, LoRA, quantization) need not be named: the training reads
      them, and refuses them where they cannot act.
    """

    name: str
    build: Callable[[ml_collections.ConfigDict], nn.Module]
    inputs: tuple[str, ...]
    objectives: tuple[str, ...]
    features: tuple[str, ...] = ()
    optional_features: tuple[str, ...] = ()
    loss: Callable = token_loss
    decoding: str | None = None
    attention: bool = True
    attention_maps: bool = False
    classifier: Callable[[ml_collections.ConfigDict], bool] = lambda model_config: False
    cls_token: bool = False
    stacks: tuple[str, ...] = ("num_layers",)
    reads: tuple[str, ...] | None = None
    rows_interact: bool = False

    def __post_init__(self):
        # reads=None means "every transformer key": a model without attention never reads them
        # all, and the ones it skips would change nothing, with no warning.
        if not self.attention and self.reads is None:
            raise ValueError(f"Family {self.name!r}: attention=False with reads=None: expected "
                             "reads=(the model keys its module reads)")

    def reads_key(self, key: str) -> bool:
        """Whether the training reads model key `key` under this family (`reads` or
        `ALWAYS_READ`; a dotted key, "moe.top_k", by its group)."""
        return self.reads is None or key.split(".")[0] in self.reads + ALWAYS_READ

    @property
    def objective(self) -> str:
        return self.objectives[0]

    @property
    def continues_text(self) -> bool:
        """Whether it continues a prompt (a language model that can print samples)."""
        return self.decoding in ("causal", "prefix", "recompute")

    def init_args(self, batch) -> list:
        return [batch[name] for name in self.inputs]

    def logits(self, model: nn.Module, params, batch, *, rngs=None, deterministic=True,
               with_aux: bool = False, mtp: bool = False):
        """The model's logits for a batch of pipeline features (transformer.data.features);
        with `with_aux`, (logits, its MoE layers' auxiliary quantities, `blocks.moe_aux`), and
        with `mtp` also the multi-token prediction modules' logits [D, B, T, V] as
        "mtp_logits" (a decoder LM with model.mtp.depth > 0, fed the batch's targets)."""
        features = {name: batch[name] for name in self.features}
        features.update({name: batch[name] for name in self.optional_features if name in batch})
        if mtp:
            features["mtp_tokens"] = batch["targets"]
        out = model.apply({"params": params}, *self.init_args(batch), **features,
                          rngs=rngs or {}, deterministic=deterministic,
                          mutable=["losses", "mtp"] if with_aux else False)
        if not with_aux:
            return out
        losses = out[1].get("losses", {})
        loads = expert_loads(losses)
        aux = {**moe_aux(losses), **({"expert_load": loads} if loads else {})}
        if mtp:
            aux["mtp_logits"] = out[1]["mtp"]["logits"][0]
        return out[0], aux

    @property
    def per_row(self) -> bool:
        """Whether its loss is a sum over rows (token_loss), so each row has its own."""
        return self.loss is token_loss

    def loss_and_metrics(self, model, config, params, batch, rng=None, deterministic=True,
                         rows: bool = False, loads: bool = False, mtp: bool = False,
                         mtp_ratio=None):
        """(loss, metrics) of a batch under the run's z_loss and label smoothing; `rng` seeds
        dropout. MoE models add their routers' weighted load-balance and z losses to the loss
        (metrics["loss"] stays the task's) and report them as `moe_*` metrics; with `loads`,
        also each layer's expert loads as metrics["moe_expert_load"] (`blocks.expert_loads`,
        for the train step). `rows` (only where `per_row`): metrics also hold each row's
        sums (`objectives.cross_entropy`). With `mtp` (the train step's) and model.mtp.depth
        > 0, the multi-token prediction loss joins the loss (`mtp.mtp_loss`; metrics
        "mtp_loss/<k>"); without it the modules do not run (evaluation: next-token loss).
        `mtp_ratio` [D] (the train step's under gradient accumulation): module k's target
        count over num_tokens in the whole batch; module k's loss is then its summed
        cross-entropy over mtp_ratio[k] x this batch's num_tokens, so that the step's
        num_tokens-weighted mean over micro-batches is the whole batch's mean."""
        mtp = mtp and bool(config.model.get("mtp", {}).get("depth"))
        logits, aux = self.logits(model, params, batch, deterministic=deterministic,
                                  rngs=None if rng is None else {"dropout": rng}, with_aux=True,
                                  mtp=mtp)
        smoothing = config.get("label_smoothing", 0.0)
        loss, metrics = self.loss(logits, batch, z_loss=config.get("z_loss", 0.0),
                                  label_smoothing=smoothing, **({"rows": True} if rows else {}))
        if mtp:
            ahead, ahead_metrics = mtp_lib.mtp_loss(
                aux.pop("mtp_logits"), batch, config.model.mtp.loss_weight,
                label_smoothing=smoothing,
                denominators=None if mtp_ratio is None else mtp_ratio * metrics["num_tokens"])
            loss, metrics = loss + ahead, {**metrics, **ahead_metrics}
        if aux:
            moe = config.model.moe
            loss = (loss + moe.load_balance_loss * aux["load_balance"]
                    + moe.router_z_loss * aux["router_z"])
            metrics = {**metrics, **{f"moe_{name}": value for name, value in aux.items()
                                     if loads or name != "expert_load"}}
        return loss, metrics
