"""Hugging Face tokenizers: `HFTokenizer` wraps a `tokenizers` tokenizer.json with its own ids,
and `load_hf_tokenizer` reads one with its roles, chat template and stop ids from a
`save_pretrained` directory (or a bare tokenizer.json)."""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer.data import fast_bpe
from transformer.data.tokenizer_base import (
    HF_FILE,
    ROLES,
    Tokenizer,
    check_num_sentinels,
    is_int,
)
from transformer.utils import cli, fileio

# Where a Hugging Face directory names no roles (a bare tokenizer.json), a role is taken by the
# first of these tokens its vocabulary has: the names GPT-2, BERT, Llama and T5 use.
_WELL_KNOWN = {
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<|endoftext|>"),
    "eos": ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>"),
    "unk": ("<unk>", "[UNK]"),
    "mask": ("<mask>", "[MASK]"),
    "cls": ("[CLS]", "<cls>"),
    "sep": ("[SEP]", "<sep>"),
}
_SENTINEL = re.compile(r"<extra_id_(\d+)>")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens
_BYTE_LEVEL = {symbol: b for b, symbol in enumerate(fast_bpe.byte_symbols())}
# The tokenizer_config.json entries, besides the roles and the chat template, that a tokenizer
# keeps from its directory for the export, so that `AutoTokenizer` loads the export as it did
# the original: its other special tokens and their flags, the inputs it returns (BERT's
# token_type_ids), its length and sides, and how it decodes.
TRANSFORMERS_KEYS = ("added_tokens_decoder", "additional_special_tokens", "extra_special_tokens",
                     "model_input_names", "model_max_length", "padding_side", "truncation_side",
                     "clean_up_tokenization_spaces", "split_special_tokens")
# Where a saved "hf" tokenizer keeps its `stop_ids`, beside CONFIG_FILE: a file of its own, so
# that tokenizer.json stays what says how text becomes ids (prepared data is checked against it).
STOP_IDS_FILE = "stop_ids.json"
# The `specials` entry listing the roles `load_hf_tokenizer` filled in from _WELL_KNOWN (neither
# the directory's config files nor its tokenizer class name them): transformers leaves those
# unset, so its chat templates see no such token. Kept in a saved tokenizer's specials (and its
# pickle), so that a reload renders chats the same without asking transformers again.
UNNAMED = "unnamed"
# The tokenizer classes with which transformers 5 reads a tokenizer.json as saved (others, such
# as LlamaTokenizerFast, rebuild its pipeline from the class: `_differs_from_transformers`).
AS_SAVED = ("PreTrainedTokenizerFast", "TokenizersBackend")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer (`tokenizer_json`: the text of a tokenizer.json)
    with its own ids. `specials` maps roles (`ROLES`) to token strings of its vocabulary, or
    None where it has no such token; read them from a save_pretrained directory with
    `load_hf_tokenizer`. `specials[UNNAMED]` (optional) lists the roles that were filled in
    rather than named by the directory: `named_specials` leaves them out.

    - Documents end with <eos>; a vocabulary without one but with [SEP] (BERT) ends them with
      [SEP]. A role a feature needs and the vocabulary lacks is a clear error there (e.g. the
      mask token for MLM), never a stand-in id.
    - Sentinels: a vocabulary with its own `<extra_id_i>` (T5: <extra_id_0> is its last id)
      uses those, and `num_sentinels` must equal their count (None: whatever it has); otherwise
      `num_sentinels` ids are appended above the vocabulary, written "<extra_id_i>" by `decode`
      as for the other kinds.
    - `encode` adds no specials (no BOS / EOS / [CLS]); `decode` drops <pad> and writes other
      specials as their text, so decode(encode(text)) == text wherever the tokenizer is
      lossless (byte-level BPE is; BERT's lower-casing WordPiece is not).
    - The tokenizer.json's `padding` and `truncation` are turned off: every text gives all of
      its ids, as `AutoTokenizer(text, add_special_tokens=False)` does.
    - `settings`: the directory's `TRANSFORMERS_KEYS` entries, written back by `hugging_face`
      with the tokenizer.json unchanged (its post-processor, padding and truncation included)
      but for the appended sentinels, which it adds as special tokens.
    - `stop_ids`: the ids at which the checkpoint's `generate` stops (its
      generation_config.json `eos_token_id`, in its order; () if it names none): generation
      stops at each and never bans them, and the export writes them back.
    """

    kind = "hf"

    def __init__(self, tokenizer_json: str, specials: dict[str, str | None],
                 num_sentinels: int | None = None, chat_template: str | None = None,
                 settings: dict[str, Any] | None = None, stop_ids: Sequence[int] = ()):
        import tokenizers

        self.tokenizer_json = tokenizer_json
        self.chat_template = chat_template or None  # a Jinja template (transformer.data.chat)
        self.settings = dict(settings or {})
        if unknown := sorted(set(self.settings) - set(TRANSFORMERS_KEYS)):
            raise ValueError(f"tokenizer settings {unknown}: expected some of {TRANSFORMERS_KEYS}")
        self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        # A tokenizer.json may pad or cut every encoding to a fixed length (sentence-transformers
        # saves `padding: Fixed 128` and `truncation: 128`): documents are encoded whole.
        self._tok.no_padding()
        self._tok.no_truncation()
        # transformers' split_special_tokens: a special token's name in text is text
        self._tok.encode_special_tokens = bool(self.settings.get("split_special_tokens"))
        self._fast = None  # a fast_bpe.TiktokenBPE, built by the first encode_batch (or False)
        self.fast_bpe_skipped = ""  # why not, where the tokenizer is not encoded by tiktoken
        vocab = self._tok.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1
        specials = dict(specials)
        unnamed = specials.pop(UNNAMED, None) or []
        if not isinstance(unnamed, list | tuple) or set(unnamed) - set(ROLES):
            raise ValueError(f"specials[{UNNAMED!r}]={unnamed!r}: expected a list of {ROLES}")
        self.unnamed = tuple(role for role in ROLES if role in unnamed)
        unknown = sorted(set(specials) - set(ROLES))
        if unknown:
            raise ValueError(f"special roles {unknown}: expected some of {ROLES}")
        self.specials = {role: specials.get(role) for role in ROLES}
        for role, token in self.specials.items():
            if token is not None and token not in vocab:
                raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
            setattr(self, f"{role}_id", None if token is None else vocab[token])
        if self.eos_id is None:
            self.eos_id = self.sep_id
        own = sorted(int(m.group(1)) for t in vocab if (m := _SENTINEL.fullmatch(t)))
        num_sentinels = check_num_sentinels(len(own) if num_sentinels is None else num_sentinels)
        if own:
            if own != list(range(len(own))) or any(
                    vocab[f"<extra_id_{i}>"] != size - 1 - i for i in own):
                raise ValueError(f"the tokenizer's <extra_id_i> tokens are not its last ids in "
                                 f"reverse order: expected <extra_id_i> = {size - 1} - i (T5)")
            if num_sentinels != len(own):
                raise ValueError(f"num_sentinels={num_sentinels}: the tokenizer has its own "
                                 f"{len(own)} sentinels <extra_id_i>: expected {len(own)}")
        self.stop_ids = _checked_stop_ids(stop_ids, size)
        self._base_size = size - len(own)
        self.num_sentinels = num_sentinels
        self.vocab_size = self._base_size + num_sentinels
        self._names = {vocab[t.content]: t.content
                       for t in self._tok.get_added_tokens_decoder().values()
                       if t.special and not _SENTINEL.fullmatch(t.content)}
        for token in self.specials.values():
            if token is not None and not _SENTINEL.fullmatch(token):
                self._names[vocab[token]] = token
        self._pad_dropped = (self.specials["pad"] is not None and
                             self.pad_id not in (self.eos_id, self.bos_id, self.unk_id))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text, as `encode` gives them: through tiktoken where a byte-level BPE
        gives the same ids that way (`fast_bpe`, 3 to 5 times as fast), else `tokenizers`."""
        if self.encoder == "tiktoken":
            ids = self._fast.encode_batch(texts, self._encode_batch)
            if ids is not None:
                return ids
            self._fast = False
            self.fast_bpe_skipped = "tiktoken and tokenizers encoded a document differently"
        return self._encode_batch(texts)

    @property
    def encoder(self) -> str:
        """What `encode_batch` encodes with: "tiktoken", or "tokenizers" (`fast_bpe_skipped`
        says why)."""
        if self._fast is None:
            self._fast, self.fast_bpe_skipped = fast_bpe.tiktoken_encoder(
                self.tokenizer_json, self._tok)
            self._fast = self._fast or False
        return "tiktoken" if self._fast else "tokenizers"

    def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in
                self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def unknown_chars(self, text: str) -> list[str]:
        if self.unk_id is None:
            return []
        return [c for c in dict.fromkeys(text) if self.unk_id in self.encode(c).tolist()]

    def decode(self, ids) -> str:
        out, run = [], []
        for i in self._checked_ids(ids):
            if i >= self._base_size:  # an appended or own sentinel
                out += [self._tok.decode(run, skip_special_tokens=False),
                        f"<extra_id_{self.vocab_size - 1 - i}>"]
                run = []
            elif not (self._pad_dropped and i == self.pad_id):
                run.append(i)
        return "".join(out) + self._tok.decode(run, skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        """Id i's own bytes. Where decoding it alone gives "\ufffd" (part of a character),
        those of a byte-fallback token (<0xE2>) or a byte-level one (GPT-2's alphabet)."""
        text = self.decode([i])
        token = self._tok.id_to_token(i) or ""
        if "\ufffd" not in text or "\ufffd" in token:
            return text.encode()
        if match := _BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        if all(c in _BYTE_LEVEL for c in token):
            return bytes(_BYTE_LEVEL[c] for c in token)
        return text.encode()

    @functools.cached_property  # (each prompt's prefix asks: a sort of the vocabulary)
    def document_start(self) -> list[int]:
        """The ids the tokenizer.json's post-processor puts before a text (transformers'
        `tokenizer(text)`): Llama's, Gemma's and Mistral's BOS; none for GPT-2's or Qwen's.

        >>> import tokenizers
        >>> tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "a": 1}))
        >>> tok.post_processor = tokenizers.processors.TemplateProcessing(
        ...     single="<s> $A", special_tokens=[("<s>", 0)])
        >>> HFTokenizer(tok.to_str(), {"bos": "<s>"}).document_start
        [0]
        """
        # (the leading specials of a one-token text: a template may also append some, BERT's
        # [SEP], and an empty text would not tell those apart. The probe is the vocabulary's
        # first token by id that the normalizer leaves something of: the same in every process)
        vocab = self._tok.get_vocab(with_added_tokens=False)
        probe = next((token for token in sorted(vocab, key=vocab.get)
                      if self._tok.encode(token, add_special_tokens=False).ids), "")
        encoding = self._tok.encode(probe, add_special_tokens=True)
        mask = list(encoding.special_tokens_mask) + [0]
        return list(encoding.ids[:mask.index(0)])

    @property
    def special_names(self) -> dict[int, str]:
        return dict(self._names)

    @property
    def named_specials(self) -> dict[str, str]:
        """{role: token} of the roles its directory names (its config files, or the defaults
        of the tokenizer class it loads as), the ones `AutoTokenizer` sets on the same
        directory and a chat template's `bos_token`, `eos_token`, ... render: the `specials`
        but those filled in from well-known tokens (`unnamed`)."""
        return {role: token for role, token in self.specials.items()
                if token is not None and role not in self.unnamed}

    def _saved_specials(self) -> dict[str, Any]:
        return {**self.specials, **({UNNAMED: list(self.unnamed)} if self.unnamed else {})}

    def _config(self, directory: str) -> dict[str, Any]:
        fileio.write_atomic(fileio.join(directory, HF_FILE), self.tokenizer_json.encode())
        chat = {"chat_template": self.chat_template} if self.chat_template else {}
        settings = {"settings": self.settings} if self.settings else {}
        stops = fileio.path(directory).joinpath(STOP_IDS_FILE)
        if self.stop_ids:
            fileio.write_atomic(str(stops), json.dumps(list(self.stop_ids)).encode())
        else:  # (none: a directory saved over keeps no other tokenizer's)
            stops.unlink(missing_ok=True)
        return {"model_file": HF_FILE, "specials": self._saved_specials(), **chat,
                **settings}

    def hugging_face(self) -> tuple[str, dict[str, Any]]:
        """Its own tokenizer.json, with its roles, settings (and chat template) in the config.
        Appended sentinels become special tokens <extra_id_i> at their ids, listed among the
        additional special tokens (as T5's own tokenizers have them: `AutoTokenizer` encodes
        "<extra_id_0>" in text as the sentinel, where `encode` reads it as text); a vocabulary
        with its own sentinels, or none, is written unchanged."""
        roles = {f"{role}_token": token for role, token in self.specials.items()
                 if token is not None}
        chat = {"chat_template": self.chat_template} if self.chat_template else {}
        tokenizer_json, settings = self._with_sentinels()
        return tokenizer_json, {"tokenizer_class": "PreTrainedTokenizerFast",
                                **settings, **roles, **chat}

    def _with_sentinels(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json, settings) with the appended sentinels added as special tokens."""
        import tokenizers

        appended = {self.sentinel_id(i): f"<extra_id_{i}>" for i in range(self.num_sentinels)
                    if self._tok.token_to_id(f"<extra_id_{i}>") is None}
        if not appended:  # no sentinels, or the vocabulary's own
            return self.tokenizer_json, self.settings
        # A fresh copy: self._tok has its padding and truncation turned off. Added tokens only
        # match their own literal text (before normalizing and pre-tokenizing), so every other
        # text (byte-level BPE included) keeps its ids.
        tok = tokenizers.Tokenizer.from_str(self.tokenizer_json)
        tok.add_special_tokens([tokenizers.AddedToken(name, special=True, normalized=False)
                                for _, name in sorted(appended.items())])
        if got := {i: tok.token_to_id(n) for i, n in appended.items() if tok.token_to_id(n) != i}:
            raise ValueError(f"the exported tokenizer puts sentinels at ids {list(got.values())}: "
                             f"expected {list(got)} (its vocabulary's ids are not 0 .. "
                             f"{self._base_size - 1} without gaps)")
        settings = dict(self.settings)
        # transformers 5 reads either list; keep the tokenizer's own entries first
        key = ("extra_special_tokens" if isinstance(settings.get("extra_special_tokens"), list)
               and "additional_special_tokens" not in settings else "additional_special_tokens")
        listed = list(settings.get(key) or [])
        settings[key] = listed + [n for _, n in sorted(appended.items()) if n not in listed]
        if isinstance(settings.get("added_tokens_decoder"), dict):
            settings["added_tokens_decoder"] = {**settings["added_tokens_decoder"], **{
                str(i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True} for i, n in appended.items()}}
        return tok.to_str(pretty=True), settings

    def __getstate__(self) -> dict[str, Any]:  # for multiprocess data loaders
        return {"tokenizer_json": self.tokenizer_json, "specials": self._saved_specials(),
                "num_sentinels": self.num_sentinels, "chat_template": self.chat_template,
                "settings": self.settings, "stop_ids": self.stop_ids}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, num_sentinels={self.num_sentinels}, "
                f"specials={ {r: t for r, t in self.specials.items() if t is not None} })")


def _checked_stop_ids(ids: Sequence[int], size: int) -> tuple[int, ...]:
    """`ids` as distinct ids (in their order) of a vocabulary of `size`, or a one-line error."""
    ids = tuple(ids)
    if not all(is_int(i) and 0 <= i < size for i in ids):
        raise ValueError(f"stop ids {list(ids)} (the eos_token_id of generation_config.json, "
                         "or of config.json without one): "
                         f"expected ids of the tokenizer's vocabulary, in [0, {size})")
    return tuple(dict.fromkeys(int(i) for i in ids))


def saved_stop_ids(directory: str) -> tuple[int, ...]:
    """The `stop_ids` a saved "hf" tokenizer keeps in STOP_IDS_FILE: () where there is none (a
    tokenizer saved before they were kept, or one whose checkpoint named none)."""
    file = fileio.path(directory).joinpath(STOP_IDS_FILE)
    return tuple(json.loads(file.read_text(encoding="utf-8"))) if file.is_file() else ()


def _generation_stop_ids(directory) -> tuple[int, ...]:
    """The ids `generate` stops at per a save_pretrained directory's generation_config.json:
    its `eos_token_id`, one id or a list (Llama 3.1 Instruct: <|end_of_text|>, <|eom_id|>,
    <|eot_id|>); without that file, config.json's (its text config's), as transformers builds
    the generation config from the model's then; () without either or the entry."""
    file = directory.joinpath("generation_config.json")
    if file.is_file():
        value = _json_object(file, "a Hugging Face generation_config.json").get("eos_token_id")
    elif (file := directory.joinpath("config.json")).is_file():
        config = _json_object(file, "a Hugging Face config.json")
        value, text = config.get("eos_token_id"), config.get("text_config")
        if value is None and isinstance(text, dict):
            value = text.get("eos_token_id")
    else:
        return ()
    ids = [] if value is None else [value] if is_int(value) else value
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise ValueError(f"{str(file)!r} has eos_token_id={value!r}: expected a token id or a "
                         "list of them")
    return tuple(ids)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string
    or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _json_object(file, expected: str) -> dict[str, Any]:
    """`file`'s JSON object, or a one-line error naming `file` and saying what was `expected`."""
    try:
        content = json.loads(file.read_bytes().decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(file)!r} is not JSON ({e}): expected {expected}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(content).__name__}: expected "
                         f"{expected}")
    return content


def load_hf_tokenizer(path: str, num_sentinels: int | None = None) -> HFTokenizer:
    """An `HFTokenizer` from a Hugging Face tokenizer.json, or a directory holding one (e.g. a
    `save_pretrained` directory). Each role comes from the directory's tokenizer_config.json
    (its `bos_token`, `eos_token`, ... entries; null names none), else special_tokens_map.json;
    a role neither names (all of them for a bare tokenizer.json) is the first well-known token
    (<pad>, [PAD], </s>, <|endoftext|>, [CLS], ...) the vocabulary has, listed as `unnamed`
    (transformers leaves it unset: chat templates do not see it). Where the directory has a
    chat template, a role neither file names but `AutoTokenizer` sets (the defaults of the
    class it picks: GPT-2's <|endoftext|>, Llama's <s>; `_class_defaults`) is that token, so
    the template renders it as transformers does. Where that `AutoTokenizer`, or the one of a
    tokenizer_class transformers rebuilds (not `AS_SAVED`), encodes a probe text into other ids
    than the tokenizer.json as saved (`_differs_from_transformers`), one warning line says so:
    the tokenizer encodes as tokenizer.json does, whatever the class.
    The first file's `TRANSFORMERS_KEYS` entries are kept for the export, and a
    generation_config.json's `eos_token_id` (one id or several) becomes the `stop_ids`.
    """
    location = fileio.path(path)
    file = location.joinpath("tokenizer.json") if location.is_dir() else location
    if not file.is_file():
        raise FileNotFoundError(f"{path!r}: expected a Hugging Face tokenizer.json or a "
                                "directory holding one")
    expected = "a Hugging Face tokenizer.json or a directory holding one"
    if not isinstance(_json_object(file, expected).get("model"), dict):
        raise ValueError(f"{str(file)!r} is JSON but not a tokenizer (it has no \"model\"): "
                         f"expected {expected}")
    text = file.read_text(encoding="utf-8")
    named, settings, tokenizer_class = {}, None, None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (meta := file.parent.joinpath(name)).is_file():
            config = _json_object(meta, f"a Hugging Face {name}")
            tokenizer_class = tokenizer_class or config.get("tokenizer_class")
            named.update({role: _token_content(config[f"{role}_token"]) for role in ROLES
                          if role not in named and f"{role}_token" in config})
            if settings is None:
                settings = {key: config[key] for key in TRANSFORMERS_KEYS if key in config}
    template = _chat_template(file.parent)
    # transformers matters to a chat template (the roles it sets) and to a class it rebuilds
    # (the ids it gives); other directories never import it
    auto = _auto_tokenizer(file.parent) if file.name == "tokenizer.json" and (
        template or tokenizer_class not in (None, *AS_SAVED)) else None
    if unnamed := [role for role in ROLES if role not in named]:
        # e.g. GPT-2's hub tokenizer_config.json names no role (its class's defaults do)
        vocab = _vocab(text, file)
        if auto is not None and template:
            defaults = _class_defaults(auto, unnamed)
            named.update({role: token for role, (token, i) in defaults.items()
                          if vocab.get(token) == i})  # (not a token transformers added)
            unnamed = [role for role in unnamed if role not in named]
        named.update({role: next((t for t in _WELL_KNOWN[role] if t in vocab), None)
                      for role in unnamed})
        named[UNNAMED] = [role for role in unnamed if named[role] is not None]
    stops = _generation_stop_ids(file.parent)
    try:
        tokenizer = HFTokenizer(text, named, num_sentinels, template, settings or {}, stops)
    except Exception as e:
        raise ValueError(f"{str(file)!r}: {e}") from None
    if auto is not None and (differs := _differs_from_transformers(auto, tokenizer._tok)):
        cli.warn_once(f"{str(file.parent)!r}: {differs}: this run follows tokenizer.json, as "
                      "its prepared data, generation and export (which AutoTokenizer reads as "
                      "saved) do, so its ids (and chat ids) are not this directory's "
                      "AutoTokenizer's")
    return tokenizer


def _auto_tokenizer(directory):
    """`transformers.AutoTokenizer` loading the local `directory` (the class it picks from
    tokenizer_config.json's tokenizer_class, else config.json's model_type); None where
    transformers is missing or cannot load it (a remote directory, a custom class needing
    trust_remote_code): the well-known names then, and no comparison of ids."""
    if fileio.is_remote(directory):
        return None
    try:
        import transformers
    except ImportError:
        return None
    logs = transformers.utils.logging
    verbosity = logs.get_verbosity()
    logs.set_verbosity_error()  # (its notes on the directory's layout are no concern here)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoTokenizer.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=False)
    except Exception:  # (whatever it is: the directory is read as before)
        return None
    finally:
        logs.set_verbosity(verbosity)


def _class_defaults(hf, roles: list[str]) -> dict[str, tuple[str, int]]:
    """{role: (token, id)} of those of `roles` that the `AutoTokenizer` `hf` sets: its
    class's defaults, and the tokenizer.json's (GPT2Tokenizer's <|endoftext|> as bos, eos and
    unk)."""
    tokens = {role: getattr(hf, f"{role}_token", None) for role in roles}
    return {role: (token, hf.convert_tokens_to_ids(token))
            for role, token in tokens.items() if isinstance(token, str)}


# A probe chat for `_differs_from_transformers`: blank lines, double spaces, a number; and a
# probe text starting with a space (a Prepend("▁") normalizer and Metaspace's prepend_scheme
# "first" differ there).
_PROBE = ({"role": "user", "content": "Hello, world!\n\nHow  are you?"},
          {"role": "assistant", "content": "Fine, thanks.\n\n  42 ok"})
_PROBE_TEXT = " Hello  there,\n\n world 42\n"


def _differs_from_transformers(hf, backend) -> str:
    """How the `AutoTokenizer` `hf` encodes a probe text differently from the run's `backend`
    (a `tokenizers.Tokenizer`: the tokenizer.json as saved; "" where alike): transformers 5
    rebuilds the pipeline of a class with its own (LlamaTokenizer(Fast), Qwen2Tokenizer,
    GPT2Tokenizer, ...) from tokenizer_class and its flags (legacy, add_prefix_space), keeping
    the vocabulary and merges; PreTrainedTokenizerFast reads tokenizer.json as saved. The
    probe: a text starting with a space, the probe chat as the template renders it (where
    there is one), and text around special tokens."""
    specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    try:
        text = hf.apply_chat_template(list(_PROBE), tokenize=False)
    except Exception:  # (a template refusing the probe: the text around specials still tells)
        text = ""
    text = _PROBE_TEXT + (text if isinstance(text, str) else "") + "".join(
        f"{s}user\nHello  there\n\n{s}\n" for s in specials[:4])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = list(hf(text, add_special_tokens=False)["input_ids"])
    except Exception:  # (a tokenizer transformers cannot run: nothing to compare)
        return ""
    ours = backend.encode(text, add_special_tokens=False).ids
    if ours == theirs:
        return ""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
              min(len(ours), len(theirs)))
    token = lambda ids: backend.id_to_token(ids[at]) if at < len(ids) else None
    return (f"AutoTokenizer loads it as {type(hf).__name__}, which transformers rebuilds from "
            f"tokenizer_class and its flags, and encodes a probe text into {len(theirs)} ids, "
            f"tokenizer.json as saved into {len(ours)} (token {at}: {token(theirs)!r} there, "
            f"{token(ours)!r} here)")


def _vocab(text: str, file) -> dict[str, int]:
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_str(text).get_vocab(with_added_tokens=True)
    except Exception as e:
        raise ValueError(f"{str(file)!r}: {e}") from None


def _chat_template(directory) -> str | None:
    """A save_pretrained directory's chat template, where transformers keeps it: the
    tokenizer_config.json's `chat_template` (a string, or a list of named templates: the one
    named "default"), else chat_template.jinja (transformers 5 writes it there)."""
    config = directory.joinpath("tokenizer_config.json")
    template = _json_object(config, "a Hugging Face tokenizer_config.json").get(
        "chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict)
                         and t.get("name") == "default"), None)
    if not template and (jinja := directory.joinpath("chat_template.jinja")).is_file():
        template = jinja.read_text(encoding="utf-8")
    return template if isinstance(template, str) and template else None
