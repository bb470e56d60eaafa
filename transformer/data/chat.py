"""Supervised fine-tuning on chat data (`data.objective = "sft"`).

A conversation is one JSON line with a `messages` list of {"role", "content"} (the format of
Hugging Face chat datasets). It is rendered with the tokenizer's own chat template by
`transformers` itself (`apply_chat_template`) and encoded by its tokenizer.json as saved, so
the ids are exactly those a Hugging Face pipeline gives the model (where `AutoTokenizer`
rebuilds the directory's tokenizer class into other ids, `load_hf_tokenizer` warns). The loss
is taken on the assistant's tokens only: where the template marks them with
`{% generation %}`, transformers' assistant mask and, where a reply's marks end before its
turn's end of turn, that end of turn; otherwise each assistant message's tokens are those of
the text that rendering the conversation through that message adds to rendering the messages
before it with the assistant turn opened (`add_generation_prompt`), up to its end of turn (its
last special token), or where its turn renders differently once more messages follow (Qwen3's
<think>), its content where the whole conversation renders it and the end of turn after that.

Splits: train is `data.path` (a .jsonl file, a directory or a glob); validation is
`data.validation_path`, else the conversations whose hash falls below
`data.validation_fraction` (`sources.split_documents`' hash, on the canonical JSON of the
messages); test is `data.test_path` (if any). Whole conversations are packed into rows of
seq_len + 1 tokens (first fit, each a segment of its own with positions from 0), so no
conversation reads another; a longer one is an error unless `data.sft_truncate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import re
import sys

import grain
import jax
import ml_collections
import numpy as np

from transformer.data import formats, pipeline, sources, tasks
from transformer.data.features import next_token_features
from transformer.utils import cli

OBJECTIVES = pipeline.CHAT_OBJECTIVES  # ("sft",)
SPLITS = ("train", "validation", "test")
# A template that marks the assistant's text itself ({% generation %} ... {% endgeneration %}).
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


# --- conversations --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: tuple[dict, ...]
    where: str  # "file:line", for errors


def parse_conversation(line: str, where: str) -> Conversation:
    """One JSONL line -> a `Conversation`, or a one-line error naming `where` (file:line).

    >>> parse_conversation('{"messages": [{"role": "user", "content": "hi"}]}', "a:1").messages
    ({'role': 'user', 'content': 'hi'},)
    >>> parse_conversation('{"messages": [{"content": "hi"}]}', "a.jsonl:3")
    Traceback (most recent call last):
    ValueError: a.jsonl:3: message 0 has no "role": expected {"role": ..., "content": ...}
    """
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e}): expected one conversation per line, "
                         '{"messages": [{"role": ..., "content": ...}, ...]}') from None
    messages = row.get("messages") if isinstance(row, dict) else row
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: no "messages" list: expected {{"messages": [{{"role": ..., '
                         '"content": ...}, ...]} (a non-empty list)')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f'{where}: message {i} is {message!r}: expected {{"role": ..., '
                             '"content": ...}')
        for key, kind in (("role", "a non-empty string"), ("content", "a string")):
            if key not in message:
                raise ValueError(f'{where}: message {i} has no "{key}": expected {{"role": ..., '
                                 '"content": ...}')
            if not isinstance(message[key], str) or not (message[key] or key == "content"):
                raise ValueError(f"{where}: message {i} has {key}={message[key]!r}: expected "
                                 f"{kind}")
    return Conversation(tuple(messages), where)


def read_conversations(path: str) -> list[Conversation]:
    """Every conversation of the JSONL file(s) at `path` (a file, a directory or a glob; .gz /
    .zst compressed or not), in file order; blank lines are skipped."""
    out = []
    for file in sources._files(path):
        # (.jsonl.gz / .jsonl.zst decompressed, gs:// read, as the corpus reader does)
        number = 0
        try:
            with io.TextIOWrapper(formats._open_binary(file), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):  # noqa: B007 - read in the except
                    if line.strip():
                        out.append(parse_conversation(line, f"{file}:{number}"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{file}: not UTF-8 after line {number} ({e.reason}): expected "
                             "JSONL text (.jsonl, or compressed .jsonl.gz / .jsonl.zst)") from None
    return out


# --- rendering with the tokenizer's chat template --------------------------------------------


def _kind(tokenizer) -> str:
    """The tokenizer's kind as data.tokenizer names it ("byte", "Hugging Face", ...)."""
    kinds = {"ByteTokenizer": "byte", "CharTokenizer": "char", "HFTokenizer": "Hugging Face",
             "SentencePieceTokenizer": "SentencePiece"}
    return kinds.get(type(tokenizer).__name__, type(tokenizer).__name__)


def _transformers_tokenizer(tokenizer):
    """The `transformers` tokenizer with this tokenizer's vocabulary, chat template and the
    special-token roles its directory names (`named_specials`: those AutoTokenizer sets, not
    the ones filled in from well-known tokens), built once per tokenizer; or a one-line error
    for a tokenizer without a chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"the {_kind(tokenizer)} tokenizer has no chat template: expected a "
                         "Hugging Face tokenizer whose tokenizer_config.json has a "
                         "chat_template (or a chat_template.jinja beside it)")
    if (cached := tokenizer.__dict__.get("_transformers_chat")) is not None:
        return cached
    try:
        import tokenizers
        import transformers
    except ImportError:
        raise ImportError("chat templates are rendered by transformers: expected "
                          "`pip install 'transformers>=5,<6'`") from None
    backend = tokenizers.Tokenizer.from_str(tokenizer.tokenizer_json)
    backend.no_padding()
    backend.no_truncation()
    roles = {f"{role}_token": token for role, token in tokenizer.named_specials.items()}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template,
                                              **roles)
    tokenizer.__dict__["_transformers_chat"] = hf
    return hf


def encode_chat(tokenizer, messages, *, add_generation_prompt: bool = False,
                where: str = "") -> np.ndarray:
    """The ids of `messages` rendered with the tokenizer's chat template: exactly
    `apply_chat_template(messages, tokenize=True)["input_ids"]` of the tokenizer.json as
    saved (PreTrainedTokenizerFast's)."""
    hf = _transformers_tokenizer(tokenizer)
    with _template_errors(where):
        ids = hf.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                     add_generation_prompt=add_generation_prompt)["input_ids"]
    return np.asarray(ids, np.int32)


@contextlib.contextmanager
def _template_errors(where: str):
    """A template's own error (its `raise_exception`, an undefined name) as one line."""
    import jinja2

    try:
        yield
    except jinja2.TemplateError as e:
        raise ValueError(f"{where or 'the conversation'}: the chat template refused it: "
                         f"{e}") from None


def assistant_tokens(tokenizer, messages, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask): a conversation's ids and 1 on its assistants' tokens (content and end of
    turn), 0 elsewhere (see the module docstring). The text each assistant message adds is a
    span of characters of the rendered conversation; the tokens overlapping a span are masked
    (by their offsets, as transformers maps {% generation %} spans onto tokens). A template's
    {% generation %} marks give transformers' mask, plus the turn's end of turn where the
    marks end before it."""
    with _template_errors(where):
        return _assistant_tokens(_transformers_tokenizer(tokenizer), messages, where)


def _assistant_tokens(hf, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
    messages = list(messages)
    generation = bool(_GENERATION.search(hf.chat_template))
    text = _render(hf, messages)
    spans = _turn_spans(hf, messages, text, where, strict=not generation)
    # The conversation's ids exactly as apply_chat_template(tokenize=True) encodes its text.
    encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoding["input_ids"], np.int32)
    offsets = np.asarray(encoding["offset_mapping"], np.int64).reshape(len(ids), 2)
    special = np.isin(ids, sorted(_special_tokens(hf)))
    if not generation:
        mask = np.zeros(len(ids), bool)
        for start, stop in spans:
            inside = np.flatnonzero((offsets[:, 0] < stop) & (offsets[:, 1] > start))
            ends = inside[special[inside]]
            # Up to the turn's end of turn (its last special token), not the text after it
            # (ChatML's '\n' after <|im_end|>), as transformers' mask of the usual marks.
            mask[inside[inside <= ends[-1]] if ends.size else inside] = True
        return ids, mask.astype(np.int32)
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    marked = np.asarray(out["assistant_masks"], bool)
    if list(out["input_ids"]) != ids.tolist():  # (not expected: no offsets to extend by)
        return np.asarray(out["input_ids"], np.int32), marked.astype(np.int32)
    empty = [not m.get("content") for m in messages if m["role"] == "assistant"]
    mask = _with_end_of_turn(marked, offsets, spans, special, text, empty)
    return ids, mask.astype(np.int32)


def _special_tokens(hf) -> dict[int, str]:
    """The tokenizer's special tokens (end of turn among them): their text by id."""
    return {int(i): token.content for i, token in hf.added_tokens_decoder.items()
            if token.special}


def _render(hf, messages, prompt: bool = False, first: dict | None = None) -> str:
    if not messages:
        return _opening(hf, first)
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _turn_spans(hf, messages, text: str, where: str,
                strict: bool) -> list[tuple[int, int]] | None:
    """Each assistant message's [start, stop) characters of the rendered conversation: what
    rendering through it adds to rendering the messages before it with the assistant turn
    opened; where the template renders that turn differently once more messages follow (Qwen3
    writes <think></think> in the last turn only), its content as rendered in the whole
    conversation (`_content_span`) and the end of turn after it. A turn found neither way is an
    error if `strict`, else None."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(hf, messages[:i], True, messages[0])
        through = _render(hf, messages[:i + 1])
        if through.startswith(before) and text.startswith(through):
            spans.append((len(before), len(through)))
        elif (span := _content_span(hf, messages, i, text)) is not None:
            spans.append(span)
        elif not strict:
            return None
        else:
            raise ValueError(f"{where}: the chat template renders the conversation before "
                             f"message {i} (assistant) differently from its start, and "
                             "rendering the message's content in its place changes the rest: "
                             "expected a template whose turns render the same whatever follows, "
                             "or one that marks assistant text with {% generation %}")
    return spans


def _content_span(hf, messages, i: int, text: str) -> tuple[int, int] | None:
    """Message i's content in the rendered conversation `text`, and the end-of-turn token
    written after it (past whitespace only): where rendering the conversation with a marker as
    that content puts the marker, if the rest renders as in `text`; else None."""
    marker = "\x00content\x00"
    marked = _render(hf, [*messages[:i], {**messages[i], "content": marker}, *messages[i + 1:]])
    head, found, tail = marked.partition(marker)
    if not found or marker in tail or len(head) + len(tail) > len(text) or \
            not (text.startswith(head) and text.endswith(tail)):
        return None
    stop = len(text) - len(tail)
    after = len(text[stop:]) - len(text[stop:].lstrip())
    ends = [content for content in _special_tokens(hf).values() if content]
    end = next((e for e in ends if text.startswith(e, stop + after)), None)
    return len(head), stop + after + len(end) if end else stop


def _with_end_of_turn(marked, offsets, spans, special, text, empty) -> np.ndarray:
    """A {% generation %} mask with the end of turn that the template renders after a marked
    reply's marks (`{% endgeneration %}<|im_end|>`), so the model learns to stop: the first
    special token of the reply's turn (`spans`) after its last marked token (none where the
    marks end in a special token: `<|im_end|>{% endgeneration %}`); or where the turns are not found
    (spans None), the special token right after each marked run that has none (past
    whitespace only). Never the text after that token. An empty reply (`empty`, per assistant
    message) marks no token: its end of turn is the first special token of its turn, as
    unmarked."""
    mask = marked.copy()
    if spans is not None:
        for (start, stop), blank in zip(spans, empty, strict=True):
            inside = np.flatnonzero((offsets[:, 0] < stop) & (offsets[:, 1] > start))
            taken = inside[marked[inside]]
            ends = inside[special[inside]]
            # (a template may leave a turn unmarked on purpose: a non-empty one with no marks).
            # Marks ending in a special token end the turn themselves (`<|im_end|>{%
            # endgeneration %}`: a special token written after them, a closing <|endoftext|>,
            # is no reply's). Marks ending in text do not, even holding a special token: a
            # reply's text "a<|im_end|>b" encodes as that token (as transformers encodes it).
            if taken.size and not special[taken[-1]]:
                ends = ends[ends > taken[-1]]
                if ends.size:
                    mask[taken[-1]:ends[0] + 1] = True
            elif blank and ends.size:
                mask[ends[0]] = True
        return mask
    edges = np.diff(np.concatenate([[0], marked.astype(np.int8), [0]]))
    runs = zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True)
    for start, stop in runs:
        if any(special[start:stop]):
            continue
        j = stop
        while j < len(special) and not special[j] and not text[slice(*offsets[j])].strip():
            j += 1
        if j < len(special) and special[j]:
            mask[stop:j + 1] = True
    return mask


def _opening(hf, first: dict) -> str:
    """What the template renders before the content of a conversation's first message, when
    that is an assistant's: its header (and a BOS or a default system prompt if the template
    writes them), which are not the assistant's tokens. (transformers renders no conversation
    of no messages, and Llama 3's template writes the BOS with the first message.)"""
    marker = "\x00content\x00"
    if not isinstance(first.get("content"), str):
        return ""
    text = hf.apply_chat_template([{**first, "content": marker}], tokenize=False)
    return text[:text.index(marker)] if marker in text else ""


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn in the template (Llama 3's <|eot_id|>, ChatML's
    <|im_end|>): the last special token of a probe reply's masked tokens; else <eos>, with a
    warning line."""
    messages = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"})
    ids, mask = assistant_tokens(tokenizer, messages)
    specials = set(tokenizer.special_names)
    ends = [int(i) for i in ids[mask.astype(bool)] if int(i) in specials]
    if ends:
        return ends[-1]
    eos = tokenizer.require("eos", "to end an assistant turn")
    cli.warn_once(f"the chat template ends an assistant turn with no special token (a "
                      f"probe reply masks {tokenizer.decode(ids[mask.astype(bool)])!r}): "
                      f"stopping at eos ({tokenizer.decode([eos])!r}) alone")
    return eos


# --- feature converter and packing ---------------------------------------------------------


def sft_features(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Packed rows of T + 1 tokens with an assistant mask -> next-token features of length T
    whose weights are 1 only where the target is an assistant token of the same conversation.

    Two conversations packed into 9 slots: [u1 a1 a2] and [u2 u3 a3] (u: user / template
    tokens, a: assistant tokens), 0 = padding:

        tokens       u1 a1 a2 u2 u3 a3  0  0  0     loss_mask  0 1 1 0 0 1 0 0 0
        targets      a1 a2 u2 u3 a3  0  0  0        weights    1 1 0 0 1 0 0 0

    >>> row = {"tokens": np.array([5, 6, 7, 8, 9, 10, 0, 0, 0]),
    ...        "tokens_segment_ids": np.array([1, 1, 1, 2, 2, 2, 0, 0, 0]),
    ...        "tokens_positions": np.array([0, 1, 2, 0, 1, 2, 0, 0, 0]),
    ...        "tokens_loss_mask": np.array([0, 1, 1, 0, 0, 1, 0, 0, 0])}
    >>> features = sft_features(row)
    >>> features["targets"].tolist(), features["weights"].tolist()
    ([6, 7, 8, 9, 10, 0, 0, 0], [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    >>> features["segment_ids"].tolist(), features["positions"].tolist()
    ([1, 1, 1, 2, 2, 2, 0, 0], [0, 1, 2, 0, 1, 2, 0, 0])
    """
    features = next_token_features(row)
    features["weights"] = features["weights"] * row["tokens_loss_mask"][..., 1:]
    return features


def first_fit(lengths, width: int) -> list[list[int]]:
    """Packs items of `lengths` (each <= width) into rows of `width`: each item, in order, goes
    into the first row with room for it. Returns each row's items.

    >>> first_fit([5, 3, 4, 2, 6], width=8)
    [[0, 1], [2, 3], [4]]
    """
    rows: list[list[int]] = []
    room = np.zeros(0, np.int64)
    for i, length in enumerate(lengths):
        fits = np.flatnonzero(room >= length)
        if fits.size:
            rows[fits[0]].append(i)
            room[fits[0]] -= length
        else:
            rows.append([i])
            room = np.append(room, width - length)
    return rows


class PackedRows:
    """A split's rows (as `windows.Windows` gives them to `pipeline._GlobalBatches`): the
    conversations packed once (`first_fit`, in a seeded order when training), each row its
    conversations end to end with their own segment ids and positions, and "tokens_loss_mask".
    Training visits the rows in a new seeded order every epoch; evaluation reads each once (in
    a fixed seeded order with `shuffle`, so the first batches are a sample), then padding."""

    def __init__(self, examples, *, width: int, seed: int, training: bool, shuffle: bool):
        order = np.random.default_rng((seed, 0x5F7)).permutation(len(examples)) \
            if training and shuffle else np.arange(len(examples))
        packed = first_fit([len(examples[i][0]) for i in order], width)
        self.packs = [[examples[order[j]] for j in row] for row in packed]
        self.rows, self.width, self.seed = len(self.packs), width, seed
        self.training, self.shuffle = training, shuffle
        self._order = (-1, np.arange(0))

    def row(self, i: int) -> dict[str, np.ndarray]:
        out = {k: np.zeros(self.width, np.int32) for k in
               ("tokens", "tokens_segment_ids", "tokens_positions", "tokens_loss_mask")}
        if self.rows == 0 or (not self.training and i >= self.rows):
            return out
        epoch, k = divmod(i, self.rows)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng((self.seed, epoch)).permutation(
                self.rows) if self.shuffle else np.arange(self.rows))
        at = 0
        for segment, (ids, mask) in enumerate(self.packs[int(self._order[1][k])], 1):
            piece = slice(at, at + len(ids))
            out["tokens"][piece], out["tokens_loss_mask"][piece] = ids, mask
            out["tokens_segment_ids"][piece] = segment
            out["tokens_positions"][piece] = np.arange(len(ids))
            at += len(ids)
        return out


# --- splits and datasets --------------------------------------------------------------------


def split_conversations(config: ml_collections.ConfigDict, split: str) -> list[Conversation]:
    """The conversations of `split` (see the module docstring)."""
    data = config.data
    if split == "test":
        return read_conversations(data.test_path) if data.get("test_path") else []
    if split == "validation" and data.get("validation_path"):
        return read_conversations(data.validation_path)
    if not data.path:
        raise ValueError("data.objective='sft' reads conversations: expected data.path (a "
                         "JSONL file, directory or glob of {\"messages\": [...]} lines)")
    fraction = 0.0 if data.get("validation_path") else data.validation_fraction
    held_out = lambda c: sources._unit_hash(json.dumps(c.messages, sort_keys=True)) < fraction
    return [c for c in read_conversations(data.path) if held_out(c) == (split == "validation")]


def tokenized(config: ml_collections.ConfigDict, tokenizer, split: str) -> list:
    """The split's (ids, assistant mask) per conversation, each at most seq_len + 1 tokens:
    a longer one is a one-line error, or with `data.sft_truncate` cut (one line says how many
    were). Built once per process, split, settings and tokenizer."""
    data = config.data
    paths = tuple(data.get(k, "") for k in ("path", "validation_path", "test_path"))
    return _tokenized(paths, tuple(sources.fingerprint(p) if p else "" for p in paths),
                      data.validation_fraction, config.seq_len, bool(data.get("sft_truncate")),
                      tokenizer, split)


@functools.lru_cache(maxsize=8)
def _tokenized(paths, fingerprints, fraction, seq_len, truncate, tokenizer, split) -> list:
    del fingerprints  # (part of the key only: edited files are read again)
    config = ml_collections.ConfigDict({"seq_len": seq_len, "data": {
        "path": paths[0], "validation_path": paths[1], "test_path": paths[2],
        "validation_fraction": fraction}})
    width, examples, cut, roles, uncut = seq_len + 1, [], 0, set(), False
    for conversation in split_conversations(config, split):
        roles |= {str(m["role"]) for m in conversation.messages}
        ids, mask = assistant_tokens(tokenizer, conversation.messages, conversation.where)
        uncut = uncut or bool(mask[1:].any())
        if len(ids) > width:
            if not truncate:
                raise ValueError(f"{conversation.where}: the conversation has {len(ids)} tokens, "
                                 f"more than seq_len + 1 = {width}: expected shorter "
                                 "conversations, a larger seq_len, or data.sft_truncate=True")
            ids, mask, cut = ids[:width], mask[:width], cut + 1
        examples.append((ids, mask))
    if cut and jax.process_index() == 0:
        print(f"data.sft_truncate: cut {cut} of {len(examples)} {split} conversations to "
              f"seq_len + 1 = {width} tokens")
    if examples and not any(mask[1:].any() for _, mask in examples):  # a loss of 0 throughout
        if uncut:  # (there were some: truncation left none)
            raise ValueError(f"the {split} split's {len(examples)} conversations have no "
                             "assistant tokens to take the loss on: all cut by "
                             f"data.sft_truncate at seq_len + 1 = {width}: expected a larger "
                             "seq_len")
        raise ValueError(f"the {split} split's {len(examples)} conversations have no assistant "
                         f"tokens to take the loss on (roles {sorted(roles)}): expected "
                         "messages with \"role\": \"assistant\"")
    return examples


def make_dataset(config: ml_collections.ConfigDict, tokenizer, split: str, *,
                 num_epochs: int | None = None, shuffle: bool = True,
                 rows=None) -> grain.IterDataset:
    """This process's `rows` of each global batch of `split`'s packed conversations, as
    `sft_features`. Training (`num_epochs=None`) repeats, every epoch in a new row order;
    evaluation (`num_epochs=1`) reads every row once, the last batch padded (weight 0)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    training = num_epochs is None
    source = PackedRows(tokenized(config, tokenizer, split), width=config.seq_len + 1,
                        seed=config.seed, training=training, shuffle=shuffle)
    batch_size = config.batch_size
    num_batches = sys.maxsize if training else -(-source.rows // batch_size)
    if training and source.rows == 0:
        raise ValueError(f"the {split} split has no conversations: expected JSONL lines at "
                         f"data.path={config.data.path!r}")
    batches = pipeline._GlobalBatches(source, sft_features, batch_size=batch_size,
                                      rows=tasks.local_rows(batch_size, rows),
                                      num_batches=num_batches, noise_base=None)
    return batches.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))

