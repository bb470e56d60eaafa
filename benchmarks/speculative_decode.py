"""Speculative decoding with a model's own multi-token prediction modules, against plain
decoding of the same model: tokens/s, the drafts' acceptance rate, and tokens per pass of the
model, on trained workdirs (e.g. the runs of experiments/ablations/mtp.py).

    python benchmarks/speculative_decode.py --workdirs=DIR[,DIR...] [--new_tokens=256]
        [--prompts=4] [--repeats=3] [--temperature=0]

Each prompt is the end-of-text id then 16 tokens of a fixed passage of Shakespeare (the opening
of Coriolanus, `_PROMPT_TEXT`, in the run's own tokenizer), row i from its token 7 i, whatever
data the run trained on (not its validation data); both decoders run greedily (or both sample at
`--temperature`: speculative sampling), after a warm-up call each (compiles excluded), taking
turns for `repeats` runs (plain, speculative, plain, ...), and the best run of each is shown.
Greedy, the tokens of the two must be equal (a row says so); a speed-up needs the drafts to be
accepted often enough to pay for running the modules.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from transformer import generate
from transformer.generation.speculative import speculative_decode
from transformer.generation.text import document_prefix

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Training workdirs of models with "
                              "model.mtp.depth > 0.", required=True)
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 256, "Tokens generated per row.")
_PROMPTS = flags.DEFINE_integer("prompts", 4, "Rows (prompts), decoded as one batch.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per decoder (the best is shown).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: both decoders sample.")
_PROMPT_TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n"
                "All:\nSpeak, speak.\nFirst Citizen:\nYou are all resolved rather to die than "
                "to famish?\n")


def best_times(fns, repeats: int) -> list[tuple[float, object]]:
    """[(best seconds, last output)] per function: each called once to compile, then all take
    turns `repeats` times over, so load from elsewhere hits every side alike."""
    outs = [fn() for fn in fns]  # compile
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return list(zip(best, outs, strict=True))


def measure(workdir: str, new_tokens: int, rows: int, repeats: int,
            temperature: float = 0.0) -> dict:
    model, params, tokenizer, config = generate.load_workdir(workdir)
    text = tokenizer.encode(_PROMPT_TEXT)
    start = document_prefix(config, tokenizer)  # as generation reads a prompt
    prompts = [[*start, *text[i * 7:i * 7 + 16]] for i in range(rows)]
    (plain_s, (want, _)), (fast_s, (got, _, stats)) = best_times([
        lambda: generate.decode(model, params, prompts, max_new_tokens=new_tokens,
                                temperature=temperature, eos_id=None),
        lambda: speculative_decode(model, params, prompts, max_new_tokens=new_tokens,
                                   eos_id=None, temperature=temperature)], repeats)
    tokens = rows * new_tokens
    return dict(depth=config.model.mtp.depth, plain=tokens / plain_s, fast=tokens / fast_s,
                rate=stats.acceptance_rate, per_pass=stats.tokens_per_pass,
                equal=bool(np.array_equal(want, got)) if not temperature else None)


def main(argv):
    del argv
    plain = f"sampled (T {_TEMPERATURE.value:g})" if _TEMPERATURE.value else "greedy"
    print(f"| workdir | MTP depth | {plain} tok/s | speculative tok/s | speed-up | acceptance | "
          "tokens a pass | same tokens |\n|---|---|---|---|---|---|---|---|")
    for workdir in _WORKDIRS.value:
        r = measure(workdir, _NEW_TOKENS.value, _PROMPTS.value, _REPEATS.value,
                    _TEMPERATURE.value)
        same = "-" if r["equal"] is None else "yes" if r["equal"] else "NO"
        print(f"| {workdir} | {r['depth']} | {r['plain']:,.0f} | {r['fast']:,.0f} | "
              f"{r['fast'] / r['plain']:.2f}x | {r['rate']:.1%} | {r['per_pass']:.2f} | "
              f"{same} |")


if __name__ == "__main__":
    app.run(main)
