"""Workdir files on a local disk or in a bucket (gs://, through etils.epath), so one run
directory can be shared by every host of a pod slice.

Object stores have no rename and no append: `write_atomic` writes a temporary file and renames
it locally (an object write is atomic by itself), and `move` copies then deletes remotely.
Remote paths need the `tpu` extra (gcsfs).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Callable, Iterator

from etils import epath


def is_remote(path) -> bool:
    """Whether `path` is a URL ("gs://bucket/run") rather than a local path.

    >>> is_remote("gs://bucket/run"), is_remote("runs/tiny")
    (True, False)
    """
    return "://" in str(path)


def path(p) -> epath.Path:
    """An epath.Path for `p`; local paths are made absolute."""
    return epath.Path(p if is_remote(p) else os.path.abspath(os.fspath(p)))


def join(p, *parts: str) -> str:
    """`os.path.join` that keeps a URL a URL."""
    return str(path(p).joinpath(*parts))


def write_atomic(p, data: str | bytes) -> None:
    """Writes a whole file so that readers see the old or the new content, never a part (and
    a failed write leaves the old one, without a temporary file)."""
    p = path(p)
    if is_remote(p):
        p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
        return
    tmp = p.with_name(f"{p.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind
        raise


@contextlib.contextmanager
def staged(directory: str | None = None) -> Iterator[Callable[[str], str]]:
    """Files written under temporary names and given their real ones together at the end.

    Yields `stage(path) -> temp`, the name to write `path` under: "{path}.tmp", or with
    `directory` "{directory}/{basename of path}" (on the same filesystem as `path`, so that the
    rename stays atomic). When the block completes every staged file is renamed to its path; if
    it raises, every staged file is removed, so a failed write never leaves a partial file under
    a real name. Local paths only.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with staged() as stage:
    ...     with open(stage(d + "/a.bin"), "wb") as f:
    ...         _ = f.write(b"x")
    ...     os.path.exists(d + "/a.bin")
    False
    >>> os.listdir(d)
    ['a.bin']
    """
    moves: list[tuple[str, str]] = []

    def stage(p: str) -> str:
        temp = os.path.join(directory, os.path.basename(p)) if directory else f"{p}.tmp"
        moves.append((temp, p))
        return temp

    try:
        yield stage
        for temp, p in moves:
            os.replace(temp, p)
    except BaseException:
        for temp, _ in moves:
            if os.path.exists(temp):
                os.remove(temp)
        raise


def move(src, dst) -> None:
    """Moves a file or directory tree (remotely: copies every file, then deletes the source)."""
    src, dst = path(src), path(dst)
    if not is_remote(src) and not is_remote(dst):
        shutil.move(os.fspath(src), os.fspath(dst))
        return
    files = [src] if src.is_file() else [f for f in src.rglob("*") if f.is_file()]
    for f in files:
        target = dst if f == src else dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        f.copy(target, overwrite=True)
    src.rmtree() if src.is_dir() else src.unlink()


def parse_init_from(spec: str) -> tuple[str, str, int | None]:
    """`init_from` -> (kind, path, step): "hf:DIR" is ("hf", DIR, None); "WORKDIR" and
    "WORKDIR@STEP" are ("workdir", WORKDIR, None or STEP).

    >>> parse_init_from("runs/bert@600"), parse_init_from("hf:/models/bert-base")
    (('workdir', 'runs/bert', 600), ('hf', '/models/bert-base', None))
    """
    if spec.startswith("hf:"):
        return "hf", spec[3:], None
    path, at, step = spec.rpartition("@")
    if at and step.isdigit():
        return "workdir", path, int(step)
    return "workdir", spec, None


# Reading corpora (transformer.data.sources and .formats): local paths through os, URLs
# (gs://, and any scheme fsspec knows, e.g. memory:// in tests) through fsspec, whose "gs"
# filesystem the tpu extra's gcsfs provides.
def _fs(url: str):
    """(the fsspec filesystem of `url`, the path within it)."""
    try:
        import fsspec

        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{url}: {type(e).__name__}: {e}: expected a URL that fsspec reads "
                         "(gs:// needs gcsfs: pip install -e '.[tpu]')") from None


def isfile(p: str) -> bool:
    if not is_remote(p):
        return os.path.isfile(p)
    fs, inner = _fs(p)
    return fs.isfile(inner)


def isdir(p: str) -> bool:
    if not is_remote(p):
        return os.path.isdir(p)
    fs, inner = _fs(p)
    return fs.isdir(inner)


def getsize(p: str) -> int:
    if not is_remote(p):
        return os.path.getsize(p)
    fs, inner = _fs(p)
    return fs.size(inner)


def open_binary(p: str):
    """A file object to read `p`'s bytes from (seekable: Parquet reads its footer first)."""
    if not is_remote(p):
        return open(p, "rb")  # noqa: SIM115 - returned, closed by the caller's `with`
    fs, inner = _fs(p)
    return fs.open(inner, "rb")


def _refuse_broken_link(p: str) -> None:
    """Raises for a local symlink to a missing file (as an interrupted download leaves in a
    Hugging Face hub cache, snapshots/<rev>/x.parquet -> ../../blobs/<hash>): skipped, it would
    leave the run with less data and no word of it."""
    if os.path.islink(p) and not os.path.exists(p):
        raise FileNotFoundError(f"{p}: a broken symbolic link to {os.path.realpath(p)}, which "
                                "does not exist: expected the file it links to (download it "
                                "again, or remove the link)")


def files_under(directory: str) -> list[str]:
    """The regular files under `directory`, recursively, skipping hidden files and folders.
    Symlinked folders are followed (as a glob over them does), each real folder once; a broken
    link is refused (`_refuse_broken_link`)."""
    if not is_remote(directory):
        found, seen = [], {os.path.realpath(directory)}
        for root, dirs, names in os.walk(directory, followlinks=True):
            kept = []
            for d in sorted(dirs):  # a folder reached twice (a cycle, two links) is walked once
                real = os.path.realpath(os.path.join(root, d))
                if not d.startswith(".") and real not in seen:
                    seen.add(real)
                    kept.append(d)
            dirs[:] = kept
            for name in sorted(n for n in names if not n.startswith(".")):
                file = os.path.join(root, name)
                _refuse_broken_link(file)
                if os.path.isfile(file):
                    found.append(file)
        return found
    fs, inner = _fs(directory)
    root = inner.rstrip("/")
    return [fs.unstrip_protocol(f) for f in fs.find(root)
            if not any(part.startswith(".") for part in f[len(root):].split("/"))]


def glob_files(pattern: str) -> list[str]:
    """The regular files a glob `pattern` matches, with those under matching folders; a broken
    link among them is refused (`_refuse_broken_link`)."""
    if not is_remote(pattern):
        matches = glob.glob(pattern, recursive=True)
    else:
        fs, inner = _fs(pattern)
        matches = [fs.unstrip_protocol(m) for m in fs.glob(inner)]
    found = set()
    for match in matches:
        if isdir(match):
            found.update(files_under(match))
        elif isfile(match):
            found.add(match)
        elif not is_remote(match):
            _refuse_broken_link(match)
    return sorted(found)
