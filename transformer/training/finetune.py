"""Pretrain, then adapt: start a run's params from a pretrained workdir or a Hugging Face
checkpoint (`config.init_from`). Freezing and re-weighting parameter groups (optimizer.freeze,
optimizer.head) is the optimizer's: `transformer.training.optim.param_labels`.

    init_from = "runs/bert_mlm"            # the latest checkpoint of a training workdir
    init_from = "runs/bert_mlm@600"        # a given step
    init_from = "hf:/models/bert-tiny"     # a save_pretrained directory (GPT-2, BERT, T5)

Params are matched by name ("encoder/layers/mlp/wi"): every param of the new model that the
source has, with the same shape, is loaded; the others (new heads) keep their fresh init; source
params the model has no place for (a pretraining head) are dropped. A shape mismatch is an
error naming the param, and so is a dropped param inside a layer stack (a different depth or
`scan_layers`), which would otherwise silently train most of the model from scratch. Only
params are loaded: the optimizer, step and data start fresh. A run that has its own
checkpoints resumes from them (its params, not init_from's) when its command gives the same
`init_from` as they were trained from; another one is refused (`fresh_start=True` sets them aside).

The architecture (every model key but `RUN_SETTINGS`, and `ROPE_SETTINGS` where the run sets
them: context extension) comes from the source (`resolve_init_config`): a workdir's saved
config, or "hf:DIR"'s config.json through the converter that maps the weights (and
`data.num_sentinels` from DIR's tokenizer: 0 but for T5's own sentinels); the experiment file
gives the family, the head and the training settings. A model key set on the command line that
contradicts the source is refused in one line, and so is a classifier workdir whose class head
was trained on other class names than this run's task gives (`_check_source_labels`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import traverse_util

from transformer.nn import lora
from transformer.training import checkpoint as checkpoint_lib
from transformer.utils import fileio, keys

# Model keys a run chooses for itself over an imported checkpoint (its head, regularization,
# precision and layout); every other model key is the checkpoint's architecture, MoE routing
# included (an imported MoE keeps its top_k, layout and dropless capacity_factor 0).
RUN_SETTINGS = frozenset({
    "family", "head", "num_classes", "dropout_rate", "attention_dropout_rate", "init_std",
    "dtype", "param_dtype", "attention_impl", "remat_policy", "scan_layers", "sequence_parallel",
    "sequence_load_balance", "image_size", "patch_size", "channels", "pooling",
    "patch_position", "projection_dim", "moe.load_balance_loss", "moe.router_z_loss",
    "moe.bias_update_rate", "mtp.loss_weight",
    "lora.rank", "lora.alpha", "lora.targets", "lora.dropout", "lora.base_quantization",
    "quantization", "quantize_head"})
# RoPE's frequencies: no param's shape or meaning depends on them, and changing them is what
# context-extension fine-tuning does (position interpolation, YaRN, a larger base as in ABF).
# The source's unless the run sets its own: on the command line, or in the experiment file
# (a value other than the model default). Not rope_layout or rope_fraction: which dims rotate.
ROPE_SETTINGS = frozenset({
    "rope_theta", "rope_scale", "rope_scaling", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len", "rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_mscale",
    "rope_yarn_mscale_all_dim", "rope_yarn_truncate", "rope_local_theta"})
# A checkpoint of the first family runs as the second (the same modules and params).
_SAME_PARAMS = {("gpt", "prefix_lm")}
_EXAMPLES = {"gpt": "gpt_tiny", "bert": "bert_mlm", "t5": "t5_span"}
_MTP = re.compile(r"mtp_\d+/")  # a multi-token prediction module's params (DecoderLM.mtp)


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
    """{"/"-joined name: param}; a QLoRA kernel ({"qvalue", "scale"}) is one param."""
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(
        dict(tree), is_leaf=lambda _, x: lora.is_quantized(x)).items()}


def _shape(param) -> tuple:
    return tuple((param["qvalue"] if lora.is_quantized(param) else param).shape)


def hf_convert(directory: str, scan: bool = False, source: str | None = None):
    """(Hugging Face config, model config, flat params) of a save_pretrained directory; with
    `scan`, its layer stacks stacked for a model with scan_layers=True. Refuses a directory
    holding a peft adapter too (`lora.check_not_peft`): every import of an hf: directory
    (init_from, transformer.load, generate) comes here. `source`: what its one-line errors
    name, as the user gave it (default `init_from='hf:DIR'`; `workdir='hf:DIR'`, ...)."""
    import transformers

    from transformer.hf import convert, quantized

    source = source or f"init_from='hf:{directory}'"
    lora.check_not_peft(directory, source)
    tensors = _safetensors(directory, source)
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    state_dict = quantized.dequantized(hf_config, tensors, source)
    try:
        model_config, params = convert.from_hf(hf_config, state_dict)
    except ValueError as error:  # what the model cannot represent, naming the setting
        raise ValueError(f"{source}: {error}") from None
    if scan:
        params = convert.scan_params(model_config, params)
    return hf_config, model_config, _flat(params)


def _safetensors(directory: str, source: str | None = None):
    """A function reading a save_pretrained directory's tensors: model.safetensors, or the
    shards model.safetensors.index.json lists (as the hub keeps checkpoints over 5 GB); a
    one-line error naming `source` (default init_from='hf:DIR'), now, if there are neither."""
    import json

    from safetensors.numpy import load_file

    source = source or f"init_from='hf:{directory}'"

    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        return lambda: load_file(single)
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{source}: expected a save_pretrained directory "
                                "with config.json and model.safetensors (or its shards and "
                                "model.safetensors.index.json)")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    if missing := [s for s in shards if not os.path.isfile(os.path.join(directory, s))]:
        raise FileNotFoundError(f"{source}: {missing[0]}, listed in "
                                "model.safetensors.index.json, is missing: expected every shard")

    def read() -> dict[str, np.ndarray]:
        tensors = {}
        for shard in shards:
            tensors.update(load_file(os.path.join(directory, shard)))
        if absent := sorted(set(weight_map) - set(tensors)):
            raise ValueError(f"{source}: {absent[0]} is in no shard: expected "
                             "the tensors model.safetensors.index.json lists")
        return tensors
    return read


def _hf_params(directory: str, scan: bool = False) -> dict[str, np.ndarray]:
    return hf_convert(directory, scan)[2]


def resolve_init_config(config: ml_collections.ConfigDict, explicit: Collection[str] = (),
                        workdir: str | None = None) -> ml_collections.ConfigDict:
    """`config` with its init_from's architecture: every model key but `RUN_SETTINGS` becomes
    the source's, i.e. the value `convert.from_hf` derives from an "hf:DIR"'s config.json, or
    a workdir's saved config at the step it names (default: its latest). An "hf:DIR" also sets
    `data.num_sentinels` to DIR's tokenizer's own sentinel count (0 for BERT, GPT-2, Llama: a
    pretrained vocabulary has no room for more ids). A config without init_from, or whose
    source is not there (validate_config then says what is missing), is returned as it is.

    Which values the user chose: `explicit`, the dotted keys set on the command line
    (`config_flags.get_override_values(FLAGS["config"])`: "model.num_layers", ...). The
    experiment file's values are defaults, replaced by the source's; an explicit value that
    differs from the source's is refused in one line naming the key. `model.family` always
    comes from the experiment (it picks the objective and data), so a checkpoint of another
    family is refused, and so is a LoRA workdir (its checkpoints hold adapters only).
    In-process callers pass the keys they set themselves; with none, the source's values
    replace every model key but the run settings. The RoPE frequency keys (`ROPE_SETTINGS`)
    are the run's where it sets them, explicitly or to a value other than the model default
    (context extension), else the source's. Raises ValueError; reads the source's
    files, changes nothing (`config` included).

    `workdir`: the run's own. Where it holds checkpoints (and fresh_start is off) the run
    resumes, and the architecture is its latest checkpoint's (`_own_architecture`), not what
    the source holds now: a source workdir trained on since, or an hf:DIR replaced.
    """
    own = _own_architecture(config, workdir)
    source = own[0] if own else _source_architecture(config.get("init_from"))
    if source is None:
        return config
    theirs, says, kind = source
    family = config.model.get("family")
    if family != theirs["family"] and (theirs["family"], family) not in _SAME_PARAMS:
        raise ValueError(
            f"model.family={family!r}: {config.init_from} is a {kind} ({theirs['family']!r} "
            f"family) checkpoint: expected model.family={theirs['family']!r}, e.g. "
            f"--config=experiments/{_EXAMPLES.get(theirs['family'], theirs['family'])}.py")
    from transformer.models import default_model_config, takes_mtp

    resolved = ml_collections.ConfigDict(config.to_dict())
    ours, defaults = keys.dotted(config.model), keys.dotted(default_model_config())
    own_rope = {k for k in ROPE_SETTINGS if f"model.{k}" in explicit or
                (k in ours and ours[k] != defaults.get(k))}
    # The MTP modules are a pretraining head, like the LM head: a run whose head or family has
    # none, or that sets model.mtp.depth=0, drops them (`match` reports their params dropped).
    drops_mtp = not takes_mtp(config.model) or (
        "model.mtp.depth" in explicit and ours.get("mtp.depth") == 0)
    for key, value in theirs.items():
        if key in own_rope and ours[key] != value:  # said, an experiment file's value above all
            logging.warning("model.%s=%r, where %s says %r: RoPE's frequencies are the "
                            "run's (context extension)", key, ours[key], says, value)
        if key in RUN_SETTINGS or key in own_rope or (key in ours and ours[key] == value) or (
                key == "mtp.depth" and drops_mtp):
            continue
        if f"model.{key}" in explicit:
            raise ValueError(f"model.{key}={ours.get(key)!r}: {says} says {value!r}")
        resolved.model.update_from_flattened_dict({key: value})
    if own:  # the count its tokenizer was saved with (an explicit other one: refused later)
        if "data.num_sentinels" not in explicit:
            resolved.data.num_sentinels = own[1].data.num_sentinels
    elif config.init_from.startswith("hf:"):
        _resolve_sentinels(resolved, config.init_from, theirs["vocab_size"], explicit)
    else:
        _workdir_sentinels(resolved, config.init_from, explicit)
        _check_source_labels(resolved)
    return resolved


def _check_source_labels(config) -> None:
    """Refuses a classifier run whose init_from workdir's class head, loaded by shape, was
    trained on other class names (in class order) than the run's task gives: its class i would
    start as the source's i-th (`tasks.label_change`). Passes where the source records none
    (saved before they were), or where the task cannot be read yet (validation says why)."""
    from transformer.data import pipeline, tasks
    from transformer.models import family_of

    path, step = fileio.parse_init_from(config.init_from)[1:]
    step, saved = checkpoint_lib.saved_run(path, step)
    if pipeline.objective_for(config) != "classification" or \
            not family_of(saved).classifier(saved.model):
        return
    before = (checkpoint_lib.saved_stream(path, step) or {}).get(tasks.LABELS)
    try:
        labels = None if before is None else tasks.task_for(config).labels
    except (FileNotFoundError, ValueError):
        return
    if change := tasks.label_change(before, labels):
        raise ValueError(f"init_from={config.init_from!r}: its checkpoint {step}, whose class "
                         f"head this run loads, {change}: expected a source without a class "
                         "head (its pretraining run), or data that gives the same classes in "
                         "the same order")


def _workdir_sentinels(config, init_from: str, explicit) -> None:
    """data.num_sentinels of a run from a workdir: its tokenizer's (`inputs.get_tokenizer`
    reads text with the source's), so that what is checked against it (span corruption's spans
    a row) and recorded is what the run uses; a different explicit count is refused."""
    from transformer.data import inputs, tokenizers

    source = fileio.parse_init_from(init_from)[1]
    folder = fileio.join(source, inputs.TOKENIZER_DIR)
    if not fileio.path(folder).joinpath(tokenizers.CONFIG_FILE).is_file():
        return  # (get_tokenizer names what is missing)
    own = tokenizers.load_tokenizer(folder).num_sentinels
    if "data.num_sentinels" in explicit and config.data.num_sentinels != own:
        raise ValueError(f"data.num_sentinels={config.data.num_sentinels}: the tokenizer of "
                         f"init_from={init_from!r}, which the run reads text with, has {own}: "
                         f"expected data.num_sentinels={own}")
    config.data.num_sentinels = own


def _source_architecture(init_from) -> tuple[dict, str, str] | None:
    """({dotted model key: value}, what says so, what kind of checkpoint) of an init_from
    source; None without one, or for one that is not there (no config.json, no checkpoints
    folder). A workdir whose checkpoint cannot be read is a one-line error, as in
    validate_config (`saved_run` reads the newest again where a training deletes one)."""
    if not isinstance(init_from, str) or not init_from:
        return None
    kind, path, step = fileio.parse_init_from(init_from)
    if kind == "hf":
        if not os.path.isfile(os.path.join(path, "config.json")):
            return None
        hf_config, theirs, _ = hf_convert(path)
        name = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        return keys.dotted(theirs), f"{init_from}'s config.json", name
    if not checkpoint_lib.has_checkpoints(path):
        return None
    try:  # (not None: the experiment's model keys would build another model than the source's)
        step, saved = checkpoint_lib.saved_run(path, step)
    except (FileNotFoundError, ValueError) as error:  # as validate_config says it
        raise type(error)(f"init_from={init_from!r}: {error}") from None
    if lora.enabled(saved):
        raise ValueError(_adapters_only(init_from, f"{path}@{step}"))
    return _saved_architecture(saved), f"{path}@{step}'s saved config", "training-run"


def _saved_architecture(saved) -> dict:
    """{dotted model key: value} of a training run's saved config, a key an older run lacks at
    its default and one this version no longer has left out."""
    from transformer.models import default_model_config

    known = keys.dotted(default_model_config())
    theirs = {**known, **keys.dotted(saved.model)}
    return {k: v for k, v in theirs.items() if k in known}


def _own_architecture(config, workdir: str | None) -> tuple[tuple, object] | None:
    """(`_source_architecture`'s triple, the saved config) of a run from init_from that resumes
    from its own checkpoints (`workdir` holds one and fresh_start is off): its latest
    checkpoint's, the architecture it trained, whatever its source holds by now (retrained,
    deleted). None otherwise, or where that checkpoint's config is unreadable (damaged: the
    source's then, as the restore falls back)."""
    if not workdir or not config.get("init_from") or config.get("fresh_start") or \
            not checkpoint_lib.complete_steps(workdir):
        return None
    try:
        step, saved = checkpoint_lib.saved_run(workdir)
    except (FileNotFoundError, ValueError):
        return None
    return (_saved_architecture(saved),
            f"this run's own checkpoint {workdir}@{step}'s saved config", "training-run"), saved


def _adapters_only(init_from: str, source: str) -> str:
    """The error for an init_from that is a LoRA run's workdir."""
    path = fileio.parse_init_from(init_from)[1]
    return (f"init_from={init_from!r}: {source} is a LoRA run, whose checkpoints hold its "
            "adapters only, not a model to start from: expected a full checkpoint, e.g. the "
            f"merged model (python -m transformer.export --workdir={path} --output=DIR "
            "--merge_lora, then init_from=hf:DIR)")


def _resolve_sentinels(config, init_from: str, vocab_size: int, explicit) -> None:
    """data.num_sentinels of a run on an imported vocabulary of `vocab_size` ids: its HF
    tokenizer's own count, unless set explicitly; then it must fit the vocabulary."""
    from transformer.data import tokenizers

    directory = init_from[3:]
    path = config.data.get("tokenizer_path") or (
        directory if os.path.isfile(os.path.join(directory, "tokenizer.json")) else "")
    if config.data.get("tokenizer") != "hf" or not path:
        return
    own = tokenizers.load_hf_tokenizer(path)  # with the sentinels its vocabulary has
    if "data.num_sentinels" not in explicit:
        config.data.num_sentinels = own.num_sentinels
        return
    wanted, base = config.data.num_sentinels, own.vocab_size - own.num_sentinels
    if base > vocab_size:  # no count of sentinels fits: say so, not "<= -3"
        raise ValueError(f"the tokenizer at {path} has {base} ids but {init_from}'s embedding "
                         f"has {vocab_size}: expected a tokenizer whose ids fit the "
                         "checkpoint's vocabulary (its own tokenizer)")
    if isinstance(wanted, int) and not own.num_sentinels and base + wanted > vocab_size:
        raise ValueError(
            f"data.num_sentinels={wanted}: {init_from}'s vocabulary has {vocab_size} ids, "
            f"{base} of them its tokenizer's, so {base + wanted} would not fit its embedding: "
            f"expected data.num_sentinels <= {vocab_size - base} (0 for a pretrained vocabulary)")


def match(source: dict[str, tuple], target: dict[str, tuple], name: str) -> LoadReport:
    """Names loaded / new / dropped between flat {name: shape} trees, or a one-line error."""
    loaded = sorted(set(source) & set(target))
    for key in loaded:
        if tuple(source[key]) != tuple(target[key]) and key.startswith("classifier/"):
            raise ValueError(f"init_from {name}: its class head {key} has {source[key][-1]} "
                             f"classes but this run's has {target[key][-1]} (model.num_classes, "
                             "or the task's labels): expected the same classes, or a source "
                             "without a class head (its pretraining run)")
        if tuple(source[key]) != tuple(target[key]):
            raise ValueError(f"init_from {name}: param {key} has shape {tuple(source[key])} "
                             f"there but {tuple(target[key])} in this model: expected the same "
                             "architecture (model.* keys) as the source")
    report = LoadReport(name, loaded, sorted(set(target) - set(source)),
                        sorted(set(source) - set(target)))
    # LoRA's adapters are new in every layer; dropped MTP modules (mtp_<k>/layers_0/...) are
    # a pretraining head, not a layer of the stack.
    in_stack = [k for k in report.dropped + report.new if re.search(r"(^|/)layers", k) and
                not lora.is_adapter(k) and not (k in report.dropped and _MTP.match(k))]
    if in_stack or not loaded:
        raise ValueError(f"init_from {name}: " + (
            f"layer params {in_stack[:4]} are in only one of the source and this model: "
            "expected the same model.num_layers and model.scan_layers" if in_stack else
            "no param names in common: expected a checkpoint of the same model family"))
    return report


def load_params(init_from: str, params, shardings,
                lora_base: bool = False) -> tuple[object, LoadReport]:
    """`params` (a fresh init, laid out by `shardings`) with every matching param replaced by
    the `init_from` source's value (see the module docstring). A LoRA model (with adapters)
    whose other params the source does not all supply is refused (`_frozen_fresh`), unless
    `lora_base`: a LoRA checkpoint's base read again, whose gaps `with_lora_base` names."""
    kind, path, step = fileio.parse_init_from(init_from)
    target = _flat(params)
    target_shardings = _flat(shardings)
    if kind == "hf":
        scanned = any(re.search(r"(^|/)layers/", k) for k in target)  # scan_layers=True
        source = _hf_params(path, scanned)
        report = match({k: np.shape(v) for k, v in source.items()},
                       {k: _shape(v) for k, v in target.items()}, init_from)
        if not lora_base:
            _frozen_fresh(report, target)
        values = {k: _as_target(np.asarray(source[k]), target[k], target_shardings[k])
                  for k in report.loaded}
    else:
        report, restored = _workdir_params(init_from, step, target, target_shardings, lora_base)
        values = {k: _as_target(v, target[k], target_shardings[k])
                  for k, v in _flat(restored).items()}
    merged = {k: values.get(k, v) for k, v in target.items()}
    out = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in merged.items()})
    return type(params)(out) if not isinstance(params, dict) else out, report


def _workdir_params(init_from: str, step: int | None, target: dict, target_shardings: dict,
                    lora_base: bool) -> tuple[LoadReport, object]:
    """(report, the params read) of `load_params` from a training workdir: checkpoint `step`'s
    (default: the latest) params metadata, then the params `target` has, from that one step.
    If a training there deletes the step meanwhile (its keep_checkpoints), both are read again
    from the then-newest one (`checkpoint.read_newest`), which the report names; a given
    `step` deleted meanwhile is a one-line error naming it."""
    path = fileio.parse_init_from(init_from)[1]

    def read(chosen: int) -> tuple[LoadReport | ValueError, object]:
        metadata = checkpoint_lib.params_metadata(path, chosen)[1]
        try:
            if metadata and all(lora.is_adapter(k) for k in metadata):
                raise ValueError(_adapters_only(init_from, f"{path}@{chosen}"))
            report = match({k: m.shape for k, m in metadata.items()},
                           {k: _shape(v) for k, v in target.items()}, f"{path}@{chosen}")
            if not lora_base:
                _frozen_fresh(report, target)
        except ValueError as refused:  # the source does not fit this model (no step would):
            return refused, None  # raised as it is, not read again as a step deleted mid-read
        wanted = {tuple(k.split("/")): jax.ShapeDtypeStruct(
            metadata[k].shape, metadata[k].dtype,
            sharding=target_shardings[k]["qvalue"] if lora.is_quantized(target_shardings[k])
            else target_shardings[k])
            for k in report.loaded}
        return report, checkpoint_lib.read_params(path, chosen,
                                                  traverse_util.unflatten_dict(wanted))

    report, restored = checkpoint_lib.read_newest(path, step, read)
    if isinstance(report, ValueError):
        raise report
    return report, restored


def _frozen_fresh(report: LoadReport, target: dict) -> None:
    """Refuses a LoRA model with params the source lacks (a new classifier head): LoRA freezes
    every param but the adapters, so these would stay at their random init."""
    ranks = [_shape(v)[-1] for k, v in target.items() if k.endswith("_lora_a")]
    fresh = [k for k in report.new if not lora.is_adapter(k)]
    if ranks and fresh:
        names = ", ".join(fresh[:8]) + (f", ... ({len(fresh)})" if len(fresh) > 8 else "")
        raise ValueError(
            f"model.lora.rank={ranks[0]} with params init_from {report.source} does not supply "
            f"({names}): LoRA trains the adapters only, so they would stay at their random "
            "init: expected a source that has them (fine-tune them first without LoRA, then "
            "init_from that run), or model.lora.rank=0")


def _as_target(value, target, sharding):
    """A source param as the target's dtype and layout; QLoRA's quantized base kernels are
    quantized as the target's (lora.quantize_like)."""
    if lora.is_quantized(target):
        return lora.quantize_like(value, target, sharding)
    if isinstance(value, np.ndarray):
        return jax.device_put(np.asarray(value, target.dtype), sharding)
    return value.astype(target.dtype)


def with_lora_base(config: ml_collections.ConfigDict, adapters, abstract_params, shardings,
                   record: dict):
    """A LoRA checkpoint's params: its `adapters` and the base read again from `record`'s
    source (`checkpoint_manager.Manager.lora_base`: a workdir at the step the run read; a
    record saved before steps were recorded names config.init_from), whose fingerprint must
    be `record`'s; a different base is a one-line error."""
    source = record.get("init_from") or config.init_from
    target = {**lora.trainable(abstract_params)[1], **lora.trainable(adapters)[0]}
    try:
        params, _ = load_params(source, traverse_util.unflatten_dict(target), shardings,
                                lora_base=True)
    except (FileNotFoundError, checkpoint_lib.MissingStep) as error:  # the adapters' base: say so
        raise FileNotFoundError(f"the LoRA checkpoint's base init_from={source}: {error} (the "
                                "adapters need the base they were trained on)") from None
    missing = [k for k, v in _flat(params).items()
               if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(v))]
    if missing:
        raise ValueError(f"init_from {source}: has no param {missing[0]}, which the LoRA "
                         "checkpoint's base had: expected the base it was trained on")
    found = lora.fingerprint(params)
    if found != record["fingerprint"]:
        raise ValueError(
            f"LoRA checkpoint step {record.get('step')}: its adapters were trained on base "
            f"{source} (fingerprint {record['fingerprint']}), which now holds other params "
            f"(fingerprint {found}): expected the same base")
    return params


def resumed(config: ml_collections.ConfigDict, state, abstract, shardings, manager):
    """A resumed train state (None: none saved); a LoRA run's with its base (`with_lora_base`)."""
    if state is None or not lora.enabled(config):
        return state
    return state.replace(params=with_lora_base(config, state.params, abstract.params,
                                               shardings.params, manager.lora_base))


def restore_params(workdir: str, step: int | None = None, mesh=None,
                   or_newer: bool = False) -> checkpoint_lib.SavedParams:
    """`checkpoint.restore_params`, with a LoRA run's base read again (`with_lora_base`): the
    params evaluation, generation and export read."""
    from transformer.models import build_model
    from transformer.training import state as state_lib

    saved = checkpoint_lib.restore_params(workdir, step, mesh, or_newer)
    if not lora.enabled(saved.config):
        return saved
    record = checkpoint_lib.saved_lora_base(workdir, saved.step)
    where = jax.tree.leaves(saved.params)[0].sharding.mesh  # the one the adapters were read onto
    abstract, shardings, _ = state_lib.initial_state(saved.config,
                                                     build_model(saved.config.model), where)
    params = with_lora_base(saved.config, saved.params, abstract.params, shardings.params,
                            record)
    return saved._replace(params=params)
