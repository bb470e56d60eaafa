"""What a run reports: the metrics logger (JSONL, TensorBoard, progress lines) and the FLOPs
and MFU accounting."""

from __future__ import annotations

import json
import sys
import time

import jax

from transformer import fileio
from transformer.models import family_of


def flops_per_token(config, num_params: int) -> float:
    """Model FLOPs per trained token: 6 N (matmuls, forward + backward) + attention scores."""
    m = config.model
    attends = family_of(config).attention
    attention = 12 * m.num_layers * m.d_model * config.seq_len if attends else 0
    return 6 * num_params + attention


def measured_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a square float32 matmul on one device: the peak MFU is measured against."""
    a = jax.random.normal(jax.random.key(0), (size, size))
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        a = matmul(a) * (1.0 / size)
    a.block_until_ready()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def keep_records_up_to(path: str, step: int) -> list[str]:
    """Drops the metrics a killed run logged after its last checkpoint (they are trained and
    logged again on resume) and any line it left half-written; rewrites the file atomically
    and returns the kept lines."""
    if not fileio.path(path).exists():
        return []
    kept = []
    for line in fileio.path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    fileio.write_atomic(path, "".join(kept))
    return kept


class MetricsLogger:
    """Metrics to JSONL + TensorBoard (process 0), progress lines to the terminal.

    Every record carries `elapsed`: seconds of this run so far, summed over resumes (the time
    a killed run spent after its last checkpoint is dropped with its records).
    """

    def __init__(self, workdir: str, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.interactive = sys.stdout.isatty()
        self.start = time.perf_counter()
        self.elapsed_before = 0.0
        if enabled:
            from tensorboardX import SummaryWriter

            self.path = fileio.join(workdir, "metrics.jsonl")
            lines = keep_records_up_to(self.path, start_step)
            if lines:
                self.elapsed_before = json.loads(lines[-1]).get("elapsed", 0.0)
            # Object stores cannot append: a remote file is kept in memory and rewritten whole
            # at each record; a local one is appended to.
            remote = fileio.is_remote(self.path)
            self.lines = lines if remote else None
            self.jsonl = None if remote else open(self.path, "a")  # noqa: SIM115
            self.tensorboard = SummaryWriter(fileio.join(workdir, "tensorboard"))

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.start

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        line = json.dumps({"step": step, "split": split, **metrics,
                           "elapsed": self.elapsed()}) + "\n"
        if self.jsonl is None:
            self.lines.append(line)
            fileio.write_atomic(self.path, "".join(self.lines))
        else:
            self.jsonl.write(line)
            self.jsonl.flush()
        for name, value in metrics.items():
            if isinstance(value, int | float):  # e.g. not new_data's list of changes
                self.tensorboard.add_scalar(f"{split}/{name}", value, step)
        self.tensorboard.flush()

    def print(self, line: str, transient: bool = False) -> None:
        if not self.enabled:
            return
        if self.interactive and transient:
            print("\r" + line.ljust(120), end="", flush=True)
        else:
            print(("\r" if self.interactive else "") + line, flush=True)

    def close(self):
        if self.enabled:
            if self.jsonl is not None:
                self.jsonl.close()
            self.tensorboard.close()
