"""Pretraining: the train state, the pure jitted train/eval steps and the loop around them.

    python -m transformer.train --config=experiments/<name>.py --workdir=DIR [--config.KEY=VALUE]

With no flags it trains the default experiment (experiments/gpt_tiny.py) into runs/gpt_tiny.
Rerunning the same command on an existing workdir resumes from its latest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from transformer import checkpoint as checkpoint_lib
from transformer import fileio, objectives, sharding
from transformer.data import inputs, pipeline
from transformer.models import build_model

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "experiments", "gpt_tiny.py")


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    first_nonfinite_step: jax.Array  # -1 until a step's loss or grads are NaN/Inf


# --- optimizer ------------------------------------------------------------------------------


def learning_rate_schedule(opt: ml_collections.ConfigDict, steps: int,
                           peak: float | None = None) -> optax.Schedule:
    """Linear warmup to `peak` (default optimizer.learning_rate), then cosine or linear decay to
    min_learning_rate_ratio of it, or constant."""
    peak = opt.learning_rate if peak is None else peak
    warmup = min(opt.warmup_steps, steps)
    end = peak * opt.min_learning_rate_ratio
    if opt.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1),
                                                  max(steps, warmup + 1), end)
    if opt.decay == "linear":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                     optax.linear_schedule(peak, end, max(steps - warmup, 1))],
                                    [warmup])
    if opt.decay == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                     optax.constant_schedule(peak)], [warmup])
    raise ValueError(f"optimizer.decay={opt.decay!r}: expected cosine, linear or constant")


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW with warmup + decay and global-norm clipping; matrices decay, vectors do not.

    Fine-tuning groups (`finetune.param_labels`): params matching the regex optimizer.freeze
    never change (their gradients are zeroed before clipping), and those matching
    optimizer.head train at optimizer.head_learning_rate (0: the same rate).
    """
    opt = config.optimizer
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)

    def adamw(peak):
        return optax.adamw(learning_rate_schedule(opt, config.steps, peak), b1=opt.b1,
                           b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask)

    clip = optax.clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm else \
        optax.identity()
    freeze, head = opt.get("freeze", ""), opt.get("head", "")
    if freeze or head:
        from transformer import finetune

        labels = lambda params: finetune.param_labels(params, freeze, head)
        frozen = lambda params: jax.tree.map(lambda label: label == "frozen", labels(params))
        tx = optax.chain(optax.masked(optax.set_to_zero(), frozen), clip, optax.multi_transform(
            {"frozen": optax.set_to_zero(), "backbone": adamw(opt.learning_rate),
             "head": adamw(opt.get("head_learning_rate", 0.0) or opt.learning_rate)}, labels))
    else:
        tx = optax.chain(clip, adamw(opt.learning_rate))
    if config.get("nonfinite", "stop") == "skip":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=config.max_nonfinite_skips)
    return tx


# --- loss per objective ---------------------------------------------------------------------


def model_logits(model, family: str, params, batch, *, rngs=None, deterministic=True):
    """The model's logits for a batch of pipeline features (see transformer.data.pipeline)."""
    kwargs = dict(rngs=rngs or {}, deterministic=deterministic)
    variables = {"params": params}
    if family == "vit":
        return model.apply(variables, batch["images"], **kwargs)
    if family == "clip":
        return model.apply(variables, batch["images"], batch["texts"], batch["text_segment_ids"],
                           **kwargs)
    if family == "captioner":
        return model.apply(variables, batch["images"], batch["decoder_inputs"], **kwargs)
    if family == "t5":  # padded rows (fine-tuning) mark their padding with segment ids
        return model.apply(variables, batch["encoder_inputs"], batch["decoder_inputs"],
                           encoder_segment_ids=batch.get("encoder_segment_ids"), **kwargs)
    if family == "lstm":
        return model.apply(variables, batch["inputs"], segment_ids=batch["segment_ids"], **kwargs)
    features = dict(segment_ids=batch["segment_ids"], positions=batch["positions"])
    if family == "prefix_lm":
        features["prefix_lengths"] = batch["prefix_lengths"]
    return model.apply(variables, batch["inputs"], **features, **kwargs)


def loss_and_metrics(model, config, params, batch, rng, deterministic):
    logits = model_logits(model, config.model.family, params, batch,
                          rngs=None if rng is None else {"dropout": rng},
                          deterministic=deterministic)
    if config.model.family == "clip":
        from transformer.models import vision

        return vision.contrastive_loss(logits, batch["weights"],
                                       z_loss=config.get("z_loss", 0.0),
                                       label_smoothing=config.get("label_smoothing", 0.0))
    return objectives.cross_entropy(logits, batch["targets"], batch["weights"],
                                    z_loss=config.get("z_loss", 0.0),
                                    label_smoothing=config.get("label_smoothing", 0.0))


def make_train_step(model, config, optimizer):
    """(state, batch) -> (state, metrics): one optimizer update on the global batch.

    With optimizer.grad_accumulation_steps = k the batch is split into k micro-batches whose
    gradients are averaged (weighted by their token counts) before the update.
    """
    accumulation = config.optimizer.grad_accumulation_steps
    base_rng = jax.random.key(config.seed)

    def grads_of(params, batch, rng):
        def loss_fn(p):
            loss, metrics = loss_and_metrics(model, config, p, batch, rng, deterministic=False)
            return loss, metrics
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, metrics

    def train_step(state: TrainState, batch):
        rng = jax.random.fold_in(base_rng, state.step)
        if accumulation == 1:
            grads, metrics = grads_of(state.params, batch, rng)
        else:
            # Micro-batch i takes rows i, i + k, i + 2k, ...: each device keeps its own rows
            # (a contiguous split would move rows between data-parallel shards).
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // accumulation, accumulation,
                                    *x.shape[1:]).swapaxes(0, 1), batch)

            def accumulate(carry, inputs):
                grads_sum, tokens, loss_sum, correct = carry
                micro_batch, i = inputs
                grads, m = grads_of(state.params, micro_batch, jax.random.fold_in(rng, i))
                n = m["num_tokens"]
                grads_sum = jax.tree.map(lambda a, g: a + g * n, grads_sum, grads)
                return (grads_sum, tokens + n, loss_sum + m["loss"] * n,
                        correct + m["accuracy"] * n), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (grads_sum, tokens, loss_sum, correct), _ = jax.lax.scan(
                accumulate, (zeros, 0.0, 0.0, 0.0), (micro, jnp.arange(accumulation)))
            denominator = jnp.maximum(tokens, 1.0)
            grads = jax.tree.map(lambda g: g / denominator, grads_sum)
            loss = loss_sum / denominator
            metrics = {"loss": loss, "perplexity": jnp.exp(loss),
                       "accuracy": correct / denominator, "num_tokens": tokens}
        grad_norm = optax.tree.norm(grads)
        exploded = jnp.asarray(False)
        if config.get("max_grad_norm", 0.0):
            exploded = grad_norm > config.max_grad_norm
            # Under nonfinite="skip", optax.apply_if_finite then skips (and counts) the step.
            grads = jax.tree.map(lambda g: jnp.where(exploded, jnp.nan, g), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params_finite = jax.tree.reduce(
            jnp.logical_and, jax.tree.map(lambda p: jnp.isfinite(p).all(), params))
        finite = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & params_finite
                  & ~exploded)
        step = state.step + 1  # the number the logs and checkpoints give this step
        first_bad = jnp.where((state.first_nonfinite_step < 0) & ~finite, step,
                              state.first_nonfinite_step)
        metrics = {**metrics, "grad_norm": grad_norm}
        return TrainState(state.step + 1, params, opt_state, first_bad), metrics

    return train_step


def make_eval_step(model, config, tokenizer=None):
    """(params, batch) -> summed metrics, so batches can be added up before dividing.

    Labeled tasks also sum a confusion matrix [true class, predicted class] over examples. A
    text-to-text model predicts the class whose name it scores highest (rank classification)
    and counts an exact match where greedy decoding gives the name exactly (every teacher-forced
    argmax right: then greedy decoding follows the same path).
    """
    objective = pipeline.objective_for(config)
    if objective == "text2text":  # every class name as a decoder target: [C, target_len]
        from transformer.data import tasks

        names, target_len = tasks.label_names(tasks.task_for(config),
                                              tokenizer or inputs.get_tokenizer(config))
        rows = [tasks.decoder_features(name, target_len) for name in names]
        candidates = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    elif objective in ("contrastive", "captioning"):  # every class's caption
        from transformer.data import images

        candidates = images.class_captions(tokenizer or inputs.get_tokenizer(config),
                                           config.seq_len, decoder=objective == "captioning")

    def eval_step(params, batch):
        loss, metrics = loss_and_metrics(model, config, params, batch, None, deterministic=True)
        n = metrics["num_tokens"]
        sums = {"loss_sum": metrics["loss"] * n, "correct_sum": metrics["accuracy"] * n,
                "num_tokens": n}
        if objective in ("classification", "image_classification"):
            logits = model_logits(model, config.model.family, params, batch)
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


# --- FLOPs and progress ---------------------------------------------------------------------


def flops_per_token(config, num_params: int) -> float:
    """Model FLOPs per trained token: 6 N (matmuls, forward + backward) + attention scores."""
    m = config.model
    attention = 0 if m.family == "lstm" else 12 * m.num_layers * m.d_model * config.seq_len
    return 6 * num_params + attention


def measured_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a square float32 matmul on one device: the peak MFU is measured against."""
    a = jax.random.normal(jax.random.key(0), (size, size))
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        a = matmul(a) * (1.0 / size)
    a.block_until_ready()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _keep_records_up_to(path: str, step: int) -> list[str]:
    """Drops the metrics a killed run logged after its last checkpoint (they are trained and
    logged again on resume) and any line it left half-written; rewrites the file atomically
    and returns the kept lines."""
    if not fileio.path(path).exists():
        return []
    kept = []
    for line in fileio.path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    fileio.write_atomic(path, "".join(kept))
    return kept


class _Logger:
    """Metrics to JSONL + TensorBoard (process 0), progress lines to the terminal.

    Every record carries `elapsed`: seconds of this run so far, summed over resumes (the time
    a killed run spent after its last checkpoint is dropped with its records).
    """

    def __init__(self, workdir: str, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.interactive = sys.stdout.isatty()
        self.start = time.perf_counter()
        self.elapsed_before = 0.0
        if enabled:
            from tensorboardX import SummaryWriter

            self.path = fileio.join(workdir, "metrics.jsonl")
            lines = _keep_records_up_to(self.path, start_step)
            if lines:
                self.elapsed_before = json.loads(lines[-1]).get("elapsed", 0.0)
            # Object stores cannot append: a remote file is kept in memory and rewritten whole
            # at each record; a local one is appended to.
            remote = fileio.is_remote(self.path)
            self.lines = lines if remote else None
            self.jsonl = None if remote else open(self.path, "a")  # noqa: SIM115
            self.tensorboard = SummaryWriter(fileio.join(workdir, "tensorboard"))

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.start

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        line = json.dumps({"step": step, "split": split, **metrics,
                           "elapsed": self.elapsed()}) + "\n"
        if self.jsonl is None:
            self.lines.append(line)
            fileio.write_atomic(self.path, "".join(self.lines))
        else:
            self.jsonl.write(line)
            self.jsonl.flush()
        for name, value in metrics.items():
            self.tensorboard.add_scalar(f"{split}/{name}", value, step)
        self.tensorboard.flush()

    def print(self, line: str, transient: bool = False) -> None:
        if not self.enabled:
            return
        if self.interactive and transient:
            print("\r" + line.ljust(120), end="", flush=True)
        else:
            print(("\r" if self.interactive else "") + line, flush=True)

    def close(self):
        if self.enabled:
            if self.jsonl is not None:
                self.jsonl.close()
            self.tensorboard.close()


# --- the loop -------------------------------------------------------------------------------


def init_fn(model, config, optimizer, example_batch):
    """rng -> a fresh TrainState whose params (and optimizer moments) are boxed with their
    logical axis names, for `sharding.sharded_init`."""
    def init(rng):
        family = config.model.family
        args = {"t5": ("encoder_inputs", "decoder_inputs"), "vit": ("images",),
                "clip": ("images", "texts", "text_segment_ids"),
                "captioner": ("images", "decoder_inputs")}.get(family, ("inputs",))
        args = [example_batch[name] for name in args]
        params = model.init(rng, *args)["params"]
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                          jnp.full((), -1, jnp.int32))
    return init


# XLA:CPU defaults for the jitted steps, measured side by side with
# benchmarks/train_throughput.py on 2-core AVX-512 machines: with float32 compute, XLA's own
# (Eigen) dots beat its YNNPACK dot fusions at transformer shapes (GPT 6/6/384 train step 1.11x
# faster). Lower-precision compute keeps YNNPACK, which uses the CPU's bfloat16 dot instructions.
CPU_FLOAT32_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> dict:
    """XLA options for the jitted steps: the CPU defaults (float32 on a CPU mesh), then
    config.compiler_options (any XLA option, e.g. {"xla_cpu_multi_thread_eigen": False})."""
    cpu_float32 = (mesh.devices.flat[0].platform == "cpu"
                   and config.model.get("dtype") == "float32")
    defaults = _accepted(tuple(CPU_FLOAT32_OPTIONS.items())) if cpu_float32 else {}
    return {**defaults, **_user_compiler_options(config)}


def _user_compiler_options(config: ml_collections.ConfigDict) -> dict:
    user = dict(config.get("compiler_options") or {})
    if user and (error := _rejection(tuple(sorted(user.items())))):
        raise ValueError(f"compiler_options={user}: XLA rejects them ({error})")
    return user


@functools.cache
def _rejection(options: tuple) -> str | None:
    """Why XLA rejects `options` (compiling a one-op function with them), or None."""
    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=dict(options))
    except Exception as e:  # noqa: BLE001 (XLA raises its own runtime error types)
        return str(e).splitlines()[0]
    return None


def _accepted(options: tuple) -> dict:
    """`options` if this XLA knows them, else none (with a warning): defaults must not break a
    newer jaxlib that renamed an experimental flag."""
    if error := _rejection(options):
        print(f"warning: XLA rejects the default CPU options {dict(options)} ({error}); "
              "compiling without them", file=sys.stderr)
        return {}
    return dict(options)


class Placement:
    """How a run lays out its arrays on the mesh: state shardings from the logical rules, batch
    rows over the data-parallel axes, and which global batch rows this process feeds.

    `compiler_options`: XLA options for the jitted steps (see `compiler_options`)."""

    def __init__(self, mesh: jax.sharding.Mesh, batch_size: int,
                 compiler_options: dict | None = None):
        self.mesh = mesh
        self.batch_size = batch_size
        self.compiler_options = dict(compiler_options or {})
        self.batch_sharding = sharding.batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.rows = pipeline.process_rows(self.batch_sharding, batch_size)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> Placement:
        """The placement of `config`: its mesh over all devices, its batch size and options."""
        mesh = sharding.make_mesh(config.mesh)
        return cls(mesh, config.batch_size, compiler_options(config, mesh))

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return pipeline.make_global_batch(local_batch, self.batch_sharding, self.rows,
                                          batch_size=self.batch_size)

    def jit_train_step(self, train_step, state_sharding):
        """The jitted (state, global batch) -> (state, metrics); the input state is donated."""
        return jax.jit(train_step, donate_argnums=0,
                       in_shardings=(state_sharding, self.batch_sharding),
                       out_shardings=(state_sharding, self.replicated),
                       compiler_options=self.compiler_options)

    def jit_eval_step(self, eval_step, params_sharding):
        return jax.jit(eval_step, in_shardings=(params_sharding, self.batch_sharding),
                       out_shardings=self.replicated, compiler_options=self.compiler_options)

    @contextlib.contextmanager
    def context(self):
        """The mesh and logical rules the model's activation constraints are traced under."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
            yield


def fetch(tree):
    """Host copies of replicated arrays (also when they span processes)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def evaluate(params, eval_step, config, tokenizer, steps: int | None, placement: Placement,
             bytes_per_token=None, split: str = "validation",
             with_confusion: bool = False) -> dict[str, float]:
    """Loss, perplexity, accuracy (and bits per byte for byte/char) on `split`; for labeled
    tasks accuracy and macro-F1 over examples (and exact match for text2text), with the
    confusion matrix [true, predicted] if `with_confusion`.

    `bytes_per_token` is a function giving the validation split's UTF-8 bytes per token, called
    only when bits per byte apply; pass a cached one when evaluating repeatedly.
    """
    dataset = inputs.get_dataset(config, tokenizer, split, num_epochs=1, shuffle=False,
                                 rows=placement.rows)
    totals, iterator, i = None, iter(dataset), 0
    while steps is None or i < steps:
        batch = next(iterator, None)
        if _agreed(batch is None):  # processes' streams can run out at different batches
            break
        sums = eval_step(params, placement.global_batch(batch))
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        i += 1
    if totals is None:
        raise ValueError("the validation split yields no full batch: expected more validation "
                         f"text or a smaller batch_size ({config.batch_size}) / seq_len")
    totals = fetch(totals)
    n = max(float(totals["num_tokens"]), 1.0)
    loss = float(totals["loss_sum"]) / n
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
    if tokenizer.kind in ("byte", "char") and pipeline.objective_for(config) == "next_token":
        if bytes_per_token is None:
            bytes_per_token = functools.partial(inputs.bytes_per_token, config, tokenizer,
                                                "validation")
        metrics["bits_per_byte"] = loss / math.log(2) / bytes_per_token()
    return metrics


def check_eval_seq_len(config, seq_len: int) -> None:
    """One-line error for a validation length the model cannot run at."""
    _check_length(seq_len, "eval_seq_len")
    if config.model.get("position") == "learned" and seq_len > config.model.max_len:
        raise ValueError(f"eval_seq_len={seq_len}: the model learned positions for "
                         f"{config.model.max_len} tokens (model.max_len), and a learned "
                         "position table cannot extrapolate: expected <= "
                         f"{config.model.max_len}")


def _check_length(seq_len, name: str) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"{name}={seq_len!r}: expected an int >= 2")


def evaluate_at_length(params, eval_step, config, tokenizer, seq_len: int,
                       placement: Placement, eval_steps: int | None) -> dict[str, float]:
    """Validation metrics with rows of `seq_len` tokens (length extrapolation: a model trained
    at config.seq_len read at another length). `eval_steps` counts batches at config.seq_len
    and is scaled, so every length reads about as many tokens; None reads the whole split."""
    check_eval_seq_len(config, seq_len)
    at_length = ml_collections.ConfigDict(config.to_dict())
    at_length.seq_len = seq_len
    steps = eval_steps and max(1, round(eval_steps * config.seq_len / seq_len))
    return evaluate(params, eval_step, at_length, tokenizer, steps, placement)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains `config` in `workdir` (resuming if it holds checkpoints); returns final metrics."""
    config = ml_collections.ConfigDict(config.to_dict())
    validate_config(config)
    fileio.path(workdir).mkdir(parents=True, exist_ok=True)
    is_main = jax.process_index() == 0
    tokenizer = inputs.get_tokenizer(config, workdir)
    if not config.model.vocab_size:
        config.model.vocab_size = tokenizer.vocab_size
    elif config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={config.model.vocab_size}: expected >= the "
                         f"tokenizer's {tokenizer.vocab_size}")
    task = inputs.labeled_task(config)  # labeled tasks hold out a test split (end of run)
    classifier = config.model.family == "vit" or (
        config.model.family in ("bert", "gpt", "prefix_lm") and config.model.head == "classify")
    if task is not None and classifier and not config.model.num_classes:
        config.model.num_classes = len(task.labels)
    model = build_model(config.model)
    optimizer = make_optimizer(config)

    placement = Placement.from_config(config)
    if config.get("fresh_start") and is_main:
        moved = checkpoint_lib.set_aside(workdir)
        if moved:
            print(f"fresh_start: moved the existing checkpoints to {moved}")
    _sync("fresh_start")
    train_data = iter(inputs.get_dataset(config, tokenizer, "train", rows=placement.rows))
    manager = checkpoint_lib.Manager(workdir, config)
    start_position = train_data.get_state()  # peek at one batch for shapes, then rewind
    first_batch = next(train_data)
    train_data.set_state(start_position)
    abstract, state_sharding, init = sharding.sharded_init(
        init_fn(model, config, optimizer, first_batch), placement.mesh,
        jax.random.key(config.seed))
    restored = manager.restore_latest(abstract, state_sharding, train_data)
    if restored is None:
        state = init(jax.random.key(config.seed))
        start_step = 0
        if config.get("init_from"):
            from transformer import finetune

            params, report = finetune.load_params(config.init_from, state.params,
                                                  state_sharding.params)
            state = state.replace(params=params)
            if is_main:
                print(report)
    else:
        state, start_step = restored, int(fetch(restored.step))
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(abstract.params))

    train_step = placement.jit_train_step(make_train_step(model, config, optimizer),
                                          state_sharding)
    eval_step = placement.jit_eval_step(make_eval_step(model, config, tokenizer),
                                        state_sharding.params)
    validation_bytes_per_token = functools.cache(
        lambda: inputs.bytes_per_token(config, tokenizer, "validation"))
    logger = _Logger(workdir, is_main, start_step)
    logger.print(f"{config.experiment}: {config.model.family}, {num_params:,} params, "
                 f"batch {config.batch_size} x {config.seq_len}, "
                 f"steps {start_step}..{config.steps}, workdir {workdir}")
    logger.print(sharding.summary(placement.mesh, abstract, state_sharding, config.batch_size))
    if task is not None:
        logger.print(f"task {task.name}: {len(task.labels)} classes; examples per class:\n"
                     + task.balance())

    stop = {"signal": None}

    def request_stop(signum, frame):
        if stop["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (no half-written checkpoint
        stop["signal"] = signum  # is ever picked up: Orbax commits a step only when complete)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    flops = flops_per_token(config, num_params)
    peak = config.get("peak_flops_per_device", 0.0) or measured_peak_flops()
    last_log_time, last_log_step = time.perf_counter(), start_step
    run_start = time.perf_counter()
    last_metrics: dict[str, Any] = {}
    step = start_step
    with placement.context():  # activation sharding constraints trace under the mesh
        try:
            stopping = False
            while step < config.steps and not stopping:
                state, metrics = train_step(state, placement.global_batch(next(train_data)))
                step += 1
                if step % config.log_every == 0 or step == config.steps:
                    metrics = fetch(metrics)
                    _check_finite(state, config)
                    now = time.perf_counter()
                    seconds = (now - last_log_time) / max(step - last_log_step, 1)
                    tokens_per_s = config.batch_size * config.seq_len / seconds
                    lr = float(learning_rate_schedule(config.optimizer, config.steps)(step - 1))
                    record = {k: float(v) for k, v in metrics.items()}
                    record.update(learning_rate=lr, step_time=seconds, tokens_per_s=tokens_per_s)
                    record["mfu"] = tokens_per_s * flops / (peak * len(jax.devices()))
                    logger.write(step, "train", record)
                    eta = (config.steps - step) * seconds
                    logger.print(f"step {step}/{config.steps} loss {record['loss']:.4f} "
                                 f"acc {record['accuracy']:.3f} lr {lr:.2e} "
                                 f"gnorm {record['grad_norm']:.2f} {tokens_per_s:,.0f} tok/s "
                                 f"MFU {record['mfu']:.0%} "
                                 f"ETA {_format_eta(eta)}", transient=True)
                    last_log_time, last_log_step, last_metrics = now, step, record
                if step % config.eval_every == 0 or step == config.steps:
                    evaluation = evaluate(state.params, eval_step, config, tokenizer,
                                          config.eval_steps, placement, validation_bytes_per_token)
                    logger.write(step, "validation", evaluation)
                    logger.print(f"step {step}: validation " + " ".join(
                        f"{k} {v:.4f}" for k, v in evaluation.items() if k != "num_tokens"))
                    last_metrics = {**last_metrics, **{f"val_{k}": v for k, v in
                                                       evaluation.items()}}
                stopping = _agreed(stop["signal"] is not None)
                if step % config.checkpoint_every == 0 or step == config.steps or stopping:
                    _check_finite(state, config)
                    manager.save(step, state, train_data)
            if stopping or _agreed(stop["signal"] is not None):  # also after the last save check
                _check_finite(state, config)
                manager.save(step, state, train_data)
                logger.print(f"received signal {stop['signal'] or 'on another process'}: "
                             f"saved step {step}, exiting")
            if step == config.steps and task is not None and not stopping:
                evaluation = evaluate(state.params, eval_step, config, tokenizer, None,
                                      placement, split="test")
                logger.write(step, "test", evaluation)
                logger.print(f"step {step}: test " + " ".join(
                    f"{k} {v:.4f}" for k, v in evaluation.items() if k != "num_tokens"))
                last_metrics.update({f"test_{k}": v for k, v in evaluation.items()})
            if step == config.steps and config.get("eval_seq_lens") and not stopping:
                for seq_len in config.eval_seq_lens:
                    try:
                        check_eval_seq_len(config, seq_len)
                    except ValueError as error:
                        logger.print(f"validation at length {seq_len}: skipped: {error}")
                        last_metrics[f"val_loss@{seq_len}"] = None
                        continue
                    evaluation = evaluate_at_length(state.params, eval_step, config, tokenizer,
                                                    seq_len, placement, config.eval_steps)
                    logger.write(step, f"validation@{seq_len}", evaluation)
                    logger.print(f"step {step}: validation at length {seq_len} " + " ".join(
                        f"{k} {v:.4f}" for k, v in evaluation.items() if k != "num_tokens"))
                    last_metrics.update({f"val_{k}@{seq_len}": v for k, v in evaluation.items()
                                         if k in ("loss", "accuracy", "bits_per_byte")})
        finally:
            manager.close()  # waits for async saves to finish
            logger.close()
            train_data.close()  # stops Grain's prefetch thread before interpreter shutdown
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    wall = time.perf_counter() - run_start
    summary = {"step": step, "wall_seconds": wall, "elapsed": logger.elapsed(),
               "num_params": num_params, **last_metrics}
    if is_main:
        fileio.write_atomic(fileio.join(workdir, "summary.json"), json.dumps(summary, indent=2))
    return {"summary": summary, "state": state, "model": model, "tokenizer": tokenizer,
            "config": config}


def _sync(name: str) -> None:
    """All processes wait here (a no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"transformer.train.{name}")


def _agreed(flag: bool) -> bool:
    """Whether any process raised `flag`: every process must stop (and save) at the same step.

    Costs a tiny all-gather per call on multi-process runs; free on one process.
    """
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def _check_finite(state: TrainState, config) -> None:
    """Stops the run (before any checkpoint of the bad state) at the first non-finite step."""
    if config.get("nonfinite", "stop") == "skip":
        in_a_row = int(fetch(state.opt_state.notfinite_count))
        if in_a_row > config.max_nonfinite_skips:
            raise FloatingPointError(
                f"{in_a_row} steps in a row had NaN/Inf gradients{_or_exploded(config)} "
                f"(max_nonfinite_skips={config.max_nonfinite_skips}); the last good checkpoint "
                "is kept")
        return
    bad = int(fetch(state.first_nonfinite_step))
    if bad >= 0:
        raise FloatingPointError(
            f"loss, gradients or parameters became NaN/Inf{_or_exploded(config)} at step {bad} "
            f"(batch {bad - 1} of the data stream, counting from 0); the last good checkpoint "
            "is kept (set nonfinite='skip' to skip such batches)")


def _or_exploded(config) -> str:
    limit = config.get("max_grad_norm", 0.0)
    return f", or the gradient norm exceeded max_grad_norm={limit}," if limit else ""


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None,
                    num_processes: int | None = None) -> None:
    """Checks values the config types cannot, with one-line errors, before anything runs
    (against this runtime's devices and processes, or the given counts)."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    num_processes = jax.process_count() if num_processes is None else num_processes
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every",
                 "checkpoint_every"):
        if not isinstance(config[name], int) or config[name] < 1:
            raise ValueError(f"{name}={config[name]!r}: expected a positive int")
    if config.seq_len < 2:
        raise ValueError(f"seq_len={config.seq_len}: expected >= 2")
    k = config.optimizer.grad_accumulation_steps
    if k < 1 or config.batch_size % (k * num_processes):
        raise ValueError(f"batch_size={config.batch_size}: expected a multiple of "
                         f"grad_accumulation_steps={k} x processes={num_processes}")
    mesh = sharding.mesh_shape(config.mesh, num_devices)
    data_parallel = mesh["data"] * mesh["fsdp"]
    if config.batch_size // k % data_parallel:
        raise ValueError(f"batch_size={config.batch_size}: each micro-batch of "
                         f"{config.batch_size // k} rows must split over the data-parallel "
                         f"size {data_parallel} (mesh.data x mesh.fsdp)")
    if not isinstance(config.get("max_grad_norm", 0.0), (int, float)) or \
            config.get("max_grad_norm", 0.0) < 0:
        raise ValueError(f"max_grad_norm={config.max_grad_norm!r}: expected a number >= 0 "
                         "(0: off)")
    if config.get("nonfinite", "stop") not in ("stop", "skip"):
        raise ValueError(f"nonfinite={config.nonfinite!r}: expected 'stop' or 'skip'")
    _user_compiler_options(config)
    for seq_len in config.get("eval_seq_lens", ()):  # lengths past a learned table: skipped
        _check_length(seq_len, "eval_seq_lens entry")
    if config.model.get("position") == "learned" and config.seq_len > config.model.max_len:
        raise ValueError(f"seq_len={config.seq_len}: expected <= model.max_len="
                         f"{config.model.max_len}, the learned position table's size")
    _validate_finetuning(config)
    learning_rate_schedule(config.optimizer, config.steps)
    model = ml_collections.ConfigDict(config.model.to_dict())
    model.num_classes = model.num_classes or 1  # 0: the task's, known once its data is read
    build_model(model)  # validates the architecture (TransformerConfig) up front


def _validate_finetuning(config: ml_collections.ConfigDict) -> None:
    """One-line errors for labeled-task and init_from settings."""
    import re

    objective, family = pipeline.objective_for(config), config.model.family
    task = config.data.get("task", "")
    if objective in pipeline.TASK_OBJECTIVES:
        from transformer.data import tasks

        if task not in tasks.TASKS:
            raise ValueError(f"data.task={task!r}: data.objective={objective!r} expected one "
                             f"of {tasks.TASKS}")
        if objective == "text2text" and family != "t5":
            raise ValueError(f"data.objective='text2text' with model.family={family!r}: "
                             "expected 't5'")
        if objective == "classification" and (family not in ("bert", "gpt", "prefix_lm")
                                              or config.model.head != "classify"):
            raise ValueError(f"data.objective='classification' with model.family={family!r}, "
                             f"model.head={config.model.head!r}: expected family bert or gpt "
                             "with head 'classify'")
    elif objective in pipeline.IMAGE_OBJECTIVES or family in ("vit", "clip", "captioner"):
        wanted = {"vit": "image_classification", "clip": "contrastive",
                  "captioner": "captioning"}.get(family)
        if wanted != objective:
            raise ValueError(f"data.objective={objective!r} with model.family={family!r}: "
                             "expected vit with 'image_classification', clip with "
                             "'contrastive' or captioner with 'captioning'")
    if task and objective not in pipeline.TASK_OBJECTIVES:
        raise ValueError(f"data.task={task!r} with data.objective={objective!r}: expected "
                         f"objective 'classification' or 'text2text'")
    for key in ("freeze", "head"):
        try:
            re.compile(config.optimizer.get(key, ""))
        except re.error as error:
            raise ValueError(f"optimizer.{key}={config.optimizer[key]!r}: expected a regular "
                             f"expression ({error})") from None
    if config.optimizer.get("head_learning_rate", 0.0) < 0:
        raise ValueError(f"optimizer.head_learning_rate={config.optimizer.head_learning_rate}: "
                         "expected >= 0 (0: optimizer.learning_rate)")
    if config.get("init_from"):
        kind, path, step = checkpoint_lib.parse_init_from(config.init_from)
        if kind == "workdir":
            checkpoint_lib.saved_run(path, step)  # a workdir with that checkpoint, or an error
        elif not fileio.path(path).joinpath("config.json").is_file():
            raise FileNotFoundError(f"init_from={config.init_from!r}: expected a save_pretrained "
                                    "directory with config.json")


def main(argv) -> None:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)  # progress lines, not every library's INFO logs
    FLAGS = flags.FLAGS
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                    FLAGS.process_id, cluster=FLAGS.jax_distributed)
    config = FLAGS.config
    workdir = FLAGS.workdir or os.path.join("runs", config.experiment)
    result = train_and_evaluate(config, workdir)
    if jax.process_index() != 0:
        return
    language_model = config.model.family in ("gpt", "prefix_lm", "lstm") and \
        pipeline.objective_for(config) in pipeline.OBJECTIVES
    if language_model and jax.process_count() == 1:
        from transformer import generate

        print("\nsamples:")
        for text in generate.sample_texts(result["model"], result["state"].params,
                                          result["tokenizer"], config, num_samples=3):
            print("---\n" + text)
    print(json.dumps(result["summary"], indent=2))


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Experiment file (get_config).",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Run directory (default runs/<experiment>).")
    flags.DEFINE_string("coordinator_address", None,
                        "host:port of process 0, to run as one of several processes "
                        "(auto-detected on multi-host Cloud TPU).")
    flags.DEFINE_integer("num_processes", None, "With --coordinator_address: process count.")
    flags.DEFINE_integer("process_id", None, "With --coordinator_address: this process's id.")
    flags.DEFINE_bool("jax_distributed", False, "Start jax.distributed from the cluster "
                      "environment (multi-host Cloud TPU; launch.tpu passes it).")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
