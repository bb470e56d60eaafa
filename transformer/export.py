"""Export a trained model as a Hugging Face `save_pretrained` directory (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json), with the user's umask:

    python -m transformer.export --workdir=runs/gpt --output=hf/gpt [--step=N]

A LoRA run (model.lora.rank > 0) exports its adapters as a peft adapter directory
(adapter_config.json + adapter_model.safetensors, `peft.PeftModel.from_pretrained` loads it onto
the Hugging Face base), or with --merge_lora the merged model W + (alpha / rank) A B as above.

The mapping itself is `transformer.hf.export` (`to_hf`, `peft_state`): which Hugging Face class
a model becomes, and the one-line refusal, before anything is written, of any model setting
that class cannot represent. This command reads the checkpoint and writes the files.

Needs `transformers` (pip install transformers); torch is not needed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Any

import jax

from transformer.hf import export as hf_export
from transformer.nn import lora
from transformer.parallel import sharding
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import finetune
from transformer.training import state as state_lib
from transformer.utils import fileio


def _tokenizer_files(tokenizer, directory: str, model_type: str | None = None,
                     run_config=None) -> None:
    """tokenizer.json and tokenizer_config.json, so `AutoTokenizer` gives the run's ids (and a
    Hugging Face tokenizer's specials, inputs and settings), and its default call the inputs
    the run's model read (`_with_template`). Where the tokenizer names no `model_input_names`,
    they are those of `model_type`'s own tokenizer class (BERT's include token_type_ids). A
    classifier's model_max_length is the run's seq_len: `truncation=True` cuts as training did."""
    import json

    from transformer.models import family_of

    tokenizer_json, config = tokenizer.hugging_face()
    if run_config is not None:
        tokenizer_json = _with_template(tokenizer_json, run_config, tokenizer)
    if model_type and "model_input_names" not in config and (
            names := _model_input_names(model_type)):
        config["model_input_names"] = names
    if run_config is not None and family_of(run_config).classifier(run_config.model):
        # `truncation=True` then cuts a long text as training did ([CLS] text [SEP] in seq_len)
        config["model_max_length"] = int(run_config.seq_len)
    fileio.path(directory).joinpath("tokenizer.json").write_text(tokenizer_json,
                                                                  encoding="utf-8")
    fileio.path(directory).joinpath("tokenizer_config.json").write_text(
        json.dumps(config, indent=1) + "\n", encoding="utf-8")


def _with_template(tokenizer_json: str, config, tokenizer) -> str:
    """tokenizer.json with the post-processor that makes `transformers`' default call
    (add_special_tokens=True) give what the run's model read: [CLS] text [SEP] for a BERT
    classifier, <eos> text for a GPT one, text <eos> for a T5 encoder
    (`tasks.classification_features`, `text2text_features`, span corruption's inputs). A
    language model's own rows are windows of packed text, which no template gives: its
    tokenizer keeps what it had. A hub tokenizer's own post-processor stays where it already
    gives the template (BERT's, with its sentence-pair form); otherwise it gives way to the
    template, its ByteLevel step (GPT-2's: offsets only, no tokens) kept before it."""
    import json

    from tokenizers import Tokenizer, processors

    from transformer.models import family_of

    family = family_of(config)
    if family.name == "t5":
        roles = ("$A", "eos")
    elif family.classifier(config.model):
        roles = ("cls", "$A", "sep") if family.cls_token else ("eos", "$A")
    else:
        return tokenizer_json
    hf = Tokenizer.from_str(tokenizer_json)
    ids = {role: int(tokenizer.require(role, "for the export's template")) for role in roles
           if role != "$A"}
    names = {role: hf.id_to_token(i) for role, i in ids.items()}
    own = json.loads(tokenizer_json).get("post_processor") or {}
    hf.post_processor = processors.TemplateProcessing(
        single=" ".join(names.get(role, role) for role in roles),
        special_tokens=[(names[role], i) for role, i in ids.items()])
    sample = "a b"
    if own and Tokenizer.from_str(tokenizer_json).encode(sample).ids == hf.encode(sample).ids:
        return tokenizer_json
    kept = [step for step in own.get("processors", [own]) if step.get("type") == "ByteLevel"]
    if not kept:
        return hf.to_str()
    data = json.loads(hf.to_str())
    data["post_processor"] = {"type": "Sequence",
                              "processors": [*kept, data["post_processor"]]}
    return Tokenizer.from_str(json.dumps(data)).to_str()  # (checked by the tokenizers library)


def _model_input_names(model_type: str) -> list[str] | None:
    """The inputs `transformers`' tokenizer class for `model_type` returns (None: it has none)."""
    from transformers.models.auto import tokenization_auto

    name = tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = tokenization_auto.tokenizer_class_from_name(name) if isinstance(name, str) else None
    return list(cls.model_input_names) if cls is not None else None


def _generation_config(hf_config, tokenizer, config=None):
    """generation_config.json: `generate` stops where ours does (`text.stop_ids`): at an imported
    checkpoint's own stop ids, in its order, at <eos>, and at a chat template's end of turn
    (Llama 3's <|eot_id|>, ChatML's <|im_end|>) where the tokenizer has one. With the run's
    `config`, it never emits what ours never does either (`suppress_tokens`: `text.banned_for`,
    the other specials and a padded vocabulary's ids past the tokenizer's, which have no text),
    so its greedy continuation is ours."""
    import transformers

    from transformer.data import chat
    from transformer.generation.text import banned_for, stop_ids

    end = chat.end_of_turn_id(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    stops = list(stop_ids(tokenizer, end))
    ids = {role: getattr(hf_config, f"{role}_token_id", None) for role in ("bos", "pad")}
    from transformer.models import family_of

    generates = config is not None and family_of(config).decoding is not None  # (not BERT)
    banned = [] if not generates else [  # (an end of turn is a stop: a chat reply ends there)
        i for i in banned_for(tokenizer, hf_config.vocab_size, config) if i not in stops]
    return transformers.GenerationConfig(
        eos_token_id=stops[0] if len(stops) == 1 else (stops or None),
        bos_token_id=ids["bos"], pad_token_id=ids["pad"], suppress_tokens=banned or None,
        **({"decoder_start_token_id": hf_config.decoder_start_token_id}
           if getattr(hf_config, "decoder_start_token_id", None) is not None else {}))


def _new_directory(parent: str) -> str:
    """A new hidden directory in `parent`, made with the user's umask (mkdtemp's is 0700)."""
    while True:
        path = os.path.join(parent, f".export-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


# The token ids an export's config.json names: the run's tokenizer's, else its import's.
TOKEN_ROLES = ("bos", "eos", "pad")


def token_ids(config, tokenizer) -> dict[str, Any]:
    """{"bos_token_id": ..., "eos_token_id": ..., "pad_token_id": ...} for the export of a run
    (`config`, its resolved config) with `tokenizer`: each role's id where the tokenizer defines
    one, else the config.json's of the Hugging Face checkpoint the run was imported from
    (`source_token_ids`), else none (left out)."""
    ids = source_token_ids(config)
    for role in TOKEN_ROLES:
        if (value := getattr(tokenizer, f"{role}_id", None)) is not None:
            ids[f"{role}_token_id"] = int(value)
    return ids


def source_token_ids(config) -> dict[str, Any]:
    """The `TOKEN_ROLES` ids of the config.json of the Hugging Face checkpoint DIR a run was
    imported from: init_from="hf:DIR", or through the workdirs it started from (init_from=
    WORKDIR, whose saved config says where it started). Only ids of the run's vocabulary (an
    id, or a list of them: eos); {} where there is no such DIR, or its config.json is gone."""
    init_from, seen = str(config.get("init_from") or ""), set()
    while init_from and not init_from.startswith("hf:") and init_from not in seen:
        seen.add(init_from)
        _, path, step = fileio.parse_init_from(init_from)
        try:
            init_from = str(checkpoint_lib.saved_run(path, step)[1].get("init_from") or "")
        except (FileNotFoundError, ValueError):  # a source workdir moved or deleted since
            return {}
    file = os.path.join(init_from[3:], "config.json")
    if not init_from.startswith("hf:") or not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            source = json.load(f)
    except (OSError, ValueError):  # (read whole at training: changed since, the tokenizer's)
        return {}
    if not isinstance(source, dict):
        return {}
    vocab = int(config.model.vocab_size)

    def valid(value) -> bool:
        ids = value if isinstance(value, list) and value else [value]
        return all(type(i) is int and 0 <= i < vocab for i in ids)

    return {key: source[key] for role in TOKEN_ROLES
            if valid(source.get(key := f"{role}_token_id"))}


def export_workdir(workdir: str, output: str, step: int | None = None,
                   merge_lora: bool = False) -> dict:
    """Writes checkpoint `step` (default: the latest) of `workdir` as a `save_pretrained`
    directory `output`, which must not exist yet, with the user's umask (a LoRA run's: its peft
    adapter, or with `merge_lora` the merged model). Returns what was written: the step, the
    output, the architecture and `files`, [(path, bytes)]."""
    from safetensors.numpy import save_file

    from transformer.data import inputs
    from transformer.data import tokenizers as tokenizers_lib

    if fileio.path(output).exists():
        raise FileExistsError(f"output={output!r} exists: expected a new directory (nothing is "
                              "overwritten)")
    newest = step is None
    step, config = checkpoint_lib.saved_run(workdir, step)
    adapters = lora.enabled(config)
    if merge_lora and not adapters:
        raise ValueError(f"--merge_lora: {workdir}'s run has no LoRA adapters (model.lora.rank "
                         "is 0): expected a LoRA run, or no --merge_lora")
    if adapters and not merge_lora and (q := config.model.lora.get("base_quantization")):
        # peft would put them on the float base: off by ~0.1 in the logits (measured, tiny Llama)
        raise ValueError(f"{workdir} is a QLoRA run (model.lora.base_quantization={q!r}): its "
                         f"adapters were trained on the {q}-rounded base, not the float one a "
                         "peft adapter loads onto: expected --merge_lora (the adapters merged "
                         f"into the {q}-rounded weights they were trained on)")
    tokenizer = tokenizers_lib.load_tokenizer(fileio.join(workdir, inputs.TOKENIZER_DIR))
    tokenizer.hugging_face()  # refused, if it is, before anything is read or written
    # Read onto one local device, whatever mesh the run trained on (Orbax reshards).
    one_device = sharding.make_mesh({axis: 1 for axis in sharding.MESH_AXES},
                                    devices=jax.local_devices()[:1])
    # A training beside it may delete the newest step meanwhile: then the next one is read.
    step, _, params = finetune.restore_params(workdir, step, one_device, or_newer=newest)
    if adapters and not merge_lora:
        peft_config = config.copy_and_resolve_references()
        peft_config.model, params = _without_mtp(config.model, params)
        return _write(output, lambda staging: _peft_files(peft_config, params, staging),
                      {"step": step, "architecture": "a peft LoRA adapter",
                       "notes": notes(config.model)})
    if adapters:
        params = lora.merged_params(params, state_lib.model_lora(config))
    labels = hf_export.task_labels(config, checkpoint_lib.saved_stream(workdir, step,
                                                                        or_newer=True))
    model_config, params = _without_mtp(hf_export.base_model_config(config.model), params)
    hf_config, state = hf_export.to_hf(model_config, params, labels=labels)
    for key, value in token_ids(config, tokenizer).items():  # an import's, too
        setattr(hf_config, key, value)
    if config.model.family == "t5":
        hf_config.decoder_start_token_id = int(tokenizer.decoder_start_id)

    def write(staging):
        hf_config.save_pretrained(staging)
        save_file(state, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        _tokenizer_files(tokenizer, staging, hf_config.model_type, config)
        _generation_config(hf_config, tokenizer, config).save_pretrained(staging)

    return _write(output, write, {"step": step, "architecture": hf_config.architectures[0],
                                  "notes": notes(config.model)})


def _dropped_mtp(model_config) -> int:
    """The multi-token prediction modules an export leaves out: all of them (mtp.depth) but in
    DeepSeek-V3's architecture (MLA), whose files hold them; they only trained the model, whose
    next-token logits are the same without them."""
    mtp = model_config.get("mtp")
    return 0 if not mtp or model_config.get("attention_kind") == "mla" else mtp.get("depth", 0)


def _without_mtp(model_config, params):
    """(model config, params) without the `_dropped_mtp` modules."""
    if not _dropped_mtp(model_config):
        return model_config, params
    model_config = model_config.copy_and_resolve_references()
    model_config.mtp.depth = 0
    return model_config, {k: v for k, v in params.items() if not k.startswith("mtp_")}


def notes(model_config) -> list[str]:
    """What an export computes otherwise than the trained model, said after it is written.

    >>> import ml_collections
    >>> moe = ml_collections.ConfigDict({"moe": {"num_experts": 8, "capacity_factor": 1.25}})
    >>> notes(moe)  # doctest: +ELLIPSIS
    ["note: moe.capacity_factor=1.25: Hugging Face's experts are dropless, ..."]
    >>> notes(ml_collections.ConfigDict({"quantization": "int8"}))  # doctest: +ELLIPSIS
    ["note: model.quantization='int8': the export holds the float weights, ..."]
    """
    moe, out = model_config.get("moe") or {}, []
    if depth := _dropped_mtp(model_config):
        out.append(f"note: model.mtp.depth={depth}: the export leaves out the multi-token "
                   "prediction modules (only DeepSeek-V3's files hold them); they trained the "
                   "model, and its next-token logits are the same without them")
    if moe.get("num_experts") and moe.get("capacity_factor", 0) > 0:
        out.append(f"note: moe.capacity_factor={moe['capacity_factor']}: Hugging Face's experts "
                   "are dropless, so the export's logits differ from this model's where its "
                   "experts dropped tokens over capacity (at moe.capacity_factor=0 they are "
                   "equal)")
    if scheme := model_config.get("quantization"):
        out.append(f"note: model.quantization={scheme!r}: the export holds the float weights, "
                   "which Hugging Face multiplies in float, so its logits differ from this "
                   f"model's {scheme} matmuls by their rounding (the float model's, within 1e-4)")
    return out


def _write(output: str, write, result: dict) -> dict:
    """`write(staging)` into a new directory renamed to `output` when complete (the files with
    the user's umask); `result` with the output and `files`, [(path, bytes)]."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = _new_directory(parent)  # complete, then renamed
    try:
        write(staging)
        file_mode = os.stat(staging).st_mode & 0o666  # the umask's (safetensors' is 0600)
        files = []
        for name in sorted(os.listdir(staging)):
            os.chmod(os.path.join(staging, name), file_mode)
            files.append((os.path.join(output, name), os.path.getsize(os.path.join(staging, name))))
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {**result, "output": output, "files": files}




def _peft_files(config, params, directory: str) -> None:
    import json

    from safetensors.numpy import save_file

    adapter_config, state = hf_export.peft_state(config, params)
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)
    save_file(state, os.path.join(directory, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def _size(num_bytes: int) -> str:
    """'812 bytes', '1.4 kB', '25.0 MB'."""
    if num_bytes < 1000:
        return f"{num_bytes} bytes"
    return f"{num_bytes / 1e3:.1f} kB" if num_bytes < 1e6 else f"{num_bytes / 1e6:.1f} MB"


def _main(argv):
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)  # one line per file, not Orbax's INFO logs
    f = flags.FLAGS
    written = export_workdir(f.workdir, f.output, f.step, f.merge_lora)
    for path, num_bytes in written["files"]:
        print(f"wrote {path} ({_size(num_bytes)})")
    print(f"step {written['step']} of {f.workdir} -> {written['output']} as "
          f"{written['architecture']}" + ("" if "peft" in written["architecture"] else
                                          ", with its tokenizer"))
    for line in written.get("notes", ()):
        print(line)


def _define_flags():
    from absl import flags

    flags.DEFINE_string("workdir", None, "Training workdir to export.", required=True)
    flags.DEFINE_string("output", None, "New directory for the save_pretrained files.",
                        required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_bool("merge_lora", False, "A LoRA run: write the merged model (W + alpha/rank "
                      "A B) instead of a peft adapter directory.")


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(_main, _define_flags)
