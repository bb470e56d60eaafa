"""What the benchmarks that run karpathy/nanoGPT from a local checkout share: its shakespeare_char
data written from a text file, timed commands, and the machine's description.

No flags are defined here, so any benchmark can import it (`nanogpt_protocol.py`,
`accelerator_check.py`). Nothing of nanoGPT is copied: its train.py runs unmodified from the
checkout, in a directory holding the data it reads.
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
