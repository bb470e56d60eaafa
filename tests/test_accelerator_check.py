"""benchmarks/accelerator_check.py (the GPU check) without a GPU: the attention check passes the
chunked kernel on every mask and fails kernels that are wrong; nanoGPT's and our logs parse into
the training table; and one --allow_cpu run goes end to end (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import accelerator_check as ac  # noqa: E402 - benchmarks/ is not a package

from transformer.configs import experiment  # noqa: E402
from transformer.nn import dense_attention  # noqa: E402
from transformer.training import metrics  # noqa: E402

SMALL = dict(batch=2, length=32, heads=4, kv_heads=2, head_dim=16)
MASKS = {"causal", "causal, GQA 4:2", "causal + packed segments", "padding",
         "sliding window 8 (causal)", "full", "prefix LM", "cross, segments (kv_len 16)"}


# -----------------------------------------------------------------------------
# Attention


def test_attention_check_passes_the_chunked_kernel_on_every_mask():
    rows = ac.attention_check("cpu", "float32", impl="chunked", **SMALL)
    assert {r["mask"] for r in rows} == MASKS
    for row in rows:
        assert row["impl"] == "chunked" and row["error"] == "", row
        assert row["ok"] and row["d_out"] < 1e-5 and row["d_grad"] < 1e-5, row
    table = ac.attention_table(rows)
    assert table.count("| yes |") == len(MASKS) and "**NO**" not in table


def test_attention_check_fails_a_kernel_that_drops_the_mask():
    def drops_the_mask(q, k, v, mask):
        return dense_attention.dot_product_attention(q, k, v)

    rows = ac.attention_check("cpu", "float32", impl="chunked", kernel_fn=drops_the_mask,
                              **SMALL)
    failed = {r["mask"] for r in rows if not r["ok"]}
    assert failed == MASKS - {"full"}  # Full allows everything: dropping it changes nothing
    assert all(r["d_out"] > 0.1 for r in rows if r["mask"] in failed)
    assert "**NO**" in ac.attention_table(rows)


def test_attention_check_fails_a_kernel_whose_gradient_is_wrong():
    def frozen_values(q, k, v, mask):  # right forward, dv = 0
        return dense_attention.dot_product_attention(q, k, jax.lax.stop_gradient(v), mask)

    rows = ac.attention_check("cpu", "float32", impl="chunked", kernel_fn=frozen_values,
                              **SMALL)
    assert all(r["d_out"] < 1e-5 and r["d_grad"] > 0.5 and not r["ok"] for r in rows), rows


def test_cudnn_lowering_names_what_each_mask_becomes():
    lowering = {name: ac.cudnn_lowering(mask, 32, kv_len)
                for name, mask, _, kv_len in ac.attention_cases(2, 32, 4, 2)}
    assert lowering == {
        "causal": "is_causal", "causal, GQA 4:2": "is_causal",
        "causal + packed segments": "is_causal, dense mask (as a bias)",
        "padding": "q lengths, kv lengths",
        "sliding window 8 (causal)": "is_causal, window (7, 0)", "full": "nothing",
        "prefix LM": "dense mask (as a bias)",
        "cross, segments (kv_len 16)": "dense mask (as a bias)"}


def test_packed_segment_ids_are_uneven_documents_then_padding():
    ids = ac.packed_segment_ids(2, 64, docs=[3, 4], seed=0, padding=[0, 8])
    assert ids.shape == (2, 64) and ids.dtype == np.int32
    assert sorted(set(ids[0])) == [1, 2, 3] and sorted(set(ids[1])) == [0, 1, 2, 3, 4]
    assert (ids[1, -8:] == 0).all() and (ids[1, :-8] > 0).all()
    assert (np.diff(ids[0]) >= 0).all()  # contiguous documents, in order
    assert len(set(np.bincount(ids[0])[1:])) > 1  # of uneven lengths


# -----------------------------------------------------------------------------
# Training: logs, FLOPs, the table

NANOGPT_LOG = """\
    0.512 | tokens per iteration will be: 16,384
    0.514 | found vocab_size = 65 (inside data/shakespeare_char/meta.pkl)
    1.020 | number of parameters: 10.65M
    1.100 | compiling the model... (takes a ~minute)
   40.000 | step 0: train loss 4.2874, val loss 4.2823
   60.000 | iter 0: loss 4.2654, time 29715.36ms, mfu -100.00%
   60.500 | iter 10: loss 3.2457, time 20.15ms, mfu 18.54%
   60.700 | iter 20: loss 2.7990, time 20.05ms, mfu 18.53%
   61.800 | step 30: train loss 2.4965, val loss 2.5108
   61.801 | saving checkpoint to out
   61.900 | iter 30: loss 2.5193, time 1152.11ms, mfu 16.81%
   62.150 | iter 40: loss 2.4655, time 20.11ms, mfu 17.01%
"""

OURS_LOG = """\
    12.712 | shakespeare_char_gpu: gpt, 10,745,088 params, batch 64 x 256, steps 0..40
    12.755 | MFU against 9.89e+14 FLOP/s per device (published bf16 dense peak of NVIDIA H100)
    29.100 | step 1: the first step (compilation included, attention cudnn) took 16.3 s
    30.000 | step 10/40 loss 3.1002 acc 0.120 lr 1.00e-03 gnorm 1.45 47 tok/s MFU 0% ETA 0:01:38
    30.100 | step 20/40 loss 2.7191 acc 0.205 lr 9.93e-04 gnorm 1.61 1,638,400 tok/s MFU 18%
    30.200 | step 30/40 loss 2.5134 acc 0.237 lr 9.40e-04 gnorm 1.25 1,638,400 tok/s MFU 18%
    30.300 | step 40/40 loss 2.4440 acc 0.255 lr 8.39e-04 gnorm 1.23 1,638,400 tok/s MFU 18%
    31.000 | step 40: validation loss 2.4812 accuracy 0.2600 perplexity 11.9560 bits_per_byte 3.58
    33.000 | samples (temperature 0.8, top-k 200, prompt 'ROMEO:'):
"""


def test_parse_nanogpt_log():
    parsed = ac.parse_nanogpt_log(NANOGPT_LOG)
    assert [i["iter"] for i in parsed["iters"]] == [0, 10, 20, 30, 40]
    assert parsed["iters"][0] == dict(iter=0, loss=4.2654, ms=29715.36, mfu=-100.0, t=60.0)
    assert parsed["evals"] == [dict(step=0, train=4.2874, val=4.2823, t=40.0),
                               dict(step=30, train=2.4965, val=2.5108, t=61.8)]
    # nanoGPT's own lines, as it prints them (no timestamps)
    bare = "iter 7: loss 1.0000, time 3.50ms, mfu 1.25%\nstep 8: train loss 1.5, val loss 1.6\n"
    assert ac.parse_nanogpt_log(bare) == {
        "iters": [dict(iter=7, loss=1.0, ms=3.5, mfu=1.25, t=None)],
        "evals": [dict(step=8, train=1.5, val=1.6, t=None)]}


def test_parse_ours_log():
    parsed = ac.parse_ours_log(OURS_LOG)
    assert [(i["iter"], i["loss"], i["t"]) for i in parsed["iters"]] == [
        (10, 3.1002, 30.0), (20, 2.7191, 30.1), (30, 2.5134, 30.2), (40, 2.444, 30.3)]
    assert parsed["evals"] == [dict(step=40, val=2.4812, t=31.0)]
    assert parsed["attention"] == "cudnn"
    assert ac.parse_ours_log(OURS_LOG.replace(", attention cudnn", ""))["attention"] is None


def test_window_tokens_per_s_leaves_out_the_first_window_and_evaluations():
    parsed = ac.parse_nanogpt_log(NANOGPT_LOG)
    # windows: 0-10 (the first: left out), 10-20 (0.2 s), 20-30 (the eval at 30 ran in it:
    # left out), 30-40 (0.25 s)
    rate = ac.window_tokens_per_s(parsed["iters"], parsed["evals"], tokens_per_iter=16384)
    assert rate == pytest.approx((10 * 16384 / 0.2 + 10 * 16384 / 0.25) / 2)
    assert ac.window_tokens_per_s(parsed["iters"][:2], [], 16384) is None  # one window: skipped
    ours = ac.parse_ours_log(OURS_LOG)
    assert ac.window_tokens_per_s(ours["iters"], ours["evals"], 16384) == pytest.approx(
        10 * 16384 / 0.1)


def test_log_lines_are_stamped_to_the_microsecond(tmp_path):
    """A GPU's log window is ~100 ms: millisecond stamps would round its tokens/s by up to
    ±0.7% (the first H100 runs' did). The stamps parse back with their six decimals."""
    log = tmp_path / "log"
    ac.run_logged([sys.executable, "-c", "print('step 10/40 loss 3.1 acc')"], str(tmp_path),
                  str(log))
    stamp = log.read_text().split(" | ")[0].strip()
    assert len(stamp.split(".")[1]) == 6, stamp
    (line,) = ac.parse_ours_log(log.read_text())["iters"]
    assert line["t"] == float(stamp)


def test_both_sides_flops_come_from_one_formula():
    n = ac.nanogpt_params(vocab=65, layers=6, width=384)
    assert f"{n / 1e6:.2f}M" == "10.65M"  # nanoGPT prints "number of parameters: 10.65M"
    flops = ac.gpt_flops_per_token(n, layers=6, width=384, context=256)
    assert flops == 6 * n + 12 * 6 * 384 * 256
    config = experiment("gpt_shakespeare_char")
    config.model.vocab_size = 65
    # ours counts the learned position table in its params; flops_per_token leaves it out
    assert metrics.flops_per_token(config, n + 256 * 384) == flops


def test_train_table_computes_mfu_alike_for_both_sides():
    sizes = dict(tokens_per_iter=16384, flops_per_token=6.6e7)
    nanogpt = ac.side_summary("nanoGPT (PyTorch)", ac.parse_nanogpt_log(NANOGPT_LOG),
                              wall_s=70.4, attention="SDPA (flash)", dtype="bfloat16",
                              own_mfu=0.1701, **sizes)
    ours = ac.side_summary("ours (JAX)", ac.parse_ours_log(OURS_LOG), wall_s=34.0,
                           attention="cudnn", dtype="bfloat16", own_mfu=0.18, **sizes)
    assert nanogpt["val_loss"] == 2.5108 and nanogpt["val_step"] == 30
    assert nanogpt["iters"] == 40 and nanogpt["wall_to_val_s"] == 61.8
    assert ours["val_loss"] == 2.4812 and ours["iters"] == 40 and ours["wall_to_val_s"] == 31.0
    # nanoGPT's step-0 evaluation (4.2823) is not its best; the best need not be the last
    assert (nanogpt["best_val_loss"], nanogpt["best_val_step"]) == (2.5108, 30)
    overfit = ac.side_summary("x", ac.parse_nanogpt_log(
        NANOGPT_LOG + "   70.000 | step 40: train loss 2.3, val loss 2.6000\n"), wall_s=80.0,
        attention="", dtype="", own_mfu=None, **sizes)
    assert (overfit["val_loss"], overfit["best_val_loss"], overfit["best_val_step"]) == (
        2.6, 2.5108, 30)
    table = ac.train_table([ours, nanogpt, {"side": "other", "error": "exited 1"}], peak=989e12)
    lines = table.splitlines()
    assert lines[0].startswith("| side | attention | dtype | iters | tokens/s | MFU (chip peak)")
    mfu_ours = 10 * 16384 / 0.1 * 6.6e7 / 989e12  # 10.9%
    mfu_nanogpt = 737280 * 6.6e7 / 989e12
    assert lines[2] == (f"| ours (JAX) | cudnn | bfloat16 | 40 | 1,638,400 | {mfu_ours:.1%} | "
                        "18.0% | 2.4812 (40) | 2.4812 (40) | 31 | 34 |")
    assert lines[3] == (f"| nanoGPT (PyTorch) | SDPA (flash) | bfloat16 | 40 | 737,280 | "
                        f"{mfu_nanogpt:.1%} | 17.0% | 2.5108 (30) | 2.5108 (30) | 62 | 70 |")
    assert lines[4].startswith("| other | **failed:** exited 1 |")
    assert "| - |" in ac.train_table([{**ours, "tokens_per_s": None}], peak=None)


def test_commands_share_iterations_batch_and_context():
    sizes = dict(batch_size=64, block_size=256, n_layer=6, n_head=6, n_embd=384)
    theirs = ac.nanogpt_command("/x/nanoGPT", gpu=True, iters=2000, sizes=sizes,
                                log_interval=10, eval_batches=0)
    assert theirs[1:3] == ["/x/nanoGPT/train.py", "/x/nanoGPT/config/train_shakespeare_char.py"]
    for arg in ("--max_iters=2000", "--lr_decay_iters=2000", "--eval_interval=250",
                "--batch_size=64", "--block_size=256", "--n_embd=384"):
        assert arg in theirs
    assert not any(a.startswith(("--device", "--compile", "--dtype", "--eval_iters",
                                 "--warmup")) for a in theirs)  # its GPU defaults
    ours = ac.ours_command("t.txt", "w", gpu=True, iters=2000, sizes=sizes, log_interval=10,
                           eval_batches=0)
    for arg in ("--config=experiments/gpt_shakespeare_char.py", "--config.steps=2000",
                "--config.eval_every=250", "--config.batch_size=64", "--config.seq_len=256",
                "--config.model.d_ff=1536"):
        assert arg in ours
    assert not any("dtype" in a or "attention_impl" in a for a in ours)  # the recipe's own
    assert ac.ours_command("t", "w", gpu=True, iters=20, sizes=sizes, log_interval=2,
                           eval_batches=0, extra=["model.attention_dropout_rate=0"])[-1] == (
        "--config.model.attention_dropout_rate=0")
    cpu = ac.nanogpt_command("/x", gpu=False, iters=20, sizes=sizes, log_interval=2,
                             eval_batches=2)
    assert {"--device=cpu", "--compile=False", "--dtype=float32", "--eval_iters=2",
            "--eval_interval=20", "--warmup_iters=2"} <= set(cpu)
    assert "--config.model.dtype=float32" in ac.ours_command(
        "t", "w", gpu=False, iters=20, sizes=sizes, log_interval=2, eval_batches=2)


# -----------------------------------------------------------------------------
# End to end


def _text(path: Path) -> Path:
    rng = np.random.default_rng(0)
    words = "the king my lord shall not be so good night sweet prince and thou art".split()
    lines = [" ".join(rng.choice(words, 8)).capitalize() + "." for _ in range(1000)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_allow_cpu_runs_end_to_end(tmp_path):
    """Decode and training (nanoGPT too where NANOGPT_DIR names a checkout) at CPU_SIZES;
    the attention section is the tests above. Without --allow_cpu: one line, exit 2."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, str(REPO / "benchmarks" / "accelerator_check.py")]
    refused = subprocess.run(script + ["--text=x"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert refused.stderr.startswith("error: no GPU:") and "--allow_cpu" in refused.stderr
    bad = subprocess.run(script + ["--allow_cpu", "--text=x", "--ours_flags=steps"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --ours_flags: 'steps': expected KEY=VALUE of our config, e.g. "
        "model.attention_dropout_rate=0"), bad.stderr

    nanogpt = os.environ.get("NANOGPT_DIR")
    report = tmp_path / "check.md"
    result = subprocess.run(script + [
        "--allow_cpu", f"--text={_text(tmp_path / 'text.txt')}", f"--workdir={tmp_path}/runs",
        f"--output={report}", "--skip=attention"] + ([f"--nanogpt_dir={nanogpt}"] if nanogpt
                                                      else []),
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert text.strip() == result.stdout.strip()  # the report is what it printed
    assert "device: cpu" in text and "No GPU" in text and "nothing failed" in text
    decode_rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert len(decode_rows) == 1 and decode_rows[0].endswith("| yes |")
    ours = next(line for line in text.splitlines() if line.startswith("| ours (JAX) |"))
    cells = [c.strip() for c in ours.split("|")[1:-1]]
    assert cells[1:4] == ["dense", "float32", "20"] and cells[7].endswith("(20)"), ours
    assert float(cells[4].replace(",", "")) > 0 and cells[5].endswith("%")
    if nanogpt:
        theirs = next(line for line in text.splitlines() if line.startswith("| nanoGPT"))
        assert theirs.split("|")[8].strip().endswith("(20)"), theirs
