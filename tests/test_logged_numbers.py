"""The numbers a run logs mean what docs/watching.md says: validation is the plain held-out
cross-entropy under label smoothing, train perplexity is exp(unsmoothed cross-entropy) however
the batch is accumulated, grad_norm (and max_grad_norm's test) count only the params the
optimizer trains, and TensorBoard shows one point per step after a resume, as metrics.jsonl."""

from __future__ import annotations

import glob
import importlib.util
import json
import re
import struct
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from tensorboardX.proto import event_pb2
from test_moe import text_batch

from transformer import configs, models
from transformer.training import evaluation, metrics, optim
from transformer.training.state import TrainState
from transformer.training.step import make_seeded_train_step, make_train_step


def tiny_config(**top):
    config = configs.base_config()
    config.update(batch_size=4, seq_len=16, **top)
    config.model.update(family="gpt", num_layers=2, d_model=32, num_heads=4, d_ff=48,
                        vocab_size=64)
    return config


def build(config, scale=1.0):
    """The model, its params (initialised under jit, times `scale`) and a batch whose targets
    are the model's own argmax: the target logits stand well above the mean logit, so label
    smoothing's term ls * (target logit - mean logit) is far from 0."""
    model = models.build_model(config.model)
    params = jax.jit(lambda: jax.tree.map(lambda p: p * scale, nn.unbox(
        model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"])))()
    batch = text_batch()
    batch["weights"][0, :5] = 0.0  # padding counts nowhere
    logits = np.asarray(models.family_of(config).logits(model, params, batch), np.float64)
    batch["targets"] = np.argmax(logits, -1).astype(np.int32)
    return model, params, batch, logits


def reference_ce(logits, batch, label_smoothing=0.0):
    """float64 per-token cross-entropy against targets smoothed toward uniform [B, T]."""
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = np.take_along_axis(log_probs, batch["targets"][..., None], -1)[..., 0]
    return -(1 - label_smoothing) * target - label_smoothing * log_probs.mean(-1)


def weighted_mean(x, batch):
    return float((x * batch["weights"]).sum() / batch["weights"].sum())


def test_validation_loss_is_the_plain_cross_entropy_under_label_smoothing():
    config = tiny_config(label_smoothing=0.1)
    model, params, batch, logits = build(config, scale=3.0)
    plain, smoothed = (reference_ce(logits, batch, ls) for ls in (0.0, 0.1))
    assert abs(weighted_mean(smoothed, batch) - weighted_mean(plain, batch)) > 0.05
    sums = jax.jit(evaluation.make_eval_step(model, config))(params, batch)
    assert float(sums["num_tokens"]) == batch["weights"].sum()
    loss = float(sums["loss_sum"]) / float(sums["num_tokens"])
    np.testing.assert_allclose(loss, weighted_mean(plain, batch), rtol=1e-5)
    # each row's sums (per-window evaluation, val_windows.npz) are plain too
    np.testing.assert_allclose(sums["row_loss_sum"], (plain * batch["weights"]).sum(1),
                               rtol=1e-5)


def test_train_perplexity_is_exp_plain_ce_for_one_or_two_micro_batches():
    values = {}
    for k in (1, 2):
        config = tiny_config(label_smoothing=0.1)
        config.optimizer.grad_accumulation_steps = k
        model, params, batch, logits = build(config, scale=3.0)
        state = TrainState(np.zeros((), np.int32), params, optax.sgd(0.1).init(params),
                           np.asarray(-1, np.int32))
        _, logged = jax.jit(make_train_step(model, config, optax.sgd(0.1)))(state, batch)
        values[k] = (float(logged["perplexity"]), float(logged["loss"]))
    plain, smoothed = (weighted_mean(reference_ce(logits, batch, ls), batch) for ls in (0, 0.1))
    assert np.exp(smoothed) > 1.1 * np.exp(plain)  # the two readings are far apart
    for k, (perplexity, loss) in values.items():
        np.testing.assert_allclose(perplexity, np.exp(plain), rtol=1e-5, err_msg=f"k={k}")
        np.testing.assert_allclose(loss, smoothed, rtol=1e-5, err_msg=f"k={k}")  # trained


FREEZE = "^(embed|decoder/layers)"


def frozen_run(max_grad_norm=0.0, freeze=FREEZE):
    """(params before, the gradients, the step's state and metrics) of one step of a run
    freezing all but the final norm (`freeze`) under adamw with clipping."""
    config = tiny_config(max_grad_norm=max_grad_norm)
    config.optimizer.update(freeze=freeze, warmup_steps=0)
    return one_step(config)


def one_step(config):
    """(params before, the gradients, the step's state and metrics) of one step of `config`'s
    optimizer on `build`'s params and batch."""
    model, params, batch, _ = build(config)
    optimizer = optim.make_optimizer(config)
    state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                       np.asarray(-1, np.int32))
    step = make_seeded_train_step(model, config, optimizer)
    grads, logged = jax.jit(step.gradients)(state, batch, jax.random.key(0))
    new, logged = jax.jit(step.update)(state, grads, logged)
    return params, grads, new, logged


def test_grad_norm_and_max_grad_norm_count_only_the_trainable_params():
    params, grads, new, logged = frozen_run()
    flat = traverse_util.flatten_dict(grads, sep="/")
    every = traverse_util.flatten_dict(frozen_run(freeze="")[1], sep="/")  # nothing frozen
    trainable = [np.asarray(g, np.float64) for name, g in every.items()
                 if not re.search(FREEZE, name)]
    assert trainable and len(trainable) < len(flat)
    for name, g in flat.items():  # a frozen param's gradient is never computed: zeros
        np.testing.assert_allclose(g, 0 if re.search(FREEZE, name) else every[name],
                                   rtol=1e-6, atol=0, err_msg=name)
    norm = np.sqrt(sum((g**2).sum() for g in trainable))
    full = np.sqrt(sum((np.asarray(g, np.float64) ** 2).sum() for g in every.values()))
    assert full > 3 * norm  # the frozen params' gradients dominate the full norm
    np.testing.assert_allclose(float(logged["grad_norm"]), norm, rtol=1e-5)
    # A limit between the two passes the step (and the final norm trains) ...
    params, _, new, _ = frozen_run(max_grad_norm=float(np.sqrt(norm * full)))
    assert int(new.first_nonfinite_step) == -1
    final, before = new.params["decoder"]["final_norm"], params["decoder"]["final_norm"]
    assert not np.allclose(final["scale"], before["scale"])
    # ... and one below the trainable norm still catches it.
    _, _, new, _ = frozen_run(max_grad_norm=float(norm) / 2)
    assert int(new.first_nonfinite_step) == 1


def test_grad_norm_and_its_clipping_are_summed_in_float32_under_bfloat16_params():
    """Under model.param_dtype="bfloat16" the gradients are bfloat16: optax sums their norm in
    bfloat16 (the logged number was rounded to 3 digits, and a deep model's came out low as
    the small leaves' squares were rounded away). The logged grad_norm is the float64 norm of
    the step's bfloat16 gradients to float32 precision, and the clip scales by that norm."""
    config = tiny_config()
    config.model.param_dtype = "bfloat16"
    params, grads, _, logged = one_step(config)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    norm = np.sqrt(sum((g**2).sum() for g in leaves))
    assert logged["grad_norm"].dtype == jnp.float32
    np.testing.assert_allclose(float(logged["grad_norm"]), norm, rtol=1e-5)
    # The clip: many small leaves beside a big one, whose bfloat16 sum drops their squares
    tree = {"big": jnp.full((4,), 8.0, jnp.bfloat16),
            "small": [jnp.full((64,), 0.05, jnp.bfloat16) for _ in range(64)]}
    want = np.sqrt(sum((np.asarray(x, np.float64) ** 2).sum() for x in jax.tree.leaves(tree)))
    clipped, _ = optim.clip_by_global_norm(1.0).update(tree, optax.EmptyState())
    assert {x.dtype for x in jax.tree.leaves(clipped)} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_allclose(float(clipped["big"][0]), 8.0 / want, rtol=4e-3)  # (bf16's ulp)
    # under float32, exactly optax's
    tree32 = optax.tree.cast(tree, jnp.float32)
    mine, theirs = (clip.update(tree32, optax.EmptyState())[0] for clip in (
        optim.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(mine),
                                                     jax.tree.leaves(theirs), strict=True))


# Uneven validation documents in three files (multi-byte characters: bytes are not characters)
VALIDATION_FILES = ["a\n\nthe quick brown fox jumps over it\n\nxy\n",
                    "ünïcode ✓ text\n\n" + "b" * 47 + "\n",
                    "end.\n\nq\n\na last, longer paragraph of plain words\n"]


@pytest.mark.parametrize("unit", ["paragraph", "stream"])
def test_bits_per_byte_is_the_summed_cross_entropy_over_the_bytes(tmp_path, unit):
    """bits_per_byte = the split's summed cross-entropy (nats) / ln 2 / its UTF-8 bytes: packed
    documents, whose first tokens are never targets, and a stream, whose first token only is
    not, alike (neither is the mean loss over all the split's tokens)."""
    from transformer.data import inputs, sources
    from transformer.training import placement as placement_lib

    validation = tmp_path / "validation"
    validation.mkdir()
    for i, text in enumerate(VALIDATION_FILES):
        (validation / f"{i}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "train.txt").write_text("some training text\n\nand more of it\n")
    config = tiny_config()
    config.data.update(path=str(tmp_path / "train.txt"), validation_path=str(validation),
                       tokenizer="byte", unit=unit)
    tokenizer = inputs.get_tokenizer(config)
    config.model.vocab_size = tokenizer.vocab_size
    model = models.build_model(config.model)
    params = jax.jit(lambda: nn.unbox(
        model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]))()
    eval_step = jax.jit(evaluation.make_eval_step(model, config, tokenizer))
    logged = evaluation.evaluate(params, eval_step, config, tokenizer, None,
                                 placement_lib.Placement.from_config(config))
    # float64 cross-entropy summed over every target of the rows a whole pass reads
    summed, targets = 0.0, 0.0
    for batch in inputs.get_dataset(config, tokenizer, "validation", num_epochs=1,
                                    shuffle=False):
        logits = np.asarray(models.family_of(config).logits(model, params, batch), np.float64)
        summed += float((reference_ce(logits, batch) * batch["weights"]).sum())
        targets += float(batch["weights"].sum())
    docs = sources.load_documents(None, "validation", unit=unit,
                                  validation_path=str(validation))
    num_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
    # byte tokens: every byte and <eos> once, less each document's first token (packed) or
    # the stream's first token
    assert targets == logged["num_tokens"] == num_bytes + len(docs) - (
        1 if unit == "stream" else len(docs))
    assert logged["bits_per_byte"] == pytest.approx(summed / np.log(2) / num_bytes, rel=1e-5)


def start_purging_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `logdir` as TensorBoard shows them: the files in name
    (= time) order, and a SessionLog START at step s drops every event seen so far at a step
    >= s (tensorboard's EventAccumulator._CheckForRestartAndMaybePurge, file_version 2)."""
    scalars = {}
    for path in sorted(glob.glob(f"{logdir}/events.out.tfevents.*")):
        data, i = open(path, "rb").read(), 0
        while i < len(data):  # TFRecord: length u64, its crc u32, the record, its crc u32
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 16 + n
            if event.session_log.status == event_pb2.SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step]
                           for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def log_killed_then_resumed(workdir):
    """A run logs steps 10, 20, 30 (loss = step), is killed and resumes from its checkpoint
    at 20, then logs 30 and 40 (loss = step + 0.5)."""
    first = metrics.MetricsLogger(str(workdir), True, 0)
    for step in (10, 20, 30):
        first.write(step, "train", {"loss": float(step)})
    first.close()
    time.sleep(1.05 - time.time() % 1)  # a file name per second: each start its own file
    resumed = metrics.MetricsLogger(str(workdir), True, 20)
    for step in (30, 40):
        resumed.write(step, "train", {"loss": step + 0.5})
    resumed.close()
    return [(10, 10.0), (20, 20.0), (30, 30.5), (40, 40.5)]


class _Killed(Exception):
    pass


class _KilledWriting:
    """A file whose writes are a kill -9 (the process stops inside them)."""

    def __getattr__(self, name):
        if name == "write":
            raise _Killed
        return getattr(self.file, name)

    def __init__(self, file):
        self.file = file


@pytest.mark.parametrize("killed_in", ["tensorboard", "metrics.jsonl"])
def test_a_record_killed_in_the_middle_of_its_writes_is_in_both_after_the_resume(tmp_path,
                                                                                killed_in):
    """Probe p6 of stop 110: metrics.jsonl's line was written first, and a record it holds is
    never written again on resume (`earlier`): a kill before TensorBoard's flush left the
    record out of TensorBoard for good. TensorBoard's comes first now: wherever the kill
    falls, the resumed start writes it to both."""
    first = metrics.MetricsLogger(str(tmp_path), True, 0)
    first.write(10, "train", {"loss": 10.0})
    if killed_in == "tensorboard":
        first.tensorboard.flush = lambda: (_ for _ in ()).throw(_Killed())
    else:
        first.jsonl = _KilledWriting(first.jsonl)
    with pytest.raises(_Killed):
        first.write(10, "validation", {"loss": 9.0})
    time.sleep(1.05 - time.time() % 1)  # a file name per second: each start its own file
    resumed = metrics.MetricsLogger(str(tmp_path), True, 10)  # (the checkpoint at 10)
    resumed.write(10, "validation", {"loss": 9.0})
    resumed.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["split"]) for r in records] == [(10, "train"), (10, "validation")]
    assert start_purging_scalars(tmp_path / "tensorboard")["validation/loss"] == [(10, 9.0)]


def test_tensorboard_drops_the_steps_a_resume_trains_again_as_metrics_jsonl_does(tmp_path):
    expected = log_killed_then_resumed(tmp_path)
    assert len(glob.glob(f"{tmp_path}/tensorboard/events.out.tfevents.*")) == 2
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in records] == expected
    assert start_purging_scalars(tmp_path / "tensorboard")["train/loss"] == expected


def test_elapsed_continues_from_a_signalled_stops_summary_and_drops_a_killed_starts_time(
        tmp_path):
    """A start stopped by a signal saves at its last step after its last record, and its
    summary.json counts that save: the next start continues from the summary (it had continued
    from the record, losing the save's seconds). A summary of another step (a start killed
    after a later checkpoint, an older stop) leaves the record's elapsed."""
    first = metrics.MetricsLogger(str(tmp_path), True, 0)
    for step in (10, 20):
        first.write(step, "train", {"loss": float(step)})
    first.close()
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["elapsed"]
    for summary_step, expected in ((20, logged + 7.5), (10, logged), (30, logged)):
        (tmp_path / "summary.json").write_text(json.dumps({"step": summary_step,
                                                           "elapsed": logged + 7.5}))
        resumed = metrics.MetricsLogger(str(tmp_path), True, 20)
        assert resumed.elapsed_before == expected, summary_step
        resumed.close()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard (the reader itself) is not installed")
def test_tensorboards_own_reader_drops_them_too(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    expected = log_killed_then_resumed(tmp_path)
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("train/loss")] == expected
