"""Evaluation: the jitted eval step's summed metrics per objective (language modelling,
classification, text-to-text, contrastive), `evaluate` over a split, and evaluation at other
sequence lengths."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer.data import inputs, pipeline
from transformer.models import family_of, vision
from transformer.nn import sequence_parallel
from transformer.parallel import sharding
from transformer.training import placement as placement_lib
from transformer.utils import fileio


def make_eval_step(model, config, tokenizer=None):
    """(params, batch) -> summed metrics, so batches can be added up before dividing.

    Labeled tasks also sum a confusion matrix [true class, predicted class] over examples. A
    text-to-text model predicts the class whose name it scores highest (rank classification)
    and counts an exact match where greedy decoding gives the name exactly (every teacher-forced
    argmax right: then greedy decoding follows the same path). Where the family's loss is per
    row (every family but CLIP), each row's summed loss and weight come too, "row_loss_sum"
    and "row_num_tokens" [B] (`evaluate` takes them out).

    The loss is the plain cross-entropy whatever the run's label_smoothing (which shapes the
    training objective, not what is measured): validation loss, perplexity and bits per byte
    are held-out cross-entropy, comparable across smoothing settings.
    """
    objective, family = pipeline.objective_for(config), family_of(config)
    plain = unsmoothed(config)
    if objective == "text2text":  # every class name as a decoder target: [C, target_len]
        from transformer.data import tasks

        tokenizer = tokenizer or inputs.get_tokenizer(config)
        names, target_len = tasks.label_names(tasks.task_for(config), tokenizer)
        rows = [tasks.decoder_features(name, target_len, tokenizer) for name in names]
        candidates = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    elif objective in ("contrastive", "captioning"):  # every class's caption
        from transformer.data import images

        candidates = images.class_captions(tokenizer or inputs.get_tokenizer(config),
                                           config.seq_len, decoder=objective == "captioning")

    def eval_step(params, batch):
        loss, metrics = family.loss_and_metrics(model, plain, params, batch,
                                                rows=family.per_row)
        n = metrics["num_tokens"]
        sums = {"loss_sum": metrics["loss"] * n, "correct_sum": metrics["accuracy"] * n,
                "num_tokens": n}
        if family.per_row:  # each row's (window's) own sums: `evaluate(windows=True)`
            sums.update(row_loss_sum=metrics["row_loss_sum"],
                        row_num_tokens=metrics["row_num_tokens"])
        if objective in ("classification", "image_classification"):
            logits = family.logits(model, params, batch)
            sums["confusion"] = _confusion(batch["targets"], jnp.argmax(logits, -1),
                                           batch["weights"], logits.shape[-1])
        elif objective == "contrastive":  # zero-shot: the class caption closest to the image
            images_BE = model.apply({"params": params}, batch["images"],
                                    method="embed_images")
            classes_CE = model.apply({"params": params}, candidates["texts"],
                                     candidates["text_segment_ids"], method="embed_texts")
            sums["confusion"] = _confusion(batch["targets"],
                                           jnp.argmax(images_BE @ classes_CE.T, -1),
                                           batch["weights"], classes_CE.shape[0])
        elif objective in ("text2text", "captioning"):
            sums.update(_text2text_sums(model, params, batch, candidates))
        return sums

    return eval_step


def unsmoothed(config):
    """`config` with label_smoothing 0 (itself when it has none)."""
    if not config.get("label_smoothing", 0.0):
        return config
    plain = ml_collections.ConfigDict(config.to_dict())
    plain.label_smoothing = 0.0
    return plain


def _confusion(labels_B, predictions_B, weights_B, num_classes: int) -> jax.Array:
    return jnp.einsum("bi,bj->ij", jax.nn.one_hot(labels_B, num_classes) * weights_B[:, None],
                      jax.nn.one_hot(predictions_B, num_classes))


def _text2text_sums(model, params, batch, candidates):
    """Exact matches and the rank-classification confusion matrix of a text2text batch."""
    variables = {"params": params}
    weights_BT = batch["weights"]
    example_B = weights_BT[:, 0]  # 1 for real rows, 0 for the rows padding a last batch
    # The encoder reads text (T5) or an image (the captioner: every patch is real).
    encoder_inputs = batch["encoder_inputs"] if "encoder_inputs" in batch else batch["images"]
    segments = batch.get("encoder_segment_ids")
    encoded_BSD = model.apply(variables, encoder_inputs, segment_ids=segments, method="encode")
    logits_BTV = model.apply(variables, encoded_BSD, batch["decoder_inputs"],
                             encoder_segment_ids=segments, method="decode")
    right_BT = (jnp.argmax(logits_BTV, -1) == batch["targets"]) | (weights_BT == 0)
    exact = jnp.sum(jnp.all(right_BT, axis=1) * example_B)
    # Score every class name: the batch repeated once per class [C * B, ...].
    C, B = candidates["targets"].shape[0], example_B.shape[0]
    repeat = lambda x: jnp.repeat(x[None], C, axis=0).reshape(C * B, *x.shape[1:])
    tile = lambda x: jnp.repeat(jnp.asarray(x)[:, None], B, axis=1).reshape(C * B, -1)
    logits = model.apply(variables, repeat(encoded_BSD), tile(candidates["decoder_inputs"]),
                         encoder_segment_ids=None if segments is None else repeat(segments),
                         method="decode")
    log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                                    tile(candidates["targets"])[..., None], -1)[..., 0]
    scores_CB = jnp.sum(log_probs * tile(candidates["weights"]), -1).reshape(C, B)
    return {"exact_match_sum": exact, "num_examples": jnp.sum(example_B),
            "confusion": _confusion(batch["label"], jnp.argmax(scores_CB, 0), example_B, C)}


def classification_metrics(confusion: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1 (the mean over classes of F1; a class never predicted nor present
    counts 0) from a confusion matrix [true, predicted].

    >>> classification_metrics(np.array([[2, 0], [1, 1]]))
    {'accuracy': 0.75, 'macro_f1': 0.7333333333333334}
    """
    confusion = np.asarray(confusion, np.float64)
    true_positive = np.diag(confusion)
    precision = true_positive / np.maximum(confusion.sum(0), 1e-12)
    recall = true_positive / np.maximum(confusion.sum(1), 1e-12)
    f1 = np.where(precision + recall > 0,
                  2 * precision * recall / np.maximum(precision + recall, 1e-12), 0.0)
    return {"accuracy": float(true_positive.sum() / max(confusion.sum(), 1.0)),
            "macro_f1": float(f1.mean())}


def evaluate(params, eval_step, config, tokenizer, steps: int | None,
             placement: placement_lib.Placement, bytes_per_token=None, split: str = "validation",
             with_confusion: bool = False, windows: bool = False) -> dict[str, float]:
    """Loss, perplexity, accuracy (and bits per byte for byte/char) on `split`; for labeled
    tasks accuracy and macro-F1 over examples (and exact match for text2text), with the
    confusion matrix [true, predicted] if `with_confusion`.

    `bytes_per_token` is a function giving the validation split's UTF-8 bytes per target token
    (`inputs.bytes_per_token`), called only when bits per byte apply; pass a cached one when
    evaluating repeatedly.

    A mixture (data.sources) evaluates each source's validation split on its own (`steps`
    batches each, or all of it) and returns their token-weighted total with the sources'
    metrics under "by_source"; `bytes_per_token` then takes the source's name.

    With `windows` (and a per-row loss, `make_eval_step`), the result also holds "windows":
    `Windows`, each evaluated row's summed loss and weight in pass order, from this same pass
    (their total over their tokens is the loss, to float32 rounding).
    """
    if split == "validation" and (mixture := inputs.source_configs(config)):
        return _evaluate_mixture(params, eval_step, mixture, tokenizer, steps, placement,
                                 bytes_per_token, windows)
    totals, rows = _pass(params, eval_step, config, tokenizer, split, steps, placement, windows)
    n = max(float(totals["num_tokens"]), 1.0)
    loss = float(totals["loss_sum"]) / n  # (the windows' own total agrees: test_val_windows)
    metrics = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
               "accuracy": float(totals["correct_sum"]) / n, "num_tokens": n}
    if "confusion" in totals:  # a labeled task: accuracy and macro-F1 over examples
        if "exact_match_sum" in totals:
            examples = max(float(totals["num_examples"]), 1.0)
            metrics.update(token_accuracy=metrics["accuracy"], num_examples=examples,
                           exact_match=float(totals["exact_match_sum"]) / examples)
        metrics.update(classification_metrics(totals["confusion"]))
        if with_confusion:
            metrics["confusion"] = totals["confusion"].astype(int).tolist()
    if rows is not None:
        metrics["windows"] = rows
    if tokenizer.kind in ("byte", "char") and pipeline.objective_for(config) == "next_token":
        if bytes_per_token is None:
            bytes_per_token = functools.partial(inputs.bytes_per_token, config, tokenizer,
                                                split)
        # the summed cross-entropy / ln 2 / the split's bytes; a partial pass (`steps`) reads a
        # seeded sample of the windows and scales its mean loss by the split's targets / bytes
        metrics["bits_per_byte"] = loss / math.log(2) / bytes_per_token()
    return metrics


def _pass(params, eval_step, config, tokenizer, split: str, steps: int | None,
          placement: placement_lib.Placement, windows: bool):
    """(the summed metrics, `Windows` if `windows` and the step gives rows, else None) of one
    pass over `split` (`steps` batches, or all of it) in its fixed seeded window order."""
    dataset = inputs.get_dataset(config, tokenizer, split, num_epochs=1, shuffle=True,
                                 rows=placement.rows)
    totals, iterator, i, rows, digest = None, iter(dataset), 0, [], hashlib.sha256()
    while steps is None or i < steps:
        batch = next(iterator, None)
        if placement_lib.agreed(batch is None):  # streams can run out at different batches
            break
        if windows:  # what the rows hold (this process's rows of the global batch)
            for key in sorted(batch):
                digest.update(key.encode() + np.ascontiguousarray(batch[key]).tobytes())
        sums = eval_step(params, placement.global_batch(batch))
        row_sums = [sums.pop(k, None) for k in ("row_loss_sum", "row_num_tokens")]
        if windows and row_sums[0] is not None:
            rows.append(row_sums)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        i += 1
    if totals is None:
        raise ValueError(f"the {split} split yields no full batch: expected more {split} "
                         f"text or a smaller batch_size ({config.batch_size}) / seq_len")
    if not rows:
        return placement_lib.fetch(totals), None
    totals, rows = placement_lib.fetch((totals, rows))
    loss_sum, num_tokens = (np.concatenate([r[j] for r in rows]).astype(np.float64)
                            for j in (0, 1))
    return totals, Windows(loss_sum, num_tokens, digest.hexdigest()[:16])


@dataclasses.dataclass(frozen=True)
class Windows:
    """An evaluation pass's rows (windows of a text split, examples of a labeled one), in its
    order: each one's summed loss and weight (its tokens), and `fingerprint`, a hash of their
    content (the features of every row of the pass, padding rows included; on several
    processes, the first process's rows). Two passes with one fingerprint read the same rows.
    The pass's loss is loss_sum.sum() / num_tokens.sum()."""

    loss_sum: np.ndarray  # [W] float64
    num_tokens: np.ndarray  # [W] float64
    fingerprint: str

    @staticmethod
    def concatenate(parts: list[Windows]) -> Windows:
        return Windows(np.concatenate([w.loss_sum for w in parts]),
                       np.concatenate([w.num_tokens for w in parts]),
                       hashlib.sha256("".join(w.fingerprint for w in parts).encode()
                                      ).hexdigest()[:16])


WINDOWS_FILE = "val_windows.npz"


def save_windows(workdir: str, step: int, windows: Windows) -> None:
    """Writes WORKDIR/val_windows.npz (process 0 only): `step`, and the final validation pass's
    per-window loss_sum, num_tokens and fingerprint (`Windows`), whose token-weighted mean
    loss_sum.sum() / num_tokens.sum() is the val_loss logged at that step."""
    if jax.process_index() != 0:
        return
    buffer = io.BytesIO()
    np.savez(buffer, step=np.int64(step), loss_sum=windows.loss_sum,
             num_tokens=windows.num_tokens, fingerprint=np.str_(windows.fingerprint))
    fileio.write_atomic(fileio.join(workdir, WINDOWS_FILE), buffer.getvalue())


def load_windows(workdir: str) -> dict | None:
    """WORKDIR/val_windows.npz as {"step", "loss_sum", "num_tokens", "fingerprint"}, or None."""
    path = fileio.path(workdir) / WINDOWS_FILE
    if not path.exists():
        return None
    with np.load(io.BytesIO(path.read_bytes())) as saved:
        return {"step": int(saved["step"]), "loss_sum": saved["loss_sum"],
                "num_tokens": saved["num_tokens"], "fingerprint": str(saved["fingerprint"])}


def _evaluate_mixture(params, eval_step, mixture, tokenizer, steps, placement,
                      bytes_per_token, windows: bool = False) -> dict:
    """Each source's validation metrics and their total, every token evaluated counting once:
    the loss and accuracy averaged over all sources' tokens, bits per byte over all their bytes
    (with `steps`, each source's `steps` batches: the sources count alike, not by their splits'
    sizes as in a whole pass). With `windows`, the total's windows are the sources' one after
    another."""
    by_source, source_bytes_per_token = {}, {}
    for name, one in mixture.items():
        source_bytes_per_token[name] = functools.cache(
            functools.partial(inputs.bytes_per_token, one, tokenizer, "validation")
            if bytes_per_token is None else functools.partial(bytes_per_token, name))
        by_source[name] = evaluate(params, eval_step, one, tokenizer, steps, placement,
                                   source_bytes_per_token[name], windows=windows)
    parts = [m.pop("windows") for m in by_source.values() if "windows" in m]
    tokens = {name: m["num_tokens"] for name, m in by_source.items()}
    n = sum(tokens.values())
    loss = sum(m["loss"] * tokens[name] for name, m in by_source.items()) / n
    total = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
             "accuracy": sum(m["accuracy"] * tokens[name] for name, m in by_source.items()) / n,
             "num_tokens": n}
    if all("bits_per_byte" in m for m in by_source.values()):
        # bits per byte = all the sources' bits over all their bytes (cached: computed above;
        # bytes per target token times the targets scored)
        num_bytes = sum(source_bytes_per_token[name]() * tokens[name] for name in by_source)
        total["bits_per_byte"] = loss * n / math.log(2) / num_bytes
    if parts and len(parts) == len(by_source):
        total["windows"] = Windows.concatenate(parts)
    return {**total, "by_source": by_source}


def sequence_balanced(config) -> bool:
    """Whether a sequence-parallel mesh lays the rows out in 2 x sequence load-balanced chunks
    (decoder LMs, unless model.sequence_load_balance=False; `transformer.nn.sequence_parallel`)."""
    return (family_of(config.model).decoding in ("causal", "prefix")
            and config.model.get("sequence_load_balance", True))


def check_eval_seq_len(config, seq_len: int, tokenizer=None) -> None:
    """One-line error for a validation length the model cannot run at: on config.mesh (the
    mesh the evaluation runs on), the length must split over its `sequence` axis as training's
    seq_len did (`configs.check_sequence_split`); span corruption's spans need as many
    sentinels (data.num_sentinels, and `tokenizer`'s if given)."""
    check_length(seq_len, "eval_seq_len")
    if family_of(config.model) is vision.VIT and seq_len != (
            tokens := vision.image_tokens(config.model)):  # (as training's seq_len is refused)
        raise ValueError(f"eval_seq_len={seq_len}: a ViT reads {tokens} tokens an image "
                         "whatever the length (its rows are images): expected only "
                         f"seq_len={tokens}")
    sequence = config.mesh.get("sequence", 1)
    if sequence == -1:  # the devices the other axes leave
        sequence = sharding.mesh_shape(config.mesh, jax.device_count())["sequence"]
    if sequence > 1:
        sequence_parallel.check_length(seq_len, sequence, load_balance=sequence_balanced(config),
                                       what="eval_seq_len")
    if pipeline.objective_for(config) == "span_corruption":  # (as training's length is)
        pipeline.check_span_sentinels(config.data, seq_len, "eval_seq_len", tokenizer)
    if config.model.get("position") == "learned" and seq_len > config.model.max_len:
        raise ValueError(f"eval_seq_len={seq_len}: the model learned positions for "
                         f"{config.model.max_len} tokens (model.max_len), and a learned "
                         "position table cannot extrapolate: expected <= "
                         f"{config.model.max_len}")


def check_length(seq_len, name: str) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"{name}={seq_len!r}: expected an int >= 2")


def evaluate_at_length(params, eval_step, config, tokenizer, seq_len: int,
                       placement: placement_lib.Placement, eval_steps: int | None,
                       split: str = "validation") -> dict[str, float]:
    """`split`'s metrics with rows of `seq_len` tokens (length extrapolation: a model trained
    at config.seq_len read at another length). `eval_steps` counts batches at config.seq_len
    and is scaled, so every length reads about as many tokens; None reads the whole split."""
    check_eval_seq_len(config, seq_len, tokenizer)
    at_length = ml_collections.ConfigDict(config.to_dict())
    at_length.seq_len = seq_len
    steps = eval_steps and max(1, round(eval_steps * config.seq_len / seq_len))
    return evaluate(params, eval_step, at_length, tokenizer, steps, placement, split=split)
