"""lm-evaluation-harness adapter over params in memory: `TransformerLM`, a causal decoder LM
(model.family "gpt") as an `lm_eval` model. A training run scores its current params with it
(`training.task_eval`, through `TransformerLM.from_params`); `transformer.harness` registers the
subclass that loads a training workdir as the `lm_eval` model "transformer" (its command).

A request's text starts a document as in training (`text.document_prefix`): behind the tokenizer's
<eos> where training streamed its documents (an imported checkpoint's BOS where its tokenizer puts
one first), else alone, and behind <eos> (or that BOS) where its context is empty (a rolling
text's first token too: there is nothing else to predict it from). `loglikelihood`
encodes context + continuation together and scores the tokens past the context's own encoding (the
harness's convention for BPE boundaries), `loglikelihood_rolling` cuts long texts into the harness's
rolling windows of `max_length` tokens, and `generate_until` decodes with the KV cache in batches
(greedy unless the task asks to sample; top_k and top_p apply, another generation setting is
refused) until a stop id, leaving the special tokens it generates out of the text, as lm-eval's HF
model does (a stop string that is a special token's text ends the text at that token there too).
Contexts longer than `max_length` (default: the training length, config.seq_len) keep their last
tokens; a continuation longer than it is refused, and so is a generation of max_length tokens or
more. Rows are padded to a few bucketed widths, except for a mixture of experts that
routes with a capacity (moe.capacity_factor > 0): a row's slots per expert grow with its width, so a
padded row would drop other choices than the text alone; its rows go unpadded, batched by length
(one compile per length).

With lm-eval's --apply_chat_template (`apply_chat_template`, `chat_template`, `tokenizer_name`)
a request's context is its conversation rendered by the tokenizer's chat template, as lm-eval's
HF model renders it; such a text opens with a special token (the template's BOS or turn marker)
and is read as that model reads it: behind the tokenizer's own document start (an import's BOS;
nothing for GPT-2's or Qwen's, nor for a model trained here, whose SFT rows start a conversation
at position 0), which is not repeated where the template writes it. The chat options of lm-eval's
HF model apply as there: `chat_template_args` (more variables for the template), `enable_thinking`
(joins them where set; true needs a `think_end_token` and refuses log-likelihood requests) and
`think_end_token` (a generation keeps only its text after the last one: a token's text, or its id).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import numbers
import re

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from transformer.generation import programs, text
from transformer.models import family_of

# generate_until's max_gen_toks where a task names none
MAX_GEN_TOKS = 64
IMPORT_WITHOUT_POSITIONS = 2048  # an import's max_length without a position limit (lm-eval's)


def int_arg(name: str, value, auto: bool = False, least: int = 1) -> int | None:
    """A model arg's `value` (an int, or its digits as --model_args gives a string) as an int
    of at least `least`; "auto" (or lm-eval's "auto:N", N retunings) is None where `auto`;
    anything else is one line naming it."""
    if auto and isinstance(value, str) and re.fullmatch(r"auto(:\d+)?", value.strip()):
        return None
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool) or \
        isinstance(value, str) and value.strip().isdigit()
    if whole and int(value) >= least:
        return int(value)
    expected = "a positive int" if least == 1 else f"an int >= {least}"
    raise ValueError(f"{name}={value!r}: expected {expected}" + (" or 'auto'" if auto else ""))


def chat_options(chat_template_args=None, enable_thinking=None, think_end_token=None) -> dict:
    """lm-eval's HF model's chat options checked, as `TransformerLM` keeps them: the template's
    extra variables (`enable_thinking` among them where it is set) and the think end (a token's
    text, or its id: digits as --model_args gives them). A bad one is one line naming it.

    >>> chat_options(enable_thinking=False)["chat_template_args"]
    {'enable_thinking': False}
    >>> chat_options(think_end_token="151668")["think_end_token"]  # Qwen3's </think>
    151668
    """
    if not isinstance(chat_template_args, dict | None):
        raise ValueError(f"chat_template_args={chat_template_args!r}: expected a dict of chat "
                         "template variables (give --model_args as JSON: '{\"workdir\": ..., "
                         "\"chat_template_args\": {...}}')")
    if clash := sorted(set(chat_template_args or {}) & set(RENDERING)):
        raise ValueError(f"chat_template_args key {clash[0]!r}: the adapter sets it as lm-eval's "
                         "HF model does: expected the template's own variables")
    if not (enable_thinking is None or isinstance(enable_thinking, bool)):
        raise ValueError(f"enable_thinking={enable_thinking!r}: expected true or false")
    if isinstance(think_end_token, numbers.Integral) and not isinstance(think_end_token, bool) \
            and think_end_token >= 0 or isinstance(think_end_token, str) and \
            think_end_token.strip().isdigit():
        think_end_token = int(think_end_token)  # a token's id (digits: as --model_args gives it)
    elif think_end_token is not None and not (isinstance(think_end_token, str) and
                                              think_end_token):
        raise ValueError(f"think_end_token={think_end_token!r}: expected the text or the id "
                         "of the token that ends the thinking (Qwen3's </think>)")
    if enable_thinking and think_end_token is None:
        raise ValueError("enable_thinking=True: expected a think_end_token too (the text or id "
                         "that ends the thinking, Qwen3's </think>), as lm-eval's HF model asks")
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return {"chat_template_args": {**(chat_template_args or {}), **extra},
            "enable_thinking": enable_thinking, "think_end_token": think_end_token}


# apply_chat_template's arguments the adapter sets itself (not chat_template_args')
RENDERING = ("tokenize", "add_generation_prompt", "continue_final_message")
# The task output types whose requests are log-likelihoods, which enable_thinking refuses.
SCORED = ("loglikelihood", "multiple_choice")


def thinking_refuses(tasks) -> ValueError:
    """The one line for enable_thinking=True with log-likelihood `tasks` (as lm-eval's HF
    model refuses them): the command says it before the model loads."""
    return ValueError(f"enable_thinking=True: log-likelihood requests (task "
                      f"{', '.join(sorted(tasks))}) have no generation to think in; expected "
                      "generative tasks only, or enable_thinking false")


def _bucket(n: int, limit: int) -> int:
    """Rows are padded to a power of two (at least 16, at most `limit`) so a handful of shapes
    compile, not one per batch."""
    return min(limit, max(16, 1 << (n - 1).bit_length()))


@functools.partial(jax.jit, static_argnames=("model",))
def _token_scores(model, params, inputs_BT, targets_BT):
    """log p(target) and whether the target is the argmax, per position, in float32."""
    logits_BTV = model.apply({"params": params}, inputs_BT).astype(jnp.float32)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logp_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT


class TransformerLM(LM):
    """A causal decoder LM (model.family "gpt") over params in memory."""

    def __init__(self, model, params, tokenizer, config, batch_size: int | str = 8,
                 max_length: int | None = None, **chat):
        """`chat`: lm-eval's HF model's chat options (`chat_options`)."""
        super().__init__()
        self._setup(model, params, tokenizer, config, batch_size, max_length)
        vars(self).update(chat_options(**chat))
        end = self.think_end_token
        if isinstance(end, int) and end >= self.tokenizer.vocab_size:
            raise ValueError(f"think_end_token={end}: expected a token id below the "
                             f"tokenizer's {self.tokenizer.vocab_size}")
        if isinstance(end, str) and (ids := [i for i in self.unwritten.tolist()
                                             if self.tokenizer.decode([i]) == end]):
            logging.getLogger(__name__).warning(
                "think_end_token=%r is a special token's text, which the decoded text leaves "
                "out (skip_special_tokens, as in lm-eval's HF model), so it never matches: give "
                "its id, think_end_token=%d", end, ids[0])

    @classmethod
    def from_params(cls, model, params, tokenizer, config, batch_size: int | str = 8,
                    max_length: int | None = None, **chat) -> TransformerLM:
        """The adapter over params in memory (a training run's: `training.task_eval`), also
        for a subclass whose own constructor takes other arguments."""
        lm = cls.__new__(cls)
        TransformerLM.__init__(lm, model, params, tokenizer, config, batch_size, max_length,
                               **chat)
        return lm

    def _setup(self, model, params, tokenizer, config, batch_size, max_length) -> None:
        self.model, self.params, self.tokenizer, self.config = model, params, tokenizer, config
        family = family_of(self.config)
        if family.decoding != "causal":
            raise ValueError(f"model.family={family.name!r}: the harness adapter scores causal "
                             "decoder LMs (model.family 'gpt')")
        self.batch_size = int_arg("batch_size", batch_size, auto=True) or 8
        max_length = None if max_length in (None, "", 0) else int_arg("max_length", max_length)
        limit = self.config.model.max_len if self.config.model.position == "learned" else None
        if not max_length and text.imported(self.config):
            # an import's context: its max_position_embeddings, as lm-eval's HF model reads
            # it; a model without positions (Mamba 2) has none: lm-eval's default, 2048
            max_length = self.config.model.max_len if self.config.model.position != "none" \
                else IMPORT_WITHOUT_POSITIONS
        self.max_length = int(max_length or self.config.seq_len)  # a trained one's rows
        if limit is not None and self.max_length > limit:
            raise ValueError(f"max_length={self.max_length}: learned positions go up to "
                             f"model.max_len={limit}")
        self.eos = int(self.tokenizer.eos_id)
        # what a text reads first, by whether it is empty (read once: it looks at data.path)
        self.prefixes = {empty: text.document_prefix(self.config, self.tokenizer, empty)
                         for empty in (False, True)}
        # what a text opening with a special token reads first (`_document`): lm-eval's HF
        # model reads what the tokenizer puts first (no <eos> where it puts nothing)
        self.chat_start = list(getattr(self.tokenizer, "document_start", [])) if str(
            self.config.get("init_from") or "").startswith("hf:") else self.prefixes[False]
        self.specials = frozenset(int(i) for i in self.tokenizer.special_ids)
        self.stops = text.stop_ids(self.tokenizer)  # <eos> and an imported checkpoint's stops
        # generate_until emits any real token, a special too (as HF generate does; decoding
        # drops it): only the padded vocabulary past the tokenizer's, which has no text
        self.banned = tuple(range(self.tokenizer.vocab_size, self.config.model.vocab_size))
        self.unwritten = np.asarray(sorted(self.specials | set(self.stops)), np.int32)
        self.unpadded = programs.routes_with_capacity(self.model)

    # --- scoring --------------------------------------------------------------------------------

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), all greedy) for token-id pairs; the fed
        sequence is context + continuation without its last token, cut to its last
        `max_length` tokens."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        for _, continuation in pairs:
            if len(continuation) > self.max_length:  # (its first tokens would go unscored)
                raise ValueError(f"a continuation of {len(continuation)} tokens: expected at "
                                 f"most max_length={self.max_length}")
        # Longest first, so a batch's rows have similar lengths.
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        for chunk in self._chunks(order, lambda i: min(len(pairs[i][0]) + len(pairs[i][1]),
                                                       self.max_length + 1)):
            rows = []
            for i in chunk:
                context, continuation = pairs[i]
                whole = (list(context) + list(continuation))[-(self.max_length + 1):]
                rows.append((whole[:-1], whole[1:], len(continuation)))
            width = self._width(max(len(r[0]) for r in rows), self.max_length)
            inputs = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            for b, (fed, predicted, _) in enumerate(rows):
                inputs[b, :len(fed)], targets[b, :len(predicted)] = fed, predicted
            logp, greedy = (np.asarray(x) for x in _token_scores(
                self.model, self.params, jnp.asarray(inputs), jnp.asarray(targets)))
            for b, (i, (fed, _, n)) in enumerate(zip(chunk, rows, strict=True)):
                span = slice(len(fed) - n, len(fed))
                results[i] = (float(logp[b, span].sum()), bool(greedy[b, span].all()))
        return results

    def _chunks(self, order: list[int], length) -> list[list[int]]:
        """`order` in batches of batch_size; of one `length` each when rows go unpadded."""
        if not self.unpadded:
            return [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        chunks: list[list[int]] = []
        for i in order:
            if chunks and len(chunks[-1]) < self.batch_size and \
                    length(chunks[-1][0]) == length(i):
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    def _width(self, n: int, limit: int) -> int:
        return n if self.unpadded else _bucket(n, limit)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).tolist()

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        if self.enable_thinking:  # (as lm-eval's HF model: a score has no room to think)
            raise thinking_refuses({getattr(r, "task_name", None) or "?" for r in requests})
        pairs, owners = [], []
        for i, request in enumerate(requests):
            context, continuation = request.args
            # Trailing whitespace belongs to the continuation (the harness's convention: a
            # chat template's context ends in its assistant opening's newline)
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self._encode(context + continuation)
            head = self._encode(context)
            for pair in self._pairs(whole[:len(head)], whole[len(head):]):
                pairs.append(pair)
                owners.append(i)
        results = [(0.0, True)] * len(requests)
        for i, (score, greedy) in zip(owners, self.score(pairs), strict=True):
            results[i] = (results[i][0] + score, results[i][1] and greedy)
        return results

    def _pairs(self, context: list[int], continuation: list[int]) -> list[tuple[list, list]]:
        """The (context, continuation) pairs that score `continuation` after `context` read as
        a document's start: one, behind `text.document_prefix`; for a packed model without a
        context, two: the first token behind <eos> (nothing else predicts it), then the rest
        behind it alone, as packed training read them (and `loglikelihood_rolling` does)."""
        if context or self.prefixes[False] or len(continuation) < 2:
            return [(self._document(context), continuation)]
        return [([self.eos], continuation[:1]), (continuation[:1], continuation[1:])]

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in requests:
            (document,) = request.args
            ids = self._encode(document)
            # A packed model's first token gets its own row behind <eos> (`_pairs`), and the
            # windows then read the rest behind it alone; otherwise the first window reads
            # the text behind the document prefix (an imported Llama's BOS, as
            # loglikelihood("", text) and lm-eval's HF model read it; else <eos>).
            first = self._pairs([], ids)[:-1]
            ids, prefix = (ids[1:], ids[0]) if first else (ids, self.prefixes[True][-1])
            windows = first + [make_disjoint_window(w) for w in get_rolling_token_windows(
                ids, prefix_token=prefix, max_seq_len=self.max_length, context_len=1)]
            out.append(sum(score for score, _ in self.score(windows)))
        return out

    # --- generation -----------------------------------------------------------------------------

    def generate_until(self, requests) -> list[str]:
        """Greedy (or sampled, as each request's settings say) KV-cache continuations, decoded
        in batches of requests that share their settings until a stop id, as lm-eval's HF model
        reads them: special tokens generated (not banned) but left out of the text, which is cut
        at the first stop string."""
        jobs = [self._generation(request) for request in requests]
        out = [""] * len(jobs)
        by_settings: dict[tuple, list[int]] = {}
        for i, (_, _, settings) in enumerate(jobs):
            by_settings.setdefault(settings, []).append(i)
        for (n, temperature, top_k, top_p, seed), members in by_settings.items():
            order = sorted(members, key=lambda i: -len(jobs[i][0]))
            for chunk in self._chunks(order, lambda i: len(jobs[i][0])):
                prompts = [jobs[i][0] for i in chunk]
                lengths = [len(p) for p in prompts]
                batch = np.zeros((len(chunk), self._width(max(lengths), self._room(n))),
                                 np.int32)
                for b, prompt in enumerate(prompts):
                    batch[b, :len(prompt)] = prompt
                tokens, ends = programs.decode(
                    self.model, self.params, batch, lengths=lengths, max_new_tokens=n,
                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    eos_id=self.stops, banned_ids=self.banned)
                for b, i in enumerate(chunk):
                    out[i] = self._answer(tokens[b, :ends[b]], jobs[i][1])
        return out

    def _answer(self, ids: np.ndarray, until: list[str]) -> str:
        """A generation's text as lm-eval's HF model reads it: its tokens up to the first stop
        string (`_stop_at`), after the last think end (an id among them, else its text in the
        decoded text), decoded without special tokens (skip_special_tokens), cut at the first
        stop string."""
        ids = ids[:self._stop_at(ids, until)]
        end = self.think_end_token
        if isinstance(end, int) and end in ids:
            ids = ids[len(ids) - list(ids[::-1]).index(end):]
        text = self.tokenizer.decode(ids[~np.isin(ids, self.unwritten)])
        if end is not None:  # (after a think end id, the stripped leading space too)
            text = (text.split(end)[-1] if isinstance(end, str) else text).lstrip()
        cut = min([text.find(s) for s in until if s and s in text] or [len(text)])
        return text[:cut]

    def _stop_at(self, ids: np.ndarray, until: list[str]) -> int:
        """How many of `ids` HF generate keeps under lm-eval's stopping criteria: up to the
        token with which a stop string first appears in their text with the special tokens
        written, so that a stop that is a special token's text (Qwen's <|im_end|> where it is no
        stop id) ends the generation there, though the text then leaves that token out."""
        until = [s for s in until if s]

        def stopped(k: int) -> bool:
            text = self.tokenizer.decode(ids[:k])
            return any(s in text for s in until)

        low, high = 1, len(ids)  # the fewest tokens that hold a stop, found by bisection
        if not until or not stopped(high):
            return len(ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if stopped(middle) else (middle + 1, high)
        return low

    def _generation(self, request) -> tuple[list[int], list[str], tuple]:
        """(prompt ids, stop strings, (max_new_tokens, temperature, top_k, top_p, seed)) of a
        generate_until request; a setting it cannot honour is one line."""
        context, kwargs = request.args
        kwargs = dict(kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        n = int(kwargs.pop("max_gen_toks", MAX_GEN_TOKS))
        sample = kwargs.pop("do_sample", False)
        temperature = float(kwargs.pop("temperature", 0.0))
        top_k, top_p = int(kwargs.pop("top_k", 0) or 0), float(kwargs.pop("top_p", 1.0) or 1.0)
        settings = (n, temperature if sample else 0.0, top_k if sample else 0,
                    top_p if sample else 1.0, int(kwargs.pop("seed", 0)))
        if kwargs:
            raise ValueError(f"generate_until settings {sorted(kwargs)}: expected only until, "
                             "max_gen_toks, do_sample, temperature, top_k, top_p and seed")
        if n >= self.max_length:  # (lm-eval's own HF model refuses it too)
            raise ValueError(f"generate_until max_gen_toks={n}: expected fewer than "
                             f"max_length={self.max_length} tokens, so that the prompt keeps "
                             "some of its context; raise max_length or lower max_gen_toks")
        prompt = self._document(self._encode(context))[-self._room(n):]
        return prompt, until, settings

    def _document(self, ids: list[int]) -> list[int]:
        """`ids` read as a document's start: behind `text.document_prefix`; a text that opens
        with a special token (a chat template's BOS or turn marker) behind `chat_start`, unless
        it opens with that itself (one BOS, where the template writes it)."""
        ids = list(ids)
        if not ids or ids[0] not in self.specials:
            return self.prefixes[not ids] + ids
        start = self.chat_start
        return ids if ids[:len(start)] == start else start + ids

    def _room(self, new_tokens: int) -> int:
        """The most prompt ids a request keeps (its last ones), leaving `new_tokens` to come."""
        return self.max_length - new_tokens

    # --- chat templates (lm-eval's --apply_chat_template) ---------------------------------------

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval's request cache keys chat-rendered requests by: the tokenizer's kind and
        a digest of its vocabulary, chat template and chat_template_args."""
        digest = hashlib.sha256()
        for part in (getattr(self.tokenizer, "tokenizer_json", ""),
                     getattr(self.tokenizer, "chat_template", None) or "",
                     json.dumps(self.chat_template_args, sort_keys=True, default=str)):
            digest.update(part.encode() + b"\0")
        return f"{type(self.tokenizer).__name__}-{digest.hexdigest()[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template (lm-eval logs it with the results), None where
        `chat_template` is False or None or the tokenizer has none, as lm-eval's HF model."""
        if chat_template is False or chat_template is None:
            return None
        return getattr(self.tokenizer, "chat_template", None) or None

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """`chat_history` rendered by the tokenizer's chat template as lm-eval's HF model renders
        it: ending in the assistant's opening where `add_generation_prompt`, else continuing the
        last message (a task's gen_prefix); a template that refuses it renders it without its
        system messages (a warning says so). A tokenizer without a chat template: one line."""
        import jinja2

        from transformer.data import chat

        hf = chat._transformers_tokenizer(self.tokenizer)  # (one line without a template)
        render = functools.partial(hf.apply_chat_template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=not add_generation_prompt,
                                   **self.chat_template_args)
        try:
            return render(list(chat_history))
        except jinja2.TemplateError as e:
            logging.getLogger(__name__).warning(
                "the chat template refused the conversation (%s): rendering it without its "
                "system messages, as lm-eval's HF model does", e)
        with chat._template_errors("lm-eval's conversation"):
            return render([m for m in chat_history if m["role"] != "system"])
