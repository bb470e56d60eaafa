"""Raw read speed of memory-mapped token shards (transformer/data/shards.py), on one core.

    python benchmarks/token_shards.py [--tokens=100_000_000] [--shards=10] [--batches=1000]

Writes a modded-nanogpt shard set of --tokens random ids to --dir (reused if it is already
there, removed at the end unless --keep), then prints tokens/s for batches of 64 windows of
1025 tokens (seq_len 1024 + 1 for the shifted targets) read with `TokenShards.read`: at random
starts, and at consecutive starts. The file was just written, so it sits in the page cache:
this is the decode-and-copy cost, not the disk's. The whole pipeline's target is >= 1M packed
tokens/s.
"""

import os
import shutil
import time

import numpy as np
from absl import app, flags

from transformer.data import shards

_TOKENS = flags.DEFINE_integer("tokens", 100_000_000, "Tokens in the shard set.")
_SHARDS = flags.DEFINE_integer("shards", 10, "Shards the tokens are cut into.")
_BATCHES = flags.DEFINE_integer("batches", 1000, "Batches to time per row.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Windows per batch.")
_WINDOW = flags.DEFINE_integer("window", 1025, "Tokens per window.")
_DIR = flags.DEFINE_string("dir", "/tmp/token_shards_benchmark", "Where the shards go.")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the shards for the next run.")


def shard_set(directory: str, tokens: int, num_shards: int) -> shards.TokenShards:
    """The shard set in `directory`, written unless one of `tokens` tokens is there already."""
    pattern = os.path.join(directory, "train_*.bin")
    try:
        existing = shards.TokenShards(pattern)
        if len(existing) == tokens:
            return existing
    except (FileNotFoundError, ValueError):
        pass
    shutil.rmtree(directory, ignore_errors=True)
    rng = np.random.default_rng(0)
    chunk = 10_000_000

    def chunks():
        for start in range(0, tokens, chunk):
            yield rng.integers(0, 50257, size=min(chunk, tokens - start), dtype=np.uint16)

    start = time.perf_counter()
    shards.write_token_shards(os.path.join(directory, "train"), chunks(),
                              tokens_per_shard=-(-tokens // num_shards))
    print(f"wrote {tokens:,} tokens in {num_shards} shards to {directory} "
          f"in {time.perf_counter() - start:.1f} s")
    return shards.TokenShards(pattern)


def tokens_per_second(data: shards.TokenShards, starts: np.ndarray, window: int) -> float:
    """Reads each row of `starts` (B,) as one (B, window) batch; returns tokens/s."""
    for row in starts[:3]:  # open the maps, warm the code paths
        np.stack([data.read(s, s + window) for s in row])
    begin = time.perf_counter()
    for row in starts:
        batch = np.stack([data.read(s, s + window) for s in row])  # (B, window) int32
    elapsed = time.perf_counter() - begin
    assert batch.shape == (len(starts[0]), window)
    return starts.size * window / elapsed


def main(argv):
    del argv
    if hasattr(os, "sched_setaffinity"):  # one core, as one Grain worker would have
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    data = shard_set(_DIR.value, _TOKENS.value, _SHARDS.value)
    batches, batch_size, window = _BATCHES.value, _BATCH_SIZE.value, _WINDOW.value
    rng = np.random.default_rng(1)
    rows = {
        "random windows": rng.integers(0, len(data) - window + 1, size=(batches, batch_size)),
        "consecutive windows": (np.arange(batches * batch_size) * window % (len(data) - window)
                                ).reshape(batches, batch_size),
    }
    print(f"\n{data}, batches of {batch_size} x {window} tokens, {batches} batches, one core\n")
    print(f"| {'read':<20} | {'tokens/s':>12} | {'batches/s':>9} |")
    print(f"|{'-' * 22}|{'-' * 14}|{'-' * 11}|")
    for name, starts in rows.items():
        rate = tokens_per_second(data, starts, window)
        print(f"| {name:<20} | {rate:>12,.0f} | {rate / (batch_size * window):>9,.1f} |")
    if not _KEEP.value:
        shutil.rmtree(_DIR.value, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
