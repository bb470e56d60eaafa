"""Pre-tokenized uint16 token shards, read through memory maps as one concatenated sequence.

Two on-disk formats, told apart per file by its first 4 bytes:
  * nanoGPT ("nanogpt"): raw little-endian uint16 token ids, no header (train.bin, val.bin).
  * modded-nanogpt ("modded"): 256 little-endian int32 (magic 20240520, version 1, token count,
    then zeros), followed by that many little-endian uint16 token ids.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import os
from collections.abc import Callable, Iterable, Sequence
from typing import SupportsIndex

import numpy as np

from transformer.data import sources
from transformer.utils import fileio

FORMATS = ("modded", "nanogpt")
MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024
_TOKEN = np.dtype("<u2")  # both formats store little-endian uint16 ids
_MAX_OPEN = 128  # memory maps kept open at once (each holds a file descriptor)


def shard_format(path: str) -> tuple[str, int, int]:
    """(format, byte offset of the first token, number of tokens) of one shard file, from its
    size and header; a file whose size does not match its format raises a one-line ValueError.

    >>> import tempfile
    >>> path = write_token_shards(tempfile.mkdtemp() + "/x", [np.arange(5)])[0]
    >>> shard_format(path)
    ('modded', 1024, 5)
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(12)
    # A nanoGPT file whose first two tokens are 55432, 308 would read as the magic; the version
    # and size checks then reject it rather than misread it (GPT-2's ids stop at 50256).
    if len(head) >= 4 and int(np.frombuffer(head[:4], "<i4")[0]) == MAGIC:
        raw = (" (or a raw nanoGPT token file opening with ids 55432, 308, which read as the "
               "header's magic number: no such file can be read)")
        if len(head) < 12:
            raise ValueError(f"{path}: modded-nanogpt shard of {size} bytes: expected at least "
                             f"a {HEADER_BYTES}-byte header{raw}")
        _, version, count = (int(v) for v in np.frombuffer(head, "<i4"))
        if version != VERSION:
            raise ValueError(f"{path}: modded-nanogpt shard version {version}: expected "
                             f"{VERSION}{raw}")
        expected = HEADER_BYTES + _TOKEN.itemsize * count
        if count < 0 or size != expected:
            raise ValueError(f"{path}: modded-nanogpt shard of {count} tokens is {size} bytes: "
                             f"expected {expected} ({HEADER_BYTES}-byte header + 2 per "
                             f"token){raw}")
        return "modded", HEADER_BYTES, count
    if size % _TOKEN.itemsize:
        raise ValueError(f"{path}: raw uint16 token file of {size} bytes: expected an even size")
    return "nanogpt", 0, size // _TOKEN.itemsize


def _shard_files(path: str) -> list[str]:
    """`sources._files(path)`, keeping only *.bin files when `path` is a directory (a prepared
    directory also holds the tokenizer and prepare.json); other non-.bin files are an error."""
    path = os.fspath(path)
    files = sources._files(path)
    if os.path.isdir(path):
        files = [f for f in files if f.endswith(".bin")]
        if not files:
            raise FileNotFoundError(f"{path}: no *.bin files under this directory")
    elif others := [f for f in files if not f.endswith(".bin")]:
        raise ValueError(f"{others[0]}: not a .bin file: expected token shards named *.bin")
    return files


class TokenShards:
    """Token shards (nanoGPT or modded-nanogpt, detected per file) as one sequence: the tokens
    of the first file, then the next file's, ... `path` is a file, a directory (its *.bin files)
    or a glob, or a list of them; each expands to its files in sorted order.

    Reads map only the shards they touch and copy only the requested range. A pickle holds the
    paths and lengths; memory maps are opened again on first use (e.g. in a Grain worker).

    >>> import tempfile
    >>> prefix = tempfile.mkdtemp() + "/train"
    >>> _ = write_token_shards(prefix, [np.arange(7)], tokens_per_shard=3)
    >>> shards = TokenShards(prefix + "_*.bin")
    >>> len(shards), shards.shard_lengths
    (7, [3, 3, 1])
    >>> shards.read(2, 5)  # across the first boundary
    array([2, 3, 4], dtype=int32)
    >>> shards[-2:].tolist()
    [5, 6]
    """

    def __init__(self, path: str | os.PathLike | Sequence[str | os.PathLike]):
        patterns = [path] if isinstance(path, str | os.PathLike) else list(path)
        self.paths = [f for pattern in patterns for f in _shard_files(pattern)]
        if not self.paths:
            raise FileNotFoundError("no token shards given: expected a file, directory or glob")
        layouts = [shard_format(p) for p in self.paths]
        self.formats = [fmt for fmt, _, _ in layouts]
        self._offsets = [offset for _, offset, _ in layouts]  # bytes before the first token
        self.shard_lengths = [count for _, _, count in layouts]
        # starts[i] = index of shard i's first token in the whole sequence; starts[-1] = total
        self._starts = [0, *itertools.accumulate(self.shard_lengths)]
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    def _map(self, i: int) -> np.memmap:
        if (memmap := self._maps.get(i)) is None:
            if len(self._maps) >= _MAX_OPEN:  # drop the longest-open map: fds are finite
                self._maps.pop(next(iter(self._maps)))
            memmap = self._maps[i] = np.memmap(self.paths[i], dtype=_TOKEN, mode="r",
                                               offset=self._offsets[i],
                                               shape=(self.shard_lengths[i],))
        return memmap

    def read(self, start: SupportsIndex, stop: SupportsIndex) -> np.ndarray:
        """Tokens [start, stop) of the concatenated sequence as a new int32 array; needs
        0 <= start <= stop <= len(self)."""
        start, stop = operator.index(start), operator.index(stop)
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) of {len(self)}: expected "
                             f"0 <= start <= stop <= {len(self)}")
        out = np.empty(stop - start, np.int32)
        # The shard holding token `start`, then each following one until `stop`; empty shards
        # are skipped by bisect_right (their start equals the next shard's).
        i = bisect.bisect_right(self._starts, start) - 1
        position = start
        while position < stop:
            begin, end = self._starts[i], self._starts[i + 1]
            if end > position:
                take = min(stop, end) - position
                # One copy, from the page cache straight into int32.
                out[position - start:position - start + take] = self._map(i)[
                    position - begin:position - begin + take]
                position += take
            i += 1
        return out

    def __getitem__(self, index: SupportsIndex | slice) -> np.ndarray | int:
        """A slice with step 1 (Python's clamping and negative indices) -> `read`; an int -> one
        token."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"slice step {step}: expected 1 (contiguous reads only)")
            return self.read(start, max(start, stop))
        i = operator.index(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"token {i} of {len(self)}: expected an index in [0, {len(self)})")
        return int(self.read(i % len(self), i % len(self) + 1)[0])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}  # memory maps are reopened lazily after unpickling

    def __repr__(self) -> str:
        return f"TokenShards({len(self.paths)} files, {len(self)} tokens)"


def _uint16(array) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"tokens of dtype {array.dtype} and shape {array.shape}: expected a 1-D "
                         "array of integers")
    if array.size and (array.min() < 0 or array.max() > 65535):
        bad = array[(array < 0) | (array > 65535)][0]
        raise ValueError(f"token id {int(bad)}: expected ids in [0, 65535] for uint16 shards")
    return array.astype(_TOKEN)


def write_token_shards(path_prefix: str, tokens: Iterable[np.ndarray], *,
                       tokens_per_shard: int | None = None, format: str = "modded") -> list[str]:
    """Writes the concatenation of the `tokens` arrays as uint16 shards of `tokens_per_shard`
    tokens (the last may be shorter; None: one shard) named "{path_prefix}_{i:06d}.bin", or
    "{path_prefix}.bin" for a single nanoGPT file (format="nanogpt", tokens_per_shard=None).
    No tokens at all still gives one, empty, shard. Every shard is written under a ".tmp" name
    and all are renamed once the last is complete. Returns the shard paths.

    >>> import tempfile
    >>> prefix = tempfile.mkdtemp() + "/val"
    >>> paths = write_token_shards(prefix, [[1, 2], [3]], format="nanogpt")
    >>> [os.path.basename(p) for p in paths], np.fromfile(paths[0], "<u2").tolist()
    (['val.bin'], [1, 2, 3])
    """
    with fileio.staged() as stage:
        writer = TokenShardWriter(path_prefix, tokens_per_shard=tokens_per_shard, format=format,
                                  stage=stage)
        try:
            for array in tokens:
                writer.write(array)
        finally:
            writer.close()
    return writer.paths


class TokenShardWriter:
    """`write_token_shards` one array at a time: `write(tokens)` appends to the stream, opening
    the next shard every `tokens_per_shard` tokens; `close()` completes the last shard and
    returns the paths. Shard `path` is written as `stage(path)` (its own name by default;
    `fileio.staged` gives a temporary one)."""

    def __init__(self, path_prefix: str, *, tokens_per_shard: int | None = None,
                 format: str = "modded", stage: Callable[[str], str] = str):
        if format not in FORMATS:
            raise ValueError(f"format={format!r}: expected one of {FORMATS}")
        if tokens_per_shard is not None and (not isinstance(tokens_per_shard, int)
                                             or tokens_per_shard < 1):
            raise ValueError(f"tokens_per_shard={tokens_per_shard!r}: expected a positive "
                             "integer")
        # The modded header stores the count as int32.
        self._capacity = tokens_per_shard or (2**31 - 1 if format == "modded" else None)
        if format == "modded" and self._capacity > 2**31 - 1:
            raise ValueError(f"tokens_per_shard={tokens_per_shard}: expected at most 2**31 - 1 "
                             "for modded-nanogpt shards (int32 count)")
        self._prefix, self._format, self._stage = os.fspath(path_prefix), format, stage
        os.makedirs(os.path.dirname(self._prefix) or ".", exist_ok=True)
        self._single = format == "nanogpt" and tokens_per_shard is None
        self.paths: list[str] = []
        self._counts: list[int] = []
        self._file = None
        self._open_shard()

    def _open_shard(self) -> None:
        self.paths.append(f"{self._prefix}.bin" if self._single
                          else f"{self._prefix}_{len(self.paths):06d}.bin")
        self._counts.append(0)
        self._file = open(self._stage(self.paths[-1]), "wb")  # noqa: SIM115 - closed in close()
        if self._format == "modded":
            self._file.write(bytes(HEADER_BYTES))  # the count is filled in when it is closed

    def _close_shard(self) -> None:
        if self._format == "modded":
            header = np.zeros(HEADER_INTS, "<i4")
            header[:3] = MAGIC, VERSION, self._counts[-1]
            self._file.seek(0)
            self._file.write(header.tobytes())
        self._file.close()

    def write(self, tokens) -> None:
        ids = _uint16(tokens)
        while ids.size:
            if self._capacity is not None and self._counts[-1] == self._capacity:
                self._close_shard()
                self._open_shard()
            take = ids.size if self._capacity is None else \
                min(ids.size, self._capacity - self._counts[-1])
            self._file.write(ids[:take].tobytes())
            self._counts[-1] += take
            ids = ids[take:]

    def close(self) -> list[str]:
        if self._file is not None and not self._file.closed:
            self._close_shard()
        return self.paths
