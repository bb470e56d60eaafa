"""What the benchmarks that run karpathy/nanoGPT from a local checkout share: its shakespeare_char
data written from a text file, byte-level tokens of the embedded corpus, timed commands, the
one FLOPs formula, the chip's peak, and the machine's description.

No flags are defined here, so any benchmark can import it (`nanogpt_protocol.py`,
`accelerator_check.py`, `gpu_gpt2.py`). Nothing of nanoGPT is copied: its train.py runs
unmodified from the checkout, in a directory holding the data it reads, or its model.py is
imported from there.
"""

from __future__ import annotations

import os
import pickle
import platform
import re
import subprocess
import time

import numpy as np

VALIDATION_FRACTION = 0.1


def split_text(text: str) -> tuple[str, str]:
    """nanoGPT's split: the first 90% of the characters, the last 10%."""
    cut = int(len(text) * (1 - VALIDATION_FRACTION))
    return text[:cut], text[cut:]


def prepare_nanogpt_data(text: str, directory: str) -> None:
    """train.bin, val.bin and meta.pkl of `text` in nanoGPT's shakespeare_char layout, as its
    data/shakespeare_char/prepare.py writes them (without downloading): uint16 ids, an id being
    the character's index in the sorted set of the text's characters."""
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    os.makedirs(directory, exist_ok=True)
    for name, part in zip(("train.bin", "val.bin"), split_text(text), strict=True):
        np.array([stoi[c] for c in part], np.uint16).tofile(os.path.join(directory, name))
    with open(os.path.join(directory, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(chars), "stoi": stoi,
                     "itos": dict(enumerate(chars))}, f)


def corpus_bytes() -> np.ndarray:
    """uint16 token ids of the embedded corpus (`sources.embedded_corpus`: Python's docs and
    standard library, shipped with every Python), one id per UTF-8 byte (ids 0-255 of any
    vocabulary), the documents in their sorted order with a blank line between them."""
    from transformer.data import sources

    text = "\n\n".join(doc.text for doc in sources.embedded_corpus())
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)


def random_windows(tokens: np.ndarray, shape: tuple[int, ...], length: int,
                   seed: int) -> np.ndarray:
    """int32 [*shape, length]: windows of `tokens` at uniformly random offsets (with
    replacement, as nanoGPT's get_batch draws them), seeded."""
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length + 1, shape)
    return tokens[starts[..., None] + np.arange(length)].astype(np.int32)


def link_configurator(nanogpt_dir: str, directory: str) -> None:
    """nanoGPT's train.py execs `configurator.py` from its working directory: link it there."""
    link = os.path.join(directory, "configurator.py")
    if not os.path.lexists(link):
        os.symlink(os.path.join(nanogpt_dir, "configurator.py"), link)


def timed_run(command: list[str], cwd: str, log_path: str, env=None) -> float:
    """Runs `command`, its output to `log_path`; its wall time in seconds."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        result = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}; see {log_path}")
    return seconds


def nanogpt_params(vocab: int, layers: int, width: int) -> int:
    """Params of nanoGPT's GPT (bias=False) as its get_num_params() counts them (the position
    table left out; the tied token table counted once, as the output head)."""
    return vocab * width + layers * (12 * width * width + 2 * width) + width


def gpt_flops_per_token(num_matmul_params: int, layers: int, width: int, context: int) -> float:
    """6 N + 12 L D T: nanoGPT's estimate_mfu and `metrics.flops_per_token` (the one formula)."""
    return 6 * num_matmul_params + 12 * layers * width * context


def chip_peak(dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s of this process's first device for `dtype` compute, its source)."""
    import ml_collections

    from transformer.training import metrics

    config = ml_collections.ConfigDict({"peak_flops_per_device": 0.0,
                                        "model": {"dtype": dtype}})
    return metrics.peak_flops(config)


def checked_sections_and_gpu(skip: list[str], sections: tuple[str, ...], allow_cpu: bool) -> bool:
    """Whether the first JAX device is a GPU, after one-line errors for a --skip outside
    `sections` and for a machine without a GPU unless --allow_cpu (the CPU rehearsal)."""
    import jax

    unknown = sorted(set(skip) - set(sections))
    if unknown:
        raise ValueError(f"--skip={','.join(skip)}: {unknown} not among {sections}")
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    if not gpu and not allow_cpu:
        raise ValueError(f"no GPU: this machine's first device is {device.platform} "
                         f"({device.device_kind}); run on a GPU machine, or pass --allow_cpu "
                         "for the CPU rehearsal at tiny sizes")
    return gpu


def device_line() -> str:
    """The first JAX device, the versions, and torch's CUDA device if it has one."""
    import jax

    device = jax.devices()[0]
    line = (f"device: {device.device_kind} ({device.platform}, {jax.device_count()} "
            f"device(s)); jax {jax.__version__}")
    try:
        import torch

        line += f", torch {torch.__version__}"
        if torch.cuda.is_available():
            line += (f" (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
                     f"{torch.cuda.get_device_name(0)})")
    except ImportError:
        line += ", no torch"
    return line


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        return f"{names[0]} ({len(names)} logical CPUs)" if names else platform.processor()
    except OSError:
        return platform.processor() or "unknown"


def versions() -> dict:
    import jax

    out = {"python": platform.python_version(), "jax": jax.__version__}
    try:
        import torch
        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out
