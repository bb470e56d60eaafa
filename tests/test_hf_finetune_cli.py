"""A short fine-tune through the CLI from each 2025-26 family's save_pretrained directory with
no model flags (`init_from=hf:DIR`): every param loads, none is new, two steps train finite
(bytes as tokens: a vocabulary of 263)."""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

VOCAB = 263
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"]))


def olmo3():
    return transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
        **SMALL, num_hidden_layers=4, sliding_window=4))


def qwen3_next():
    from test_hf_qwen3_next import qwen3_next as build

    return build(vocab_size=VOCAB)


def deepseek_v3():
    from test_hf_deepseek import deepseek

    return deepseek(vocab_size=VOCAB)


def gpt_oss():
    from test_hf_gpt_oss import gpt_oss as build

    return build(vocab_size=VOCAB)


def mamba2():
    from test_hf_mamba2 import mamba2 as build

    return build(vocab_size=VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("family", [deepseek_v3, gpt_oss, gemma3, olmo3, qwen3_next, mamba2],
                         ids=lambda f: f.__name__)
def test_a_short_fine_tune_through_the_cli_with_no_model_flags(family, tmp_path):
    from test_train import assert_succeeded, run_cli, tiny_flags

    directory = tmp_path / "hf"
    family().save_pretrained(directory)
    result = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                     f"--config.init_from=hf:{directory}", "--config.data.tokenizer=byte",
                     "--config.data.num_sentinels=0", f"--workdir={tmp_path / 'run'}",
                     *[f for f in tiny_flags(2) if not f.startswith("--config.model.")],
                     logs=tmp_path)
    assert_succeeded(result)
    line = next(x for x in result.stdout.splitlines() if x.startswith("init_from"))
    assert line.endswith("new 0; dropped 0"), line
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert np.isfinite([r["loss"] for r in records if r.get("split") == "train"]).all()
