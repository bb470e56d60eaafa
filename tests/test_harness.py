"""lm-evaluation-harness adapter (transformer.hf.harness, registered with a workdir's loading by
transformer.harness): tasks defined here from local JSONL files
(nothing is downloaded) give the numbers computed directly from the model's log-probabilities."""

import functools
import glob
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from test_train import REPO, TINY_MODEL, assert_succeeded, describe, run_cli  # noqa: E402

from transformer import configs, generate, train  # noqa: E402
from transformer.harness import TransformerLM  # noqa: E402

QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "a fish", "blue"], "answer": 0},
    {"question": "def main(argv):", "choices": ["\n    return 0", " 42", "!!"], "answer": 0},
    {"question": "import os\nimport", "choices": [" sys", " 12345", "()"], "answer": 0},
    {"question": "for i in range(", "choices": ["10):", "zebra", "\t\t"], "answer": 1},
]
TEXTS = [{"text": "Return the number of items in a container."},
         {"text": "x = 1\n" * 30}]  # longer than max_length: several rolling windows
PROMPTS = [{"prompt": "def f(x):\n    return", "target": " x"},
           {"prompt": "import", "target": " os"}]


def write_tasks(directory):
    directory.mkdir(exist_ok=True)
    for name, rows in (("mc", QUESTIONS), ("rolling", TEXTS), ("gen", PROMPTS)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (directory / "mc.yaml").write_text(
        f"task: local_mc\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{directory / 'mc.jsonl'}\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (directory / "rolling.yaml").write_text(
        f"task: local_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{directory / 'rolling.jsonl'}\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n")
    (directory / "gen.yaml").write_text(
        f"task: local_gen\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{directory / 'gen.jsonl'}\noutput_type: generate_until\n"
        "doc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return directory


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("harness") / "run"
    config = configs.experiment("gpt_tiny")
    config.update(steps=30, batch_size=8, seq_len=32, log_every=10, eval_every=30,
                  eval_steps=1, checkpoint_every=30)
    config.model.update(**TINY_MODEL)
    train.train_and_evaluate(config, str(workdir))
    return workdir


@functools.cache
def forward(model):
    """model.apply, jitted (one compile per length; eager runs every op on its own, ~3x
    slower): an unpadded forward pass of one sequence."""
    return jax.jit(model.apply)


def direct_logprob(lm, context: str, continuation: str, streamed: bool = False) -> float:
    """log p(continuation | context) from one forward pass, byte tokens (concatenative): the
    context read as training's rows begin a document, alone where it packed them (gpt_tiny),
    behind <eos> where it streamed them. Without a context a packed model reads the first
    token behind <eos> (nothing else predicts it), the rest behind that token alone."""
    if not context and not streamed and len(continuation) > 1:
        return direct_logprob(lm, "", continuation[:1]) + direct_logprob(lm, *continuation[:1],
                                                                          continuation[1:])
    ids = [lm.eos] * (streamed or not context) + lm.tokenizer.encode(
        context + continuation).tolist()
    n = len(lm.tokenizer.encode(continuation))
    logits = forward(lm.model)({"params": lm.params}, jnp.asarray([ids[:-1]]))
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))[0]
    return float(sum(logp[t, ids[t + 1]] for t in range(len(ids) - 1 - n, len(ids) - 1)))


def window_logprob(lm, context: list[int], target: list[int]) -> float:
    """log p(target | context) of token ids, from one forward pass of context + target."""
    fed = (context + target)[:-1]
    logits = forward(lm.model)({"params": lm.params}, jnp.asarray([fed]))
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))[0]
    return float(sum(logp[len(fed) - len(target) + k, t] for k, t in enumerate(target)))


def evaluate(lm, tmp_path, task):
    from lm_eval.tasks import TaskManager

    # Only the tasks defined here: indexing lm_eval's thousands of built-in ones takes ~10 s.
    manager = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")),
                          include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager,
                                   log_samples=False)["results"][task]


@pytest.mark.slow
def test_multiple_choice_accuracy_is_the_direct_log_likelihood_argmax(workdir, tmp_path):
    lm = TransformerLM(workdir=str(workdir), batch_size=3)
    result = evaluate(lm, tmp_path, "local_mc")
    picks = [int(np.argmax([direct_logprob(lm, q["question"], " " + c) for c in q["choices"]]))
             for q in QUESTIONS]
    expected = np.mean([p == q["answer"] for p, q in zip(picks, QUESTIONS, strict=True)])
    assert result["acc,none"] == pytest.approx(expected)
    # And the scores themselves, through the adapter's batched, padded path.
    requests = [type("R", (), {"args": (q["question"], " " + c)})()
                for q in QUESTIONS for c in q["choices"]]
    scores = lm.loglikelihood(requests)
    direct = [direct_logprob(lm, *r.args) for r in requests]
    np.testing.assert_allclose([s for s, _ in scores], direct, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_rolling_log_likelihood_covers_every_token_once(workdir, tmp_path):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    lm = TransformerLM(workdir=str(workdir), max_length=16)
    result = evaluate(lm, tmp_path, "local_rolling")
    total, n_bytes, predicted = 0.0, 0, 0
    for doc in TEXTS:  # the harness's windows, each scored by one direct forward pass
        ids = lm.tokenizer.encode(doc["text"]).tolist()
        # gpt_tiny packs its documents: the first token is read behind <eos> (nothing else
        # predicts it), the others behind the text alone
        windows = [([lm.eos], ids[:1])] + list(map(make_disjoint_window, get_rolling_token_windows(
            ids[1:], prefix_token=ids[0], max_seq_len=16, context_len=1)))
        for context, target in windows:
            total += window_logprob(lm, context, target)
            predicted += len(target)
        n_bytes += len(doc["text"].encode())
    assert predicted == sum(len(lm.tokenizer.encode(d["text"])) for d in TEXTS)
    assert len(lm.tokenizer.encode(TEXTS[1]["text"])) > 3 * 16  # several windows
    assert result["bits_per_byte,none"] == pytest.approx(-total / n_bytes / math.log(2),
                                                         rel=1e-4)


@pytest.mark.slow
def test_generate_until_is_greedy_kv_cache_decoding_cut_at_the_stop_string(workdir, tmp_path):
    lm = TransformerLM(workdir=str(workdir))
    requests = [type("R", (), {"args": (p["prompt"], {"until": ["\n"], "max_gen_toks": 8})})()
                for p in PROMPTS]
    got = lm.generate_until(requests)
    for text, p in zip(got, PROMPTS, strict=True):
        prompt = [lm.eos] + lm.tokenizer.encode(p["prompt"]).tolist()
        tokens, lengths = generate.decode(lm.model, lm.params, [prompt], max_new_tokens=8,
                                          eos_id=lm.eos, banned_ids=lm.banned)
        ids = tokens[0, :lengths[0]]
        ids = ids[~np.isin(ids, list(lm.specials))]  # (the text leaves specials out)
        assert text == lm.tokenizer.decode(ids).split("\n")[0]
    result = evaluate(lm, tmp_path, "local_gen")
    expected = np.mean([t == p["target"] for t, p in zip(got, PROMPTS, strict=True)])
    assert result["exact_match,none"] == pytest.approx(expected)
    # top_k=1 samples the argmax (top_k was dropped: random text); other settings: refused
    sampled = [type("R", (), {"args": (p["prompt"], {"until": ["\n"], "max_gen_toks": 8,
                                                     "do_sample": True, "temperature": 1.0,
                                                     "top_k": 1, "seed": seed})})()
               for p in PROMPTS for seed in (1, 2)]
    assert lm.generate_until(sampled) == [text for text in got for _ in (1, 2)]
    # a generation as long as max_length would leave the prompt no context: refused
    long = type("R", (), {"args": ("x", {"until": ["\n"], "max_gen_toks": lm.max_length})})()
    with pytest.raises(ValueError, match=r"^generate_until max_gen_toks=\d+: expected fewer "
                                         "than max_length="):
        lm.generate_until([long])
    odd = type("R", (), {"args": ("x", {"until": ["\n"], "num_beams": 4})})()
    with pytest.raises(ValueError, match=r"^generate_until settings \['num_beams'\]: expected "
                                         "only until"):
        lm.generate_until([odd])


@pytest.mark.slow
def test_the_lm_eval_command_runs_with_the_model_registered(workdir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    result = run_cli("transformer.harness", "--model", "transformer", "--model_args",
                     f"workdir={workdir},batch_size=4", "--tasks", "local_mc",
                     "--include_path", str(tasks), "--output_path", str(tmp_path / "out"),
                     logs=tmp_path)
    assert_succeeded(result)
    assert "local_mc" in result.stdout and "acc" in result.stdout
    assert any(f.endswith(".json") for _, _, files in os.walk(tmp_path / "out") for f in files)


def test_lm_eval_model_transformer_is_the_params_adapter_loading_a_workdir():
    """`--model transformer` names the command's class, which loads a workdir into the adapter
    over params in memory (`training.task_eval`'s, below the commands)."""
    from lm_eval.api.registry import get_model

    from transformer.hf import harness as hf_harness

    assert get_model("transformer") is TransformerLM
    assert issubclass(TransformerLM, hf_harness.TransformerLM)
    assert TransformerLM.from_params.__func__ is hf_harness.TransformerLM.from_params.__func__


def run_main(evaluate: str, *args: str) -> subprocess.CompletedProcess:
    """`harness.main()` in a fresh process without JAX_PLATFORMS (the command must choose it),
    with `args` as its flags and lm_eval's command replaced by the code `evaluate` (cheap:
    lm_eval's own task index takes 20 s to build)."""
    probe = ("import sys, jax, lm_eval.__main__ as m\n"
             "from transformer import harness\n"
             f"m.cli_evaluate = lambda: {evaluate}\n"
             f"sys.argv = ['python -m transformer.harness', *{list(args)!r}]\n"
             "harness.main()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("JAX_PLATFORMS", None)
    return subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_command_chooses_its_platform_like_the_other_commands():
    """As `cli.run` does for every command: the CPU where there is no TPU or GPU device, so
    libtpu is never probed (it printed five lines of warnings)."""
    if any(glob.glob(d) for d in ("/dev/accel*", "/dev/vfio", "/dev/nvidia*", "/dev/kfd")):
        pytest.skip("this machine has an accelerator: JAX chooses it")
    result = run_main("print(sys.argv, jax.config.jax_platforms, jax.default_backend())",
                      "--model", "transformer", "--verbose")
    assert_succeeded(result)
    assert result.stdout.split() == ["['lm_eval',", "'--model',", "'transformer']", "cpu",
                                     "cpu"]
    assert "TPU" not in result.stderr and "libtpu" not in result.stderr, result.stderr


@pytest.mark.slow
def test_a_bad_workdir_is_one_line_and_exit_2(tmp_path):
    """The command's side of the messages below (each is tested in-process there): one line on
    stderr, exit 2; --verbose: the traceback."""
    bad = tmp_path / "none"
    result = run_main(f"harness.TransformerLM.create_from_arg_string('workdir={bad}')")
    assert result.returncode == 2, describe(result)
    assert result.stderr.splitlines() == [
        f"error: workdir={str(bad)!r} does not exist: expected a training workdir (or hf:DIR, "
        "a Hugging Face checkpoint)"]
    result = run_main(f"harness.TransformerLM(workdir={str(bad)!r})", "--verbose")
    assert result.returncode == 1 and "Traceback" in result.stderr  # --verbose: the traceback


@pytest.mark.parametrize("args,message", [
    ("workdir=runs/gpt,foo=1,bar=x", r"^--model_args bar, foo: the model 'transformer' takes "
                                     r"only workdir, step, batch_size, max_length, "
                                     r"chat_template_args, enable_thinking, think_end_token$"),
    ("workdir=runs/gpt,batch_size=abc", r"^batch_size='abc': expected a positive int or "
                                        r"'auto'$"),
    ("workdir=runs/gpt,batch_size=0", r"^batch_size=0: expected a positive int or 'auto'$"),
    ("workdir=runs/gpt,batch_size=1.5", r"^batch_size=1\.5: expected a positive int or "
                                        r"'auto'$"),
    ("workdir=runs/gpt,max_length=-3", r"^max_length=-3: expected a positive int$"),
    ("workdir=runs/gpt,step=latest", r"^step='latest': expected an int >= 0$"),
    ("workdir={missing}", r"^workdir='.*nonexist' does not exist: expected a training workdir"),
    ("workdir={file}", r"^workdir='.*\.jsonl' is a file: expected a training workdir"),
    ("batch_size=4", r"^--model_args workdir=\.\.\.: expected a training workdir or hf:DIR"),
    ("workdir={missing},batch_size=auto:4", r"^workdir='.*nonexist' does not exist"),
    ("workdir={empty}", r"^'.*empty' holds no checkpoints: expected a training workdir that "
                        r"has saved one$"),
    ("workdir={missing},enable_thinking=true", r"^enable_thinking=True: expected a "
                                               r"think_end_token too \(the text or id"),
    ("workdir=runs/gpt,enable_thinking=maybe", r"^enable_thinking='maybe': expected true or "
                                               r"false$"),
    ("workdir=runs/gpt,think_end_token=-1", r"^think_end_token=-1: expected the text or the "
                                            r"id of the token that ends the thinking"),
    ("workdir=runs/gpt,chat_template_args=x", r"^chat_template_args='x': expected a dict of "
                                              r"chat template variables \(give --model_args "
                                              r"as JSON"),
], ids=["unknown_keys", "batch_size_text", "batch_size_zero", "batch_size_float",
        "max_length_negative", "step_text", "workdir_missing", "workdir_a_file", "no_workdir",
        "batch_size_auto_n", "workdir_empty", "thinking_without_its_end", "thinking_text",
        "think_end_negative", "chat_template_args_text"])
def test_bad_model_args_are_one_line_before_any_checkpoint_is_read(tmp_path, args, message):
    """--model_args as the command passes them (`create_from_arg_string`): an unknown key, a
    batch_size, max_length or step that is no int (a TypeError or "invalid literal for int()"),
    a chat option lm-eval's HF model would refuse or misread (enable_thinking without its
    think_end_token, before the workdir is looked at), a workdir that does not exist (it said
    "holds no checkpoints"), one that holds none: one
    line naming it, and what was expected (the command prints it, exit 2; the test above runs
    it). No checkpoint is read: runs/gpt is none."""
    file = tmp_path / "mc.jsonl"
    file.write_text("{}\n")
    (tmp_path / "empty").mkdir()
    args = args.format(missing=tmp_path / "nonexist", file=file, empty=tmp_path / "empty")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        TransformerLM.create_from_arg_string(args, {"batch_size": "1"})


def test_the_command_checks_a_local_tasks_splits_before_the_model_loads(tmp_path):
    """The tasks as the command resolved them (a YAML file given as a task: its config) reach
    `task_eval.check_splits` before lm-eval builds them: one line, where lm-eval's own error
    was a bare KeyError ('tst'); the model ('none') is never loaded."""
    tasks = write_tasks(tmp_path / "tasks")
    config = {"task": "mine", "dataset_path": "json", "test_split": "tst",
              "dataset_kwargs": {"data_files": {"test": str(tasks / "mc.jsonl")}}}
    result = run_main("__import__('lm_eval.evaluator').evaluator.simple_evaluate("
                      f"model='none', tasks=[{config!r}])")
    assert result.returncode == 2, describe(result)
    assert result.stderr.splitlines()[-1] == (
        "error: task 'mine': test_split='tst' is not among its data_files' splits ['test']: "
        "expected one of those")


def test_a_stream_trained_model_reads_every_request_behind_eos():
    """A model whose training ran its documents on as one stream (each after the previous
    one's <eos>) reads every context behind <eos>, and a rolling text's first token too; a
    packed one (the default unit) reads a context alone (`direct_logprob`)."""
    import flax.linen as nn
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from transformer.data.tokenizers import ByteTokenizer
    from transformer.models import build_model

    tokenizer = ByteTokenizer(num_sentinels=0)
    config = configs.experiment("gpt_tiny")
    config.seq_len = 16
    config.model.update(**TINY_MODEL, vocab_size=tokenizer.vocab_size)
    model = build_model(config.model)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), np.ones((1, 8), np.int32))[
        "params"])
    pairs = [("import", " os"), ("", "x = 1")]
    requests = [type("R", (), {"args": pair})() for pair in pairs]
    for unit, streamed in (("paragraph", False), ("stream", True)):
        config.data.unit = unit
        lm = TransformerLM.from_params(model, params, tokenizer, config, batch_size=2)
        np.testing.assert_allclose([score for score, _ in lm.loglikelihood(requests)],
                                   [direct_logprob(lm, *pair, streamed) for pair in pairs],
                                   rtol=1e-5)
    ids = tokenizer.encode("a text of more than sixteen bytes").tolist()
    total = sum(window_logprob(lm, context, target) for context, target in map(
        make_disjoint_window, get_rolling_token_windows(ids, prefix_token=lm.eos,
                                                        max_seq_len=16, context_len=1)))
    rolling = lm.loglikelihood_rolling([type("R", (), {"args": (tokenizer.decode(ids),)})()])
    assert rolling == [pytest.approx(total, rel=1e-5)]


def test_a_capacity_routed_mixture_of_experts_scores_as_its_unpadded_forward():
    """Padding took expert slots from a capacity MoE's real tokens (every token's first choice
    goes before any second): its scores moved with batch_size and with the other requests of a
    batch. Its rows now go unpadded, so each is the forward pass of its own tokens; a
    continuation longer than max_length is refused (its first tokens went unscored)."""
    import flax.linen as nn

    from transformer.data.tokenizers import ByteTokenizer
    from transformer.models import build_model

    tokenizer = ByteTokenizer(num_sentinels=0)
    config = configs.experiment("gpt_tiny")
    config.seq_len = 32
    config.model.update(**TINY_MODEL, vocab_size=tokenizer.vocab_size)
    config.model.moe.update(num_experts=4, top_k=2, capacity_factor=1.0)
    model = build_model(config.model)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), np.ones((1, 8), np.int32))[
        "params"])
    pairs = [("import", " os"), ("x =", " 1"), ("def f(x):", " return x"), ("a", "bc")]
    scores = {}
    for batch_size in (1, 4):
        lm = TransformerLM.from_params(model, params, tokenizer, config, batch_size=batch_size)
        requests = [type("R", (), {"args": pair})() for pair in pairs]
        scores[batch_size] = [score for score, _ in lm.loglikelihood(requests)]
    np.testing.assert_allclose(scores[4], scores[1], rtol=1e-5)
    np.testing.assert_allclose(scores[1], [direct_logprob(lm, *pair) for pair in pairs],
                               rtol=1e-5)
    with pytest.raises(ValueError, match=r"^a continuation of 40 tokens: expected at most "
                                         r"max_length=32$"):
        lm.loglikelihood([type("R", (), {"args": ("x", "y" * 40)})()])


def tiny_llama(directory, vocab_size: int, bos: int, eos: int, max_positions: int = 128):
    """A 2-layer float32 Llama (seed 0) saved beside the tokenizer in `directory`."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=vocab_size, max_position_embeddings=max_positions,
        tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos)).eval()
    hf.save_pretrained(directory)
    return hf


def test_an_imported_llamas_rolling_text_starts_behind_its_bos(tmp_path):
    """A checkpoint whose tokenizer puts a BOS first reads a rolling text's first token behind
    that BOS, as loglikelihood("", text) and lm-eval's own HF model (its prefix_token_id) do;
    it was read behind <eos>. Every window equals transformers' log-probs (float32)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from test_sft import llama3_with_bos

    directory, vocab, bos, eos = llama3_with_bos(tmp_path / "llama")
    hf = tiny_llama(directory, len(vocab), bos, eos, max_positions=64)

    def direct(context, target):
        fed = torch.tensor([(context + target)[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=fed).logits[0].float(), -1).numpy()
        return float(sum(logp[len(context) - 1 + k, t] for k, t in enumerate(target)))

    lm = TransformerLM(workdir=f"hf:{directory}", batch_size=2, max_length=16)
    assert lm.prefixes == {False: [bos], True: [bos]}
    short, long = "tell me a story about a king", " ".join(["the sea and the king"] * 9)
    ids = {text: lm.tokenizer.encode(text).tolist() for text in (short, long)}
    assert len(ids[short]) < 16 < 2 * 16 < len(ids[long])  # one window; several
    rolling = lm.loglikelihood_rolling([type("R", (), {"args": (t,)})() for t in (short, long)])
    want = [sum(direct(*make_disjoint_window(w)) for w in get_rolling_token_windows(
        ids[t], prefix_token=bos, max_seq_len=16, context_len=1)) for t in (short, long)]
    np.testing.assert_allclose(rolling, want, rtol=1e-5, atol=1e-4)
    assert rolling[0] == pytest.approx(direct([bos], ids[short]), abs=1e-4)
    assert abs(rolling[0] - direct([eos], ids[short])) > 1e-2  # (what it read before)
    (empty, _), = lm.loglikelihood([type("R", (), {"args": ("", short)})()])
    assert empty == pytest.approx(rolling[0], abs=1e-4)
    # without max_length, the checkpoint's context (max_position_embeddings), not seq_len 128
    assert TransformerLM(workdir=f"hf:{directory}", batch_size=2).max_length == 64


def test_an_imported_model_without_positions_scores_lm_evals_default_length(tmp_path):
    """A Mamba 2 import has no position limit (its max_len is a converter's bound, 2^17): its
    max_length is lm-eval's HF model's default for such a config, 2048, not 2^17 tokens."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from test_sft import LLAMA3, build_tokenizer

    directory = build_tokenizer(tmp_path / "mamba", LLAMA3)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, state_size=8, head_dim=8,
        num_heads=4, n_groups=1, expand=2, conv_kernel=4, chunk_size=8)).save_pretrained(directory)
    lm = TransformerLM(workdir=f"hf:{directory}", batch_size=2)
    assert lm.config.model.max_len == 1 << 17 and lm.max_length == 2048
    assert TransformerLM(workdir=f"hf:{directory}", batch_size=2, max_length=96).max_length == 96


@pytest.mark.parametrize("template,adds_bos", [("chatml", True), ("llama3", True),
                                               ("chatml", False)],
                         ids=["chatml_after_the_tokenizers_bos", "llama3_writing_its_bos",
                              "chatml_without_bos"])
def test_apply_chat_template_scores_what_lm_evals_hf_model_scores(tmp_path, template, adds_bos):
    """lm-eval's --apply_chat_template (a system instruction, a few-shot example as a turn of
    its own): the adapter renders each request's context as lm-eval's HF model does on the same
    checkpoint, and scores the same ids: behind the BOS the tokenizer puts first (once, where
    the template writes it too: Llama 3's), behind nothing where it puts none (Qwen's layout,
    whose plain texts read behind <eos>), the context's trailing newline moved to the
    continuation; so every log-likelihood is HF's. It was NotImplementedError."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import tokenizers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from test_sft import CHATML, LLAMA3, build_tokenizer

    directory = build_tokenizer(tmp_path / template, {"chatml": CHATML, "llama3": LLAMA3}[
        template])
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos = vocab["<|begin_of_text|>"], vocab["<|end_of_text|>"]
    if adds_bos:  # (as llama3_with_bos)
        tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
        tok.save(str(directory / "tokenizer.json"))
    tiny_llama(directory, len(vocab), bos, eos)
    manager = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")),
                          include_defaults=False)
    ours = TransformerLM(workdir=f"hf:{directory}", batch_size=4)
    theirs = HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=4)
    samples = {}
    for name, lm in (("ours", ours), ("hf", theirs)):
        out = lm_eval.simple_evaluate(
            model=lm, tasks=["local_mc"], task_manager=manager, apply_chat_template=True,
            system_instruction="Answer briefly.", num_fewshot=1, limit=2, log_samples=True)
        samples[name] = out["samples"]["local_mc"]
    contexts = [s["arguments"] for s in samples["hf"]]
    assert [s["arguments"] for s in samples["ours"]] == contexts
    context = contexts[0][0][0]
    assert context.startswith("<|begin_of_text|>" if template == "llama3" else "<|im_start|>")
    assert "Answer briefly." in context and context.count("assistant") == 2  # shot, then ours
    scored = ours._document(ours._encode(context.rstrip()))
    assert scored == theirs.tok_encode(context.rstrip())
    assert scored[:2].count(bos) == adds_bos  # one BOS where the template writes one too
    np.testing.assert_allclose(
        [float(r[0][0]) for s in samples["ours"] for r in s["resps"]],
        [float(r[0][0]) for s in samples["hf"] for r in s["resps"]], rtol=1e-5, atol=1e-5)
    assert ours.chat_template(True) == theirs.chat_template(True)


def test_a_model_without_a_chat_template_refuses_apply_chat_template_in_one_line():
    """As lm-eval's HF model (transformers refuses a tokenizer without a chat template): one
    line naming what is missing, where it was lm-eval's NotImplementedError."""
    import flax.linen as nn

    from transformer.data.tokenizers import ByteTokenizer
    from transformer.models import build_model

    tokenizer = ByteTokenizer(num_sentinels=0)
    config = configs.experiment("gpt_tiny")
    config.model.update(**TINY_MODEL, vocab_size=tokenizer.vocab_size)
    model = build_model(config.model)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), np.ones((1, 8), np.int32))[
        "params"])
    lm = TransformerLM.from_params(model, params, tokenizer, config)
    assert lm.chat_template(True) is None and lm.tokenizer_name.startswith("ByteTokenizer-")
    with pytest.raises(ValueError, match=r"^the byte tokenizer has no chat template: "):
        lm.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_refusing_the_system_role_renders_as_lm_evals_hf_model(tmp_path, caplog):
    """As lm-eval's HF model: a template that refuses a system message (Gemma's, Mistral's) gets
    the conversation without it, with a warning; a task's gen_prefix (add_generation_prompt=
    False) continues the last message rather than closing its turn."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.models.huggingface import HFLM
    from test_sft import CHATML, build_tokenizer

    refusing = CHATML.replace("['system', 'user', ", "['user', ")
    assert refusing != CHATML
    directory = build_tokenizer(tmp_path / "chat", refusing)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    tiny_llama(directory, len(vocab), vocab["<|begin_of_text|>"], vocab["<|end_of_text|>"])
    ours = TransformerLM(workdir=f"hf:{directory}", batch_size=2)
    theirs = HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=2)
    history = [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "The capital of France is"},
               {"role": "assistant", "content": "Answer:"}]
    for messages, prompt in ((history[:2], True), (history, False)):
        with caplog.at_level("WARNING"):
            rendered = ours.apply_chat_template(messages, prompt)
        assert rendered == theirs.apply_chat_template(messages, prompt)
        assert "system" not in rendered and rendered.endswith(
            "assistant\n" if prompt else "Answer:")
    assert "without its system messages" in caplog.text


def test_generate_until_drops_a_generated_special_as_lm_evals_hf_model(tmp_path):
    """A base Llama 3 whose greedy pick is a special token that does not end a sample
    (<|start_header_id|>: its lm_head row outscores the argmax's): as HF generate, the adapter
    emits it (it was banned, so the next-best token was taken and the text went on elsewhere),
    and as lm-eval's HF model leaves it out of the text (skip_special_tokens) before cutting at
    `until`: the same strings as HFLM's, batched and alone. A stop string that is its text
    ends the generation there (it went on past it: the text has no such string to cut at)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from test_sft import llama3_with_bos

    directory, vocab, bos, eos = llama3_with_bos(tmp_path / "llama")
    hf = tiny_llama(directory, len(vocab), bos, eos)
    header = vocab["<|start_header_id|>"]
    prompts = ["the sea and the king", "tell me a story"]
    with torch.no_grad():  # the header outscores whatever the first prompt's greedy pick is
        ids = torch.tensor([[bos, *lm_eval_ids(directory, prompts[0])]])
        top = int(hf(input_ids=ids).logits[0, -1].argmax())
        hf.lm_head.weight[header] = 1.5 * hf.lm_head.weight[top]
    hf.save_pretrained(directory)
    theirs = HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=2)
    raw = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert header in raw and eos not in raw  # a special generated, not a stop
    requests = [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 12}), i)
                for i, p in enumerate(prompts)]
    want = theirs.generate_until(requests)
    assert want[0] == theirs.tok_decode(raw).split("\n\n")[0]
    # A stop string that is the special's text ends the generation at it (HF generate's
    # stopping criteria read the text with the specials written), the text leaving it out;
    # HFLM alone (batched, its rows go on until every row has stopped)
    stopping = [Instance("generate_until", {}, (p, {"until": ["<|start_header_id|>"],
                                                    "max_gen_toks": 12}), i)
                for i, p in enumerate(prompts)]
    alone = HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=1)
    stopped = alone.generate_until(stopping)
    assert want[0].startswith(stopped[0]) and len(stopped[0]) < len(want[0])
    for batch_size in (2, 1):
        ours = TransformerLM(workdir=f"hf:{directory}", batch_size=batch_size, max_length=64)
        assert ours.generate_until(requests) == want
        assert ours.generate_until(stopping) == stopped
    assert ours.banned == ()  # (the padded vocabulary only: none here)


def lm_eval_ids(directory, text: str) -> list[int]:
    """`text`'s ids without specials, as the directory's tokenizer.json encodes it."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids


# Qwen3's generation prompt as Qwen/Qwen3-* ship it: enable_thinking false writes an empty think
# block after the assistant's opening.
QWEN3_THINKING_PROMPT = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_chat_options_render_as_lm_evals_hf_model(tmp_path):
    """lm-eval's HF model's chat options reach the chat template as they reach its own:
    Qwen3's `enable_thinking=false` (or `chat_template_args={"enable_thinking": false}`) writes
    the empty think block, true or unset does not, and the rendered contexts equal HFLM's with
    the same options. Rendered contexts are cached by `tokenizer_name`, which tells the options
    apart (HFLM's key, the tokenizer's name, does not). With enable_thinking true a
    log-likelihood request is refused, as HFLM refuses it. The options were refused as unknown
    --model_args."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from test_sft import QWEN3, build_tokenizer

    template = QWEN3.replace("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
                             "{%- endif %}", QWEN3_THINKING_PROMPT.replace("\\n", "\n"))
    assert template != QWEN3
    directory = build_tokenizer(tmp_path / "qwen3", template)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    tiny_llama(directory, len(vocab), vocab["<|begin_of_text|>"], vocab["<|im_end|>"])
    history = [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "The capital of France is"}]
    options = {"unset": {}, "off": {"enable_thinking": False},
               "off_by_args": {"chat_template_args": {"enable_thinking": False}},
               "on": {"enable_thinking": True, "think_end_token": "</think>"}}
    rendered, names = {}, {}
    for name, chat in options.items():
        ours = TransformerLM(workdir=f"hf:{directory}", batch_size=1, **chat)
        theirs = HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=1,
                      **chat)
        rendered[name], names[name] = ours.apply_chat_template(history), ours.tokenizer_name
        assert rendered[name] == theirs.apply_chat_template(history), name
    empty_block = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert rendered["off"].endswith(empty_block) and rendered["off_by_args"] == rendered["off"]
    assert rendered["unset"] == rendered["on"] == rendered["off"].removesuffix(
        "<think>\n\n</think>\n\n")
    # a cache key per rendering: the same options by either name share one
    assert names["off"] == names["off_by_args"] and len(set(names.values())) == 3
    request = Instance("loglikelihood", {}, ("The capital", " of"), 0, metadata=("mc", 0, 1))
    with pytest.raises(ValueError, match=r"^enable_thinking=True: log-likelihood requests "
                                         r"\(task mc\) have no generation to think in"):
        ours.loglikelihood([request])
    for key in ("tokenize", "add_generation_prompt"):  # (a TypeError in functools.partial)
        with pytest.raises(ValueError, match=rf"^chat_template_args key '{key}': the adapter "
                                             "sets it as lm-eval's HF model does"):
            TransformerLM.create_from_arg_obj({"workdir": "runs/gpt",
                                               "chat_template_args": {key: True}})


def test_thinking_refuses_log_likelihood_tasks_before_the_model_loads(tmp_path):
    """The command with enable_thinking=true refuses a log-likelihood task (multiple choice
    too, in a group or a tag) in one line before the model loads, as the docs promise; lm-eval
    and the adapter refused it only once every generation had run, and the results were lost.
    Rolling and generative tasks run; enable_thinking false runs anything."""
    from lm_eval.tasks import TaskManager

    from transformer import harness

    tasks = write_tasks(tmp_path / "tasks")
    (tasks / "group.yaml").write_text("group: local_group\ntask:\n  - local_gen\n"
                                      "  - task: local_mc\n")
    (tasks / "tagged.yaml").write_text((tasks / "mc.yaml").read_text().replace(
        "task: local_mc\n", "task: local_tagged\ntag: local_tag\n"))
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    ran = []
    evaluate = harness._checking_tasks(lambda **kwargs: ran.append(kwargs["tasks"]))
    thinking = {"workdir": "runs/gpt", "enable_thinking": True, "think_end_token": "</think>"}
    for names, refused in ((["local_gen", "local_rolling"], None),
                           (["local_rolling", "local_mc"], "local_mc"),
                           (["local_group"], "local_mc"), (["local_tag"], "local_tagged")):
        for model_args in (thinking, "workdir=runs/gpt,enable_thinking=true,think_end_token=9"):
            if refused is None:
                evaluate(model="transformer", model_args=model_args, tasks=names,
                         task_manager=manager)
                assert ran.pop() == names
                continue
            with pytest.raises(ValueError, match=rf"^enable_thinking=True: log-likelihood "
                                                 rf"requests \(task {refused}\) have no"):
                evaluate(model="transformer", model_args=model_args, tasks=names,
                         task_manager=manager)
        evaluate(model="transformer", model_args={**thinking, "enable_thinking": False},
                 tasks=names, task_manager=manager)
        assert ran == [names]
        ran.clear()


def test_think_end_token_keeps_the_answer_after_the_thinking_as_lm_evals_hf_model(tmp_path,
                                                                                 caplog):
    """`think_end_token` (the end of a reasoning trace: its text, or its id) keeps only what
    a generation says after its last occurrence, its leading space stripped, before the stop
    strings cut it: the same strings as HFLM's with the same option, batched, where the plain
    generation keeps the trace; a stop string inside the trace ends the generation there, as
    in HFLM. A special token's text as the think end is warned about (it never matches)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from test_sft import llama3_with_bos

    directory, vocab, bos, eos = llama3_with_bos(tmp_path / "llama")
    hf = tiny_llama(directory, len(vocab), bos, eos)
    prompts = ["the sea and the king", "tell me a story"]
    raws = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([[bos, *lm_eval_ids(directory, prompt)]])
            raws.append(hf.generate(ids, max_new_tokens=12, do_sample=False)[
                0, ids.shape[1]:].tolist())
    decode = HFLM(pretrained=str(directory), dtype="float32", device="cpu").tok_decode

    def after(raw, token):  # what follows the token's last occurrence
        return raw[len(raw) - raw[::-1].index(token):]

    # think ends among the greedy tokens, as a reasoning model writes </think>: one the first
    # generation repeats (a random model repeats itself; the last occurrence counts), one
    # followed by a space (stripped)
    repeated = next(t for t in raws[0] if raws[0].count(t) > 1)
    spaced = next(t for raw in raws for t in raw[:-1] if decode(after(raw, t))[:1] == " ")
    requests = [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 12}), i)
                for i, p in enumerate(prompts)]
    kept = TransformerLM(workdir=f"hf:{directory}", batch_size=2, max_length=64
                         ).generate_until(requests)
    for think_id in (repeated, spaced):
        for think_end in (think_id, str(think_id), decode([think_id]).strip()):
            theirs = HFLM(pretrained=str(directory), dtype="float32", device="cpu",
                          batch_size=2, think_end_token=think_end)
            want = theirs.generate_until(requests)
            ours = TransformerLM(workdir=f"hf:{directory}", batch_size=2, max_length=64,
                                 think_end_token=think_end)
            assert ours.generate_until(requests) == want, think_end
            cut = [i for i, raw in enumerate(raws) if think_id in raw]
            assert all(kept[i] != want[i] and kept[i].endswith(want[i]) for i in cut), want
        assert think_id != spaced or any(kept[i].endswith(" " + want[i]) for i in cut), want
    # A stop string inside the trace ends the generation there (HF generate's stopping
    # criteria; HFLM alone: batched, its rows go on until every row has stopped): the trace,
    # before its last think end, is then the answer
    last = len(raws[0]) - raws[0][::-1].index(repeated) - 1
    stop = next(text for t in raws[0][:last] if t != repeated and (
        text := decode([t]).strip()).isascii() and text.isalpha())
    in_trace = [Instance("generate_until", {}, (p, {"until": [stop], "max_gen_toks": 12}), i)
                for i, p in enumerate(prompts)]
    alone = HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=1,
                 think_end_token=repeated)
    ours = TransformerLM(workdir=f"hf:{directory}", batch_size=2, max_length=64,
                         think_end_token=repeated)
    assert ours.generate_until(in_trace) == alone.generate_until(in_trace)
    # A special token's text never matches (the text leaves the specials out, in HFLM too)
    with caplog.at_level("WARNING"):
        TransformerLM(workdir=f"hf:{directory}", batch_size=2, think_end_token="<|eot_id|>")
    assert f"give its id, think_end_token={vocab['<|eot_id|>']}" in caplog.text
