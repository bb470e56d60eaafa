"""Export by allowlist: each Hugging Face exporter names the model keys it maps (with the values
it accepts where only some are representable), and `check` refuses any other model key set away
from its default, in one line naming the key, its value and the exporter, before anything is
written. The model keys and their defaults come from `default_model_config()` (the
`TransformerConfig` fields, moe.*, lora.* and the family keys), so a key added later is refused
by every exporter until one opts in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformer.models import MODEL_KEYS, default_model_config
from transformer.nn.config import TransformerConfig
from transformer.utils import keys

ANY = None  # an allowlist value: every value of the key is mapped

# The shape keys every exporter maps.
SHAPES = dict.fromkeys(("vocab_size", "num_layers", "d_model", "num_heads", "d_ff", "max_len",
                        "norm_epsilon"), ANY)


@dataclasses.dataclass(frozen=True)
class Exporter:
    """An exporter's name (HF's model_type), its title in messages, and its allowlist:
    {dotted model key: ANY, or the tuple of values it represents}."""

    name: str
    title: str
    allows: dict[str, tuple | None]


def export_neutral() -> set[str]:
    """The model keys declared export-neutral (`utils.keys.Key.export_neutral`): they change
    how a model is computed, stored, initialised or trained (quantization is a compute setting,
    the params stay float; dropout and loss weights act in training only), not the function it
    exports, so every exporter accepts them at any value."""
    return ({name for name, declared in MODEL_KEYS.items() if declared.export_neutral} |
            {name for name, declared in keys.declarations(TransformerConfig)
             if declared.export_neutral})


def model_defaults() -> dict[str, Any]:
    """{dotted model key: default} of every model key: the model config group's, and any
    `TransformerConfig` field it lacks."""
    defaults = keys.dotted(default_model_config())
    for field in dataclasses.fields(TransformerConfig):
        if field.name not in defaults and not any(k.startswith(field.name + ".")
                                                  for k in defaults):
            defaults[field.name] = field.default
    return defaults


def refusal(exporter: Exporter, key: str, value, expected: str) -> ValueError:
    """The one-line error of a model setting `exporter` cannot represent."""
    return ValueError(f"export to {exporter.name}: model.{key}={value!r} has no Hugging Face "
                      f"{exporter.title} equivalent (expected {expected})")


def check(exporter: Exporter, model_config, prefix: str = "") -> None:
    """Refuses the first model key (of those starting with `prefix`) that `exporter` does not
    map and that is set away from its default (export-neutral keys excepted), or a listed key
    at a value it does not represent: the listed keys first, in the allowlist's order."""
    defaults = model_defaults()
    neutral = export_neutral()
    values = {**defaults, **keys.dotted(model_config)}  # a key the config lacks is at its default
    for key, allowed in exporter.allows.items():
        if allowed is not ANY and key.startswith(prefix) and values.get(key) not in allowed:
            raise refusal(exporter, key, values.get(key), " or ".join(map(repr, allowed)))
    for key, value in values.items():
        if key in exporter.allows or key in neutral or not key.startswith(prefix):
            continue
        if key not in defaults:
            raise refusal(exporter, key, value, "no such key: not one of default_model_config()")
        if not _same(value, defaults[key]):
            raise refusal(exporter, key, value, f"the default {defaults[key]!r}")


def _same(value, default) -> bool:
    return value == default and (value is None) == (default is None)
