"""`transformer.load`: a training workdir or a Hugging Face directory as a model ready to use in
Python. Its logits are the forward pass on the text as a document's start (`ids`), `score` the
log-probability from them, `generate` the CLI's greedy text, and an imported model stops at its
tokenizer's own end of sequence; logits of a Hugging Face Llama equal transformers'."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from test_harness import TINY_MODEL

import transformer
from transformer import configs, generate, train


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("load") / "run"
    config = configs.experiment("gpt_tiny")
    config.update(steps=4, batch_size=4, seq_len=32, log_every=2, eval_every=4, eval_steps=1,
                  checkpoint_every=4)
    config.model.update(**TINY_MODEL)
    train.train_and_evaluate(config, str(workdir))
    return workdir


@pytest.mark.slow
def test_a_workdir_loads_with_logits_score_and_generate(workdir):
    lm = transformer.load(str(workdir))
    forward = jax.jit(lm.model.apply)
    ids = lm.tokenizer.encode("def f(x):")  # gpt_tiny packs its documents: the text alone
    assert lm.ids("def f(x):").tolist() == ids.tolist()
    want = np.asarray(forward({"params": lm.params}, ids[None]))[0]
    np.testing.assert_allclose(lm.logits("def f(x):"), want, rtol=1e-5, atol=1e-5)
    # ids as given, with no document start (a list or an array)
    behind = np.concatenate([[lm.tokenizer.eos_id], ids]).astype(np.int32)
    np.testing.assert_allclose(lm.logits(behind.tolist()),
                               np.asarray(forward({"params": lm.params}, behind[None]))[0],
                               rtol=1e-5, atol=1e-5)
    for bad in ([], [[1, 2]], [1.5], [lm.model.vocab_size]):
        with pytest.raises(ValueError, match=r"expected a str, or a 1-D sequence of token ids"):
            lm.logits(bad)

    def log_probs(ids):  # float64 log-softmax of the forward pass
        logits = np.asarray(forward({"params": lm.params}, ids[None]))[0].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

    # score: the sum of log p(token | before) over the text's tokens, after the context
    full = lm.tokenizer.encode("def f(x): return")
    logp = log_probs(full)
    want_score = sum(logp[t - 1, full[t]] for t in range(len(ids), len(full)))
    assert lm.score(" return", context="def f(x):") == pytest.approx(want_score, rel=1e-5)
    # no context: the first token from <eos> (nothing else predicts it), the rest behind it alone
    first = log_probs(np.asarray([lm.tokenizer.eos_id, ids[0]]))[0, ids[0]]
    logp = log_probs(ids)
    assert lm.score("def f(x):") == pytest.approx(
        first + sum(logp[t - 1, ids[t]] for t in range(1, len(ids))), rel=1e-5)
    assert lm.ids("").tolist() == [lm.tokenizer.eos_id]
    model, params, tokenizer, config = generate.load_workdir(str(workdir))
    assert lm.generate("def ", max_new_tokens=12) == generate.sample_texts(
        model, params, tokenizer, config, num_samples=1, prompt="def ", temperature=0.0,
        max_new_tokens=12)[0]
    assert transformer.load(f"{workdir}@4").config.steps == 4
    with pytest.raises(ValueError, match="merge_lora=True: .* has no LoRA adapters"):
        transformer.load(str(workdir), merge_lora=True)


@pytest.mark.slow
def test_a_run_on_bin_shards_reads_texts_behind_eos_once_its_data_is_gone(tmp_path):
    """A run on prepared .bin shards read its documents as one stream whatever data.unit said:
    its checkpoints record that, so a text is read behind <eos> from anywhere (another
    directory, the data moved or deleted), not as the data.unit left in its config says."""
    from transformer.data import inputs, prepare
    from transformer.training import checkpoint, checkpoint_manager

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"paragraph {i}: some words of text.\n\n" for i in range(60)))
    prepare.prepare(str(tmp_path / "bin"), str(corpus), format="bin")
    config = configs.experiment("gpt_tiny")
    config.update(steps=2, batch_size=2, seq_len=16, log_every=1, eval_every=2, eval_steps=1,
                  checkpoint_every=2)
    config.data.path = str(tmp_path / "bin")
    config.model.update(**TINY_MODEL)
    train.train_and_evaluate(config, str(tmp_path / "run"))
    eos = transformer.load(str(tmp_path / "run")).tokenizer.eos_id
    (tmp_path / "bin").rename(tmp_path / "moved")
    lm = transformer.load(str(tmp_path / "run"))
    assert lm.ids("ab").tolist() == [eos, *lm.tokenizer.encode("ab").tolist()]
    stream = checkpoint.saved_stream(str(tmp_path / "run"), 2)
    assert stream[inputs.DOCUMENTS] == "stream"
    # a checkpoint saved before the record resumes: it is derived, never a difference
    older = {k: v for k, v in stream.items() if k != inputs.DOCUMENTS}
    assert checkpoint_manager.stream_differences(older, stream) == []


def test_a_step_that_lost_its_stream_item_is_damaged_not_an_older_versions(workdir, tmp_path):
    """A step whose Orbax record says it wrote a data stream, with the stream folder gone, is
    damage: `saved_stream` names it, and evaluate's data comparison fails on it (it read it as
    an older version's step, with no stream to compare: data changes went unreported). Only a
    step whose record names no stream is an older version's (None)."""
    import shutil

    from transformer import evaluate
    from transformer.training import checkpoint

    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    step_dir = copy / "checkpoints" / "4"
    shutil.rmtree(step_dir / "stream")
    with pytest.raises(FileNotFoundError, match=r"checkpoints/4/stream is missing, though Orbax "
                                                r"recorded writing it: checkpoint 4 is damaged"):
        checkpoint.saved_stream(str(copy), 4)
    _, config = checkpoint.saved_run(str(copy), 4)
    with pytest.raises(RuntimeError, match=r"checkpoint 4 of .* cannot be read "
                                           r"\(FileNotFoundError: .*checkpoint 4 is damaged"):
        evaluate.data_changes(str(copy), 4, config)
    record = json.loads((step_dir / checkpoint.STEP_RECORD).read_text())
    del record["item_handlers"]["stream"]  # as an older version wrote it: no stream at all
    (step_dir / checkpoint.STEP_RECORD).write_text(json.dumps(record))
    assert checkpoint.saved_stream(str(copy), 4) is None
    assert evaluate.data_changes(str(copy), 4, config) == []


def test_evaluate_says_why_the_embedded_corpus_changed(workdir, monkeypatch):
    """A checkpoint trained on the embedded corpus (data.path '') under another Python has
    another fingerprint: evaluate's data-changed warning says why, as a refused resume does."""
    from transformer import evaluate
    from transformer.training import checkpoint

    stream = checkpoint.saved_stream(str(workdir), 4)
    assert stream["data"]["path"] == ""
    other = {**stream, "fingerprint": "0" * 16}  # as another Python's corpus
    monkeypatch.setattr(evaluate.checkpoint_lib, "saved_stream", lambda *args, **kw: other)
    _, config = checkpoint.saved_run(str(workdir), 4)
    (change,) = evaluate.data_changes(str(workdir), 4, config)
    assert change.startswith(f"content fingerprint: checkpoint '{'0' * 16}', config ")
    assert "(data.path is empty: the embedded corpus, which is the running Python's" in change


def test_evaluate_names_an_edited_mixture_source(workdir, monkeypatch):
    """A mixture's fingerprint is a dict of its sources': evaluate's data comparison looks
    under it (it compared the top-level key alone, and an edited source went unreported)."""
    from transformer import evaluate
    from transformer.training import checkpoint

    _, config = checkpoint.saved_run(str(workdir), 4)
    current = {"fingerprint": {"a": "f-a", "b": "f-b"}, "batch_size": 4}
    saved = {"fingerprint": {"a": "EDITED", "b": "f-b"}, "batch_size": 4}
    monkeypatch.setattr(evaluate.checkpoint_lib, "saved_stream", lambda *args, **kw: saved)
    monkeypatch.setattr(evaluate.inputs, "data_stream", lambda *args: current)
    assert evaluate.data_changes(str(workdir), 4, config) == [
        "fingerprint.a: checkpoint 'EDITED', config 'f-a'"]


def test_a_hugging_face_directory_loads_with_transformers_logits_and_its_own_eos(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_sft import llama3_with_bos

    # the hub's Llama 3 tokenizer.json: its post-processor puts <|begin_of_text|> first
    directory, vocab, bos, eos = llama3_with_bos(tmp_path / "llama")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=len(vocab) + 8, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=vocab["<|begin_of_text|>"], eos_token_id=eos))
    with torch.no_grad():
        hf.lm_head.weight[eos] += 5.0 * hf.model.norm.weight  # <eos> wins soon: stop there
    hf.eval().save_pretrained(directory, max_shard_size="20KB")  # in shards, as the hub has
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    lm = transformer.load(f"hf:{directory}")
    assert lm.tokenizer.eos_id == eos
    # a document starts as transformers' tokenizer starts one: behind its BOS
    ids = np.asarray(transformers.AutoTokenizer.from_pretrained(directory)("the cat sat")[
        "input_ids"])
    assert ids[0] == bos and lm.ids("the cat sat").tolist() == ids.tolist()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(lm.logits("the cat sat"), want, atol=1e-4)
    text = lm.generate("the", max_new_tokens=20)
    tokens, _ = generate.decode(lm.model, lm.params, [ids[:2]], max_new_tokens=20,
                                eos_id=eos)
    assert len(lm.tokenizer.encode(text)) < 20 and eos in tokens[0].tolist()
    assert transformer.load(str(directory)).tokenizer.eos_id == eos  # a plain directory too
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(ValueError, match=r"quantization_config \('gptq'\): expected "
                                         "unquantized or mxfp4 weights"):
        transformer.load(f"hf:{directory}")
    (directory / "config.json").write_text(json.dumps(config))
    shard = sorted(set(index["weight_map"].values()))[1]
    (directory / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard}, listed in model.safetensors.index"
                                                ".json, is missing: expected every shard"):
        transformer.load(f"hf:{directory}")


def test_a_text_past_the_learned_positions_is_refused_and_no_text_scores_zero():
    """A learned position table ends at max_len (its rows beyond give NaN logits): logits and
    score refuse a longer text in one line, as decoding does; an empty text is no tokens."""
    import flax.linen as nn

    from transformer.data.tokenizers import ByteTokenizer
    from transformer.loaded import Loaded
    from transformer.models import build_model

    tokenizer = ByteTokenizer(num_sentinels=0)
    config = configs.base_config()
    config.model.update(**TINY_MODEL, position="learned", max_len=16,
                        vocab_size=tokenizer.vocab_size)
    model = build_model(config.model)
    params = jax.jit(lambda: nn.unbox(model.init(jax.random.key(0), np.ones((1, 8), np.int32))[
        "params"]))()
    lm = Loaded(model, params, tokenizer, config)
    # (packed documents: a text is read alone)
    assert np.isfinite(lm.logits("x" * 16)).all() and np.isfinite(lm.score("y" * 15, "x"))
    assert np.isfinite(lm.score("y" * 16))
    for call in (lambda: lm.logits("x" * 17), lambda: lm.score("y" * 16, context="x"),
                 lambda: lm.score("y" * 17)):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == ("text of 17 tokens: expected at most 16, the model's "
                                    "learned positions end at max_len=16")
    lm.config.data.unit = "stream"  # streamed documents: behind <eos>
    assert np.isfinite(lm.logits("x" * 15)).all()
    for call in (lambda: lm.logits("x" * 16), lambda: lm.score("y" * 15, context="x")):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == ("text of 16 tokens (after <eos>): expected at most 15, the "
                                    "model's learned positions end at max_len=16")
    assert lm.score("") == 0.0 and lm.score("", context="x" * 30) == 0.0
    # the model itself, called on more rows than its table holds (with no positions given)
    with pytest.raises(ValueError, match=r"^17 tokens: expected at most model.max_len=16, "
                                         r"where the learned position table ends"):
        model.apply({"params": params}, np.ones((1, 17), np.int32))


def test_a_sequence_mesh_refuses_rows_past_the_learned_table_too(monkeypatch):
    """Load-balanced sequence parallelism lays positions out zig-zag, made by the model before
    the stack: it refuses rows past max_len as the stack does (it gave NaN logits)."""
    import flax.linen as nn

    from transformer.models import build_model
    from transformer.nn import sequence_parallel

    config = configs.base_config()
    config.model.update(**TINY_MODEL, position="learned", max_len=16, vocab_size=64,
                        sequence_load_balance=True)
    model = build_model(config.model)
    params = jax.jit(lambda: nn.unbox(model.init(jax.random.key(0), np.ones((1, 8), np.int32))[
        "params"]))()
    monkeypatch.setattr(sequence_parallel, "shards", lambda: 2)  # as under mesh.sequence=2
    with pytest.raises(ValueError, match=r"^32 tokens: expected at most model.max_len=16, "
                                         r"where the learned position table ends"):
        model.apply({"params": params}, np.ones((1, 32), np.int32))


def test_a_t5_with_its_sentinels_loads_and_only_language_models_score(tmp_path):
    """A T5 directory whose tokenizer has its 100 <extra_id_i> (every hub T5, and every export
    of a run with the default data.num_sentinels) loads (it was refused, asking for
    num_sentinels=0); logits and score, which read next-token rows, refuse an encoder-decoder,
    an encoder and a class head in one line (BERT gave a number, T5 a traceback)."""
    transformers = pytest.importorskip("transformers")
    from transformer.data.tokenizers import ByteTokenizer
    from transformer.export import _tokenizer_files
    from transformer.loaded import Loaded

    tokenizer = ByteTokenizer(num_sentinels=100)
    hf_config = transformers.T5Config(vocab_size=tokenizer.vocab_size, d_model=32, d_kv=8,
                                      d_ff=64, num_layers=1, num_heads=4,
                                      decoder_start_token_id=0, pad_token_id=0)
    transformers.T5ForConditionalGeneration(hf_config).save_pretrained(tmp_path)
    _tokenizer_files(tokenizer, str(tmp_path))
    lm = transformer.load(f"hf:{tmp_path}")
    assert lm.tokenizer.num_sentinels == 100 and lm.config.model.family == "t5"
    assert isinstance(lm.generate("abc", max_new_tokens=3), str)
    cases = ((lm.config, "model.family='t5'"),
             (configs.experiment("bert_mlm"), "model.family='bert'"),
             (configs.experiment("bert_finetune_cls"), "model.family='bert' and a class head"),
             (configs.experiment("gpt_finetune_cls"), "model.family='gpt' and a class head"))
    for config, named in cases:
        loaded = Loaded(None, {}, tokenizer, config)
        for method in ("logits", "score"):
            with pytest.raises(ValueError) as error:
                getattr(loaded, method)("text")
            assert str(error.value) == (f"Loaded.{method} with {named}: expected a causal "
                                        "language model (gpt or lstm), whose rows predict the "
                                        "next token")


def test_a_base_model_without_an_lm_head_is_refused_by_logits_score_and_generate(tmp_path):
    """A Qwen3Model (no lm_head) imports with head 'none', whose rows are hidden states
    [T, d_model]: logits gave them as if vocab logits, score NaN and generate a broadcasting
    traceback. Each now refuses it in one line, as the generate command does."""
    transformers = pytest.importorskip("transformers")
    from transformer.data.tokenizers import ByteTokenizer
    from transformer.export import _tokenizer_files

    tokenizer = ByteTokenizer(num_sentinels=0)
    transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(tmp_path)
    _tokenizer_files(tokenizer, str(tmp_path))
    lm = transformer.load(f"hf:{tmp_path}")
    assert lm.config.model.head == "none"
    for method in ("logits", "score", "generate"):
        with pytest.raises(ValueError) as error:
            getattr(lm, method)("First")
        assert str(error.value) == (f"Loaded.{method} with model.head='none' (a base model "
                                    "without an LM head): expected a causal language model, "
                                    "whose rows predict the next token")
    # The generate command too, whichever way it decodes (it failed in the ban mask's shapes)
    from test_generate import _command_flags

    from transformer import generate

    for args in ((), ("--beam_size=2",), ("--speculative",), ("--chat=x.json",)):
        with pytest.raises(ValueError, match=rf"^--workdir='hf:{tmp_path}' with model.head="
                                             r"'none' \(a base model without an LM head\)"):
            generate.main([], _command_flags(f"--workdir=hf:{tmp_path}", *args))


def _tiny_llama_directory(directory, head_times):
    """A saved tiny LlamaForCausalLM whose config.json says tie_word_embeddings=True and whose
    safetensors also hold lm_head.weight = head_times x the embedding; its HF logits on `ids`."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from transformer.data.tokenizers import ByteTokenizer
    from transformer.export import _tokenizer_files

    tokenizer = ByteTokenizer(num_sentinels=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True)).save_pretrained(directory)
    _tokenizer_files(tokenizer, str(directory))
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * head_times
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    ids = np.arange(3, 15)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return ids, hf.eval()(input_ids=torch.tensor(ids[None])).logits[0].numpy()


@pytest.mark.parametrize("head_times", [2.0, 1.0], ids=["different head", "the embedding"])
def test_a_tied_config_with_its_own_lm_head_loads_as_transformers_does(tmp_path, head_times):
    """config.json ties the head but the file also holds lm_head.weight: transformers 5 unties
    them where the two differ and uses the file's head (the import tied it, logits off 2x);
    an lm_head.weight equal to the embedding (a tied save) still loads tied."""
    ids, want = _tiny_llama_directory(tmp_path, head_times)
    lm = transformer.load(f"hf:{tmp_path}")
    assert lm.config.model.tie_embeddings == (head_times == 1.0)
    assert ("lm_head" in lm.params) == (head_times != 1.0)
    got = lm.model.apply({"params": lm.params}, ids[None].astype(np.int32))[0]
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_an_moe_layout_the_stack_cannot_hold_is_refused_naming_the_hf_keys(tmp_path, family):
    """Qwen3-MoE decoder_sparse_step=2 over 3 layers, DeepSeek-V3 first_k_dense_replace=3 of 3
    (no MoE layer left): refused naming config.json's keys and the directory, not our
    model.moe keys from config validation."""
    transformers = pytest.importorskip("transformers")
    from transformer.data.tokenizers import ByteTokenizer
    from transformer.export import _tokenizer_files

    tokenizer = ByteTokenizer(num_sentinels=0)
    shape = dict(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 max_position_embeddings=64, num_experts_per_tok=2, moe_intermediate_size=16)
    if family == "qwen3_moe":
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, head_dim=8, num_experts=4, decoder_sparse_step=2))
        message = "Qwen3Moe decoder_sparse_step=2 with num_hidden_layers=3: expected a divisor"
    else:
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **shape, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=3, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-6))
        message = ("deepseek_v3 first_k_dense_replace=3 with num_hidden_layers=3: expected "
                   "fewer (at least one mixture-of-experts layer)")
    hf.save_pretrained(tmp_path)
    _tokenizer_files(tokenizer, str(tmp_path))
    with pytest.raises(ValueError) as error:
        transformer.load(f"hf:{tmp_path}")
    assert str(error.value).startswith(f"'hf:{tmp_path}': {message}")
    if family == "qwen3_moe":  # 0, which no count divides (HF's modulo fails on it)
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "decoder_sparse_step": 0}))
        with pytest.raises(ValueError) as error:
            transformer.load(f"hf:{tmp_path}")
        assert str(error.value).startswith(
            f"'hf:{tmp_path}': Qwen3Moe decoder_sparse_step=0 with "
            "num_hidden_layers=3: expected a divisor")
