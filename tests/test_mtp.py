"""Multi-token prediction (transformer.nn.mtp) and speculative decoding with its modules as the
draft (transformer.generation.speculative): the modules see no token they predict, the loss is
next-token loss plus the weighted mean of theirs, evaluation is next-token alone, greedy
speculative decoding equals greedy decoding token for token, with each round accepting exactly
the drafts that the modules, run over the whole true sequence, get right, and speculative
sampling draws sequences with the LM's own sampling probabilities."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats
from test_moe import text_batch
from test_train import assert_succeeded, read_metrics, run_cli, tiny_flags

from transformer import configs, models
from transformer.data import features
from transformer.generation.programs import decode
from transformer.generation.speculative import speculative_decode
from transformer.training import metrics as metrics_lib
from transformer.training.state import TrainState
from transformer.training.step import make_seeded_train_step, make_train_step


def mtp_config(depth=2, vocab=64, **model):
    config = configs.base_config()
    config.update(batch_size=4, seq_len=16)
    config.model.update({**dict(family="gpt", num_layers=2, d_model=32, num_heads=4, d_ff=48,
                                vocab_size=vocab, activation="swiglu", norm="rmsnorm",
                                use_bias=False), **model})
    config.model.mtp.depth = depth
    return config


def build(config, seed=0, scale=1.0):
    """The model and its params, initialised under jit (eager Linen runs op by op)."""
    model = models.build_model(config.model)
    init = jax.jit(lambda: jax.tree.map(lambda p: p * scale, nn.unbox(
        model.init(jax.random.key(seed), jnp.ones((1, 8), jnp.int32))["params"])))
    return model, init()


@functools.partial(jax.jit, static_argnums=0)
def _mtp_logits(model, params, batch):
    _, state = model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                           segment_ids=batch["segment_ids"], mtp_tokens=batch["targets"],
                           mutable=["mtp"])
    return state["mtp"]["logits"][0]


def mtp_logits(model, params, batch):
    return np.asarray(_mtp_logits(model, params, batch), np.float64)


def test_module_k_sees_the_tokens_up_to_i_plus_k_and_none_it_predicts():
    config = mtp_config(depth=2)
    model, params = build(config)
    batch = text_batch()
    base = mtp_logits(model, params, batch)
    i = 5
    for k in (1, 2):
        for j, moved in ((i + k - 1, True), (i + k, False), (i + k + 1, False)):
            # change token t_{j+1} (targets[j]): module k at position i reads t_{i+k} only
            changed = {**batch, "targets": batch["targets"].copy()}
            changed["targets"][:, j] = (changed["targets"][:, j] + 1) % 64
            if j + 1 < batch["inputs"].shape[1]:
                changed["inputs"] = batch["inputs"].copy()
                changed["inputs"][:, j + 1] = changed["targets"][:, j]
            out = mtp_logits(model, params, changed)
            same = np.allclose(out[k - 1, :, i], base[k - 1, :, i], atol=1e-6)
            assert same != moved, (k, j)


def test_the_loss_is_next_token_plus_the_weighted_mean_of_each_depth_and_eval_is_next_token():
    config = mtp_config(depth=2)
    config.model.mtp.loss_weight = 0.5
    model, params = build(config)
    batch = text_batch()
    batch["segment_ids"][:, 10:] = 2  # two documents a row: no prediction crosses the border
    batch["positions"][:, 10:] -= 10
    family = models.family_of(config)
    loss_and_metrics = lambda model, config, mtp=False: jax.jit(
        lambda p, batch: family.loss_and_metrics(model, config, p, batch, mtp=mtp))
    loss, metrics = loss_and_metrics(model, config, mtp=True)(params, batch)
    logits = mtp_logits(model, params, batch)
    expected = []
    for k in (1, 2):
        ce = []
        for b in range(4):
            for i in range(16 - k):
                if batch["segment_ids"][b, i] == batch["segment_ids"][b, i + k]:
                    row = logits[k - 1, b, i]
                    lse = np.log(np.exp(row - row.max()).sum()) + row.max()
                    ce.append(lse - row[batch["targets"][b, i + k]])
        assert float(metrics[f"mtp_loss/{k}"]) == pytest.approx(np.mean(ce), rel=1e-5)
        expected.append(np.mean(ce))
    assert float(loss) == pytest.approx(float(metrics["loss"]) + 0.5 * np.mean(expected),
                                        rel=1e-5)
    # Evaluation (mtp=False) is the next-token loss alone, equal to the model without modules.
    plain_config = mtp_config(depth=0)
    plain, _ = build(plain_config)
    trunk = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    eval_loss, eval_metrics = loss_and_metrics(model, config)(params, batch)
    plain_loss, _ = loss_and_metrics(plain, plain_config)(trunk, batch)
    assert float(eval_loss) == float(plain_loss) == float(metrics["loss"])
    assert not any(k.startswith("mtp") for k in eval_metrics)


def test_the_train_step_logs_each_depth_and_its_gradient_reaches_the_trunk():
    config = mtp_config(depth=2)
    model, params = build(config)
    batch = text_batch()
    optimizer = optax.sgd(0.1)
    state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                       np.asarray(-1, np.int32))
    _, metrics = jax.jit(make_train_step(model, config, optimizer))(state, batch)
    assert {"mtp_loss/1", "mtp_loss/2"} <= set(metrics)
    family = models.family_of(config)
    ahead = lambda p: family.loss_and_metrics(model, config, p, batch, mtp=True)[0] - \
        family.loss_and_metrics(model, config, p, batch)[0]
    grads = jax.jit(jax.grad(ahead))(params)
    assert np.abs(grads["decoder"]["layers_0"]["mlp"]["wo"]).max() > 0  # the trunk learns
    assert np.abs(grads["mtp_1"]["projection"]).max() > 0


def packed_batch(documents, length=16, vocab=64):
    """The next-token features (`features.next_token_features`) of rows of packed documents
    of the given lengths, each row right-padded to `length` + 1 slots."""
    rng = np.random.default_rng(1)
    segments = np.zeros((len(documents), length + 1), np.int32)
    positions = np.zeros_like(segments)
    for row, lengths in enumerate(documents):
        start = 0
        for segment, n in enumerate(lengths, 1):
            segments[row, start:start + n], positions[row, start:start + n] = segment, range(n)
            start += n
    tokens = np.where(segments > 0, rng.integers(1, vocab, segments.shape), 0).astype(np.int32)
    return features.next_token_features({"tokens": tokens, "tokens_segment_ids": segments,
                                         "tokens_positions": positions})


def test_accumulated_micro_batches_weight_each_module_by_its_own_targets():
    """With grad_accumulation_steps 4, the step's gradients and each mtp_loss/<k> are those
    of the whole batch, though each micro-batch holds a different share of module k's targets
    (short documents and padding cut more of them); a micro-batch of padding alone adds
    nothing, NaN included."""
    # Micro-batch i takes rows i and i + 4 (step.py): their documents differ in length, and
    # micro-batch 2's module 2 has few targets. Weighted by the next-token counts, the means
    # were off by 4e-4 to 2e-3 and the gradients by 6-7% (in norm); now by 2e-7 and 9e-7.
    documents = [[3, 4, 10], [17], [2, 2, 3, 10], [6], [17], [5, 12], [2] * 8, [17]]
    batches = [packed_batch(documents),
               packed_batch(documents[:3] + [[]] + documents[4:7] + [[]])]  # rows 3, 7 empty
    results = {}
    for accumulation in (1, 4):
        config = mtp_config(depth=2)
        config.update(batch_size=8)
        config.optimizer.grad_accumulation_steps = accumulation
        model, params = build(config)
        optimizer = optax.sgd(0.1)
        state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                           np.asarray(-1, np.int32))
        gradients = jax.jit(make_seeded_train_step(model, config, optimizer).gradients)
        results[accumulation] = [gradients(state, batch, jax.random.key(0))
                                 for batch in batches]
    for (grads_1, logged_1), (grads_4, logged_4) in zip(results[1], results[4], strict=True):
        for name in ("loss", "mtp_loss/1", "mtp_loss/2"):
            np.testing.assert_allclose(logged_4[name], logged_1[name], rtol=2e-6, err_msg=name)
        flat_1, flat_4 = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
                          for grads in (grads_1, grads_4))
        assert np.isfinite(flat_4).all()
        assert np.linalg.norm(flat_4 - flat_1) <= 1e-5 * np.linalg.norm(flat_1)


@pytest.mark.slow
def test_an_expert_module_balances_its_experts_as_the_stack_does_and_remat_changes_nothing():
    """An MoE stack's module has experts too: its load is logged as layer 0 of `mtp_0` and its
    balance bias moves by the rate times the sign of its load error."""
    config = mtp_config(depth=1)
    config.model.moe.update(num_experts=4, top_k=2, capacity_factor=0.0, score="sigmoid",
                            balance_bias=True, bias_update_rate=0.05)
    model, params = build(config)
    batch = text_batch()
    sown = jax.jit(lambda params, batch: model.apply(
        {"params": params}, batch["inputs"], mtp_tokens=batch["targets"],
        segment_ids=batch["segment_ids"], positions=batch["positions"], mutable=["losses"])[1])(
        params, batch)
    load = np.asarray(sown["losses"]["mtp_0"]["layers_0"]["moe"]["expert_load"][0])
    optimizer = optax.sgd(0.0)
    state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                       np.asarray(-1, np.int32))
    new, metrics = jax.jit(make_train_step(model, config, optimizer))(state, batch)
    assert float(metrics["moe_imbalance/mtp_0_0"]) == pytest.approx(load.max() * 4, rel=1e-6)
    moved = np.asarray(new.params["mtp_0"]["layers_0"]["moe"]["balance_bias"]) - \
        np.asarray(params["mtp_0"]["layers_0"]["moe"]["balance_bias"])
    np.testing.assert_allclose(moved, 0.05 * np.sign(1 / 4 - load), atol=1e-7)
    family = models.family_of(config)
    remat = mtp_config(depth=1, remat_policy="full")
    remat.model.moe.update(config.model.moe)
    loss = lambda c, p: jax.jit(lambda p: family.loss_and_metrics(
        models.build_model(c.model), c, p, batch, mtp=True)[0])(p)
    assert float(loss(remat, params)) == pytest.approx(float(loss(config, params)), rel=1e-6)


def test_a_zigzag_sequence_axis_is_refused_before_anything_compiles():
    config = mtp_config(depth=1)
    with pytest.raises(ValueError, match="mtp.depth=1 with mesh.sequence=2"):
        configs.check_sequence_split(config, {"sequence": 2})
    config.model.sequence_load_balance = False
    configs.check_sequence_split(config, {"sequence": 2})


def test_flops_count_each_module_block_and_head_pass():
    config = mtp_config(depth=2)
    plain = mtp_config(depth=0)
    n = 10_000
    extra = metrics_lib.flops_per_token(config, n) - metrics_lib.flops_per_token(plain, n)
    attention = 12 * 32 * 16  # one layer's scores and values at seq_len 16
    assert extra == 2 * (attention + 6 * 64 * 32)


@pytest.mark.parametrize("settings", [
    dict(family="prefix_lm"), dict(position="alibi")], ids=["prefix_lm", "alibi"])
def test_settings_the_modules_cannot_take_are_refused(settings):
    config = mtp_config(depth=1, **settings)
    with pytest.raises(ValueError, match="mtp.depth=1"):
        models.build_model(config.model)


# --- speculative decoding ----------------------------------------------------------------------


def simulated_rounds(model, params, prompt, tokens, depth, n, max_new_tokens):
    """(rounds, accepted drafts, offered drafts) that exact drafting gives on the final
    sequence: at each round (tokens known up to position m - 1) module k's draft is its argmax
    at position m - 2 over the true sequence, and the LM keeps drafts while they equal the true
    tokens; a round offers the drafts for positions below prompt + max_new_tokens."""
    seq = np.concatenate([prompt, tokens[:n]]).astype(np.int32)
    batch = {"inputs": seq[None, :-1], "targets": seq[None, 1:],
             "positions": np.arange(len(seq) - 1)[None], "segment_ids": None}
    logits = jax.jit(lambda params, inputs, targets: model.apply(
        {"params": params}, inputs, mtp_tokens=targets, mutable=["mtp"])[1]["mtp"]["logits"][0])(
        params, batch["inputs"], batch["targets"])
    drafts = np.argmax(np.asarray(logits), axis=-1)[:, 0]  # [D, T]
    p, rounds, accepted, offered = len(prompt), 0, 0, 0
    m = p + 1
    while m < p + n:
        offered += min(depth, p + max_new_tokens - m - 1)
        agreed = 0
        for k in range(1, depth + 1):
            if m - 1 + k >= p + n or drafts[k - 1, m - 2] != seq[m - 1 + k]:
                break
            agreed += 1
        rounds, accepted, m = rounds + 1, accepted + agreed, m + agreed + 1
    return rounds, accepted, offered


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 3])
def test_speculative_greedy_equals_greedy_and_accepts_exactly_the_right_drafts(depth):
    config = mtp_config(depth=depth, vocab=6)  # few ids: many drafts come out right
    model, params = build(config, seed=depth, scale=2.0)
    prompts = [[3, 4, 5], [1, 2, 3, 4, 5, 1, 2], [4]]
    for eos in (None, 2):
        want, want_lengths = decode(model, params, prompts, max_new_tokens=17, temperature=0.0,
                                    eos_id=eos, banned_ids=[0])
        got, lengths, stats = speculative_decode(model, params, prompts, max_new_tokens=17,
                                                 eos_id=eos, banned_ids=[0])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(lengths, want_lengths)
    for b, prompt in enumerate(prompts):  # eos 2: each row up to its EOS
        counts = simulated_rounds(model, params, np.array(prompt), got[b], depth,
                                  int(lengths[b]), max_new_tokens=17)
        assert (stats.rounds[b], stats.accepted[b], stats.offered[b]) == counts, b
    assert stats.accepted.sum() > 0  # the drafts did some of the work
    assert stats.tokens == lengths.sum()  # the prompt's pass gives each row its first token
    _, lengths, stats = speculative_decode(model, params, prompts, max_new_tokens=1)
    assert (stats.tokens, stats.rounds.sum(), stats.offered.sum()) == (3, 0, 0)


@pytest.mark.slow
def test_speculative_text_by_default_fills_what_a_learned_position_table_holds():
    """The default length fills the training context, less the 2 D positions the drafts take
    past the last new token in a learned table (which `speculative_decode` checks), and the
    text is the greedy one."""
    from transformer.data.tokenizers import ByteTokenizer
    from transformer.generation.text import sample_texts, speculative_text

    tokenizer = ByteTokenizer(num_sentinels=0)
    config = mtp_config(depth=2, vocab=tokenizer.vocab_size, position="learned", max_len=16)
    model, params = build(config)  # seq_len 16 = max_len, as the char experiments train
    text, stats = speculative_text(model, params, tokenizer, config, prompt="ab")
    assert stats.tokens == 16 - 2 - 4  # a, b (packed documents: no <eos>) and the drafts' 2 x 2
    assert text == sample_texts(model, params, tokenizer, config, num_samples=1, prompt="ab",
                                temperature=0.0, max_new_tokens=10)[0]
    with pytest.raises(ValueError, match=r"max_len=16 \(max_new_tokens <= 10\)$"):
        speculative_text(model, params, tokenizer, config, prompt="ab", max_new_tokens=11)


def sampling_probs(logits, temperature, top_k, top_p, banned):
    """float64 NumPy: the distribution sampling draws from, written out from its definition
    (banned ids out, softmax(logits / T), the top_k best, then the smallest best-first set
    whose mass reaches top_p)."""
    logits = np.where(np.isin(np.arange(logits.shape[-1]), banned), -np.inf,
                      logits.astype(np.float64) / temperature)
    order = np.argsort(-logits, kind="stable")
    kept = np.zeros(len(logits), bool)
    kept[order[:top_k or len(logits)]] = True
    logits = np.where(kept, logits, -np.inf)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    kept[order[1:][mass_before[1:] >= top_p - 1e-6]] = False
    probs = np.where(kept, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.slow
@pytest.mark.parametrize("depth,temperature,top_k,top_p", [(2, 1.3, 0, 1.0), (1, 0.8, 4, 0.9)])
def test_speculative_sampling_draws_the_sequences_with_the_lms_own_probabilities(
        depth, temperature, top_k, top_p):
    """Speculative sampling's output follows the LM's sampling distribution exactly (the
    drafts, from other distributions, only decide how many tokens a pass gives): over 12,000
    rows, the three new tokens' 125 sequences come out as often as the LM's chain-rule
    probability says (chi-square), as plain `decode` sampling draws them, never a filtered id."""
    config = mtp_config(depth=depth, vocab=6)
    model, params = build(config, seed=7, scale=1.5)
    prompt, rows, new, banned = [3, 4, 5], 12000, 3, [0]
    every = np.stack(np.meshgrid(*[np.arange(6)] * new, indexing="ij"), -1).reshape(-1, new)
    inputs = np.concatenate([np.tile(prompt, (len(every), 1)), every], 1).astype(np.int32)
    logits = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, inputs))
    want = np.ones(len(every))
    for j in range(new):  # p(sequence) = prod_j p(token j | prompt, tokens before j)
        probs = np.stack([sampling_probs(row, temperature, top_k, top_p, banned)
                          for row in logits[:, len(prompt) - 1 + j]])
        want *= probs[np.arange(len(every)), every[:, j]]
    np.testing.assert_allclose(want.sum(), 1.0, rtol=1e-9)
    settings = dict(max_new_tokens=new, eos_id=None, banned_ids=banned, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=3)
    got, _, stats = speculative_decode(model, params, [prompt] * rows, **settings)
    plain, _ = decode(model, params, [prompt] * rows, **settings)
    assert 0.05 < stats.acceptance_rate < 0.95  # drafts both kept and rejected
    for tokens in (got, plain):
        index = np.ravel_multi_index(tokens.T, [6] * new)
        counts = np.bincount(index, minlength=len(every))
        assert counts[want == 0].sum() == 0  # banned or filtered ids never come out
        chi2 = scipy.stats.chisquare(counts[want > 0], rows * want[want > 0])
        assert chi2.pvalue > 1e-4, chi2
    # prompts of different lengths and an EOS: each row stops at its first EOS, then pads
    eos, prompts = 2, [[3, 4, 5], [1], [5, 4, 3, 2, 1, 3, 4]] * 20
    got, lengths, _ = speculative_decode(model, params, prompts, **{
        **settings, "max_new_tokens": 9, "eos_id": eos})
    for row, length in zip(got, lengths, strict=True):
        assert eos not in row[:length - 1] and (length == 9 or row[length - 1] == eos)
        assert (row[length:] == 0).all() and 0 not in row[:length]  # PAD after, banned 0 never
    assert (lengths < 9).any() and (lengths == 9).any()


@pytest.mark.slow
def test_speculative_decoding_refuses_what_it_cannot_do_exactly():
    model, params = build(mtp_config(depth=0))
    with pytest.raises(ValueError, match="mtp.depth > 0"):
        speculative_decode(model, params, [[1, 2]], max_new_tokens=4)
    model, params = build(mtp_config(depth=1, layer_types="linear_attention,full_attention"))
    with pytest.raises(ValueError, match="linear_attention layers"):
        speculative_decode(model, params, [[1, 2]], max_new_tokens=4)


@pytest.mark.slow
def test_train_with_mtp_then_generate_speculatively_through_the_cli(tmp_path):
    """A run with two modules logs each depth's loss and evaluates next-token loss; `generate
    --speculative` prints the greedy text, and says how many tokens a pass gave; with
    --temperature it samples."""
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    assert_succeeded(run_cli("transformer.train", f"--workdir={workdir}",
                             *tiny_flags(4), "--config.model.mtp.depth=2", logs=logs))
    records = read_metrics(workdir)
    train = [r for r in records if r["split"] == "train"]
    assert train and all(np.isfinite(r["mtp_loss/1"]) and np.isfinite(r["mtp_loss/2"])
                         for r in train)
    validation = [r for r in records if r["split"] == "validation"]
    assert validation and not any(k.startswith("mtp") for r in validation for k in r)
    common = ("transformer.generate", f"--workdir={workdir}", "--prompt=ab",
              "--max_new_tokens=12")
    greedy = run_cli(*common, "--temperature=0", logs=logs)
    fast = run_cli(*common, "--speculative", logs=logs)
    assert_succeeded(greedy)
    assert_succeeded(fast)
    assert fast.stdout == greedy.stdout
    assert re.search(r"^speculative: 12 new tokens from [0-9]+ passes of the model ",
                     fast.stderr, re.M) and "accepted" in fast.stderr
    sampled = run_cli(*common, "--speculative", "--temperature=0.7", "--top_k=20", logs=logs)
    assert_succeeded(sampled)  # speculative sampling
    assert sampled.stdout.startswith("ab") and "passes of the model" in sampled.stderr
    refused = run_cli(*common, "--speculative", "--num_samples=2", logs=logs)
    assert refused.returncode == 2 and "--speculative" in refused.stderr
