"""Attention maps of a trained model as pictures: a heatmap per layer and head with the tokens
on the axes, and a grid of every head of every layer.

    python -m transformer.visualize --workdir=DIR --text="def f(x):" [--target="..."] \
        [--layer=L] [--head=H] [--step=N] [--prefix_length=P] [--output_dir=DIR]

Loads checkpoint N (default: the latest) and the tokenizer of a training workdir, runs the text
through the model with every attention layer's weights collected (they are sown into the
'intermediates' collection), and writes to the output directory `attention.npz` (the weights,
token labels and layer indices), `<map>_grid.png` per map and `<map>_L<l>_H<h>.png` per layer
and head (only layer L and/or head H if given), where <map> is e.g. `decoder.self_attention`
and <l> the layer's index in its stack. Layers without softmax attention (a hybrid stack's
linear_attention, mamba2 or conv layers) have no map; the command names them. The default
directory, WORKDIR/attention/step<N>-<hash of the text>, is one per checkpoint and text (its
input.json names them), so the pictures of another text never overwrite these.

The model reads the text the way it was trained: a decoder LM as a document's start
(`text.document_prefix`: behind an <eos> where training streamed its documents), BERT as is, T5 with
an <eos> appended in the encoder and `--target` after <bos> in the decoder, which gives encoder
self-, decoder self- and cross-attention maps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from transformer.data import tokenizers as tokenizers_lib
from transformer.generation.text import document_prefix
from transformer.models import FAMILIES, Family, family_of, shift_right, transformer_config
from transformer.nn.blocks import scan_segments
from transformer.nn.mixers import RECURRENT

ATTENTION_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.attention_maps)
_WHITESPACE = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_MAX_TICK_LABELS = 128  # longer texts label every k-th token of the per-head pictures


def _check_family(config) -> Family:
    family = family_of(config)
    if not family.attention_maps:
        raise ValueError(f"model.family={family.name!r} has no attention to visualize: expected "
                         f"{', '.join(ATTENTION_FAMILIES[:-1])} or {ATTENTION_FAMILIES[-1]}")
    return family


def encode_text(config, tokenizer, text: str, target: str = "") -> tuple[np.ndarray,
                                                                         np.ndarray | None]:
    """(tokens, decoder_tokens) the model reads for `text`, as in training and generation.

    GPT / prefix LM / LSTM: the text as a document's start (`text.document_prefix`: behind an
    <eos> where training streamed its documents, else alone). BERT: the text. T5: the
    encoder reads text + <eos>, the decoder the target shifted right behind <bos> (just <bos>
    without a target). decoder_tokens is None except for T5.
    """
    family = _check_family(config)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    eos = np.array([tokenizer.eos_id], np.int32)
    if family.decoding == "encoder_decoder":
        targets = np.concatenate([np.asarray(tokenizer.encode(target), np.int32), eos])
        decoder_tokens = np.asarray(shift_right(targets[None], tokenizer.decoder_start_id))[0]
        return np.concatenate([ids, eos]), decoder_tokens.astype(np.int32)
    if target:
        raise ValueError(f"target={target!r}: only a t5 model reads a target, this is "
                         f"model.family={family.name!r}")
    if not family.continues_text:
        return ids, None
    prefix = document_prefix(config, tokenizer, empty=not len(ids))
    return np.concatenate([prefix, ids]).astype(np.int32), None  # as generation reads it


def _check_tokens(name: str, tokens, config) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not tokens.size or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{name} of shape {tokens.shape}, dtype {tokens.dtype}: expected a "
                         "non-empty 1-D int array (one example)")
    vocab_size = config.model.vocab_size
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)] if vocab_size else tokens[:0]
    if bad.size:
        raise ValueError(f"{name} hold id {int(bad[0])}: expected 0 <= id < "
                         f"model.vocab_size={vocab_size}")
    if config.model.position == "learned" and len(tokens) > config.model.max_len:
        raise ValueError(f"{name} of length {len(tokens)}: learned positions go up to "
                         f"model.max_len={config.model.max_len}")
    return tokens.astype(np.int32)


def attention_maps(model, params, config, tokens, *, decoder_tokens=None,
                   prefix_length: int | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
    """Every softmax-attention layer's weights for one example: ({name: float32 [layers,
    heads, T, S]}, {name: those layers' indices in their stack}).

    `tokens` [T] are the ids the model reads (see `encode_text`; for T5 the encoder's), with
    `decoder_tokens` [T_dec] for T5 (default: just the project tokenizers' <bos>). Names are
    "<stack>/<attention module>", in sorted order: "decoder/self_attention" (GPT, prefix LM),
    "encoder/self_attention" (BERT), and for T5 "decoder/cross_attention" ([L, N, T_dec, T]),
    "decoder/self_attention" and "encoder/self_attention". A prefix LM attends bidirectionally
    over its first `prefix_length` tokens (default: half of them, rounded down). Layers of a
    recurrent type (`model.layer_types`: linear_attention, mamba2, conv) have no map, so the
    layers of a hybrid stack's map are not 0..k-1 (`missing_layers` names the others).
    """
    family = _check_family(config)
    stack = transformer_config(config.model)
    if all(stack.layer_type(i) in RECURRENT for i in range(stack.num_layers)):
        raise ValueError(f"model.layer_types={stack.layer_types!r}: no softmax-attention layer, "
                         "so no attention maps: expected a full_attention or sliding_attention "
                         "layer")
    tokens = _check_tokens("tokens", tokens, config)
    if family.decoding != "encoder_decoder" and decoder_tokens is not None:
        raise ValueError(f"decoder_tokens: only a t5 model has a decoder input, this is "
                         f"model.family={family.name!r}")
    if family.decoding != "prefix" and prefix_length is not None:
        raise ValueError(f"prefix_length={prefix_length}: only a prefix_lm has a prefix, this "
                         f"is model.family={family.name!r}")
    variables = {"params": params}
    # Jitted: one compile beats dispatching (and compiling) every op of the model on its own.
    apply = jax.jit(lambda variables, *args, **kwargs: model.apply(
        variables, *args, mutable=["intermediates"], **kwargs)[1])
    if family.decoding == "encoder_decoder":
        if decoder_tokens is None:
            decoder_tokens = np.array([tokenizers_lib.BOS_ID], np.int32)
        decoder_tokens = _check_tokens("decoder_tokens", decoder_tokens, config)
        state = apply(variables, tokens[None], decoder_tokens[None])
    elif family.decoding == "prefix":
        prefix = len(tokens) // 2 if prefix_length is None else prefix_length
        if not 0 <= prefix <= len(tokens):
            raise ValueError(f"prefix_length={prefix}: expected 0..{len(tokens)} (the number "
                             "of tokens)")
        state = apply(variables, tokens[None], prefix_lengths=np.array([prefix], np.int32))
    else:
        state = apply(variables, tokens[None])
    return _collect(state.get("intermediates", {}), stack)


def _collect(intermediates, stack) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
    """({"<stack>/<attention>": [layers, heads, T, S]} of batch row 0, {name: the layers'
    indices}) from the weights sown by unrolled stacks (`layers_<i>/<attention>`, one layer's)
    or scanned ones (`stack`'s `scan_segments`, `layers` or `dense_layers`, then `block_<j>`
    where its layer_period P > 1: a leading axis of groups, group g being layers o + g P + j of
    a part starting at layer o)."""
    parts, first = {}, 0
    for part_name, part, count in scan_segments(stack):
        parts[part_name] = (first, part.layer_period)
        first += count
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    for path, weights in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if "attention_weights" not in keys:
            continue
        end = keys.index("attention_weights")
        at = next((i for i, k in enumerate(keys[:end])
                   if k in parts or (k.startswith("layers_") and k[7:].isdigit())), None)
        weights = np.asarray(jax.device_get(weights), np.float32)
        skip, found = 1, {0: weights[0]}  # one layer's [B, N, T, S]
        if at is not None and keys[at] in parts:  # scanned: [groups, B, N, T, S]
            start, period = parts[keys[at]]
            j = int(keys[at + 1][6:]) if period > 1 else 0  # block_<j>
            skip = 2 if period > 1 else 1
            found = {start + g * period + j: w[0] for g, w in enumerate(weights)}
        elif at is not None:
            found = {int(keys[at][7:]): weights[0]}
        name = "/".join(keys[:end] if at is None else keys[:at] + keys[at + skip:end])
        per_layer.setdefault(name, {}).update(found)
    maps = {name: np.stack([layers[i] for i in sorted(layers)])
            for name, layers in sorted(per_layer.items())}
    return maps, {name: tuple(sorted(per_layer[name])) for name in maps}


def missing_layers(config) -> str | None:
    """One line naming the layers that have no attention map, those of a recurrent type
    (`mixers.RECURRENT`: linear_attention, mamba2, conv), or None if every layer has one."""
    stack = transformer_config(config.model)
    by_type: dict[str, list[int]] = {}
    for i in range(stack.num_layers):
        if stack.layer_type(i) in RECURRENT:
            by_type.setdefault(stack.layer_type(i), []).append(i)
    if not by_type:
        return None
    listed = "; ".join(f"{_spans(layers)} ({name})" for name, layers in by_type.items())
    return f"layers without softmax attention, so without a map: {listed}"


def _spans(indices: Sequence[int]) -> str:
    """Sorted layer indices, runs shortened: [0, 1, 2, 5] -> "0..2, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1][1:] = [i]
        else:
            runs.append([i])
    return ", ".join("..".join(map(str, run)) for run in runs)


def token_labels(tokenizer, ids) -> list[str]:
    r"""One short label per token id, each decoded on its own.

    Whitespace is made visible (space "␣", newline and tab as the two characters "\n", "\t"),
    other unprintable characters are escaped, special ids and sentinels are their names and
    bytes that are not complete UTF-8 on their own are hex:

    >>> tokenizer = tokenizers_lib.ByteTokenizer(num_sentinels=1)
    >>> token_labels(tokenizer, tokenizer.encode("h \n\t").tolist() + [0, 2, 233, 263])
    ['h', '␣', '\\n', '\\t', '<pad>', '<eos>', '\\xe2', '<extra_id_0>']
    """
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
        bad = ids[(ids < 0) | (ids >= tokenizer.vocab_size)][0]
        raise ValueError(f"id {int(bad)} out of range: expected 0 <= id < "
                         f"{tokenizer.vocab_size}")
    names = tokenizer.special_names
    first_sentinel = tokenizer.vocab_size - tokenizer.num_sentinels
    labels = []
    for i in ids.tolist():
        if i in names or i >= first_sentinel:
            labels.append(names.get(i) or tokenizer.decode([i]))
            continue
        raw = tokenizer.token_bytes(i)  # `decode` would make a lone byte "\ufffd"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            labels.append("".join(f"\\x{b:02x}" for b in raw))
            continue
        labels.append("".join(_WHITESPACE.get(c) or (c if c.isprintable() else
                                                     ascii(c)[1:-1]) for c in text))
    return labels


def axis_labels(names: Sequence[str], labels: Sequence[str],
                decoder_labels: Sequence[str] | None = None
                ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(query labels, key labels) per map name, for `save_attention_maps`.

    `labels` are those of `tokens` (for T5: the encoder's) and `decoder_labels` those of a T5's
    decoder tokens: decoder maps have decoder queries, and cross attention has encoder keys.
    """
    queries, keys = {}, {}
    for name in names:
        stack, attention = name.split("/")[0], name.split("/")[-1]
        decoder = decoder_labels is not None and stack == "decoder"
        queries[name] = list(decoder_labels if decoder else labels)
        keys[name] = list(decoder_labels if decoder and attention != "cross_attention"
                          else labels)
    return queries, keys


def _per_map(labels, name: str) -> list[str]:
    if not isinstance(labels, Mapping):
        return list(labels)
    if name not in labels:
        raise ValueError(f"labels for {sorted(labels)}: expected labels for {name!r} too")
    return list(labels[name])


def save_attention_maps(maps: Mapping[str, np.ndarray],
                        query_labels: Sequence[str] | Mapping[str, Sequence[str]],
                        key_labels: Sequence[str] | Mapping[str, Sequence[str]],
                        output_dir: str, *,
                        layers: Mapping[str, Sequence[int]] | None = None,
                        layer: int | None = None, head: int | None = None) -> list[str]:
    """Writes `attention.npz`, `<map>_grid.png` per map and per-head `<map>_L<l>_H<h>.png`
    heatmaps into `output_dir` (<map>: the name with "/" -> "."); returns the written paths.

    `query_labels` / `key_labels` label the T rows and S columns of every map, or are dicts of
    them per map name (`axis_labels`). `layers` are each map's layer indices in its stack, as
    `attention_maps` gives them (default 0..layers-1): the <l> of the names and titles. The npz
    holds each map under <map>, its labels under <map>.query_labels / <map>.key_labels and its
    layer indices under <map>.layers. With `layer` (an index <l>) and/or `head` only those
    per-head pictures are written; both, and the label lengths, are checked before anything is
    written. Each heatmap is scaled from 0 to its largest weight.
    """
    layers = {name: [int(i) for i in (range(len(weights)) if layers is None
                                      else layers.get(name, ()))]
              for name, weights in maps.items()}
    _check_maps(maps, layers, query_labels, key_labels, output_dir, layer, head)

    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    stems = {name: name.replace("/", ".") for name in maps}
    arrays = {}
    for name, weights in maps.items():
        arrays[stems[name]] = np.asarray(weights, np.float32)
        arrays[f"{stems[name]}.query_labels"] = np.array(_per_map(query_labels, name), str)
        arrays[f"{stems[name]}.key_labels"] = np.array(_per_map(key_labels, name), str)
        arrays[f"{stems[name]}.layers"] = np.array(layers[name], np.int32)
    written = [os.path.join(output_dir, "attention.npz")]
    np.savez(written[0], **arrays)

    def save(figure, path):
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)

    for name, weights in maps.items():
        weights = np.asarray(weights, np.float32)
        num_layers, num_heads = weights.shape[:2]
        figure, axes = plt.subplots(num_layers, num_heads, squeeze=False,
                                    figsize=(1.6 * num_heads + 0.4, 1.6 * num_layers + 0.6))
        for (i, h), ax in np.ndenumerate(axes):
            ax.imshow(weights[i, h], cmap="viridis", vmin=0.0, vmax=weights[i, h].max() or 1.0,
                      interpolation="nearest")
            ax.set_title(f"L{layers[name][i]} H{h}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
        figure.suptitle(f"{name} (rows: queries, columns: keys)", fontsize=9)
        figure.tight_layout()
        save(figure, os.path.join(output_dir, f"{stems[name]}_grid.png"))

        queries, keys = _per_map(query_labels, name), _per_map(key_labels, name)
        for i, index in enumerate(layers[name]):
            if layer not in (None, index):
                continue
            for h in range(num_heads) if head is None else [head]:
                save(_head_figure(weights[i, h], queries, keys,
                                  f"{name}: layer {index}, head {h}"),
                     os.path.join(output_dir, f"{stems[name]}_L{index}_H{h}.png"))
    return written


def _check_maps(maps, layers, query_labels, key_labels, output_dir, layer, head) -> None:
    """One-line errors for anything `save_attention_maps` cannot write, before it writes."""
    if not maps:
        raise ValueError("maps={}: expected at least one attention map")
    if "://" in str(output_dir):
        raise ValueError(f"output_dir={output_dir!r}: expected a local directory")
    for name, weights in maps.items():
        num_layers, num_heads, t, s = np.shape(weights)
        if len(layers[name]) != num_layers or layers[name] != sorted(set(layers[name])):
            raise ValueError(f"layers[{name!r}]={layers[name]}: expected {num_layers} "
                             "increasing layer indices, one per map")
        if layer is not None and layer not in layers[name]:
            raise ValueError(f"layer={layer}: expected {_spans(layers[name])} (the layers with "
                             f"a {name} map)")
        if head is not None and not 0 <= head < num_heads:
            raise ValueError(f"head={head}: expected 0..{num_heads - 1} ({name} has "
                             f"{num_heads} heads)")
        found = (len(_per_map(query_labels, name)), len(_per_map(key_labels, name)))
        if found != (t, s):
            raise ValueError(f"{name} is {t} queries x {s} keys but got {found[0]} query and "
                             f"{found[1]} key labels")


def _head_figure(weights_TS: np.ndarray, queries: Sequence[str], keys: Sequence[str],
                 title: str):
    """One head's heatmap with its token labels (every k-th on long texts) and a colorbar."""
    import matplotlib.pyplot as plt
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    size = lambda n: min(40.0, max(2.5, 0.16 * min(n, 4 * _MAX_TICK_LABELS)))
    figure, ax = plt.subplots(figsize=(size(len(keys)) + 2.5, size(len(queries)) + 1.5))
    image = ax.imshow(weights_TS, cmap="viridis", vmin=0.0, vmax=weights_TS.max() or 1.0,
                      interpolation="nearest")
    for axis, labels in ((ax.xaxis, keys), (ax.yaxis, queries)):
        every = math.ceil(len(labels) / _MAX_TICK_LABELS)
        ticks = range(0, len(labels), every)
        axis.set_ticks(list(ticks), [labels[j] for j in ticks], fontsize=7)
    ax.tick_params(axis="x", labelrotation=90)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title)
    bar = make_axes_locatable(ax).append_axes("right", size=0.15, pad=0.1)
    figure.colorbar(image, cax=bar)  # as tall as the heatmap
    figure.tight_layout()
    return figure


def default_output_dir(workdir: str, step: int, text: str, target: str = "",
                       prefix_length: int | None = None) -> str:
    """WORKDIR/attention/step<N>-<hash>: one directory per checkpoint and input, so the maps
    of another text (or step) never overwrite these; the hash is of the text, target and
    prefix length (the directory's input.json holds them)."""
    key = json.dumps([text, target, prefix_length])
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return os.path.join(workdir, "attention", f"step{step}-{digest}")


def visualize_workdir(workdir: str, text: str, *, target: str = "", step: int | None = None,
                      layer: int | None = None, head: int | None = None,
                      output_dir: str | None = None, prefix_length: int | None = None
                      ) -> tuple[list[str], list[str]]:
    """Loads a saved run (`generate.load_workdir`), computes its attention maps for `text`
    (and a T5's `target`) and saves them (default: `default_output_dir`, with an input.json
    naming the step and text); (one line per map, its shape and layers, plus
    `missing_layers`'s line in a hybrid stack; the written paths)."""
    from transformer.data import inputs
    from transformer.models import build_model
    from transformer.training import checkpoint as checkpoint_lib
    from transformer.training import finetune
    from transformer.utils import fileio

    if not text:
        raise ValueError("text='': expected a text to read (--text=...)")
    newest = step is None
    step, _ = checkpoint_lib.saved_run(workdir, step)  # this step, even if training saves more
    # ... unless a training deletes it while it is read: then the then-newest one.
    step, config, params = finetune.restore_params(workdir, step, or_newer=newest)
    model = build_model(config.model)
    tokenizer = tokenizers_lib.load_tokenizer(fileio.join(workdir, inputs.TOKENIZER_DIR))
    tokens, decoder_tokens = encode_text(config, tokenizer, text, target)
    maps, layers = attention_maps(model, params, config, tokens, decoder_tokens=decoder_tokens,
                                  prefix_length=prefix_length)
    queries, keys = axis_labels(
        list(maps), token_labels(tokenizer, tokens),
        None if decoder_tokens is None else token_labels(tokenizer, decoder_tokens))
    directory = output_dir or default_output_dir(workdir, step, text, target, prefix_length)
    paths = save_attention_maps(maps, queries, keys, directory, layers=layers, layer=layer,
                                head=head)
    if not output_dir:
        inputs = {"step": step, "text": text, "target": target, "prefix_length": prefix_length}
        paths.append(os.path.join(directory, "input.json"))
        with open(paths[-1], "w") as f:
            json.dump(inputs, f, indent=2)
    lines = []
    for name, weights in maps.items():
        count, heads, t, s = weights.shape
        lines.append(f"{name}: [{count}, {heads}, {t}, {s}] ({count} layers x {heads} heads, "
                     f"{t} queries x {s} keys; layers {_spans(layers[name])})")
    return lines + [line for line in [missing_layers(config)] if line], paths


def main(argv) -> None:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    lines, paths = visualize_workdir(f.workdir, f.text, target=f.target, step=f.step,
                                     layer=f.layer, head=f.head, output_dir=f.output_dir,
                                     prefix_length=f.prefix_length)
    for line in lines + paths:
        print(line)


if __name__ == "__main__":
    from absl import flags

    from transformer.utils import cli

    flags.DEFINE_string("workdir", None, "Training workdir to load.", required=True)
    flags.DEFINE_string("text", None, "Text to read (t5: the encoder input).", required=True)
    flags.DEFINE_string("target", "", "t5: the decoder's text (default: just <bos>).")
    flags.DEFINE_integer("layer", None, "Only this layer's per-head pictures (its index in "
                         "the stack).")
    flags.DEFINE_integer("head", None, "Only this head's per-head pictures.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer("prefix_length", None, "prefix_lm: prefix tokens (default: half).")
    flags.DEFINE_string("output_dir", None, "Where to write (default: WORKDIR/attention/"
                        "step<N>-<hash of the text>).")
    cli.run(main)
