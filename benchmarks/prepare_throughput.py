"""Tokenizing a FineWeb-style corpus: our `prepare` against nanoGPT's `fineweb.py` logic.

    pip install tiktoken   # nanoGPT's tokenizer (and ours, for byte-level BPE: fast_bpe)
    python benchmarks/prepare_throughput.py --gpt2_tiktoken=PATH/gpt2.tiktoken --megabytes=1000

Both sides tokenize the same FineWeb-style Parquet files with GPT-2's BPE into uint16 shards,
each as a fresh command (start-up, reading and writing included), in rounds (`--repeats`, the
best kept) that alternate: ours at 1 and N workers (N: every core), nanoGPT's logic at its
default cpu_count // 2 processes and at N.

- Input: `--megabytes` of English-like documents synthesized offline (`synthesize_documents`:
  spans of the embedded corpus's prose, words swapped and misspelled, log-normal lengths, no two
  alike), in `--files` Parquet files with FineWeb's columns (text, id, dump, url, date,
  file_path, language, language_score, token_count) and row groups of 1,000 rows.
- Tokenizer: GPT-2's ranks from `--gpt2_tiktoken` (offline: `pip download openai-whisper
  --no-deps` ships them as whisper/assets/gpt2.tiktoken; without it tiktoken downloads "gpt2"),
  as a tiktoken Encoding for nanoGPT and, the merges recovered from the ranks, a Hugging Face
  tokenizer.json for ours; <|endoftext|> is 50256 on both. `prepare` encodes that tokenizer.json
  through tiktoken too (`transformer.data.fast_bpe`, which checks that the ids are the same).
- Ours: `python -m transformer.data.prepare --input=DIR/*.parquet --tokenizer=hf
  --tokenizer_path=... --format=bin --num_workers=n`, the tokenizer one thread a process.
- nanoGPT: build-nanogpt's fineweb.py loop, reimplemented (`nanogpt_prepare`; nothing copied):
  the rows as `datasets` yields them (dicts of every column), a fork Pool, imap(tokenize, rows,
  chunksize=16), <|endoftext|> then encode_ordinary as uint16, shards of 1e8 tokens by np.save.
- Columns: tokens/s is the tokens written (a document's ids and its <|endoftext|>) over the
  command's wall time; tokens/s per core is over its CPU time (user + sys, its processes
  together), which other jobs on the machine disturb less.
- Checks: the ids are equal document by document (both sides' shards, all documents), every
  50th document encoded by the `tokenizers` library itself is among ours' (ours encodes through
  tiktoken too), and ours at 1 and N workers wrote the same bytes.
- Training side: tokens/s of one host's rows of experiments/llama_1b7.py's batch (128 x 2048,
  `--hosts` 4 as on a v5p-32) through the input pipeline (`inputs.get_dataset`) on ours' shards,
  against what one v5p host (4 chips) consumes at 100% MFU on that model: no run of it is
  measured, so its model FLOPs a token (`metrics.flops_per_token`) at v5p's bf16 peak
  (`metrics.PEAK_FLOPS`) give the ceiling.

`tests/test_prepare_throughput.py` rehearses it on a small BPE trained there.
"""

from __future__ import annotations

import base64
import collections
import filecmp
import glob
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, ROOT)  # this checkout's transformer, as the prepare runs (cwd ROOT) use
from transformer.data import fast_bpe  # noqa: E402

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
EOT = "<|endoftext|>"  # GPT-2's one special token, the id after its ranks (50256)


def load_ranks(path: str) -> dict[bytes, int]:
    """GPT-2's BPE ranks from a tiktoken file (a base64 token and its rank a line), or, with no
    path, from tiktoken's own "gpt2" encoding (which downloads them)."""
    if not path:
        import tiktoken

        return dict(tiktoken.get_encoding("gpt2")._mergeable_ranks)
    with open(path, "rb") as f:
        pairs = (line.split() for line in f if line.strip())
        return {base64.b64decode(token): int(rank) for token, rank in pairs}


def tiktoken_encoding(ranks: dict[bytes, int]):
    """The tiktoken Encoding nanoGPT uses ("gpt2"), built from `ranks`."""
    import tiktoken

    return tiktoken.Encoding("gpt2", pat_str=fast_bpe.GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT: len(ranks)})


def _split_by_ranks(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE merges into `token`: its bytes merged by the ranks below its own."""
    limit, parts = ranks[token], [bytes([b]) for b in token]
    while len(parts) > 2:
        rank, i = min((ranks.get(a + b, limit), i)
                      for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False)))
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) is not one merge of lower ranks")
    return parts[0], parts[1]


def hf_tokenizer_json(ranks: dict[bytes, int]) -> str:
    """A Hugging Face byte-level BPE tokenizer.json equal to GPT-2's: the vocabulary of `ranks`
    in GPT-2's byte alphabet, the merges recovered from the ranks in rank order, GPT-2's
    pre-tokenizer and decoder, and <|endoftext|> as the special token after them (50256)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    symbols = fast_bpe.byte_symbols()

    def spelled(token: bytes) -> str:
        return "".join(symbols[b] for b in token)

    ordered = sorted(ranks, key=ranks.get)
    if [ranks[t] for t in ordered] != list(range(len(ordered))):
        raise ValueError(f"{len(ordered)} ranks: expected ranks 0..{len(ordered) - 1}")
    merges = [tuple(map(spelled, _split_by_ranks(t, ranks))) for t in ordered if len(t) > 1]
    model = models.BPE({spelled(t): ranks[t] for t in ordered}, merges)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([tokenizers.AddedToken(EOT, special=True)])
    if tok.token_to_id(EOT) != len(ranks):
        raise ValueError(f"{EOT} is id {tok.token_to_id(EOT)}: expected {len(ranks)}")
    return tok.to_str()


def corpus_words() -> np.ndarray:
    """The embedded corpus's prose as a word sequence: pydoc's topics and the standard library's
    comments (transformer.data.sources.embedded_corpus)."""
    from transformer.data import sources

    lines = []
    for doc in sources.embedded_corpus():
        if doc.name.startswith("pydoc:"):
            lines.append(doc.text)
        else:
            lines += [line.strip()[1:] for line in doc.text.splitlines()
                      if line.strip().startswith("#")]
    return np.array(" ".join(lines).split(), dtype=object)


def _mutated(words: np.ndarray, rng: np.random.Generator, rate: float) -> None:
    """Misspells a `rate` of `words` in place (a letter substituted, inserted or dropped): rare
    words, as web text has, for the tokenizers' word caches to miss."""
    where = np.flatnonzero(rng.random(len(words)) < rate)
    ops, letters, at = (rng.integers(0, 3, len(where)), rng.integers(97, 123, len(where)),
                        rng.random(len(where)))
    for i, op, letter, u in zip(where, ops, letters, at, strict=True):
        w = words[i]
        p = int(u * len(w))
        words[i] = (w[:p] + chr(letter) + w[p + 1:], w[:p] + chr(letter) + w[p:],
                    w[:p] + w[p + 1:] or w)[op]


def synthesize_documents(megabytes: float, seed: int, words: np.ndarray | None = None):
    """English-like documents, about `megabytes` MB of text in all, from a seeded RNG: each a
    log-normal number of words (median 400, 20..20,000) made of spans of consecutive corpus
    words (mean 12) from random places, 3% of words swapped for random corpus words and 1%
    misspelled, broken into lines and paragraphs at random. No two documents are alike."""
    rng = np.random.default_rng(seed)
    words = corpus_words() if words is None else words
    made, total = 0, megabytes * 1e6
    while made < total:
        lengths = np.clip(rng.lognormal(np.log(400), 1.0, 64).astype(np.int64), 20, 20_000)
        n = int(lengths.sum())
        spans = rng.geometric(1 / 12, size=n // 4 + 64)
        spans = spans[:np.searchsorted(np.cumsum(spans), n) + 1]
        begins = np.cumsum(spans) - spans
        starts = rng.integers(0, len(words) - spans)
        chosen = words[(np.repeat(starts - begins, spans) + np.arange(begins[-1] + spans[-1]))[:n]]
        swapped = rng.random(n) < 0.03
        chosen[swapped] = words[rng.integers(0, len(words), int(swapped.sum()))]
        _mutated(chosen, rng, 0.01)
        joined = np.empty(2 * n, dtype=object)
        joined[0::2] = chosen
        joined[1::2] = np.where(rng.random(n) < 1 / 80, "\n\n",
                                np.where(rng.random(n) < 1 / 200, "\n", " "))
        for end, length in zip(np.cumsum(lengths), lengths, strict=True):
            text = "".join(joined[2 * (end - length):2 * end - 1].tolist())
            made += len(text)
            yield text
            if made >= total:
                return


def _fineweb_columns(texts: list[str], rng: np.random.Generator, row: int) -> dict:
    """FineWeb's columns for `texts` (metadata made up from `rng`; token_count, which neither
    side reads, estimated as characters / 4)."""
    n = len(texts)
    dumps = [f"CC-MAIN-{y}-{w:02d}" for y, w in zip(rng.integers(2013, 2025, n),
                                                     rng.integers(5, 51, n), strict=True)]
    hexes = [f"{a:016x}{b:016x}" for a, b in rng.integers(0, 2**63, (n, 2))]
    ids = [f"<urn:uuid:{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}>" for h in hexes]
    return {
        "text": texts, "id": ids, "dump": dumps,
        "url": [f"https://www.example{k % 997}.org/page/{row + k}" for k in range(n)],
        "date": [f"{d[8:12]}-{m:02d}-{day:02d}T{h:02d}:14:05Z" for d, m, day, h in
                 zip(dumps, rng.integers(1, 13, n), rng.integers(1, 29, n),
                     rng.integers(0, 24, n), strict=True)],
        "file_path": [f"s3://commoncrawl/crawl-data/{d}/segments/{row + k}.warc.gz"
                      for k, d in enumerate(dumps)],
        "language": ["en"] * n, "language_score": rng.uniform(0.65, 1.0, n),
        "token_count": [len(t) // 4 for t in texts],
    }


FINEWEB_SCHEMA = (("text", "string"), ("id", "string"), ("dump", "string"), ("url", "string"),
                  ("date", "string"), ("file_path", "string"), ("language", "string"),
                  ("language_score", "float64"), ("token_count", "int64"))


def write_fineweb(directory: str, megabytes: float, num_files: int, seed: int) -> dict:
    """`synthesize_documents` as FineWeb-style Parquet: `num_files` files of about equal text
    (000_00000.parquet, ...), FineWeb's columns, row groups of 1,000 rows as datatrove's
    ParquetWriter writes them, pyarrow's default (snappy) compression. Returns the files, the
    documents and the text's UTF-8 bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    schema = pa.schema(FINEWEB_SCHEMA)
    rng = np.random.default_rng(seed + 1)
    docs = synthesize_documents(megabytes, seed)
    paths, per_file, done = [], megabytes * 1e6 / num_files, {"rows": 0, "bytes": 0}

    def write(writer, texts: list[str]) -> None:
        writer.write_table(pa.table(_fineweb_columns(texts, rng, done["rows"]), schema=schema))
        done["rows"] += len(texts)
        done["bytes"] += sum(len(t.encode("utf-8")) for t in texts)

    for i in range(num_files):  # the last file takes what is left
        paths.append(os.path.join(directory, f"{i:03d}_00000.parquet"))
        with pq.ParquetWriter(paths[-1], schema) as writer:
            size, texts = 0, []
            for text in docs:
                texts.append(text)
                size += len(text)
                if len(texts) == 1000:
                    write(writer, texts)
                    texts = []
                if size >= per_file and i < num_files - 1:
                    break
            if texts:
                write(writer, texts)
    return {"files": paths, "documents": done["rows"], "bytes": done["bytes"]}


# --- nanoGPT's side: build-nanogpt's fineweb.py, reimplemented -------------------------------

_ENCODING = None  # the tiktoken encoding, global so that the forked workers inherit it


def _nanogpt_tokenize(doc: dict) -> np.ndarray:
    """fineweb.py's `tokenize`: <|endoftext|>, then the document's encode_ordinary ids, as
    uint16."""
    tokens = [_ENCODING._special_tokens[EOT]]
    tokens.extend(_ENCODING.encode_ordinary(doc["text"]))
    tokens_np = np.array(tokens)
    assert (0 <= tokens_np).all() and (tokens_np < 2**16).all(), "too large for uint16"
    return tokens_np.astype(np.uint16)


def _fineweb_rows(paths: list[str]):
    """The rows as a `datasets` Dataset yields them: dicts of every column."""
    import pyarrow.parquet as pq

    for path in paths:
        with pq.ParquetFile(path) as f:
            for batch in f.iter_batches():
                yield from batch.to_pylist()


def nanogpt_prepare(paths: list[str], output_dir: str, ranks_path: str, nprocs: int,
                    shard_size: int = 100_000_000) -> None:
    """fineweb.py's loop on the rows of `paths`: a fork Pool of `nprocs` processes maps
    `_nanogpt_tokenize` over the documents (imap, chunksize 16) and the main process fills
    shards of `shard_size` tokens, a document cut across two where it does not fit, written
    with np.save (shard 0 "val", the rest "train")."""
    import multiprocessing

    import tqdm

    global _ENCODING
    _ENCODING = tiktoken_encoding(load_ranks(ranks_path))
    os.makedirs(output_dir, exist_ok=True)

    def write(index: int, tokens: np.ndarray) -> None:
        split = "val" if index == 0 else "train"
        np.save(os.path.join(output_dir, f"edufineweb_{split}_{index:06d}"), tokens)

    with multiprocessing.get_context("fork").Pool(nprocs) as pool:
        index, count, bar = 0, 0, None
        buffer = np.empty((shard_size,), dtype=np.uint16)
        for tokens in pool.imap(_nanogpt_tokenize, _fineweb_rows(paths), chunksize=16):
            if count + len(tokens) < shard_size:
                buffer[count:count + len(tokens)] = tokens
                count += len(tokens)
                if bar is None:
                    bar = tqdm.tqdm(total=shard_size, unit="tokens", desc=f"Shard {index}",
                                    disable=None)
                bar.update(len(tokens))
            else:
                remainder = shard_size - count
                bar.update(remainder)
                buffer[count:count + remainder] = tokens[:remainder]
                write(index, buffer)
                index, bar = index + 1, None
                buffer[0:len(tokens) - remainder] = tokens[remainder:]
                count = len(tokens) - remainder
        if count:
            write(index, buffer[:count])


# --- running and checking both sides ---------------------------------------------------------


def timed(command: list[str], log_path: str, env: dict | None = None) -> tuple[float, float]:
    """Runs `command` from the repository root, its output to `log_path`: (wall seconds, CPU
    seconds of it and its child processes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}; see {log_path}")
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def run_ours(data_dir: str, tokenizer_json: str, output_dir: str, workers: int):
    """python -m transformer.data.prepare into .bin shards; (wall s, CPU s). The tokenizer
    runs one thread a process (TOKENIZERS_PARALLELISM=false), so 1 worker is one core."""
    command = [sys.executable, "-m", "transformer.data.prepare",
               f"--input={data_dir}/*.parquet", f"--output_dir={output_dir}", "--tokenizer=hf",
               f"--tokenizer_path={tokenizer_json}", "--format=bin", f"--num_workers={workers}"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return timed(command, output_dir + ".log", env)


def run_nanogpt(paths: list[str], ranks_path: str, output_dir: str, nprocs: int,
                shard_size: int = 100_000_000):
    """`nanogpt_prepare` in a fresh Python process; (wall s, CPU s)."""
    code = (f"import sys; sys.path.insert(0, {BENCHMARKS!r}); import prepare_throughput as p; "
            f"p.nanogpt_prepare({paths!r}, {output_dir!r}, {ranks_path!r}, {nprocs}, "
            f"{shard_size})")
    return timed([sys.executable, "-c", code], output_dir + ".log")


def our_streams(output_dir: str) -> list[np.ndarray]:
    """Each split's tokens from prepare's .bin shards, as uint16."""
    from transformer.data import shards

    streams = []
    for split in ("train", "validation"):
        tokens = shards.TokenShards(os.path.join(output_dir, f"{split}_*.bin"))
        streams.append(np.concatenate([tokens.read(int(a), int(a + n)).astype(np.uint16)
                                       for a, n in zip(np.cumsum([0, *tokens.shard_lengths]),
                                                       tokens.shard_lengths, strict=False)]))
    return streams


def nanogpt_streams(output_dir: str) -> list[np.ndarray]:
    """fineweb.py's shards in shard order as one stream."""
    files = sorted(glob.glob(os.path.join(output_dir, "*.npy")), key=lambda p: p[-10:])
    return [np.concatenate([np.load(f) for f in files])]


def document_digests(streams: list[np.ndarray], eot: int, eot_first: bool
                     ) -> collections.Counter:
    """A digest of each document's ids, cut at <|endoftext|> (nanoGPT puts it before each
    document, ours after), counted."""
    counted = collections.Counter()
    for stream in streams:
        pieces = np.split(stream, np.flatnonzero(stream == eot) + (0 if eot_first else 1))
        for piece in pieces[1:] if eot_first else pieces[:-1]:
            body = piece[1:] if eot_first else piece[:-1]
            counted[hashlib.blake2b(body.tobytes(), digest_size=16).digest()] += 1
    return counted


# --- the training side ------------------------------------------------------------------------


def llama_1b7_config(prepared_dir: str, tokenizer_json: str):
    """experiments/llama_1b7.py reading `prepared_dir` with the GPT-2 tokenizer."""
    from transformer import configs

    config = configs.experiment("llama_1b7")
    config.data.update(path=prepared_dir, tokenizer="hf", tokenizer_path=tokenizer_json,
                       num_sentinels=0)
    return config


def training_read_rate(config, hosts: int, batches: int) -> tuple[int, float]:
    """(rows a host reads a step, tokens/s) of this host's share (1 of `hosts`) of the global
    batches, through the input pipeline as training builds it (inputs.get_dataset)."""
    from transformer.data import inputs

    tokenizer = inputs.get_tokenizer(config)
    it = iter(inputs.get_dataset(config, tokenizer, "train", process_index=0,
                                 process_count=hosts))
    next(it)  # the first epoch's orders
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
    seconds = time.perf_counter() - start
    rows = config.batch_size // hosts
    assert next(iter(batch.values())).shape[0] == rows, {k: v.shape for k, v in batch.items()}
    return rows, batches * rows * config.seq_len / seconds


def v5p_host_ceiling(config, chips_per_host: int = 4) -> tuple[int, float, float]:
    """(params, model FLOPs a token, tokens/s) of the config's train step on one v5p host at
    100% MFU: `chips_per_host` chips at v5p's bf16 peak (metrics.PEAK_FLOPS) over the model
    FLOPs a token (metrics.flops_per_token: 6 N + attention)."""
    import jax
    import jax.numpy as jnp

    from transformer.models import build_model
    from transformer.training import metrics

    model = build_model(config.model)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(shapes["params"]))
    per_token = metrics.flops_per_token(config, params)
    peak = dict((kind, bf16) for kind, bf16, _ in metrics.PEAK_FLOPS)["TPU v5"]
    return params, per_token, chips_per_host * peak / per_token


def cpu_name() -> str:
    """/proc/cpuinfo's model name, with AVX-512 yes/no, and the cores this process may use."""
    model, flags_line = platform.processor() or "unknown CPU", ""
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next(iter(re.findall(r"^model name\s*:\s*(.+)$", info, re.M)), model)
        flags_line = next(iter(re.findall(r"^flags\s*:\s*(.+)$", info, re.M)), "")
    avx512 = "yes" if "avx512f" in flags_line.split() else "no"
    return f"{model}, AVX-512 {avx512}, {CORES} cores"


# --- the benchmark ----------------------------------------------------------------------------


def corpus(directory: str, megabytes: float, num_files: int, seed: int) -> dict:
    """`write_fineweb`'s corpus in `directory`, written unless it is there already."""
    wanted = {"megabytes": megabytes, "num_files": num_files, "seed": seed}
    record = os.path.join(directory, "corpus.json")
    if os.path.isfile(record):
        with open(record) as f:
            made = json.load(f)
        if {k: made.get(k) for k in wanted} == wanted:
            return made
    shutil.rmtree(directory, ignore_errors=True)
    start = time.perf_counter()
    made = {**wanted, **write_fineweb(directory, **wanted)}
    print(f"wrote {made['bytes'] / 1e6:,.1f} MB of text, {made['documents']:,} documents, in "
          f"{len(made['files'])} Parquet files in {time.perf_counter() - start:.0f} s")
    with open(record, "w") as f:
        json.dump(made, f)
    return made


def measure(made: dict, ranks_path: str, tokenizer_json: str, out: str, workers: int,
            repeats: int) -> dict:
    """(side, processes) -> the best (wall s, CPU s) of `repeats` rounds; each round runs ours
    at 1 and `workers` workers and nanoGPT's logic at its default and `workers` processes, in
    turns."""
    data_dir = os.path.dirname(made["files"][0])
    runs = list(dict.fromkeys([("ours", 1), ("nanoGPT", max(1, CORES // 2)),
                               ("ours", workers), ("nanoGPT", workers)]))
    best = {}
    os.makedirs(out, exist_ok=True)
    for round_ in range(repeats):
        for side, n in runs:
            output_dir = os.path.join(out, f"{side}_{n}")
            shutil.rmtree(output_dir, ignore_errors=True)
            if side == "ours":
                wall, cpu = run_ours(data_dir, tokenizer_json, output_dir, n)
            else:
                wall, cpu = run_nanogpt(made["files"], ranks_path, output_dir, n)
            print(f"round {round_ + 1}: {side}, {_processes(n)}: {wall:.1f} s, CPU {cpu:.1f} s",
                  flush=True)
            if (side, n) not in best or wall < best[side, n][0]:
                best[side, n] = (wall, cpu)
    return best


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def table(best: dict, tokens: dict) -> str:
    """The markdown table: tokens/s and tokens/s per core (tokens per CPU-second) of each run,
    ours against nanoGPT's logic at the same number of processes."""
    default = max(1, CORES // 2)
    lines = ["| run | processes | wall s | tokens/s | tokens/s per core | ours / nanoGPT |",
             "|---|---:|---:|---:|---:|---:|"]
    for (side, n), (wall, cpu) in best.items():
        name = (f"ours: prepare --num_workers={n}" if side == "ours" else
                f"nanoGPT fineweb.py logic, {_processes(n)}" +
                (" (its default, cpu_count // 2)" if n == default else ""))
        rate = tokens[side] / wall
        ratio = ""
        if side == "ours" and ("nanoGPT", n) in best:
            ratio = f"{rate / (tokens['nanoGPT'] / best['nanoGPT', n][0]):.2f}x"
        lines.append(f"| {name} | {n} | {wall:,.1f} | {rate:,.0f} | {tokens[side] / cpu:,.0f} "
                     f"| {ratio} |")
    return "\n".join(lines)


def check_outputs(out: str, workers: int, eot: int, tokenizer_json: str,
                  sample: list[str]) -> tuple[dict, str]:
    """Tokens a side wrote, and a line saying whether the ids are equal document by document
    (nanoGPT's N-process shards against ours at N workers), whether `sample` documents encoded
    by the `tokenizers` library itself are among ours (prepare encodes GPT-2's BPE through
    tiktoken, `transformer.data.fast_bpe`), and whether ours at 1 and N workers wrote the same
    bytes."""
    import tokenizers

    ours = our_streams(os.path.join(out, f"ours_{workers}"))
    nano = nanogpt_streams(os.path.join(out, f"nanoGPT_{workers}"))
    tokens = {"ours": sum(map(len, ours)), "nanoGPT": sum(map(len, nano))}
    theirs, mine = document_digests(nano, eot, True), document_digests(ours, eot, False)
    differ, documents = sum((theirs - mine).values()), sum(theirs.values())
    same = "yes" if differ == 0 and theirs == mine else f"NO: {differ} documents differ"
    library = tokenizers.Tokenizer.from_file(tokenizer_json)
    missing = sum(hashlib.blake2b(np.asarray(e.ids, np.uint16).tobytes(), digest_size=16)
                  .digest() not in mine
                  for e in library.encode_batch(sample, add_special_tokens=False))
    one, many = (os.path.join(out, f"ours_{n}") for n in (1, workers))
    names = sorted(n for n in os.listdir(many) if n.endswith(".bin"))
    identical = sorted(n for n in os.listdir(one) if n.endswith(".bin")) == names and all(
        filecmp.cmp(os.path.join(one, n), os.path.join(many, n), shallow=False) for n in names)
    return tokens, (f"ids of nanoGPT (tiktoken) and ours equal on all {documents:,} documents: "
                    f"{same}; {len(sample):,} of them encoded by the tokenizers library found "
                    f"among ours: {'yes' if not missing else f'NO: {missing} missing'}; ours at "
                    f"1 and {workers} workers wrote the same bytes: "
                    f"{'yes' if identical else 'NO'}")


def sample_documents(files: list[str], every: int) -> list[str]:
    """Every `every`-th row's text of the Parquet `files` (blank ones left out)."""
    import pyarrow.parquet as pq

    texts = []
    for file in files:
        texts += pq.read_table(file, columns=["text"]).column("text").to_pylist()[::every]
    return [t for t in texts if t.strip()]


def _define_flags() -> None:
    """Flags are defined only when run as a command (the tests import this module)."""
    flags.DEFINE_float("megabytes", 20, "Megabytes of text to write as Parquet (the table in "
                       "docs/performance.md: 300).")
    flags.DEFINE_integer("files", 8, "Parquet files the text is written to.")
    flags.DEFINE_integer("seed", 0, "Seed of the synthesized documents.")
    flags.DEFINE_string("gpt2_tiktoken", "", "GPT-2's BPE ranks as a tiktoken file (e.g. "
                        "whisper/assets/gpt2.tiktoken); default: tiktoken downloads \"gpt2\".")
    flags.DEFINE_integer("workers", None, "N, the processes of the all-core runs (default: "
                         "every core).", lower_bound=1)
    flags.DEFINE_integer("repeats", 1, "Rounds of the four runs (the best is shown).",
                         lower_bound=1)
    flags.DEFINE_string("workdir", "", "Where the corpus and the outputs go (kept, and its "
                        "corpus reused when the flags match); default: a temporary directory, "
                        "removed at the end unless --keep.")
    flags.DEFINE_bool("keep", False, "Keep the temporary directory.")
    flags.DEFINE_integer("hosts", 4, "Hosts the 1.7B experiment's batch is shared by (v5p-32: "
                         "4), for the training read.", lower_bound=1)
    flags.DEFINE_integer("read_batches", 50, "Batches the training read times.", lower_bound=1)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}: expected only flags")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host-side work only: libtpu need not probe
    import tiktoken
    import tokenizers

    print(f"CPU: {cpu_name()}; python {platform.python_version()}, tiktoken "
          f"{tiktoken.__version__}, tokenizers {tokenizers.__version__}")
    f = flags.FLAGS
    workdir = f.workdir or tempfile.mkdtemp(prefix="prepare_throughput_")
    made = corpus(os.path.join(workdir, "fineweb"), f.megabytes, f.files, f.seed)
    ranks = load_ranks(f.gpt2_tiktoken)
    tokenizer_json = os.path.join(workdir, "gpt2_tokenizer.json")
    with open(tokenizer_json, "w", encoding="utf-8") as file:
        file.write(hf_tokenizer_json(ranks))
    out, workers = os.path.join(workdir, "runs"), f.workers or CORES
    best = measure(made, f.gpt2_tiktoken, tokenizer_json, out, workers, f.repeats)
    tokens, checked = check_outputs(out, workers, len(ranks), tokenizer_json,
                                    sample_documents(made["files"], every=50))
    print(f"\n{made['bytes'] / 1e6:,.1f} MB of text, {made['documents']:,} documents in "
          f"{len(made['files'])} Parquet files (row groups of 1,000 rows); "
          f"{tokens['ours']:,} tokens, {made['bytes'] / tokens['ours']:.2f} bytes a token\n"
          f"{checked}\n\n{table(best, tokens)}\n")
    default = max(1, CORES // 2)
    ratio = (tokens["ours"] / best["ours", workers][0]) / (
        tokens["nanoGPT"] / best["nanoGPT", default][0])
    print(f"each side as it runs by default (ours {workers} workers, nanoGPT cpu_count // 2 = "
          f"{_processes(default)}): ours / nanoGPT {ratio:.2f}x")
    config = llama_1b7_config(os.path.join(out, f"ours_{workers}"), tokenizer_json)
    rows, rate = training_read_rate(config, f.hosts, f.read_batches)
    params, per_token, ceiling = v5p_host_ceiling(config)
    print(f"training read (experiments/llama_1b7.py, one host's {rows} x {config.seq_len} rows "
          f"of the global {config.batch_size}, {f.hosts} hosts): {rate:,.0f} tokens/s\n"
          f"one v5p host (4 chips) at 100% MFU on it ({params:,} params, {per_token:.3e} FLOPs "
          f"a token): {ceiling:,.0f} tokens/s; the read is {rate / ceiling:,.0f}x that")
    if not f.keep and not f.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
