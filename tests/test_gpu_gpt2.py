"""benchmarks/gpu_gpt2.py (GPT-2 124M against nanoGPT on a GPU, and the token mixers' decode
table of benchmarks/decode.py) without a GPU: the byte-level batches both sides share, each
mixer's measured cache bytes against its own count, the decode table, and one --allow_cpu
rehearsal end to end (slow; nanoGPT too where NANOGPT_DIR names a checkout)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import decode  # noqa: E402 - benchmarks/ is not a package
import nanogpt_common  # noqa: E402

from transformer.data import sources  # noqa: E402
from transformer.models import build_model, init_cache, transformer_config  # noqa: E402


def test_corpus_bytes_are_the_embedded_corpus_one_id_per_byte():
    tokens = nanogpt_common.corpus_bytes()
    text = "\n\n".join(doc.text for doc in sources.embedded_corpus()).encode("utf-8")
    assert tokens.dtype == np.uint16 and len(tokens) == len(text) > 1_000_000
    assert tokens.max() < 256 and bytes(tokens[:5000].astype(np.uint8)) == text[:5000]


def test_random_windows_are_seeded_slices_reaching_the_end():
    tokens = np.arange(1000, dtype=np.uint16)
    windows = nanogpt_common.random_windows(tokens, (3, 2), 9, seed=0)
    assert windows.shape == (3, 2, 9) and windows.dtype == np.int32
    assert (np.diff(windows, axis=-1) == 1).all()  # each a contiguous slice
    assert np.array_equal(windows, nanogpt_common.random_windows(tokens, (3, 2), 9, seed=0))
    assert not np.array_equal(windows, nanogpt_common.random_windows(tokens, (3, 2), 9, seed=1))
    whole = nanogpt_common.random_windows(np.arange(10, dtype=np.uint16), (4,), 10, seed=0)
    assert (whole == np.arange(10)).all()  # the one window that fits


@pytest.mark.parametrize("variant", list(decode.MIXER_VARIANTS))
def test_each_mixers_cache_grows_as_its_own_count_says(variant):
    """What the mixers table reports per sequence (the cache's bytes, from init_cache's shapes)
    grows by the registry's cache_bytes_per_token per token; recurrent states not at all."""
    config = decode.mixer_config(variant, layers=4, d_model=64, heads=4, kv_heads=2, vocab=256,
                                 dtype="float32")
    model, stack = build_model(config), transformer_config(config)

    def per_sequence(length: int) -> int:
        shapes = jax.eval_shape(lambda: init_cache(model, 2, length))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) // 2

    per_token = sum(stack.mixer(i).cache_bytes_per_token(stack) for i in range(4))
    assert per_sequence(128) - per_sequence(64) == 64 * per_token
    states = {decode.decode_state(config, i) for i in range(4)}
    expected = {"gqa": {"kv cache"}, "mha": {"kv cache"}, "mla": {"latent cache"},
                "gated_deltanet": {"recurrent state"}, "mamba2": {"recurrent state"},
                "hybrid": {"recurrent state", "kv cache"}}[variant]
    assert states == expected
    if variant in ("gated_deltanet", "mamba2"):
        assert per_token == 0 and per_sequence(64) > 0
    if variant == "mla":  # latent 4 x head_dim 16 + RoPE key 8, float32, 4 layers
        assert per_token == 4 * (64 + 8) * 4


def test_mixer_table_gives_each_context_and_the_ratio_to_gqa():
    def cell(tokens_s, size):
        return dict(tokens_s=tokens_s, bytes_per_seq=size, compile_s=0.0, kernels=())

    rows = [dict(mixer="GQA (4:2 heads)", variant="gqa", state="kv cache", batch=1,
                 kernels=["dense"], cells={1024: cell(100, 2**20), 32768: cell(10, 2**25)}),
            dict(mixer="Mamba 2", variant="mamba2", state="recurrent state", batch=1,
                 kernels=[], cells={1024: cell(50, 1536), 32768: cell(50, 1536)})]
    lines = decode.mixer_table({"header": "", "contexts": [1024, 32768],
                                "rows": rows}).splitlines()
    assert [lines[0], *lines[2:]] == [
        "| mixer | decode state | batch | tokens/s 1k | tokens/s 32k | bytes/seq 1k | "
        "bytes/seq 32k | attention kernel |",
        "| GQA (4:2 heads) | kv cache | 1 | 100 | 10 | 1 MiB | 32 MiB | dense |",
        "| Mamba 2 | recurrent state | 1 | 50 (0.50x) | 50 (5.00x) | 1.5 KiB | 1.5 KiB | - |"]


def _cells(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(start))
    return [c.strip() for c in line.split("|")[1:-1]]


@pytest.mark.slow
def test_allow_cpu_rehearsal_runs_end_to_end(tmp_path):
    """Training (nanoGPT too where NANOGPT_DIR names a checkout) and decode at CPU_SIZES. Both
    sides start at the loss of a uniform guess over the vocabulary and score the same held-out
    batches. Without --allow_cpu: one line, exit 2."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, str(REPO / "benchmarks" / "gpu_gpt2.py")]
    refused = subprocess.run(script, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: no GPU:")
    assert "--allow_cpu" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1

    nanogpt = os.environ.get("NANOGPT_DIR")
    report = tmp_path / "gpu_gpt2.md"
    result = subprocess.run(script + [
        "--allow_cpu", f"--output={report}", "--steps=4", "--mixers=gqa,mamba2",
        "--contexts=32"] + ([f"--nanogpt_dir={nanogpt}"] if nanogpt else []),
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert text.strip() == result.stdout.strip()  # the report is what it printed
    assert "device: cpu" in text and "No GPU" in text and "nothing failed" in text
    ours = _cells(text, "| ours (JAX) |")
    assert ours[1:4] == ["dense", "float32", "4"], ours
    assert float(ours[4].replace(",", "")) > 0 and ours[5].endswith("%")
    first_loss = float(ours[7].split(" / ")[0])
    assert abs(first_loss - math.log(50304)) < 0.1, ours
    if nanogpt:
        theirs = _cells(text, "| nanoGPT (PyTorch) |")
        assert theirs[1:4] == ["SDPA", "float32", "4"], theirs
        assert abs(float(theirs[7].split(" / ")[0]) - first_loss) < 0.1
        assert abs(float(theirs[8]) - float(ours[8])) < 0.2  # the same held-out batches
    assert _cells(text, "| GQA (2:1 heads) |")[1:3] == ["kv cache", "1"]
    mamba = _cells(text, "| Mamba 2 (state 128) |")
    assert mamba[1:3] == ["recurrent state", "1"] and mamba[3].endswith("x)")


def _bundle_pins() -> dict[str, str]:
    """benchmarks/gpu_bundle.sh's PINS=(name==version ...), as {normalized name: version}."""
    from packaging.utils import canonicalize_name

    text = (REPO / "benchmarks" / "gpu_bundle.sh").read_text()
    body = text.split("PINS=(", 1)[1].split(")", 1)[0]
    return {canonicalize_name(p.split("==")[0]): p.split("==")[1] for p in body.split()}


def test_the_gpu_bundle_carries_versions_setup_cfg_allows():
    """The wheels gpu_bundle.sh gathers for the device stand in for what `pip install .` would
    resolve there, so each must be a version setup.cfg's install_requires accepts."""
    import configparser

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    required = {canonicalize_name(r.name): r for r in (
        Requirement(line.split("#")[0]) for line in
        setup["options"]["install_requires"].splitlines() if line.split("#")[0].strip())}
    pins = _bundle_pins()
    assert {"grain", "array-record", "ml-collections", "flax"} <= set(pins)
    for name, version in pins.items():
        if name in required:  # portpicker is grain's, not ours
            assert required[name].specifier.contains(version), (name, version, required[name])


@pytest.mark.parametrize("files, text, message", [
    (["model.py"], None, "{d} holds no nanoGPT model.py and train.py"),
    (["model.py", "train.py"], "missing.txt", "no text file {d}/missing.txt"),
])
def test_the_gpu_bundle_refuses_bad_arguments_in_one_line_before_touching_build(
        tmp_path, files, text, message):
    for name in files:
        (tmp_path / name).write_text("")
    build = REPO / "build"
    before = sorted(os.listdir(build)) if build.exists() else None
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_bundle.sh"), str(tmp_path)]
                            + ([str(tmp_path / text)] if text else []),
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "gpu_bundle.sh: " + message.format(d=tmp_path)
    assert (sorted(os.listdir(build)) if build.exists() else None) == before


@pytest.mark.parametrize("flags, message", [
    ([], None),  # the defaults: GQA 6:2 heads
    (["--kv_heads=4"], "--kv_heads=4: expected a divisor of --heads=6"),
    (["--mixers=hybrid", "--layers=6"], "--layers=6 with the hybrid mixer: expected a multiple"),
])
def test_decode_mixers_table_takes_its_defaults_and_refuses_bad_shapes_in_one_line(flags,
                                                                                   message):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "decode.py"), "--table=mixers",
         "--contexts=16", "--new_tokens=2", "--repeats=1", "--vocab=64", "--layers=4",
         "--d_model=24", "--mixers=gqa", *flags], env=env, capture_output=True, text=True,
        timeout=300, cwd=REPO)
    if message is None:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "6:2 heads" in result.stdout
    else:
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"error: {message}"), lines
