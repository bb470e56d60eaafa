"""Text in, texts out: `sample_texts` (a model of any family; LSTM: full recomputation),
`beam_search_text` (the families with a KV cache), `chat_replies` (decoder LMs) and
`read_chat`, the conversations of --chat. They stop at
the tokenizer's `stop_ids` (<eos>, and the stop ids of an imported checkpoint's
generation_config.json), never emit ids without text (`banned_ids`: the other specials,
sentinels, ids past the tokenizer) and warn on prompt characters the tokenizer lacks."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.data import tokenizers as tokenizers_lib
from transformer.generation.programs import _check_seed_and_eos, beam_search, decode
from transformer.generation.sampling import (
    BOS_ID,
    _pick,
    _split,
    sampling,
)
from transformer.generation.speculative import new_tokens_that_fit, speculative_decode
from transformer.models import FAMILIES, family_of
from transformer.utils import cli


@functools.partial(jax.jit, static_argnames=("apply_fn", "length", "mode"))
def _sample_loop(params, buffer, start, seed, knobs, *, apply_fn, length, mode):
    """Fills buffer[:, start:length] one token at a time, rerunning the whole prefix per token
    (models without a KV cache: the LSTM)."""
    keys = jax.random.split(jax.random.key(seed), buffer.shape[0])

    def step(t, buffer):
        logits = apply_fn(params, buffer)[:, t - 1]  # position t - 1 predicts token t
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)
        return buffer.at[:, t].set(_pick(logits, keys_B, mode, knobs).astype(buffer.dtype))

    return jax.lax.fori_loop(start, length, step, buffer)


@dataclasses.dataclass(frozen=True)
class _ApplyTokens:
    model: nn.Module

    def __call__(self, params, tokens):
        return self.model.apply({"params": params}, tokens)


def stop_ids(tokenizer: tokenizers_lib.Tokenizer, end: int | None = None) -> tuple[int, ...]:
    """The ids that end a sample, each once: those an imported checkpoint's
    generation_config.json lists, in its order (`HFTokenizer.stop_ids`; HF `generate` stops at
    each), then <eos> and `end` (a chat template's end of turn).

    >>> stop_ids(tokenizers_lib.build_tokenizer("byte"))
    (2,)
    """
    ids = (*getattr(tokenizer, "stop_ids", ()), tokenizer.eos_id, end)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


@functools.lru_cache(maxsize=8)
def banned_ids(tokenizer: tokenizers_lib.Tokenizer, vocab_size: int, *,
               sentinels_allowed: bool = False) -> tuple[int, ...]:
    """The ids a text decoder never emits, below the model's `vocab_size`: the specials except
    the `stop_ids` (which end a sample), the sentinels unless `sentinels_allowed`, and the ids
    past the tokenizer's vocabulary (a model's padded vocabulary), which have no text."""
    sentinels, stops = set(tokenizer.sentinel_ids), set(stop_ids(tokenizer))
    banned = [i for i in tokenizer.special_ids if i not in stops and
              not (sentinels_allowed and i in sentinels)]
    return tuple(banned + list(range(tokenizer.vocab_size, vocab_size)))


def _emits_sentinels(config) -> bool:
    """Whether the config's model legitimately writes sentinels: a T5-style encoder-decoder
    trained on span corruption, whose targets are `<extra_id_0> c d <extra_id_1> ... <eos>`.
    Every other text model saw sentinels never (or only as inputs)."""
    from transformer.data import pipeline

    return _decoding(config) == "encoder_decoder" and \
        pipeline.objective_for(config) == "span_corruption"


def banned_for(tokenizer, vocab_size: int, config) -> tuple[int, ...]:
    """`banned_ids` of a run's model (`config`): sentinels allowed where it writes them."""
    return banned_ids(tokenizer, vocab_size, sentinels_allowed=_emits_sentinels(config))


def _encode_prompt(tokenizer, prompt: str) -> np.ndarray:
    """The prompt's ids, with one warning line on stderr naming the characters the tokenizer
    has no ids for (they become <unk>)."""
    missing = tokenizer.unknown_chars(prompt)
    if missing:
        print(f"warning: the tokenizer has no ids for {', '.join(map(repr, missing))} in the "
              "prompt; they become <unk>", file=sys.stderr)
    return tokenizer.encode(prompt)


def _start_id(tokenizer, decoding: str) -> int:
    """An encoder-decoder's first decoder token (the tokenizer's); decoder LMs read none."""
    return tokenizer.decoder_start_id if decoding == "encoder_decoder" else BOS_ID


def document_prefix(config, tokenizer, empty: bool = False) -> list[int]:
    """What the config's decoder LM reads before a document's first token, as its training rows
    began one: [eos] where training ran its documents on as one stream, each after the
    previous one's <eos> (`inputs.streamed`); for weights from a Hugging Face checkpoint
    (init_from="hf:..."), what its tokenizer puts before a text (`HFTokenizer.document_start`:
    Llama's or Gemma's BOS; a fine-tune's documents begin with it, `inputs.document_start`),
    else [eos], the token its tokenizer names eos (GPT-2's and a Qwen base model's documents
    follow it, <|endoftext|>; a Qwen instruct checkpoint names <|im_end|>); nothing where
    training packed them (the default data.unit), each from position 0 of its own segment,
    nor for a prefix LM (the prefix_lm rows, `windows.Chunks`, begin at a document's first
    token). Before an `empty` text there is nothing to predict its
    first token from: [eos] (or the checkpoint's BOS), the nearest thing to a document start.

    >>> import ml_collections
    >>> from transformer.data import tokenizers
    >>> config = ml_collections.ConfigDict({"model": {"family": "gpt", "objective": "causal"},
    ...     "data": {"path": "", "unit": "paragraph", "sources": ()}, "init_from": ""})
    >>> byte = tokenizers.build_tokenizer("byte")
    >>> document_prefix(config, byte), document_prefix(config, byte, empty=True)
    ([], [2])
    >>> config.data.unit = "stream"
    >>> document_prefix(config, byte)
    [2]
    """
    from transformer.data import inputs

    eos = [int(tokenizer.eos_id)]
    if _decoding(config) == "prefix":
        return eos if empty else []
    if str(config.get("init_from") or "").startswith("hf:"):
        return list(getattr(tokenizer, "document_start", [])) or eos
    return eos if empty or inputs.streamed(config) else []


def _prompt_ids(encoded: np.ndarray, tokenizer, config) -> tuple[np.ndarray, np.ndarray]:
    """(the ids the model reads, the ids the printed text starts with) of an encoded prompt,
    laid out as the family's training rows are. An encoder-decoder reads prompt + <eos> and
    prints what it decodes. A decoder LM reads `document_prefix` then the prompt."""
    if _decoding(config) == "encoder_decoder":
        return (np.concatenate([encoded, [tokenizer.eos_id]]).astype(np.int32),
                np.zeros(0, np.int32))
    prefix = document_prefix(config, tokenizer, empty=not len(encoded))
    ids = np.concatenate([prefix, encoded]).astype(np.int32)
    return ids, ids[len(prefix):]


def _until_eos(ids: np.ndarray, stops: tuple[int, ...]) -> np.ndarray:
    """`ids` before the first of the `stops`."""
    ends = np.flatnonzero(np.isin(ids, stops))
    return ids[:ends[0]] if ends.size else ids


def _past_eos(ids: np.ndarray, stops: tuple[int, ...], tokenizer) -> str:
    r"""The text of ids that run past document ends: each stop (<eos>) a paragraph break.

    >>> from transformer.data import tokenizers
    >>> char = tokenizers.build_tokenizer("char", ["ab"])
    >>> ids = np.concatenate([char.encode("ab"), [char.eos_id], char.encode("ba")])
    >>> _past_eos(ids, (char.eos_id,), char)
    'ab\n\nba'
    """
    pieces = np.split(ids, np.flatnonzero(np.isin(ids, stops)))
    return "\n\n".join(tokenizer.decode(p[1:] if i else p) for i, p in enumerate(pieces))


def print_samples(model, params, tokenizer, config, prompt: str, num_samples: int = 3) -> None:
    """Prints samples with nanoGPT's settings (temperature 0.8, top-k 200) continuing `prompt`,
    shortened to at most half the context (room to continue); the end of a training run. Each
    sample fills the context, running on past a document's end (a paragraph break), so it
    shows what the model learned rather than stopping at the first <eos>."""
    while len(tokenizer.encode(prompt)) > config.seq_len // 2:
        prompt = prompt[:-1]
    print(f"\nsamples (temperature 0.8, top-k 200, prompt {prompt!r}):")
    for text in sample_texts(model, params, tokenizer, config, num_samples=num_samples,
                             prompt=prompt, temperature=0.8, top_k=200, past_eos=True):
        print("---\n" + text)


def sample_texts(model, params, tokenizer, config, *, num_samples: int = 3, prompt: str = "",
                 temperature: float = 0.8, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                 max_new_tokens: int | None = None, chunk_size: int | None = None,
                 callback: Callable[[list[str]], None] | None = None,
                 past_eos: bool = False) -> list[str]:
    """`num_samples` continuations of `prompt`, each ending at EOS (any of `stop_ids`) or after
    `max_new_tokens` (`past_eos`: always after `max_new_tokens`, each stop a paragraph break).

    Decoder LMs return prompt + continuation, the prompt read as training's rows begin
    (`document_prefix`: behind an <eos> where training streamed, else alone); by default they
    fill the training context of config.seq_len tokens (an `imported` checkpoint's: at most
    seq_len tokens, within its max_position_embeddings). An encoder-decoder reads prompt +
    <eos> and returns what it decodes (default: seq_len tokens).
    With `chunk_size`, `callback` gets the texts so far after every chunk of tokens.
    """
    decoding = _decoding(config)
    s = sampling(temperature, top_k, top_p)
    _check_seed_and_eos(seed, None)
    check_max_new_tokens(max_new_tokens)
    encoded = _encode_prompt(tokenizer, prompt)
    banned = banned_for(tokenizer, model.vocab_size, config)
    stops = stop_ids(tokenizer)
    prompt_ids, keep = _prompt_ids(encoded, tokenizer, config)
    n = _new_tokens(max_new_tokens, config, decoding, len(prompt_ids), len(keep))

    def to_texts(rows):
        if past_eos:
            return [_past_eos(np.concatenate([keep, r]), stops, tokenizer) for r in rows]
        return [tokenizer.decode(np.concatenate([keep, _until_eos(r, stops)])) for r in rows]
    if n == 0:
        texts = to_texts(np.zeros((num_samples, 0), np.int32))
        if callback is not None:
            callback(texts)
        return texts
    if decoding == "recompute":
        length = len(prompt_ids) + n
        buffer = np.zeros((num_samples, length), np.int32)
        buffer[:, :len(prompt_ids)] = prompt_ids
        mode, knobs = _split(s, model.vocab_size, banned_ids=banned)
        out = _sample_loop(params, jnp.asarray(buffer), len(prompt_ids), np.int32(seed), knobs,
                           apply_fn=_ApplyTokens(model), length=length, mode=mode)
        texts = to_texts(np.asarray(out)[:, len(prompt_ids):])
        if callback is not None:
            callback(texts)
        return texts
    on_tokens = None if callback is None else (lambda tokens: callback(to_texts(tokens)))
    tokens, _ = decode(model, params, [prompt_ids] * num_samples, max_new_tokens=n,
                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed,
                       prefix_lm=decoding == "prefix", chunk_size=chunk_size,
                       callback=on_tokens, banned_ids=banned,
                       eos_id=None if past_eos else stops,
                       start_id=_start_id(tokenizer, decoding))
    return to_texts(tokens)


def speculative_text(model, params, tokenizer, config, *, prompt: str = "",
                     max_new_tokens: int | None = None, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int = 0):
    """(a continuation of `prompt`, the `speculative.SpeculativeStats`), drafted by the model's
    multi-token prediction modules: greedy (temperature 0) the text `sample_texts` gives;
    sampling, a text drawn from the same distribution as `sample_texts(num_samples=1)`'s."""
    if _decoding(config) != "causal":
        raise ValueError(f"--speculative with family={config.model.family!r}: expected a "
                         "causal decoder LM (family gpt) with model.mtp.depth > 0")
    check_max_new_tokens(max_new_tokens)
    encoded = _encode_prompt(tokenizer, prompt)
    stops = stop_ids(tokenizer)
    prompt_ids, keep = _prompt_ids(encoded, tokenizer, config)
    n = _new_tokens(max_new_tokens, config, "causal", len(prompt_ids), len(keep))
    if max_new_tokens is None and config.model.get("position") == "learned":
        # the drafts checked past the last new token need positions in the table too
        n = max(min(n, new_tokens_that_fit(config.model, len(prompt_ids))), 1)
    if n == 0:
        return tokenizer.decode(encoded), None
    tokens, _, stats = speculative_decode(
        model, params, [prompt_ids], max_new_tokens=n, eos_id=stops,
        banned_ids=banned_for(tokenizer, model.vocab_size, config), temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed)
    return tokenizer.decode(np.concatenate([encoded, _until_eos(tokens[0], stops)])), stats


def check_max_new_tokens(max_new_tokens) -> None:
    """One-line error unless `max_new_tokens` is None (the default length) or an int >= 0
    (0: no new tokens, the prompt alone)."""
    if max_new_tokens is not None and (
            isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer)
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 0 "
                         "(0: the prompt alone)")


def imported(config) -> bool:
    """Whether `config` is a Hugging Face checkpoint's as loaded (`generate.load_hf`: `--workdir=
    hf:DIR`, `transformer.load("hf:DIR")`), which has no training context: its context is
    model.max_len, the checkpoint's max_position_embeddings. A fine-tune of one
    (init_from="hf:DIR") trained on seq_len tokens a row, its context."""
    return bool(config.get("imported"))


def _new_tokens(max_new_tokens: int | None, config, decoding: str, prompt_length: int,
                typed: int | None = None) -> int:
    """`max_new_tokens`, or by default seq_len tokens (an encoder-decoder's output) or what
    fills the training context after the prompt (a decoder LM), within a learned position
    table (model.max_len); a `max_new_tokens` past the positions it was trained on warns
    (`_warn_past`). An `imported` checkpoint's decoder LM: `_imported_new_tokens`. `typed`:
    how many of the prompt's `prompt_length` ids are the user's (the rest are the
    `document_prefix` read before them)."""
    if decoding == "encoder_decoder":
        return config.seq_len if max_new_tokens is None else int(max_new_tokens)
    if imported(config):
        return _imported_new_tokens(max_new_tokens, config, prompt_length, typed)
    if max_new_tokens is not None:
        if decoding != "recompute":  # (an LSTM has no positions)
            learned = config.model.get("position") == "learned"
            _warn_past(prompt_length, max_new_tokens, *_trained_positions(config), config,
                       refused_past=config.model.max_len if learned else None)
        return int(max_new_tokens)
    context, name = config.seq_len, "seq_len"
    if config.model.get("position") == "learned" and config.model.max_len < context:
        context, name = config.model.max_len, "model.max_len"
    if prompt_length >= context:
        raise _too_long(prompt_length, typed, f"{name}={context}", " (or pass max_new_tokens)")
    return context - prompt_length


def _trained_positions(config) -> tuple[str, int]:
    """(name, count) of the positions a trained workdir's model learned: its rows' seq_len, or
    a fine-tune's imported checkpoint's (init_from="hf:DIR") max_position_embeddings where
    that is more."""
    if str(config.get("init_from") or "").startswith("hf:") and \
            config.model.max_len > config.seq_len:
        return "the imported checkpoint's max_position_embeddings", config.model.max_len
    return "the training context seq_len", config.seq_len


def _imported_new_tokens(max_new_tokens: int | None, config, prompt_length: int,
                         typed: int | None) -> int:
    """An imported checkpoint's context is its max_position_embeddings (model.max_len): by
    default what fills it after the prompt, but at most seq_len tokens (128 unless set), so
    that a 131k-token context does not make a 131k-position cache unasked. `max_new_tokens`
    that runs past it is a warning (as HF `generate` gives) where the positions are not a
    learned table: RoPE does run past its trained positions (the text may degrade); a learned
    table has no rows there (`programs._program` refuses it)."""
    max_len, learned = config.model.max_len, config.model.get("position") == "learned"
    if max_new_tokens is None:
        if prompt_length >= max_len:
            raise _too_long(prompt_length, typed, f"the checkpoint's max_position_embeddings="
                            f"{max_len}", "" if learned else " (or pass max_new_tokens)")
        return min(max_len - prompt_length, config.seq_len)
    _warn_past(prompt_length, max_new_tokens, "the checkpoint's max_position_embeddings",
               max_len, config, refused_past=max_len if learned else None)
    return int(max_new_tokens)


def _warn_past(prompt_length: int, max_new_tokens: int, name: str, limit: int, config,
               refused_past: int | None) -> None:
    """One warning line (as HF `generate` gives) where the prompt and `max_new_tokens` run
    past the `limit` positions the model was trained on (`name`), unless they also run past
    `refused_past` (a learned table's rows), which `programs._program` refuses."""
    positions = prompt_length + max_new_tokens - 1  # the last new token is never read
    if max_new_tokens and positions > limit and not (
            refused_past is not None and positions > refused_past):
        cli.warn_once(f"prompt of {prompt_length} tokens + max_new_tokens={max_new_tokens} - 1 "
                      f"= {positions} positions, past {name}={limit}: model.position="
                      f"{config.model.get('position')!r} runs beyond the positions it was "
                      "trained on, and the text may degrade")


def _too_long(prompt_length: int, typed: int | None, limit: str, way_out: str) -> ValueError:
    """The one-line error for a prompt that leaves no room in a context of `limit` tokens."""
    before = prompt_length - (prompt_length if typed is None else typed)
    read = f" and the {before} read before it (a document's start)" if before else ""
    return ValueError(f"prompt of {prompt_length - before} tokens{read}: expected < {limit} in "
                      f"all{way_out}")


def check_head(config, what: str) -> None:
    """One line for a base model without an LM head (head 'none': an imported LlamaModel,
    BertModel, ...), whose outputs are hidden states [T, d_model], not vocab logits: `what`
    (e.g. "Loaded.generate") needs next-token logits."""
    if config.model.get("head") == "none":
        raise ValueError(f"{what} with model.head='none' (a base model without an LM head): "
                         "expected a causal language model, whose rows predict the next token")


def _decoding(config) -> str:
    """How the config's model family generates (`Family.decoding`), or a one-line error."""
    family = family_of(config)
    if family.decoding is None:
        raise ValueError(f"model.family={family.name!r} does not generate text: expected one of "
                         f"{[name for name, f in FAMILIES.items() if f.decoding]}")
    return family.decoding


def check_beam_family(config) -> None:
    """One-line error unless the config's model has a KV cache that beam search runs on (not
    the LSTM, which `sample_texts` decodes by full recomputation)."""
    if _decoding(config) == "recompute":
        cached = [name for name, f in FAMILIES.items() if f.decoding not in (None, "recompute")]
        raise ValueError(f"beam search with model.family={config.model.family!r}: expected a "
                         f"family with a KV cache {cached}; sample instead (--beam_size=0)")


def beam_search_text(model, params, tokenizer, config, *, prompt: str, beam_size: int = 4,
                     max_new_tokens: int | None = None, length_penalty: float = 0.6) -> str:
    """The best beam for `prompt`, read as in `sample_texts` (an encoder-decoder's result is
    what it decodes; a decoder LM's includes the prompt). Families with a KV cache only: the
    LSTM is refused (one line, before any compile)."""
    decoding = _decoding(config)
    check_max_new_tokens(max_new_tokens)
    check_beam_family(config)
    encoded = _encode_prompt(tokenizer, prompt)
    stops = stop_ids(tokenizer)
    ids, keep = _prompt_ids(encoded, tokenizer, config)
    n = _new_tokens(max_new_tokens, config, decoding, len(ids), len(keep))
    if n == 0:
        return tokenizer.decode(keep)
    tokens, _, _ = beam_search(model, params, [ids], beam_size=beam_size,
                               max_new_tokens=n, length_penalty=length_penalty,
                               prefix_lm=decoding == "prefix",
                               banned_ids=banned_for(tokenizer, model.vocab_size, config),
                               eos_id=stops, start_id=_start_id(tokenizer, decoding))
    return tokenizer.decode(np.concatenate([keep, _until_eos(tokens[0], stops)]))


def chat_replies(model, params, tokenizer, config, conversation, *, num_samples: int = 1,
                 temperature: float = 0.8, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                 max_new_tokens: int | None = None) -> list[str]:
    """`num_samples` assistant replies to `conversation` (a list of {"role", "content"}): the
    conversation rendered with the tokenizer's chat template and the assistant turn open
    (`add_generation_prompt`), exactly as `data.objective="sft"` renders training data, then
    sampled until the template's end of turn (or another of `stop_ids`: <eos>, an imported
    checkpoint's generation_config.json stop ids), which the reply leaves out."""
    from transformer.data import chat

    if _decoding(config) not in ("causal", "prefix"):
        raise ValueError(f"model.family={config.model.family!r}: --chat expected a decoder LM")
    check_max_new_tokens(max_new_tokens)
    prompt = chat.encode_chat(tokenizer, conversation, add_generation_prompt=True,
                              where="--chat")
    stops = stop_ids(tokenizer, chat.end_of_turn_id(tokenizer))
    n = _new_tokens(max_new_tokens, config, "causal", len(prompt))
    if n == 0:
        return [""] * num_samples
    banned = tuple(i for i in banned_for(tokenizer, model.vocab_size, config) if i not in stops)
    tokens, _ = decode(model, params, [prompt] * num_samples, max_new_tokens=n,
                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       prefix_lm=_decoding(config) == "prefix", banned_ids=banned, eos_id=stops)
    return [tokenizer.decode(_until_eos(row, stops)) for row in tokens]


def read_chat(value: str) -> list[list[dict]]:
    """--chat's conversations: inline JSON (a messages list, or {"messages": [...]}), a .json
    file holding the same, or a JSONL file of one conversation per line."""
    import os

    from transformer.data import chat

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        try:
            json.loads(text)
        except json.JSONDecodeError:  # several lines: JSONL
            return [list(c.messages) for c in chat.read_conversations(value)]
        return [list(chat.parse_conversation(text, value).messages)]
    if not value.lstrip().startswith(("[", "{")):
        raise ValueError(f"--chat={value!r}: expected a JSON/JSONL file of conversations or "
                         'inline JSON, e.g. \'[{"role": "user", "content": "Hi"}]\'')
    return [list(chat.parse_conversation(value, "--chat").messages)]
