"""Text generation from a training workdir: sampling (greedy, temperature, top-k, top-p), beam
search and chat replies.

    python -m transformer.generate --workdir=DIR --prompt="..." [--max_new_tokens=N]
        [--temperature=T] [--top_k=K] [--top_p=P] [--seed=S] [--num_samples=N] [--beam_size=K]
        [--speculative]

loads the latest checkpoint of a training workdir (or a Hugging Face checkpoint directory,
`--workdir=hf:DIR`) and its tokenizer and prints continuations
(streamed as they are produced when stdout is a terminal). `--speculative` decodes with the
model's multi-token prediction modules as the draft: greedy (unless --temperature is given),
the same text; sampling, text drawn from the same distribution (speculative sampling). Stderr
says how many tokens each pass of the model gave.

The decoding library is transformer.generation; its calls are re-exported here
(`generate.decode`, ...):
  * `sampling`: logits -> tokens (`sample_tokens` / `kept_tokens`: temperature, top-k, top-p).
  * `loop` / `beam`: `generate_tokens` / `beam_search_tokens`, the loops over any
    `step_fn(params, context, cache, tokens_B1, positions_B1) -> (logits_BV, cache)`, pure and
    jittable. The prompt is prefilled in one pass, then a jitted `lax.while_loop` emits one token
    per step (no Python per token), stopping at `max_new_tokens` or when every row has emitted
    `eos_id`. Prompts of different lengths share a batch: each row writes and reads its own
    cache positions (a capacity-routed MoE's decode in one batch per length, unpadded).
  * `programs`: `decode` / `beam_search`, those loops over a `DecoderLM` (gpt, prefix_lm) or
    `EncoderDecoder` (t5), each compiled once per shape and setting.
  * `speculative`: `speculative_decode`, decoding drafted by the model's multi-token
    prediction modules (model.mtp.depth > 0): greedy, equal to greedy `decode` token for token;
    sampling, drawing from the distribution `decode` samples.
  * `text`: `sample_texts` / `beam_search_text` / `chat_replies`: text in, texts out
    (`sample_texts` for a model of any family, the LSTM by full recomputation; beam search
    needs a KV cache, so not the LSTM). They never emit ids without text (`banned_ids`:
    specials other than <eos>, sentinels, ids past the tokenizer), and warn on prompt
    characters the tokenizer lacks.
"""

from __future__ import annotations

import math
import sys

from transformer.data import tokenizers as tokenizers_lib

# The library calls, as `generate.NAME` (defined in transformer.generation).
from transformer.generation.beam import beam_search_tokens, length_penalty_factor  # noqa: F401
from transformer.generation.loop import DecodeState, generate_tokens  # noqa: F401
from transformer.generation.programs import beam_search, decode  # noqa: F401
from transformer.generation.sampling import (  # noqa: F401
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Sampling,
    kept_tokens,
    sample_tokens,
    sampling,
)
from transformer.generation.speculative import speculative_decode  # noqa: F401
from transformer.generation.text import (  # noqa: F401
    _decoding,
    banned_ids,
    beam_search_text,
    chat_replies,
    check_head,
    check_max_new_tokens,
    print_samples,
    read_chat,
    sample_texts,
    speculative_text,
)

# --- command line -------------------------------------------------------------------------------


def load_workdir(workdir: str, step: int | None = None, say_step: bool = False):
    """(model, params, tokenizer, config) of checkpoint `step` (default: the latest) of a
    training workdir (on a mesh this machine's devices hold: `placement.local_mesh`), with the
    tokenizer saved beside the checkpoints; the config's data.unit is "stream" where the
    checkpoint records that training read its documents as one stream. `hf:DIR`: a Hugging
    Face save_pretrained directory and its tokenizer.json, as `transformer.load("hf:DIR")`.
    `say_step`: print `step N of WORKDIR`, the step read, on stderr (the command's note: a
    training beside it may have deleted the latest meanwhile, and stdout is the text)."""
    if workdir.startswith("hf:"):
        if step is not None:
            raise ValueError(f"step={step} with {workdir!r}: a Hugging Face checkpoint has no "
                             "steps; expected no step")
        return load_hf(workdir[len("hf:"):], source=f"workdir={workdir!r}")
    from transformer.data import inputs
    from transformer.models import build_model
    from transformer.training import checkpoint as checkpoint_lib
    from transformer.training import finetune
    from transformer.utils import fileio

    # (a run trained on more devices than this machine has reads onto data parallel here)
    saved = finetune.restore_params(workdir, step)
    if say_step:
        print(f"step {saved.step} of {workdir}", file=sys.stderr, flush=True)
    tokenizer = tokenizers_lib.load_tokenizer(fileio.join(workdir, inputs.TOKENIZER_DIR))
    stream = checkpoint_lib.saved_stream(workdir, saved.step, or_newer=True)
    if (stream or {}).get(inputs.DOCUMENTS) == "stream":  # token shards, .bin: read as a stream
        # whatever data.path is from here (another directory, moved, deleted), so that texts
        # are read as its documents were (`text.document_prefix`)
        saved.config.data.unit = "stream"
    return build_model(saved.config.model), saved.params, tokenizer, saved.config


def load_hf(directory: str, source: str | None = None):
    """(model, params, tokenizer, config) of a Hugging Face directory, imported as `init_from=hf:`
    does (`transformer.load("hf:DIR")` wraps it); `source`: what its errors name, as the user
    gave it (`finetune.hf_convert`)."""
    from flax import traverse_util

    from transformer import configs
    from transformer.data.hf_tokenizer import load_hf_tokenizer
    from transformer.models import build_model
    from transformer.training import finetune

    _, model_config, flat = finetune.hf_convert(directory, source=source)
    params = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})
    config = configs.base_config()
    config.model = model_config
    config.init_from = f"hf:{directory}"  # a prompt reads as its documents: document_prefix
    # no training context: generation's is model.max_len, the checkpoint's
    # max_position_embeddings, seq_len (128) bounding the default length (`text.imported`)
    config.imported = True
    tokenizer = load_hf_tokenizer(directory, num_sentinels=None)  # its own sentinels, if any
    return build_model(model_config), params, tokenizer, config


class _Streamer:
    """Prints the growing text of one sample, holding back a trailing partial UTF-8 character."""

    def __init__(self, out=None):
        self.out, self.printed = sys.stdout if out is None else out, ""

    def __call__(self, texts: list[str], final: bool = False) -> None:
        """Prints what is new in texts[0]; `final`: the finished text, whose trailing U+FFFD
        are its own (nothing more will complete them), printed as piped output has them."""
        text = texts[0] if final else texts[0].rstrip("\ufffd")
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


# Sampling's flags, which beam search (the most likely continuation) has no use for.
_SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "seed")


def _checked_flags(f) -> Sampling:
    """The sampling the flags ask for, once every flag is checked: a bad one is refused in one
    line before any loading, whether or not this run reads it (--chunk_size when not on a
    terminal, --length_penalty without --beam_size)."""
    s = sampling(f.temperature, f.top_k, f.top_p)
    check_max_new_tokens(f.max_new_tokens)
    if f.num_samples < 1:
        raise ValueError(f"num_samples={f.num_samples}: expected >= 1")
    if f.beam_size < 0:
        raise ValueError(f"beam_size={f.beam_size}: expected an int >= 0 (0: sampling, no beam "
                         "search)")
    if f.beam_size and (f.chat is not None or f.num_samples != 1):
        raise ValueError(f"--beam_size={f.beam_size}: expected the one best continuation of "
                         "--prompt (no --chat or --num_samples)")
    changed = [f"--{name}={f[name].value}" for name in _SAMPLING_FLAGS
               if f[name].value != f[name].default]
    if f.beam_size and changed:
        raise ValueError(f"--beam_size={f.beam_size} with {' '.join(changed)}: beam search "
                         "does not sample; expected no sampling flags (or --beam_size=0)")
    if f.speculative and (f.beam_size or f.chat is not None or f.num_samples != 1):
        raise ValueError("--speculative: expected one continuation of --prompt (no --beam_size, "
                         "--chat or --num_samples)")
    if f.speculative and not f["temperature"].present and changed:  # (greedy without it)
        raise ValueError(f"--speculative with {' '.join(changed)} but no --temperature: it "
                         "decodes greedily unless --temperature is given; expected "
                         "--temperature to sample (or no sampling flags)")
    if f.chunk_size < 1:
        raise ValueError(f"chunk_size={f.chunk_size}: expected an int >= 1 (tokens a streamed "
                         "chunk)")
    if not (math.isfinite(f.length_penalty) and f.length_penalty >= 0):
        raise ValueError(f"length_penalty={f.length_penalty}: expected a finite float >= 0")
    return s


def main(argv, flag_values=None) -> None:
    """The command, on absl's FLAGS (or `flag_values`, defined by `_define_flags`)."""
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS if flag_values is None else flag_values
    s = _checked_flags(f)  # bad flags fail before any loading
    model, params, tokenizer, config = load_workdir(f.workdir, f.step, True)
    check_head(config, f"--workdir={f.workdir!r}")
    if f.chat is not None:
        conversations = read_chat(f.chat)
        if f.prompt:  # one more user turn
            conversations = [c + [{"role": "user", "content": f.prompt}] for c in conversations]
        for i, conversation in enumerate(conversations):
            for j, reply in enumerate(chat_replies(
                    model, params, tokenizer, config, conversation, num_samples=f.num_samples,
                    temperature=s.temperature, seed=f.seed, top_k=s.top_k, top_p=s.top_p,
                    max_new_tokens=f.max_new_tokens)):
                print(("---\n" if i or j else "") + reply)
        return
    if f.speculative:
        text, stats = speculative_text(model, params, tokenizer, config, prompt=f.prompt,
                                       max_new_tokens=f.max_new_tokens,
                                       # greedy unless --temperature is given
                                       temperature=s.temperature if f["temperature"].present
                                       else 0.0, top_k=s.top_k, top_p=s.top_p, seed=f.seed)
        print(text)
        if stats is not None:
            print(f"speculative: {stats.tokens} new tokens from {1 + stats.rounds.sum()} "
                  f"passes of the model (the prompt's, then {stats.rounds.sum()} checking "
                  f"{stats.depth}-token drafts: {stats.tokens_per_pass:.2f} tokens a checking "
                  f"pass); {stats.acceptance_rate:.1%} of the drafts accepted", file=sys.stderr)
        return
    if f.beam_size:
        print(beam_search_text(model, params, tokenizer, config, prompt=f.prompt,
                               beam_size=f.beam_size, max_new_tokens=f.max_new_tokens,
                               length_penalty=f.length_penalty))
        return
    stream = sys.stdout.isatty() and f.num_samples == 1 and _decoding(config) != "recompute"
    streamer = _Streamer() if stream else None
    texts = sample_texts(model, params, tokenizer, config, num_samples=f.num_samples,
                         prompt=f.prompt, temperature=s.temperature, seed=f.seed, top_k=s.top_k,
                         top_p=s.top_p, max_new_tokens=f.max_new_tokens,
                         chunk_size=f.chunk_size if stream else None, callback=streamer)
    if stream:
        streamer([texts[0]], final=True)
        print()
        return
    for i, text in enumerate(texts):
        if i:
            print("---")
        print(text)


def _define_flags(flag_values=None) -> None:
    """The command's flags, in absl's FLAGS (or `flag_values`)."""
    from absl import flags

    into = {"flag_values": flags.FLAGS if flag_values is None else flag_values}
    flags.DEFINE_string("workdir", None, "Training workdir to sample from, or hf:DIR (a Hugging "
                        "Face checkpoint directory).", required=True, **into)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", **into)
    flags.DEFINE_string("prompt", "", "Text to continue (t5: the encoder input).", **into)
    flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate (default: fill the "
                         "training context seq_len; hf:DIR: up to seq_len=128 within its "
                         "max_position_embeddings; 0: print the prompt alone).", **into)
    flags.DEFINE_float("temperature", 0.8, "0: greedy.", **into)
    flags.DEFINE_integer("top_k", 0, "Sample among the k best tokens (0: all).", **into)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set reaching p (1: all).",
                       **into)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", **into)
    flags.DEFINE_integer("num_samples", 1, "Continuations to generate (as one batch).", **into)
    flags.DEFINE_integer("beam_size", 0, "Beam search with this many beams (0: sample; not "
                         "with the sampling flags, nor an LSTM).", **into)
    flags.DEFINE_float("length_penalty", 0.6, "Beam search: GNMT length penalty alpha.", **into)
    flags.DEFINE_string("chat", None, "Answer as the assistant: a JSON/JSONL file of "
                        "conversations ({\"messages\": [...]} per line) or inline JSON, rendered "
                        "with the tokenizer's chat template (--prompt: one more user turn).",
                        **into)
    flags.DEFINE_bool("speculative", False, "Decoding drafted by the model's multi-token "
                      "prediction modules (model.mtp.depth > 0), in fewer passes: greedy unless "
                      "--temperature is given (the same text), else sampling (the same "
                      "distribution).", **into)
    flags.DEFINE_integer("chunk_size", 8, "Streaming: tokens per jitted chunk on a terminal.",
                         **into)


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(main, _define_flags)
