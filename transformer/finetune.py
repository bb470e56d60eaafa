"""Pretrain, then adapt: start a run's params from a pretrained workdir or a Hugging Face
checkpoint (`config.init_from`). Freezing and re-weighting parameter groups (optimizer.freeze,
optimizer.head) is the optimizer's: `transformer.optim.param_labels`.

    init_from = "runs/bert_mlm"            # the latest checkpoint of a training workdir
    init_from = "runs/bert_mlm@600"        # a given step
    init_from = "hf:/models/bert-tiny"     # a save_pretrained directory (GPT-2, BERT, T5)

Params are matched by name ("encoder/layers/mlp/wi"): every param of the new model that the
source has, with the same shape, is loaded; the others (new heads) keep their fresh init; source
params the model has no place for (a pretraining head) are dropped. A shape mismatch is an
error naming the param, and so is a dropped param inside a layer stack (a different depth or
`scan_layers`), which would otherwise silently train most of the model from scratch. Only
params are loaded: the optimizer, step and data start fresh. A run that has its own
checkpoints resumes from them and ignores `init_from`.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np
from flax import traverse_util

from transformer import checkpoint as checkpoint_lib


@dataclasses.dataclass
class LoadReport:
    source: str
    loaded: list[str]
    new: list[str]
    dropped: list[str]

    def __str__(self) -> str:
        def names(items):
            return ", ".join(items[:8]) + (f", ... ({len(items)})" if len(items) > 8 else "")

        return (f"init_from {self.source}: loaded {len(self.loaded)} params; "
                f"new {len(self.new)}" + (f" ({names(self.new)})" if self.new else "") +
                f"; dropped {len(self.dropped)}" +
                (f" ({names(self.dropped)})" if self.dropped else ""))


def _flat(tree) -> dict[str, object]:
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(dict(tree)).items()}


def _hf_params(directory: str) -> dict[str, np.ndarray]:
    import transformers
    from safetensors.numpy import load_file

    from transformer import convert

    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        raise FileNotFoundError(f"init_from=hf:{directory}: expected a save_pretrained directory "
                                "with config.json and model.safetensors")
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    _, params = convert.from_hf(hf_config, load_file(os.path.join(directory,
                                                                  "model.safetensors")))
    return _flat(params)


def match(source: dict[str, tuple], target: dict[str, tuple], name: str) -> LoadReport:
    """Names loaded / new / dropped between flat {name: shape} trees, or a one-line error."""
    loaded = sorted(set(source) & set(target))
    for key in loaded:
        if tuple(source[key]) != tuple(target[key]):
            raise ValueError(f"init_from {name}: param {key} has shape {tuple(source[key])} "
                             f"there but {tuple(target[key])} in this model: expected the same "
                             "architecture (model.* keys) as the source")
    report = LoadReport(name, loaded, sorted(set(target) - set(source)),
                        sorted(set(source) - set(target)))
    in_stack = [k for k in report.dropped + report.new if re.search(r"(^|/)layers", k)]
    if in_stack or not loaded:
        raise ValueError(f"init_from {name}: " + (
            f"layer params {in_stack[:4]} are in only one of the source and this model: "
            "expected the same model.num_layers and model.scan_layers" if in_stack else
            "no param names in common: expected a checkpoint of the same model family"))
    return report


def load_params(init_from: str, params, shardings) -> tuple[object, LoadReport]:
    """`params` (a fresh init, laid out by `shardings`) with every matching param replaced by
    the `init_from` source's value (see the module docstring)."""
    kind, path, step = checkpoint_lib.parse_init_from(init_from)
    target = _flat(params)
    target_shardings = _flat(shardings)
    if kind == "hf":
        source = _hf_params(path)
        report = match({k: np.shape(v) for k, v in source.items()},
                       {k: v.shape for k, v in target.items()}, init_from)
        values = {k: jax.device_put(np.asarray(source[k], target[k].dtype), target_shardings[k])
                  for k in report.loaded}
    else:
        step, metadata = checkpoint_lib.params_metadata(path, step)
        report = match({k: m.shape for k, m in metadata.items()},
                       {k: v.shape for k, v in target.items()}, f"{path}@{step}")
        wanted = {tuple(k.split("/")): jax.ShapeDtypeStruct(
            metadata[k].shape, metadata[k].dtype, sharding=target_shardings[k])
            for k in report.loaded}
        restored = checkpoint_lib.read_params(path, step, traverse_util.unflatten_dict(wanted))
        values = {k: v.astype(target[k].dtype) for k, v in _flat(restored).items()}
    merged = {k: values.get(k, v) for k, v in target.items()}
    out = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in merged.items()})
    return type(params)(out) if not isinstance(params, dict) else out, report
