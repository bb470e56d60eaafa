"""The Python entry point: `transformer.load(source)` gives a trained model ready to use, from a
training workdir (`runs/gpt_tiny`, `runs/gpt_tiny@600` for a step) or a Hugging Face
`save_pretrained` directory (`hf:/models/llama`, or any directory with a config.json):

    lm = transformer.load("runs/gpt_tiny")
    lm.logits("def f").shape            # [len(lm.ids("def f")), vocab]: row t predicts id t + 1
    lm.score("return x", context="def f(x):\\n    ")   # log-probability of the text
    lm.generate("def ", max_new_tokens=40)              # greedy unless temperature > 0

A LoRA run's params are its base with the adapters applied; `merge_lora=True` gives the merged
model (W + alpha / rank A B) with the base's architecture instead. Every call uses the
tokenizer's own end of sequence and an imported checkpoint's generation_config.json stop ids,
so an imported model stops where HF `generate` stops it.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

Array = jax.Array


@dataclasses.dataclass
class Loaded:
    """A model with its params, tokenizer and run config (`model.apply({"params": params},
    ids)` is the forward pass; the methods below are the common uses)."""

    model: object
    params: dict
    tokenizer: object
    config: ml_collections.ConfigDict
    _forward: object = dataclasses.field(default=None, repr=False)
    _log_probs: object = dataclasses.field(default=None, repr=False)

    def ids(self, text: str) -> np.ndarray:
        """The ids the model reads for `text` as a document's start: `text.document_prefix`
        (<eos> where training streamed its documents, or a Hugging Face checkpoint's BOS or
        <eos>; nothing where training packed them, except before an empty text), then the
        text's tokens. Row t of `logits(text)` predicts `ids(text)[t + 1]`."""
        return self._read(text)[0]

    def _read(self, text: str) -> tuple[np.ndarray, int]:
        """(`ids(text)`, how many of them come before the text's tokens)."""
        from transformer.generation.text import document_prefix

        encoded = self.tokenizer.encode(text)
        prefix = document_prefix(self.config, self.tokenizer, empty=not len(encoded))
        return np.concatenate([prefix, encoded]).astype(np.int32), len(prefix)

    def _check_head(self, method: str) -> None:
        from transformer.generation.text import check_head

        check_head(self.config, f"Loaded.{method}")

    def _check_language_model(self, method: str) -> None:
        """One line for a model whose output is no next-token distribution: no LM head, an
        encoder (BERT sees the token it would predict), an encoder-decoder, a class head."""
        from transformer.models import family_of

        self._check_head(method)
        family = family_of(self.config)
        head = family.classifier(self.config.model)
        if head or not family.continues_text or family.decoding == "prefix":
            raise ValueError(f"Loaded.{method} with model.family={family.name!r}" +
                             " and a class head" * head + ": expected a causal language "
                             "model (gpt or lstm), whose rows predict the next token")

    def _fits(self, ids: np.ndarray, prefix: int) -> np.ndarray:
        """`ids` (`prefix` of them before the text), or a one-line error if they run past a
        learned position table (whose rows beyond max_len are NaN: the logits would be NaN
        with no error)."""
        cfg = getattr(self.model, "config", None)
        if getattr(cfg, "position", None) == "learned" and len(ids) > cfg.max_len:
            behind = " (after <eos>)" if prefix else ""
            raise ValueError(f"text of {len(ids) - prefix} tokens{behind}: expected at most "
                             f"{cfg.max_len - prefix}, the model's learned positions end at "
                             f"max_len={cfg.max_len}")
        return ids

    def logits(self, text) -> np.ndarray:
        """float32 logits [len(ids(text)), V] of the ids the model reads for the text (`ids`:
        the text's T tokens, behind an <eos> where training streamed); row t predicts
        `ids(text)[t + 1]`, the last row what follows the text. Given token ids instead (a 1-D
        sequence of ints), exactly those: to compare models that read a text's start apart
        (an export read back as `hf:DIR`, and its workdir) on the same ids."""
        self._check_language_model("logits")
        if self._forward is None:  # compiled once per Loaded (and per text length)
            self._forward = jax.jit(lambda p, x: self.model.apply({"params": p}, x))
        ids = self._fits(*self._read(text)) if isinstance(text, str) else \
            self._fits(self._checked_ids(text), 0)
        return np.asarray(self._forward(self.params, ids[None])[0], np.float32)

    def _checked_ids(self, ids) -> np.ndarray:
        array, vocab = np.asarray(ids), self.model.vocab_size
        if array.ndim != 1 or not len(array) or array.dtype.kind not in "iu" or \
                array.min() < 0 or array.max() >= vocab:
            raise ValueError(f"logits of {type(ids).__name__} {array.dtype} {array.shape}: "
                             f"expected a str, or a 1-D sequence of token ids in [0, {vocab})")
        return array.astype(np.int32)

    def score(self, text: str, context: str = "") -> float:
        """The log-probability (nats) of `text`'s tokens following `context`, read as `ids`
        reads a document's start: the sum of log p(token | everything before it) over the
        text's tokens (0 for no text). Without a context the first token is predicted from
        the document start `ids` reads (<eos>, or an import's BOS); a model trained on packed
        documents, which reads none, predicts it from <eos> and then reads the rest behind the
        first token alone, as it read every document (and as the harness's rolling
        log-likelihood does)."""
        from transformer.generation.text import document_prefix

        self._check_language_model("score")
        if not text:
            return 0.0
        head = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + text)
        if len(whole) <= len(head) or not np.array_equal(whole[:len(head)], head):
            raise ValueError(f"text={text!r}: expected text whose tokens follow context="
                             f"{context!r}'s (the tokenizer merges them across the boundary)")
        prefix = document_prefix(self.config, self.tokenizer)  # [] where training packed
        total = 0.0
        if not len(head) and not prefix:
            # packed, no context: the first token from <eos>, then the rest behind it alone
            first = np.asarray([self.tokenizer.eos_id, whole[0]], np.int32)
            total, prefix, head = float(self._token_log_probs(first)[0]), [], whole[:1]
            if len(whole) == 1:
                return total
        ids = self._fits(np.concatenate([prefix, whole]).astype(np.int32), len(prefix))
        before = len(prefix) + len(head)
        return total + float(np.sum(self._token_log_probs(ids)[before - 1:], dtype=np.float64))

    def _token_log_probs(self, ids: np.ndarray) -> np.ndarray:
        """float32 [T - 1]: log p(ids[t + 1] | ids[:t + 1]), computed where the model runs (one
        compiled program per length; only T numbers come back, not T x vocab logits)."""
        if self._log_probs is None:
            def log_probs(params, ids_1T):
                logits = self.model.apply({"params": params}, ids_1T)[0, :-1]
                log_softmax = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
                return jnp.take_along_axis(log_softmax, ids_1T[0, 1:, None], axis=-1)[:, 0]
            self._log_probs = jax.jit(log_probs)
        return np.asarray(self._log_probs(self.params, ids[None]))

    def generate(self, prompt: str = "", *, max_new_tokens: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> str:
        """The prompt and its continuation, to the tokenizer's end of sequence or
        `max_new_tokens` (default: fill the training context; an imported checkpoint's: up
        to config.seq_len=128 tokens within its max_position_embeddings), as
        `transformer.generate`."""
        from transformer.generation.text import sample_texts

        self._check_head("generate")  # (an encoder-decoder does generate)
        return sample_texts(self.model, self.params, self.tokenizer, self.config,
                            num_samples=1, prompt=prompt, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, max_new_tokens=max_new_tokens)[0]


def load(source: str, step: int | None = None, merge_lora: bool = False) -> Loaded:
    """A `Loaded` model from a training workdir (`DIR` or `DIR@STEP`; `step` also picks one) or
    a Hugging Face directory (`hf:DIR`, or DIR holding a config.json)."""
    from transformer.utils import fileio

    kind, path, at = fileio.parse_init_from(source if source.startswith("hf:") or not
                                            os.path.isfile(os.path.join(source, "config.json"))
                                            else f"hf:{source}")
    if kind == "hf":
        return _load_hf(path)  # (its errors name 'hf:DIR')
    return _load_workdir(path, step if step is not None else at, merge_lora)


def _load_workdir(workdir: str, step: int | None, merge_lora: bool) -> Loaded:
    from transformer.generate import load_workdir
    from transformer.hf import export as hf_export
    from transformer.models import build_model
    from transformer.nn import lora
    from transformer.training import state as state_lib

    model, params, tokenizer, config = load_workdir(workdir, step)
    if merge_lora:
        if not lora.enabled(config):
            raise ValueError(f"merge_lora=True: {workdir}'s run has no LoRA adapters "
                             "(model.lora.rank is 0): expected a LoRA run")
        params = lora.merged_params(params, state_lib.model_lora(config))
        config = ml_collections.ConfigDict(config.to_dict())
        config.model = hf_export.base_model_config(config.model)
        model = build_model(config.model)
    return Loaded(model, params, tokenizer, config)


def _load_hf(directory: str) -> Loaded:
    from transformer.generate import load_hf

    return Loaded(*load_hf(directory, source=repr(f"hf:{directory}")))
