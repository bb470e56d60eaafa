"""Supervised fine-tuning on chat data (`data.objective="sft"`, transformer.data.chat).

A byte-level BPE tokenizer is trained here on a few lines and saved as a Hugging Face
save_pretrained directory with a chat template (Llama 3's layout in tokenizer_config.json, or
ChatML in chat_template.jinja as transformers 5 writes it); `transformers.AutoTokenizer` loading
that directory is the reference for every id. The end-to-end test imports a tiny
LlamaForCausalLM through `init_from=hf:DIR` and runs the CLI. No test reads ../shared.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import forkserver
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from transformer import configs  # noqa: E402
from transformer.data import chat, inputs  # noqa: E402
from transformer.data import tokenizers as tokenizers_lib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# Llama 3's template (its layout, as Meta ships it): bos, a header per turn, <|eot_id|>.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
          "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
# ChatML (Qwen's layout), refusing unknown roles with raise_exception.
CHATML = ("{% for message in messages %}{% if message['role'] not in ['system', 'user', "
          "'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML marking the assistant's text for transformers' own assistant mask.
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endgeneration %}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ... the usual way: the marks end at <|im_end|>, the '\n' after it is the template's.
CHATML_GENERATION_USUAL = CHATML_GENERATION.replace(
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}",
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}")
assert CHATML_GENERATION_USUAL != CHATML_GENERATION
# Qwen3's message loop (tools left out, as Qwen/Qwen3-* ship it): an assistant turn after the
# last user message opens with <think>...</think>, so earlier turns render differently once
# more messages follow.
QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' %}{%- set ns.found = true %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.role != 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- else %}{%- set reasoning = message.reasoning_content | default('') %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + "
    "message.content.lstrip('\n') }}{%- else %}{{- '<|im_start|>assistant\n' + "
    "message.content }}{%- endif %}{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

_WORDS = ("what is the capital of france paris two plus four six tell me a story about a king "
          "who loved the sea thank you hello how are you fine good night please write poem "
          "short long the and of to it").split()


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def conversation(seed: int, turns: int | None = None, system: bool | None = None) -> list:
    """A multi-turn conversation of uneven lengths, sometimes with a system message."""
    rng = random.Random(seed)
    turns = turns or rng.randint(1, 3)
    messages = [{"role": "system", "content": sentence(rng, 2, 6)}] \
        if (rng.random() < 0.5 if system is None else system) else []
    for _ in range(turns):
        messages += [{"role": "user", "content": sentence(rng, 1, 12)},
                     {"role": "assistant", "content": sentence(rng, 1, 20)}]
    return messages


def build_tokenizer(directory: Path, template: str, where: str = "tokenizer_config.json",
                    specials: list[str] = SPECIALS):
    """A byte-level BPE with `specials` trained on a few lines, saved with `template` in `where`
    (tokenizer_config.json's chat_template, or chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # (Blank lines too, so "\n\n" is one token that the text around a header can split.)
    lines = [" ".join(_WORDS[i:i + 7]) + "\n\n" for i in range(len(_WORDS))]
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
    if where == "tokenizer_config.json":
        config["chat_template"] = template
    elif where == "chat_template.jinja":
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def llama3_with_bos(directory: Path) -> tuple[Path, dict, int, int]:
    """`build_tokenizer`'s Llama 3 directory whose tokenizer.json's post-processor puts
    <|begin_of_text|> first, as the hub's does: (directory, vocab, bos id, eos id)."""
    import tokenizers

    directory = build_tokenizer(directory, LLAMA3)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    eos, bos = vocab["<|end_of_text|>"], vocab["<|begin_of_text|>"]
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(directory / "tokenizer.json"))
    return directory, vocab, bos, eos


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA3)


def reference(directory):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


# --- rendering equals transformers' ------------------------------------------------------------


@pytest.mark.parametrize("template,where", [(LLAMA3, "tokenizer_config.json"),
                                           (CHATML, "chat_template.jinja")],
                         ids=["llama3_in_tokenizer_config", "chatml_in_chat_template_jinja"])
def test_tokens_equal_transformers_apply_chat_template(tmp_path, template, where):
    directory = build_tokenizer(tmp_path, template, where)
    ours, hf = tokenizers_lib.load_hf_tokenizer(str(directory)), reference(directory)
    assert ours.chat_template == template
    for seed in range(6):
        messages = conversation(seed)
        for prompt in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=True,
                                              add_generation_prompt=prompt)["input_ids"]
            got = chat.encode_chat(ours, messages, add_generation_prompt=prompt)
            assert got.tolist() == list(expected)
    # The template travels with the tokenizer a run saves into its workdir.
    ours.save(str(tmp_path / "saved"))
    again = tokenizers_lib.load_tokenizer(str(tmp_path / "saved"))
    assert again.chat_template == template
    assert chat.encode_chat(again, conversation(0)).tolist() == \
        hf.apply_chat_template(conversation(0), tokenize=True)["input_ids"]
    # ... and into what transformer.export writes (tokenizer_config.json's chat_template).
    tokenizer_json, config = again.hugging_face()
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported/tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (tmp_path / "exported/tokenizer_config.json").write_text(json.dumps(config))
    assert reference(tmp_path / "exported").apply_chat_template(
        conversation(4), tokenize=True, add_generation_prompt=True)["input_ids"] == \
        chat.encode_chat(ours, conversation(4), add_generation_prompt=True).tolist()


def test_roles_the_directory_does_not_name_are_not_the_template_s(tmp_path):
    """A tokenizer_config.json without bos_token: AutoTokenizer has no BOS, so a template's
    {{ bos_token }} writes nothing, for us too (whose bos is the well-known <|begin_of_text|>
    the vocabulary has, for other uses), also once saved into a workdir and loaded back."""
    import pickle

    directory = build_tokenizer(tmp_path, "{{ bos_token }}" + CHATML)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["bos_token"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours, hf = tokenizers_lib.load_hf_tokenizer(str(directory)), reference(directory)
    assert hf.bos_token is None and ours.decode([ours.bos_id]) == "<|begin_of_text|>"
    ours.save(str(tmp_path / "saved"))
    again = tokenizers_lib.load_tokenizer(str(tmp_path / "saved"))
    for tok in (ours, again, pickle.loads(pickle.dumps(ours))):
        assert tok.bos_id == ours.bos_id
        for seed in range(3):
            messages = conversation(seed)
            assert chat.encode_chat(tok, messages).tolist() == \
                hf.apply_chat_template(messages, tokenize=True)["input_ids"]
            ids, _ = chat.assistant_tokens(tok, messages)
            assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True)["input_ids"]


def train_and_save(tok, directory: Path, vocab_size: int) -> None:
    """Trains the BPE `tok` on a few lines with a Llama-2-like set of special tokens and saves
    it as directory/tokenizer.json."""
    import string

    from tokenizers import trainers

    lines = [" ".join(_WORDS[i:i + 7]) + "\n\n" for i in range(len(_WORDS))]
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=list(string.printable) + ["▁"]))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))


def llama_style(directory: Path, config: dict, template: str) -> Path:
    """A SentencePiece-shaped BPE (Metaspace, <unk> <s> </s> first, as Llama 2 and Mistral
    lay it out) with ChatML's specials, saved with `config` as tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    train_and_save(tok, directory, vocab_size=400)
    (directory / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": template}))
    return directory


# A template writing every role transformers passes it (an unset one writes nothing).
ROLES_TEMPLATE = "{{ bos_token }}{{ unk_token }}{{ pad_token }}" + CHATML.replace(
    "'<|im_end|>' + '\n'", "'<|im_end|>' + (eos_token or '') + '\n'")
assert ROLES_TEMPLATE.count("eos_token") == 1
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def hub_layout(directory: Path, layout: str) -> Path:
    """A directory laid out as one on the hub, ROLES_TEMPLATE its chat template."""
    template, config = ROLES_TEMPLATE, None
    if layout == "gpt2_hub":  # openai-community/gpt2's: no roles, no class, config.json's type
        build_tokenizer(directory, template, specials=CHATML_SPECIALS)
        config = {"model_max_length": 1024, "chat_template": template}
        (directory / "config.json").write_text('{"model_type": "gpt2"}')
    elif layout == "gpt2_class":  # ... naming its class; here with other well-known tokens too
        build_tokenizer(directory, template, specials=SPECIALS + ["<|endoftext|>"])
        config = {"model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer",
                  "chat_template": template}
    elif layout == "llama_without_bos":
        return llama_style(directory, {"tokenizer_class": "LlamaTokenizerFast",
                                       "eos_token": "</s>"}, template)
    elif layout == "qwen25_bos_null":
        build_tokenizer(directory, template, specials=CHATML_SPECIALS)
        config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
                  "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
                  "chat_template": template}
    elif layout == "bare_with_jinja":  # a bare tokenizer.json: no roles at all
        build_tokenizer(directory, template, "chat_template.jinja", specials=CHATML_SPECIALS)
        (directory / "tokenizer_config.json").unlink()
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.mark.parametrize("layout,roles", [
    ("gpt2_hub", {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>"}),
    ("gpt2_class", {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>"}),
    ("llama_without_bos", {"bos": "<s>", "eos": "</s>", "unk": "<unk>"}),
    ("qwen25_bos_null", {"eos": "<|im_end|>", "pad": "<|endoftext|>"}),
    ("bare_with_jinja", {}),
])
def test_the_template_sees_the_roles_autotokenizer_sets(tmp_path, layout, roles):
    """A role no config file names but the tokenizer class AutoTokenizer loads the directory
    as has by default (GPT2Tokenizer's <|endoftext|>, found from tokenizer_class or
    config.json's model_type; LlamaTokenizer's <s>) is the template's too, while one nothing
    names (Qwen's null bos, a bare tokenizer.json's) stays unset: ids equal transformers',
    also once saved and loaded back, and pickled."""
    import pickle

    directory = hub_layout(tmp_path / layout, layout)
    ours, hf = tokenizers_lib.load_hf_tokenizer(str(directory)), reference(directory)
    assert {r: t for r in tokenizers_lib.ROLES if (t := getattr(hf, f"{r}_token"))} == roles
    assert ours.named_specials == roles
    ours.save(str(tmp_path / "saved"))
    again = tokenizers_lib.load_tokenizer(str(tmp_path / "saved"))
    for tok in (ours, again, pickle.loads(pickle.dumps(ours))):
        assert tok.named_specials == roles
        for seed in range(3):
            messages = conversation(seed)
            for prompt in (False, True):
                assert chat.encode_chat(tok, messages, add_generation_prompt=prompt).tolist() \
                    == hf.apply_chat_template(messages, tokenize=True,
                                              add_generation_prompt=prompt)["input_ids"]
            ids, _ = chat.assistant_tokens(tok, messages)
            assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True)["input_ids"]


def legacy_llama(directory: Path, tokenizer_class: str) -> Path:
    """Llama 2's / Mistral's tokenizer.json layout (normalizer Prepend("▁") + Replace, no
    pre-tokenizer, byte fallback) with ChatML's specials and template, its
    tokenizer_config.json naming `tokenizer_class` with `legacy: false`."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    train_and_save(tok, directory, vocab_size=300)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "legacy": False, "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHATML}))
    return directory


def test_a_directory_autotokenizer_rebuilds_differently_warns_and_keeps_tokenizer_json(
        tmp_path, capsys):
    """transformers 5 rebuilds a LlamaTokenizerFast from its class and flags (legacy: false:
    Metaspace, no "▁" after a special token), not from the tokenizer.json as saved: its chat
    ids differ. One warning line at load says so and that the run follows tokenizer.json,
    whose ids the chat ids are, as they are those of the run's export through AutoTokenizer.
    The same files named PreTrainedTokenizerFast: no warning, AutoTokenizer's ids."""
    directory = legacy_llama(tmp_path / "llama", "LlamaTokenizerFast")
    tok, hf = tokenizers_lib.load_hf_tokenizer(str(directory)), reference(directory)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "AutoTokenizer loads it as LlamaTokenizer" in lines[0] and \
        "this run follows tokenizer.json" in lines[0], lines
    messages = conversation(0)
    ids = chat.encode_chat(tok, messages).tolist()
    assert ids == tok.encode(hf.apply_chat_template(messages, tokenize=False)).tolist()
    assert ids != hf.apply_chat_template(messages, tokenize=True)["input_ids"]
    tokenizer_json, config = tok.hugging_face()
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported/tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (tmp_path / "exported/tokenizer_config.json").write_text(json.dumps(config))
    assert reference(tmp_path / "exported").apply_chat_template(
        messages, tokenize=True)["input_ids"] == ids
    same = legacy_llama(tmp_path / "fast", "PreTrainedTokenizerFast")
    tok = tokenizers_lib.load_hf_tokenizer(str(same))
    assert "warning" not in capsys.readouterr().err
    assert chat.encode_chat(tok, messages).tolist() == ids == \
        reference(same).apply_chat_template(messages, tokenize=True)["input_ids"]


def test_a_class_autotokenizer_rebuilds_differently_warns_without_a_chat_template(tmp_path,
                                                                                   capsys):
    """Pretraining or fine-tuning on plain text from the same Llama 2-style directory, no chat
    template: a text starting with a space gets an extra "▁" from the saved Prepend("▁") that
    the rebuilt class leaves out. One warning line; the ids are tokenizer.json's."""
    directory = legacy_llama(tmp_path / "llama", "LlamaTokenizerFast")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok, hf = tokenizers_lib.load_hf_tokenizer(str(directory)), reference(directory)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "AutoTokenizer loads it as LlamaTokenizer" in lines[0] and \
        "this run follows tokenizer.json" in lines[0], lines
    assert tok.encode(" a").tolist() == tok._tok.encode(" a", add_special_tokens=False).ids \
        != hf(" a", add_special_tokens=False)["input_ids"]


def test_a_directory_transformers_cannot_load_keeps_the_well_known_roles(tmp_path):
    """A custom tokenizer class (auto_map: trust_remote_code, never granted here): its roles
    are read as before, the ones no file names filled in from well-known tokens and unnamed."""
    directory = build_tokenizer(tmp_path, ROLES_TEMPLATE, specials=CHATML_SPECIALS)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]},
        "tokenizer_class": "MyTokenizer", "chat_template": ROLES_TEMPLATE}))
    with pytest.raises(ValueError, match="trust_remote_code"):
        reference(directory)
    tok = tokenizers_lib.load_hf_tokenizer(str(directory))
    assert (tok.specials["eos"], tok.unnamed, tok.named_specials) == \
        ("<|endoftext|>", ("bos", "eos"), {})


def test_the_template_raise_exception_is_one_line(tmp_path):
    tok = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path, CHATML)))
    with pytest.raises(ValueError, match="^--chat: the chat template refused it: unknown role "
                                         "narrator$"):
        chat.encode_chat(tok, [{"role": "narrator", "content": "Once."}], where="--chat")
    with pytest.raises(ValueError, match="^a.jsonl:2: the chat template refused it: unknown "
                                         "role narrator$"):
        chat.assistant_tokens(tok, [{"role": "narrator", "content": "Once."}], "a.jsonl:2")


# --- the loss mask ---------------------------------------------------------------------------


def spans(mask) -> list[tuple[int, int]]:
    """[start, stop) of each run of ones."""
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def test_the_mask_covers_each_assistant_reply_and_its_end_of_turn_only(llama3_dir):
    tok = tokenizers_lib.load_hf_tokenizer(str(llama3_dir))
    for seed in range(10):  # the last two open with the assistant's message: bos, header first
        messages = conversation(seed, turns=3, system=seed % 2 == 0 and seed < 8)[seed // 8:]
        ids, mask = chat.assistant_tokens(tok, messages)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tok.decode(ids[a:b]) for a, b in spans(mask)] == \
            [r + "<|eot_id|>" for r in replies]
        # What is not masked decodes to the rest of the rendered text: bos, headers, the
        # system and user messages.
        text = reference(llama3_dir).apply_chat_template(messages, tokenize=False)
        assert tok.decode(ids) == text
        rest = tok.decode(ids[mask == 0])
        assert all(m["content"] in rest for m in messages if m["role"] != "assistant")


def test_the_mask_equals_transformers_generation_mask(tmp_path):
    """A template that marks assistant text ({% generation %}) gives transformers' own
    assistant mask, whether the marks hold ChatML's '\n' after <|im_end|> or (the usual way)
    end at <|im_end|>; the same template without the marks gives the usual mask by rendering:
    the reply and its <|im_end|>, never the '\n' after it."""
    plain = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path / "plain", CHATML)))
    for name, template in (("newline", CHATML_GENERATION), ("usual", CHATML_GENERATION_USUAL)):
        marked = tokenizers_lib.load_hf_tokenizer(
            str(build_tokenizer(tmp_path / name, template)))
        hf = reference(tmp_path / name)
        for seed in range(10):  # the last two open with the assistant's message
            messages = conversation(seed, turns=1 + seed % 3, system=False if seed >= 8 else None)
            messages = messages[1:] if seed >= 8 else messages
            expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            ids, mask = chat.assistant_tokens(marked, messages)
            assert (ids.tolist(), mask.tolist()) == (expected["input_ids"],
                                                     expected["assistant_masks"]), name
            if name == "usual":
                plain_ids, plain_mask = chat.assistant_tokens(plain, messages)
                assert (plain_ids.tolist(), plain_mask.tolist()) == (ids.tolist(),
                                                                     mask.tolist())
                assert [plain.decode(ids[a:b]) for a, b in spans(mask)] == \
                    [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def test_a_qwen3_template_masks_each_reply_of_a_multi_turn_conversation(tmp_path):
    """Qwen3's template renders an earlier assistant turn differently once more messages
    follow (<think></think> only after the last user message): each reply is found where the
    whole conversation renders it, with its <|im_end|>; the last one as the model writes it
    after the opened turn, <think></think> included."""
    tok = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path, QWEN3)))
    hf = reference(tmp_path)
    for seed in range(6):
        messages = conversation(seed, turns=1 + seed % 3)
        ids, mask = chat.assistant_tokens(tok, messages)
        assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True)["input_ids"]
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        replies[-1] = "<think>\n\n</think>\n\n" + replies[-1]
        assert [tok.decode(ids[a:b]) for a, b in spans(mask)] == replies
    # A reply with its reasoning: the think block is the last reply's; an earlier one's
    # reasoning is dropped by the template, so masks nothing.
    messages = conversation(1, turns=2, system=False)
    messages[1] = {**messages[1], "reasoning_content": "Think first."}
    messages[3] = {**messages[3], "reasoning_content": "Think again."}
    ids, mask = chat.assistant_tokens(tok, messages)
    assert [tok.decode(ids[a:b]) for a, b in spans(mask)] == [
        messages[1]["content"] + "<|im_end|>",
        "<think>\nThink again.\n</think>\n\n" + messages[3]["content"] + "<|im_end|>"]
    assert tok.decode([chat.end_of_turn_id(tok)]) == "<|im_end|>"


def test_a_template_whose_replies_cannot_be_found_is_refused_with_one_line(tmp_path):
    """Earlier turns in capitals: neither the prefixes nor a marker in a reply's place find it."""
    shouting = CHATML.replace("'\n' + message['content'] +",
                              "'\n' + (message['content'] if loop.last else "
                              "message['content'] | upper) +")
    assert shouting != CHATML
    tok = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path, shouting)))
    with pytest.raises(ValueError, match="^a.jsonl:4: the chat template renders the "
                                         "conversation before message 1 .assistant. "
                                         "differently from its start, and .*generation"):
        chat.assistant_tokens(tok, conversation(2, turns=2, system=False), "a.jsonl:4")


def test_the_end_of_turn_is_the_template_s(llama3_dir, tmp_path):
    llama = tokenizers_lib.load_hf_tokenizer(str(llama3_dir))
    chatml = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path, CHATML)))
    assert llama.decode([chat.end_of_turn_id(llama)]) == "<|eot_id|>"
    assert chatml.decode([chat.end_of_turn_id(chatml)]) == "<|im_end|>"


def marked_content(opening: str = "", end: str = "<|im_end|>") -> str:
    """ChatML whose {% generation %} marks an assistant's content alone, the end of turn after
    the marks (`opening` before the content of every assistant turn but the last)."""
    return ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
            "{{ '<|im_start|>assistant\n' }}{% if not loop.last %}{{ '" + opening + "' }}"
            "{% endif %}{% generation %}{{ message['content'] }}{% endgeneration %}"
            "{{ '" + end + "\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_generation_marks_on_the_content_alone_still_mask_the_end_of_turn(tmp_path, capsys):
    """`{% generation %}{{ content }}{% endgeneration %}<|im_end|>`: transformers' mask lacks
    the end of turn, so the model would never learn to stop; the end of turn the template
    renders after the marks joins the mask, as the unmarked template's mask has it."""
    marked = tokenizers_lib.load_hf_tokenizer(
        str(build_tokenizer(tmp_path / "marked", marked_content())))
    plain = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path / "plain", CHATML)))
    for seed in range(8):
        messages = conversation(seed, turns=1 + seed % 3)
        ids, mask = chat.assistant_tokens(marked, messages)
        assert (ids.tolist(), mask.tolist()) == tuple(
            x.tolist() for x in chat.assistant_tokens(plain, messages))
    assert marked.decode([chat.end_of_turn_id(marked)]) == "<|im_end|>"
    # Turns that render differently by what follows: the special token after each mark.
    earlier = tokenizers_lib.load_hf_tokenizer(
        str(build_tokenizer(tmp_path / "earlier", marked_content(opening="Earlier: "))))
    messages = conversation(3, turns=3)
    ids, mask = chat.assistant_tokens(earlier, messages)
    assert [earlier.decode(ids[a:b]) for a, b in spans(mask)] == \
        [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    # No special token ends a turn: eos, with a warning line rather than silently.
    bare = tokenizers_lib.load_hf_tokenizer(
        str(build_tokenizer(tmp_path / "bare", marked_content(end="\n"))))
    assert chat.end_of_turn_id(bare) == bare.require("eos", "")
    assert "warning: the chat template ends an assistant turn with no special token" in \
        capsys.readouterr().err


def test_an_empty_reply_s_end_of_turn_is_masked_with_generation_marks_too(tmp_path):
    """An assistant message with content "": its marks hold no token, yet its end of turn is
    in the mask, as the unmarked template's mask has it."""
    marked = tokenizers_lib.load_hf_tokenizer(
        str(build_tokenizer(tmp_path / "marked", marked_content())))
    plain = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path / "plain", CHATML)))
    whole = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": "A king loved the sea."}]
    for messages in (whole, whole[:2]):
        ids, mask = chat.assistant_tokens(marked, messages)
        assert (ids.tolist(), mask.tolist()) == tuple(
            x.tolist() for x in chat.assistant_tokens(plain, messages))
        assert marked.decode(ids[spans(mask)[0][0]:spans(mask)[0][1]]) == "<|im_end|>"


def test_a_reply_holding_the_end_of_turn_as_text_still_masks_its_turn_s_end(tmp_path):
    """A reply whose text holds "<|im_end|>" (encoded as that special token, as transformers
    encodes it): with marks on the content alone, the turn's own <|im_end|> after the marks is
    still in the mask, as the unmarked template's and transformers' usual marks have it."""
    marked = tokenizers_lib.load_hf_tokenizer(
        str(build_tokenizer(tmp_path / "marked", marked_content())))
    plain = tokenizers_lib.load_hf_tokenizer(str(build_tokenizer(tmp_path / "plain", CHATML)))
    hf = reference(build_tokenizer(tmp_path / "usual", CHATML_GENERATION_USUAL))
    for reply in ("Paris.<|im_end|>The king", "Paris. <|im_end|> The king"):
        messages = [{"role": "user", "content": "Echo it."},
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": "Again."},
                    {"role": "assistant", "content": "Fine. " + reply}]
        ids, mask = chat.assistant_tokens(marked, messages)
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert (ids.tolist(), mask.tolist()) == (expected["input_ids"],
                                                 expected["assistant_masks"]), reply
        assert mask.tolist() == chat.assistant_tokens(plain, messages)[1].tolist()
        assert [marked.decode(ids[a:b]) for a, b in spans(mask)] == \
            [reply + "<|im_end|>", "Fine. " + reply + "<|im_end|>"]


def test_marks_ending_in_the_end_of_turn_are_the_mask_before_a_closing_special(tmp_path):
    """Marks that hold the end of turn end the reply: a special token the template writes after
    the conversation (<|end_of_text|> here) is no reply's, as in transformers' mask."""
    template = CHATML_GENERATION_USUAL + "{% if not add_generation_prompt %}<|end_of_text|>" \
        "{% endif %}"
    directory = build_tokenizer(tmp_path / "closing", template)
    tok, hf = tokenizers_lib.load_hf_tokenizer(str(directory)), reference(directory)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Fine."}]
    ids, mask = chat.assistant_tokens(tok, messages)
    expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    assert ids.tolist()[-1] == hf.convert_tokens_to_ids("<|end_of_text|>")
    assert (ids.tolist(), mask.tolist()) == (expected["input_ids"], expected["assistant_masks"])


def test_chat_replies_open_the_assistant_turn_and_stop_at_its_end(llama3_dir, monkeypatch):
    """generate --chat: the prompt is the conversation with the assistant turn open, exactly
    as transformers renders it; decoding stops at the template's end of turn (never banned),
    and the reply is what comes before it."""
    from types import SimpleNamespace

    from transformer import generate
    from transformer.generation import text

    tok = tokenizers_lib.load_hf_tokenizer(str(llama3_dir))
    eot, reply, seen = chat.end_of_turn_id(tok), tok.encode(" Paris."), {}

    def decode(model, params, prompts, *, max_new_tokens, eos_id, banned_ids, **kwargs):
        seen.update(prompt=list(prompts[0]), eos=eos_id, banned=banned_ids, n=max_new_tokens)
        return np.array([[*reply, eot, 40, 41]]), None

    monkeypatch.setattr(text, "decode", decode)  # what chat_replies calls
    config = configs.experiment("sft_chat")
    messages = conversation(3)[:-1]  # ends with the user's turn
    got = generate.chat_replies(SimpleNamespace(vocab_size=tok.vocab_size + 7), None, tok,
                                config, messages, max_new_tokens=9)
    assert got == [" Paris."]
    assert seen["prompt"] == reference(llama3_dir).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert seen["eos"] == (tok.eos_id, eot) and eot not in seen["banned"] and seen["n"] == 9
    assert tok.vocab_size in seen["banned"]  # (the padded ids past the vocabulary stay banned)
    seen.clear()  # 0 new tokens: empty replies, nothing decoded (as generate's other calls)
    assert generate.chat_replies(SimpleNamespace(vocab_size=tok.vocab_size + 7), None, tok,
                                 config, messages, num_samples=2, max_new_tokens=0) == ["", ""]
    assert not seen


# Llama 3.1 Instruct's generation_config.json: HF `generate` stops at each of these.
LLAMA31_STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")


def llama31_tokenizer(directory: Path) -> list[int]:
    """Llama 3.1 Instruct's layout: the Llama 3 template (a turn ends with <|eot_id|>), <eos>
    <|end_of_text|>, and a generation_config.json whose eos_token_id lists `LLAMA31_STOPS`
    (<|eom_id|> among them: neither <eos> nor the end of turn). Returns that list."""
    build_tokenizer(directory, LLAMA3, specials=SPECIALS + ["<|eom_id|>"])
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    stops = [vocab[t] for t in LLAMA31_STOPS]
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": vocab["<|begin_of_text|>"], "eos_token_id": stops}))
    return stops


def test_chat_stops_at_every_stop_id_of_the_checkpoints_generation_config(tmp_path,
                                                                         monkeypatch):
    """An imported checkpoint's generation_config.json stop ids (kept with the tokenizer the
    workdir saves) end a reply as HF `generate` ends it: never banned, the reply cut at the
    first one (here <|eom_id|>); --prompt sampling does not ban them either."""
    from types import SimpleNamespace

    from transformer import generate
    from transformer.generation import text

    stops = llama31_tokenizer(tmp_path / "llama31")
    tokenizers_lib.load_hf_tokenizer(str(tmp_path / "llama31")).save(str(tmp_path / "saved"))
    tok = tokenizers_lib.load_tokenizer(str(tmp_path / "saved"))
    assert tok.stop_ids == tuple(stops)
    eom, reply, seen = stops[1], tok.encode(" Paris."), {}

    def decode(model, params, prompts, *, eos_id, banned_ids, **kwargs):
        seen.update(eos=eos_id, banned=banned_ids)
        return np.array([[*reply, eom, 40, chat.end_of_turn_id(tok), 41]]), None

    monkeypatch.setattr(text, "decode", decode)
    model = SimpleNamespace(vocab_size=tok.vocab_size)
    got = generate.chat_replies(model, None, tok, configs.experiment("sft_chat"),
                                conversation(3)[:-1], max_new_tokens=9)
    assert got == [" Paris."]
    assert set(seen["eos"]) == set(stops) and not set(stops) & set(seen["banned"])
    header = tok._tok.token_to_id("<|start_header_id|>")
    assert header in seen["banned"]  # the other specials stay banned
    assert not set(stops) & set(generate.banned_ids(tok, tok.vocab_size))


def test_an_export_writes_back_the_checkpoints_stop_ids_in_its_order(tmp_path):
    """generation_config.json's eos_token_id is the imported checkpoint's list, in its order
    (not <eos> and the end of turn alone), so HF `generate` stops on the export as on it."""
    import types

    from transformer import export

    stops = llama31_tokenizer(tmp_path / "llama31")
    tokenizers_lib.load_hf_tokenizer(str(tmp_path / "llama31")).save(str(tmp_path / "saved"))
    tokenizer = tokenizers_lib.load_tokenizer(str(tmp_path / "saved"))
    hf_config = types.SimpleNamespace(bos_token_id=tokenizer.bos_id, pad_token_id=None)
    assert export._generation_config(hf_config, tokenizer).eos_token_id == stops


def test_generate_reads_chat_inline_as_a_json_file_or_as_jsonl(tmp_path):
    from transformer import generate

    one = conversation(1)
    (tmp_path / "one.json").write_text(json.dumps({"messages": one}))
    write_jsonl(tmp_path / "two.jsonl", [one, conversation(2)])
    assert generate.read_chat(json.dumps(one)) == [one]
    assert generate.read_chat(str(tmp_path / "one.json")) == [one]
    assert generate.read_chat(str(tmp_path / "two.jsonl")) == [one, conversation(2)]
    with pytest.raises(ValueError, match="--chat='hello': expected a JSON/JSONL file"):
        generate.read_chat("hello")


# --- packed rows -----------------------------------------------------------------------------


def write_jsonl(path: Path, conversations) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations),
                    encoding="utf-8")
    return path


def sft_config(tmp_path: Path, llama3_dir: Path, **data):
    config = configs.experiment("sft_chat")
    config.init_from = ""
    config.update(batch_size=4, seq_len=256, seed=3)
    config.data.update(tokenizer="hf", tokenizer_path=str(llama3_dir),
                       path=str(write_jsonl(tmp_path / "train.jsonl",
                                            [conversation(s) for s in range(40)])),
                       validation_path=str(write_jsonl(tmp_path / "val.jsonl",
                                                       [conversation(s) for s in range(40, 50)])),
                       **data)
    return config


def batches(config, split, **kwargs):
    tok = inputs.get_tokenizer(config)
    return tok, list(inputs.get_dataset(config, tok, split, **kwargs))


def test_rows_pack_whole_conversations_weighting_only_assistant_targets(tmp_path, llama3_dir):
    config = sft_config(tmp_path, llama3_dir)
    tok, passes = batches(config, "validation", num_epochs=1, shuffle=False)
    examples = [chat.assistant_tokens(tok, c) for c in
                [conversation(s) for s in range(40, 50)]]
    seen = []
    for batch in passes:
        for r in range(len(batch["inputs"])):
            segments = batch["segment_ids"][r]
            for s in np.unique(segments[segments > 0]):
                at = np.flatnonzero(segments == s)
                # positions restart per conversation; weights never cross into the next one
                assert batch["positions"][r][at].tolist() == list(range(len(at)))
                seen.append((batch["inputs"][r][at], batch["weights"][r][at],
                             batch["targets"][r][at]))
            assert not batch["weights"][r][segments == 0].any()
    # Every conversation exactly once, weighted exactly on the targets that are assistant
    # tokens (its last token, an input only where the row goes on, predicts nothing).
    assert len(seen) == len(examples)
    by_start = {tuple(ids[:-1].tolist()): (ids, mask) for ids, mask in examples}
    for inputs_, weights, targets in seen:
        key = tuple(inputs_.tolist())  # at a row's end; else the last token is an input too
        ids, mask = by_start[key if key in by_start else key[:-1]]
        n = len(ids) - 1
        assert targets[:n].tolist() == ids[1:].tolist()
        assert weights[:n].tolist() == mask[1:].astype(np.float32).tolist()
        assert not weights[n:].any()


def test_changing_a_user_message_keeps_the_weights_on_the_same_tokens(tmp_path, llama3_dir):
    """The weights follow the roles, not the text: a user message of the same length but
    other words weights the same positions, and none of its tokens."""
    tok = tokenizers_lib.load_hf_tokenizer(str(llama3_dir))
    messages = conversation(5, turns=2, system=True)
    ids, mask = chat.assistant_tokens(tok, messages)
    other = [dict(m) for m in messages]
    other[1]["content"] = " ".join("king" for _ in other[1]["content"].split())
    other_ids, other_mask = chat.assistant_tokens(tok, other)
    assert other_ids.tolist() != ids.tolist()
    user = tok.encode(other[1]["content"]).tolist()
    start = next(i for i in range(len(other_ids)) if other_ids[i:i + len(user)].tolist() == user)
    assert not other_mask[start:start + len(user)].any()
    shift = len(other_ids) - len(ids)  # the user message's token count changed by this
    assert [(a + shift, b + shift) for a, b in spans(mask)] == spans(other_mask)


def test_training_rows_are_seeded_and_repeat_each_conversation_once_per_epoch(tmp_path,
                                                                              llama3_dir):
    config = sft_config(tmp_path, llama3_dir)
    tok = inputs.get_tokenizer(config)
    take = lambda: [b for _, b in zip(range(6), inputs.get_dataset(config, tok, "train"),
                                      strict=False)]
    first, again = take(), take()
    assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, again,
                                                                        strict=True))
    rows = chat.PackedRows(chat.tokenized(config, tok, "train"), width=config.seq_len + 1,
                           seed=config.seed, training=True, shuffle=True)
    epoch = [rows.row(i) for i in range(rows.rows)]
    assert sum(len(np.unique(r["tokens_segment_ids"][r["tokens_segment_ids"] > 0]))
               for r in epoch) == len(chat.tokenized(config, tok, "train"))


def test_the_packed_sft_loss_equals_hf_llama_with_labels_masked_to_assistant_tokens(
        tmp_path, llama3_dir):
    """The loss of one packed batch (segment ids, positions per conversation, weights on
    assistant targets) equals the Hugging Face convention of SFT: each conversation through
    LlamaForCausalLM alone, labels -100 outside the assistant's tokens, the token-weighted
    mean over conversations."""
    import jax
    import jax.numpy as jnp
    import torch

    from transformer.hf import convert
    from transformer.models import build_model

    config = sft_config(tmp_path, llama3_dir)
    tok = inputs.get_tokenizer(config)
    batch = next(iter(inputs.get_dataset(config, tok, "validation", num_epochs=1,
                                         shuffle=False)))
    tiny_llama(tmp_path / "llama", tok.vocab_size)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    model_config, params = convert.from_hf(hf.config, hf.state_dict())
    logits = np.asarray(jax.jit(build_model(model_config).apply)(
        {"params": params}, jnp.asarray(batch["inputs"]),
        segment_ids=jnp.asarray(batch["segment_ids"]),
        positions=jnp.asarray(batch["positions"])), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, batch["targets"][..., None], -1)[..., 0]
    ours = -(picked * batch["weights"]).sum() / batch["weights"].sum()

    examples = [chat.assistant_tokens(tok, conversation(c)) for c in range(40, 50)]
    total, count = 0.0, 0
    for r in range(len(batch["inputs"])):
        segments = batch["segment_ids"][r]
        for s in np.unique(segments[segments > 0]):
            at = np.flatnonzero(segments == s)
            ids = np.append(batch["inputs"][r][at], batch["targets"][r][at[-1]])
            ids, mask = next((i, m) for i, m in examples
                             if np.array_equal(i[:len(at)], ids[:len(at)]))
            labels = np.where(mask == 1, ids, -100)
            with torch.no_grad():
                loss = hf(input_ids=torch.tensor(ids[None], dtype=torch.long),
                          labels=torch.tensor(labels[None], dtype=torch.long)).loss.item()
            total, count = total + loss * int(mask[1:].sum()), count + int(mask[1:].sum())
    assert count == batch["weights"].sum()
    assert ours == pytest.approx(total / count, rel=1e-5)


# --- bad input: one line each, before training ---------------------------------------------


def test_a_tokenizer_without_a_chat_template_is_one_line(tmp_path, llama3_dir):
    bare = build_tokenizer(tmp_path / "bare", LLAMA3, where="nowhere")
    config = sft_config(tmp_path, bare)
    with pytest.raises(ValueError) as error:
        batches(config, "validation", num_epochs=1)
    assert str(error.value) == ("the Hugging Face tokenizer has no chat template: expected a "
                                "Hugging Face tokenizer whose tokenizer_config.json has a "
                                "chat_template (or a chat_template.jinja beside it)")
    with pytest.raises(ValueError, match=r"^the byte tokenizer has no chat template"):
        chat.encode_chat(tokenizers_lib.build_tokenizer("byte"),
                         [{"role": "user", "content": "hi"}])


def test_a_message_without_a_role_names_its_file_and_line(tmp_path, llama3_dir):
    config = sft_config(tmp_path, llama3_dir)
    lines = Path(config.data.path).read_text().splitlines()
    lines[6] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"content": "x"}]})
    Path(config.data.path).write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"^{config.data.path}:7: message 1 has no \"role\""):
        batches(config, "train")


def test_a_split_with_no_assistant_tokens_is_refused_not_trained_at_loss_0(tmp_path,
                                                                         llama3_dir):
    """Replies under Gemma's rendered role ("model") or user turns alone leave every weight 0:
    a loss of 0 at every step and perplexity 1. Refused in one line naming the roles found."""
    config = sft_config(tmp_path, llama3_dir)
    rows = [[{**m, "role": "model" if m["role"] == "assistant" else m["role"]}
             for m in conversation(seed, system=False)] for seed in range(6)]
    config.data.validation_path = str(write_jsonl(tmp_path / "model.jsonl", rows))
    with pytest.raises(ValueError, match=r"^the validation split's 6 conversations have no "
                                         r"assistant tokens to take the loss on \(roles "
                                         r"\['model', 'user'\]\): expected"):
        batches(config, "validation", num_epochs=1)


def test_a_long_conversation_is_refused_or_truncated_and_counted(tmp_path, llama3_dir, capsys):
    config = sft_config(tmp_path, llama3_dir)
    config.seq_len = 40
    lengths = [len(chat.encode_chat(inputs.get_tokenizer(config), conversation(s)))
               for s in range(40, 50)]
    first_long = next(i for i, n in enumerate(lengths) if n > 41)
    with pytest.raises(ValueError, match=rf"val.jsonl:{first_long + 1}: the conversation has "
                                         rf"{lengths[first_long]} tokens, more than seq_len \+ 1 "
                                         r"= 41: .*data.sft_truncate=True"):
        batches(config, "validation", num_epochs=1)
    config.data.sft_truncate = True
    _, passes = batches(config, "validation", num_epochs=1)
    long = sum(n > 41 for n in lengths)
    assert f"data.sft_truncate: cut {long} of 10 validation conversations to seq_len + 1 = 41 " \
        "tokens" in capsys.readouterr().out
    assert all(b["inputs"].shape == (4, 40) for b in passes)


def test_truncation_that_cuts_every_assistant_token_says_so(tmp_path, llama3_dir, capsys):
    config = sft_config(tmp_path, llama3_dir, sft_truncate=True)
    config.seq_len = 32
    rows = [[{"role": "system", "content": "the king who loved the sea " * 10},
             {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]] * 3
    config.data.validation_path = str(write_jsonl(tmp_path / "long.jsonl", rows))
    with pytest.raises(ValueError, match=r"^the validation split's 3 conversations have no "
                                         r"assistant tokens to take the loss on: all cut by "
                                         r"data.sft_truncate at seq_len \+ 1 = 33: expected a "
                                         r"larger seq_len$"):
        batches(config, "validation", num_epochs=1)
    assert "data.sft_truncate: cut 3 of 3 validation conversations" in capsys.readouterr().out


def test_compressed_conversation_files_read_as_plain_ones(tmp_path):
    import gzip

    plain = write_jsonl(tmp_path / "val.jsonl", [conversation(s) for s in range(5)])
    expected = [c.messages for c in chat.read_conversations(str(plain))]
    with gzip.open(tmp_path / "val.jsonl.gz", "wb") as f:
        f.write(plain.read_bytes())
    gz = chat.read_conversations(str(tmp_path / "val.jsonl.gz"))
    assert [c.messages for c in gz] == expected and gz[1].where.endswith("val.jsonl.gz:2")
    # Bytes that are not UTF-8 (a compressed file under a plain name): one line naming it.
    (tmp_path / "packed.jsonl").write_bytes((tmp_path / "val.jsonl.gz").read_bytes())
    with pytest.raises(ValueError, match=r"packed.jsonl: not UTF-8 after line 0 .*: expected "
                                         r"JSONL text \(.jsonl, or compressed .jsonl.gz"):
        chat.read_conversations(str(tmp_path / "packed.jsonl"))
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "val.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        plain.read_bytes()))
    assert [c.messages for c in chat.read_conversations(str(tmp_path / "val.jsonl.zst"))] == \
        expected


def test_sft_needs_a_decoder_family():
    config = configs.experiment("bert_mlm")
    config.data.objective = "sft"
    with pytest.raises(ValueError, match="data.objective='sft' with model.family='bert': "
                                         "expected 'gpt'"):
        configs.validate_config(config, num_devices=1, num_processes=1)


# --- end to end through the CLI --------------------------------------------------------------


def tiny_llama(directory: Path, vocab_size: int) -> None:
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=vocab_size, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    result = forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_sft_from_an_imported_llama_through_the_cli_then_chat(tmp_path, llama3_dir):
    model_dir = tmp_path / "llama"
    build_tokenizer(model_dir, LLAMA3)
    tiny_llama(model_dir, len(json.loads((model_dir / "tokenizer.json").read_text())
                             ["model"]["vocab"]) + 0)
    (tmp_path / "data").mkdir()
    train = write_jsonl(tmp_path / "data/train.jsonl", [conversation(s) for s in range(64)])
    val = write_jsonl(tmp_path / "data/val.jsonl", [conversation(s) for s in range(64, 72)])
    workdir = tmp_path / "run"
    result = run("transformer.train", "--config=experiments/sft_chat.py", f"--workdir={workdir}",
                 f"--config.init_from=hf:{model_dir}", f"--config.data.path={train}",
                 f"--config.data.validation_path={val}", f"--config.data.test_path={val}",
                 "--config.steps=8",
                 "--config.batch_size=4", "--config.seq_len=256", "--config.log_every=1",
                 "--config.eval_every=8", "--config.eval_steps=10",
                 "--config.checkpoint_every=8", "--config.optimizer.learning_rate=3e-3",
                 "--config.optimizer.warmup_steps=0")
    assert f"init_from hf:{model_dir}: loaded" in result.stdout
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r.get("split") == "train"]
    losses = [r["loss"] for r in train_records]
    assert len(losses) == 8 and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    summary = json.loads((workdir / "summary.json").read_text())
    assert np.isfinite(summary["val_loss"])

    # The training and validation losses are over assistant tokens: the first step's weighted
    # tokens are its batch's assistant targets, and the validation pass weights exactly the
    # assistant targets of the validation conversations.
    config = configs.experiment("sft_chat")
    config.update(init_from="", batch_size=4, seq_len=256)
    config.data.update(path=str(train), validation_path=str(val))
    tok = tokenizers_lib.load_tokenizer(str(workdir / "tokenizer"))
    first = next(iter(inputs.get_dataset(config, tok, "train")))
    rows = chat.PackedRows(chat.tokenized(config, tok, "train"), width=257, seed=config.seed,
                           training=True, shuffle=True)
    assistant = sum(int(rows.row(i)["tokens_loss_mask"][1:].sum()) for i in range(4))
    assert train_records[0]["num_tokens"] == float(first["weights"].sum()) == assistant
    weighted = sum(float(b["weights"].sum()) for b in inputs.get_dataset(
        config, tok, "validation", num_epochs=1, shuffle=False))
    expected = sum(int(chat.assistant_tokens(tok, conversation(s))[1][1:].sum())
                   for s in range(64, 72))
    assert weighted == expected == summary["val_num_tokens"]
    assert summary["test_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)  # same file

    reply = run("transformer.generate", f"--workdir={workdir}", "--temperature=0",
                "--max_new_tokens=12",
                "--chat=" + json.dumps([{"role": "user", "content": "What is two plus four?"}]))
    assert reply.returncode == 0 and "<|eot_id|>" not in reply.stdout
    conversations = write_jsonl(tmp_path / "ask.jsonl", [conversation(1), conversation(2)])
    both = run("transformer.generate", f"--workdir={workdir}", "--temperature=0",
               "--max_new_tokens=6", f"--chat={conversations}")
    assert both.stdout.count("---") == 1


@pytest.mark.slow
def test_bad_chat_data_stops_the_cli_with_one_line_before_training(tmp_path, llama3_dir):
    from test_cli import assert_one_line_error

    model_dir = tmp_path / "llama"
    build_tokenizer(model_dir, LLAMA3)
    tiny_llama(model_dir, len(json.loads((model_dir / "tokenizer.json").read_text())
                             ["model"]["vocab"]))
    rows = [conversation(s) for s in range(8)]
    rows[3][1] = {"content": "no role"}
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    result = forkserver.run(
        [sys.executable, "-m", "transformer.train", "--config=experiments/sft_chat.py",
         f"--workdir={tmp_path / 'run'}", f"--config.init_from=hf:{model_dir}",
         f"--config.data.path={train}", "--config.seq_len=256"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, 2, f"{train}:4: message 1 has no \"role\"")
    assert not (tmp_path / "run" / "checkpoints").exists() or \
        not any((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.slow
def test_lora_sft_on_an_imported_llama_exports_to_transformers_and_peft(tmp_path, llama3_dir):
    """Issue 48's path end to end: an imported Llama with its chat tokenizer, LoRA adapters
    trained on chat JSONL (loss on assistant tokens), then the merged model and the peft
    adapter, each loaded by transformers / peft with our logits."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformer.models import build_model
    from transformer.nn import lora
    from transformer.training import finetune

    model_dir = tmp_path / "llama"
    build_tokenizer(model_dir, LLAMA3)
    tiny_llama(model_dir, len(json.loads((model_dir / "tokenizer.json").read_text())
                             ["model"]["vocab"]))
    train = write_jsonl(tmp_path / "train.jsonl", [conversation(s) for s in range(32)])
    val = write_jsonl(tmp_path / "val.jsonl", [conversation(s) for s in range(32, 36)])
    workdir = tmp_path / "run"
    result = run("transformer.train", "--config=experiments/sft_chat.py", f"--workdir={workdir}",
                 f"--config.init_from=hf:{model_dir}", f"--config.data.path={train}",
                 f"--config.data.validation_path={val}", "--config.model.lora.rank=4",
                 "--config.model.lora.alpha=8", "--config.steps=6", "--config.batch_size=4",
                 "--config.seq_len=256", "--config.log_every=1", "--config.eval_every=6",
                 "--config.eval_steps=4", "--config.checkpoint_every=6",
                 "--config.optimizer.learning_rate=1e-2", "--config.optimizer.warmup_steps=0")
    assert "lora: rank 4, " in result.stdout
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("split") == "train"]
    assert len(losses) == 6 and np.isfinite(losses).all() and losses[-1] < losses[0]

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    run("transformer.export", f"--workdir={workdir}", f"--output={merged}", "--merge_lora")
    run("transformer.export", f"--workdir={workdir}", f"--output={adapter}")
    saved = finetune.restore_params(str(workdir))
    assert any(lora.is_adapter(k) for k in flat_names(saved.params))
    tok = transformers.AutoTokenizer.from_pretrained(merged)  # the chat template travels
    ids = np.asarray([tok.apply_chat_template(conversation(40), tokenize=True)["input_ids"]])
    model = build_model(saved.config.model)
    ours = np.asarray(model.apply({"params": saved.params}, ids))
    with torch.no_grad():
        got_merged = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(
            input_ids=torch.tensor(ids)).logits.numpy()
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        got_base = base(input_ids=torch.tensor(ids)).logits.numpy()
        got_peft = peft.PeftModel.from_pretrained(base, adapter).eval()(
            input_ids=torch.tensor(ids)).logits.numpy()
    scale = np.abs(ours).max()
    assert np.abs(got_base - ours).max() > 1e-3 * scale  # the adapters changed the model
    assert np.abs(got_merged - ours).max() <= 1e-5 * scale
    assert np.abs(got_peft - ours).max() <= 1e-5 * scale


def flat_names(params) -> list[str]:
    from flax import traverse_util

    return ["/".join(k) for k in traverse_util.flatten_dict(dict(params))]


def test_an_export_stops_generate_at_the_templates_end_of_turn(llama3_dir):
    """generation_config.json lists the chat template's end of turn beside <eos>, so HF
    `generate` ends an assistant reply where training ended it."""
    import types

    from transformer import export, generate

    tokenizer = tokenizers_lib.load_hf_tokenizer(str(llama3_dir))
    hf_config = types.SimpleNamespace(bos_token_id=tokenizer.bos_id, pad_token_id=None,
                                      vocab_size=tokenizer.vocab_size)
    config = configs.experiment("sft_chat")
    generation = export._generation_config(hf_config, tokenizer, config)
    end = chat.end_of_turn_id(tokenizer)
    assert end != tokenizer.eos_id
    assert generation.eos_token_id == [tokenizer.eos_id, end]
    assert generation.bos_token_id == tokenizer.bos_id
    # what our generate never emits is suppressed, but not the end of turn it stops at (a
    # special, which a plain continuation does not write)
    assert end in generate.banned_ids(tokenizer, tokenizer.vocab_size)
    assert end not in generation.suppress_tokens and tokenizer.bos_id in generation.suppress_tokens


def tiny_llama31(directory: Path, prompt: list[int]) -> list[int]:
    """A tiny random Llama saved beside `llama31_tokenizer`'s files (generation_config.json
    listing its stops), returning HF generate's greedy tokens after `prompt`. Its weights are
    spread out (N(0, 0.15): no near-ties for float rounding to flip), and <|eom_id|>'s output
    row is 1.2 x that of its sixth greedy token, so greedy decoding writes <|eom_id|> a few
    tokens in."""
    import torch

    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    stops = [vocab[t] for t in LLAMA31_STOPS]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=len(vocab), max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1))
    greedy = lambda: model.generate(torch.tensor([prompt]), max_new_tokens=16,
                                    do_sample=False)[0, len(prompt):].tolist()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
        model.generation_config.eos_token_id = None  # (no stop: its own sixth token)
        model.lm_head.weight[vocab["<|eom_id|>"]] = model.lm_head.weight[greedy()[5]] * 1.2
    model.generation_config.eos_token_id = stops
    model.save_pretrained(directory)
    return greedy()


@pytest.mark.slow
def test_chat_through_the_cli_stops_where_hf_generate_does_and_the_export_keeps_the_stops(
        tmp_path):
    """A Llama 3.1-style checkpoint whose greedy reply ends at <|eom_id|> (a stop id of its
    generation_config.json, neither <eos> nor the end of turn): `generate --chat` on a workdir
    holding its weights (imported, one step at a learning rate of 1e-30) gives HF generate's
    reply token for token and stops there, and the export's generation_config.json lists the
    original's stop ids in its order."""
    model_dir = tmp_path / "llama31"
    stops = llama31_tokenizer(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    hf_tokenizer = reference(model_dir)
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=True,
                                              add_generation_prompt=True)["input_ids"]
    expected = tiny_llama31(model_dir, prompt)
    specials = {hf_tokenizer.convert_tokens_to_ids(t) for t in SPECIALS + ["<|eom_id|>"]}
    assert expected[-1] == stops[1] and len(expected) > 3 and not specials & set(expected[:-1])
    train = write_jsonl(tmp_path / "train.jsonl", [conversation(s) for s in range(8)])
    val = write_jsonl(tmp_path / "val.jsonl", [conversation(s) for s in range(8, 10)])
    workdir, exported = tmp_path / "run", tmp_path / "exported"
    run("transformer.train", "--config=experiments/sft_chat.py", f"--workdir={workdir}",
        f"--config.init_from=hf:{model_dir}", f"--config.data.path={train}",
        f"--config.data.validation_path={val}", "--config.steps=1", "--config.batch_size=2",
        "--config.seq_len=256", "--config.eval_every=1", "--config.eval_steps=1",
        "--config.checkpoint_every=1", "--config.optimizer.learning_rate=1e-30")
    reply = run("transformer.generate", f"--workdir={workdir}", "--temperature=0",
                "--max_new_tokens=16", "--chat=" + json.dumps(messages))
    assert reply.stdout == hf_tokenizer.decode(expected[:-1]) + "\n"
    run("transformer.export", f"--workdir={workdir}", f"--output={exported}")
    assert transformers.GenerationConfig.from_pretrained(exported).eos_token_id == stops


def test_a_checkpoint_of_the_older_sft_mask_resumes_only_with_new_data(tmp_path, llama3_dir):
    """The loss mask stopped taking the text after a reply's end of turn (ChatML's '\\n'): an
    SFT stream records the mask's version, so a checkpoint of the older mask (no record) is a
    data difference on resume and in `evaluate`; other objectives' streams are as they were."""
    from transformer.training import checkpoint_manager

    config = sft_config(tmp_path, llama3_dir)
    stream = inputs.data_stream(config)
    assert stream[inputs.SFT_MASK] == 2
    older = {k: v for k, v in stream.items() if k != inputs.SFT_MASK}
    assert checkpoint_manager.stream_differences(older, stream) == [
        "sft_mask: checkpoint None, config 2"]
    config.data.objective = "next_token"
    assert inputs.SFT_MASK not in inputs.data_stream(config)
