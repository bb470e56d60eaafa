"""What a run reports: the metrics logger (JSONL, TensorBoard, progress lines) and the FLOPs
and MFU accounting (model FLOPs per token, the peak they are measured against, and hardware
FLOPs with rematerialisation)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import platform
import sys
import time
from types import SimpleNamespace

import flax.linen as nn
import jax

from transformer.models import build_model, family_of, transformer_config, vision
from transformer.training import state as state_lib
from transformer.utils import fileio

# Dense (no sparsity) peak FLOP/s per chip, (device_kind prefix, bfloat16, float32 compute),
# first match wins. TPU: Google Cloud's TPU system-architecture pages (v4, v5e, v5p, v6e); a
# float32 matmul runs on the MXU at the bf16 rate under JAX's default precision. NVIDIA: the
# A100 / H100 / H200 datasheets, bf16 Tensor Core and, for float32, TF32 Tensor Core, which
# XLA uses for float32 matmuls by default.
PEAK_FLOPS = (
    ("TPU v4", 275e12, 275e12),
    ("TPU v5 lite", 197e12, 197e12),  # v5e
    ("TPU v5e", 197e12, 197e12),
    ("TPU v5", 459e12, 459e12),  # v5p reports "TPU v5" (or "TPU v5p")
    ("TPU v6", 918e12, 918e12),  # v6e / Trillium ("TPU v6 lite")
    ("NVIDIA A100", 312e12, 156e12),
    ("NVIDIA H100 PCIe", 756e12, 378e12),
    ("NVIDIA H100", 989e12, 494e12),  # SXM
    ("NVIDIA H200", 989e12, 494e12),
)
# Where `measured_cpu_peak` caches; TRANSFORMER_CPU_PEAK_CACHE moves it (the test suite uses a
# temporary file: a peak measured while the tests load every core is far below the machine's).
CPU_PEAK_CACHE = os.environ.get("TRANSFORMER_CPU_PEAK_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "transformer", "cpu_peak.json")
CPUINFO = "/proc/cpuinfo"  # where the cache's key reads the CPU (Linux; elsewhere absent)


def matmul_params(config, num_params: int) -> int:
    """The params that multiply activations: all of them but the tables only looked up (learned
    positions, and the token embedding wherever no tied LM head multiplies by it: the output
    head is separate, or model.head is not the LM head: GPT's and BERT's class head or none)."""
    m = config.model
    reads = family_of(config).reads  # a family that never reads `position` has no such table
    learned = m.get("position") == "learned" and (reads is None or "position" in reads)
    lookups = m.max_len * m.d_model if learned else 0
    # model.head is read by the families with a head choice (GPT, prefix LM, BERT); the others
    # keep its default "mlm" (a ViT's class head is `Family.classifier`'s, with no token table).
    if not m.get("tie_embeddings", True) or m.get("head", "mlm") != "mlm":
        lookups += m.vocab_size * m.d_model
    return num_params - lookups


def flops_per_token(config, num_params: int,
                    encoder_decoder: tuple[int, int] | None = None) -> float:
    """Model FLOPs per trained token, the PaLM / nanoGPT convention: 6 N (N = matmul params,
    forward + backward) + each layer's token-mixer FLOPs (`mixers.base.Mixer.flops_per_token`):
    12 D T for attention's scores and values (D = heads x head_dim, T = seq_len; a sliding
    layer's T at most its window), a linear layer's state updates. For a mixture of experts
    pass its active params (`state.active_params`): the experts a token skips, and routing work
    such as the dispatch einsums, are not useful FLOPs. Causal attention is *not* halved
    (MaxText halves it), so numbers compare with nanoGPT's `estimate_mfu`. Each multi-token
    prediction module (model.mtp.depth) adds its block's mixer and one more pass of the output
    head (6 V D: the head's params are shared, so N counts them once). An encoder-decoder (T5)
    given `encoder_decoder`, (its encoder's active params, its decoder's length), counts each
    stack at its own length (`encoder_decoder_flops`); without it (`transformer.scaling`, from
    a summary) its decoder counts as if it read seq_len tokens too, an overcount. A CLIP or a
    captioner counts each tower at its own length (`image_text_flops`)."""
    m = config.model
    if m.family == "t5" and encoder_decoder is not None:
        return encoder_decoder_flops(config, num_params, *encoder_decoder)
    if m.family in ("clip", "captioner"):
        return image_text_flops(config, num_params)
    mixing = 0
    if family_of(config).attention:
        stack = transformer_config(m)
        # each layer's token mixer: attention's scores and values, a linear layer's state work
        mixing = sum(stack.mixer(i).flops_per_token(stack, config.seq_len)
                     for i in range(stack.num_layers))
        mixing += stack.mtp.depth * (
            stack.mixer(stack.num_layers - 1).flops_per_token(stack, config.seq_len)
            + 6 * m.vocab_size * m.d_model)
        if m.family == "t5":
            width = m.num_heads * (m.get("head_dim") or m.d_model // m.num_heads)
            mixing += 2 * (m.get("num_decoder_layers") or m.num_layers) * 12 * width * \
                config.seq_len
    return 6 * matmul_params(config, num_params) + mixing


# The params an encoder-decoder's encoder tokens pass through (state.param_name's): the encoder
# stack's, and the decoder's cross-attention key and value projections, which read the encoder's
# output (S rows, not T).
ENCODER_SIDE = r"^encoder/|^decoder/.*cross_attention/(key|value)"


def encoder_decoder_flops(config, num_params: int, encoder_params: int,
                          decoder_len: int) -> float:
    """`flops_per_token` of an encoder-decoder whose rows are S = seq_len encoder tokens (what
    tok/s counts) and T = `decoder_len` decoder tokens: per row 6 N_enc S + 6 N_dec T, the
    encoder's mixers at S over S tokens, and over T tokens the decoder's mixers at T and its
    cross-attention (T queries x S keys: 12 D S a decoder token and layer); over S. N_enc is
    `encoder_params` (`ENCODER_SIDE`'s), N_dec the other matmul params (the decoder stack and
    the output head, which run on decoder tokens); the stacks' relative-position tables are
    lookups."""
    m, s, t = config.model, config.seq_len, decoder_len
    encoder = transformer_config(m)
    decoder = transformer_config(m, num_layers=m.get("num_decoder_layers") or m.num_layers)
    # each stack's relative-position table (buckets x heads)
    table = encoder.t5_num_buckets * encoder.num_heads if encoder.position == "t5" else 0
    n_encoder = encoder_params - table
    n_decoder = matmul_params(config, num_params) - encoder_params - table
    encoder_mixing = sum(encoder.mixer(i).flops_per_token(encoder, s)
                         for i in range(encoder.num_layers))
    decoder_mixing = sum(decoder.mixer(i).flops_per_token(decoder, t) + 12 * decoder.num_heads
                         * decoder.resolved_head_dim * s for i in range(decoder.num_layers))
    return 6 * n_encoder + encoder_mixing + (6 * n_decoder + decoder_mixing) * t / s


# The params of an image-text model (CLIP, captioner; state.param_name's) by the rows they run
# on. IMAGE_SIDE: the image tower's (on its S tokens) and the captioner's cross-attention key
# and value projections (they project the patches). LOOKUPS: tables only indexed or added, no
# matmul (learned positions, [CLS], CLIP's text token table: no head multiplies by it, where
# the captioner's tied embedding is its output head), and CLIP's temperature. PER_PAIR: CLIP's
# projections, once an image and once a text. The rest run on each of the T text tokens.
IMAGE_SIDE = (r"^image_encoder/(?!cls$)(?!.*position_embedding)"
              r"|^decoder/.*cross_attention/(key|value)")
LOOKUPS = r"position_embedding|^image_encoder/cls$|^logit_scale$|^text_encoder/embed/"
PER_PAIR = r"^(image|text)_projection/"


def image_text_params(config, abstract_state=None) -> tuple[int, int, int]:
    """The active params (`state.active_params`) of a CLIP or captioner matching IMAGE_SIDE,
    LOOKUPS and PER_PAIR; of `abstract_state`'s params, else of the model `config` builds
    (shapes only: a summary has the total, not this split)."""
    if abstract_state is None:
        args = family_of(config).init_args(state_lib.example_batch(config))
        params = jax.eval_shape(build_model(config.model).init, jax.random.key(0), *args)
        abstract_state = SimpleNamespace(params=nn.unbox(params["params"]))
    return tuple(state_lib.active_params(abstract_state, config, regex)
                 for regex in (IMAGE_SIDE, LOOKUPS, PER_PAIR))


def image_text_flops(config, num_params: int, split: tuple[int, int, int] | None = None
                     ) -> float:
    """`flops_per_token` of a CLIP or captioner, a row an image and T = seq_len text tokens
    (what tok/s counts), per text token: per row 6 N_img S and the image tower's mixers at S
    over its S tokens (S: the patches, + [CLS] where CLIP pools by it), 6 N_text T and the text
    stack's mixers at T over T tokens (a captioner's also its cross-attention, T queries x S
    keys: 12 D S a token and layer) and 6 N_pair once; over T. N_img, the lookups and N_pair
    are `split` (`image_text_params`, counted from config when None); N_text the rest of
    `num_params`. CLIP adds its logits, each image's projection against the B texts of its
    batch (B: a microbatch's rows, P = projection_dim): 6 B P a row."""
    m, t = config.model, config.seq_len
    image_side, lookups, pair = split or image_text_params(config)
    text_side = num_params - image_side - lookups - pair
    clip = m.family == "clip"
    s = vision.image_tokens(m) if clip else (m.image_size // m.patch_size) ** 2
    stack = transformer_config(m)  # both towers'
    image = 6 * image_side + sum(stack.mixer(i).flops_per_token(stack, s)
                                 for i in range(stack.num_layers))
    text = 6 * text_side + sum(stack.mixer(i).flops_per_token(stack, t) + (
        0 if clip else 12 * stack.num_heads * stack.resolved_head_dim * s)
        for i in range(stack.num_layers))
    rows = config.batch_size // config.optimizer.get("grad_accumulation_steps", 1)
    logits = 6 * rows * m.projection_dim if clip else 0
    return (image * s + text * t + 6 * pair + logits) / t


def model_flops_per_token(config, abstract_state, batch: dict) -> float:
    """A run's `flops_per_token`: of its active params (`state.active_params`), each frozen
    matmul param (`frozen_matmul_params`) counting 4 FLOPs a token, not 6; for an
    encoder-decoder of its encoder side's and of `batch`'s decoder length (decoder_inputs
    [B, T], a training batch: the length the run trains on), for a CLIP or captioner of its
    towers' (`image_text_params`)."""
    def trained(matching=None) -> float:  # (a frozen one as 2/3 of a param in 6 N)
        return (state_lib.active_params(abstract_state, config, matching)
                - frozen_matmul_params(config, abstract_state, matching) / 3)

    if config.model.family in ("clip", "captioner"):  # (the split of the params it has)
        return image_text_flops(config, trained(), tuple(
            trained(regex) for regex in (IMAGE_SIDE, LOOKUPS, PER_PAIR)))
    if config.model.family != "t5":
        return flops_per_token(config, trained())
    return flops_per_token(config, trained(), (trained(ENCODER_SIDE),
                                               batch["decoder_inputs"].shape[1]))


def frozen_matmul_params(config, abstract_state, matching: str | None = None) -> int:
    """The active matmul params (`matmul_params`'s; of those `matching` finds) that no update
    changes (`optim.frozen_regex`: optimizer.freeze's, a LoRA run's base): the forward and the
    gradient through them run, their weight gradient never does (`step.trained_value_and_grad`).
    """
    from transformer.training import optim

    frozen = optim.frozen_regex(config)
    if not frozen:
        return 0
    m = config.model
    if m.family in ("clip", "captioner"):
        lookups = LOOKUPS
    else:  # learned positions, T5's relative buckets, a token table no head multiplies by
        untied = not m.get("tie_embeddings", True) or m.get("head", "mlm") != "mlm"
        lookups = "position_embedding|rel_embedding" + (r"|(^|/)embed/" if untied else "")
    chosen = (frozen,) if matching is None else (frozen, matching)
    return (state_lib.active_params(abstract_state, config, chosen)
            - state_lib.active_params(abstract_state, config, (*chosen, lookups)))


def hardware_flops_per_token(config, model_flops: float, train_step, *args) -> float | None:
    """FLOPs the hardware runs per trained token: under rematerialisation (model.remat_policy)
    or pipelining (mesh.stage > 1, whose program also runs every stage through the bubble's
    iterations), the matmuls of the train step's program (`program_matmul_flops` of
    `train_step` traced on `args`: the forward, what the backward recomputes as JAX wrote it,
    the backward, and the optimizer's) over the step's tokens; None where it cannot count
    them. Otherwise `model_flops` (utilisation is then MFU)."""
    from transformer.parallel import sharding

    stages = config.get("mesh", {}).get("stage", 1)
    if stages == -1:  # the devices the other axes leave
        stages = sharding.mesh_shape(config.mesh, jax.device_count())["stage"]
    if config.model.get("remat_policy", "none") == "none" and stages <= 1:
        return model_flops
    flops = program_matmul_flops(train_step.trace(*args).jaxpr.jaxpr)
    return None if flops is None else flops / (config.batch_size * config.seq_len)


def program_matmul_flops(jaxpr) -> float | None:
    """2 x the multiply-adds of the matmuls (dot_general, ragged_dot_general, convolutions;
    not a dot_general that contracts nothing, an elementwise product) a jaxpr runs on all its
    devices: a scan's body times its length, a shard_map's body times the devices it is split
    over, a cond's costliest branch; None with a while loop that runs matmuls (its trip count
    is not in the program; one without them, an index's, counts 0)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name, out = eqn.primitive.name, eqn.outvars[0].aval.shape if eqn.outvars else ()
        if name in ("dot_general", "ragged_dot_general"):
            ragged = eqn.params.get("ragged_dot_dimension_numbers")
            numbers = eqn.params["dimension_numbers"] if ragged is None else \
                ragged.dot_dimension_numbers
            lhs = eqn.invars[0].aval.shape
            # (one contracting nothing is an elementwise product, Mamba 2's decay scalings
            # written as einsums: no matmul, and counted nowhere else either)
            flops = 2 * math.prod(out) * math.prod(lhs[d] for d in numbers[0][0]) \
                if numbers[0][0] else 0.0
            if ragged is not None and set(ragged.lhs_ragged_dimensions) & set(numbers[0][0]):
                # the ragged rows are summed into one [in, out] block a group (the experts'
                # weight gradient [G, in, out]): each row meets its own group's block only
                flops /= eqn.invars[2].aval.shape[0]
            total += flops
        elif name == "conv_general_dilated":  # each output, the kernel's taps x input features
            kernel = eqn.invars[1].aval.shape
            total += 2 * math.prod(out) * math.prod(kernel) / kernel[
                eqn.params["dimension_numbers"].rhs_spec[0]]
        subs = [sub for value in eqn.params.values()
                for sub in (value if isinstance(value, tuple | list) else [value])
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns")]
        counts = [program_matmul_flops(getattr(sub, "jaxpr", sub)) for sub in subs]
        if None in counts or (name == "while" and any(counts)):
            return None
        if name == "while":
            continue
        if name == "cond":
            total += max(counts, default=0)
            continue
        times = eqn.params["length"] if name == "scan" else 1
        if name == "shard_map":
            times = math.prod(eqn.params["mesh"].shape[a] for a in eqn.params["newly_manual_axes"])
        total += times * sum(counts)
    return total


def _host_id() -> str:
    """The cached peak's key: the CPU (its model name, with the family and model numbers where
    /proc/cpuinfo has them), the cores this process may use and the jax version."""
    fields = {}
    if os.path.isfile(CPUINFO):
        with open(CPUINFO) as f:
            for line in f:
                if not line.strip() and fields:
                    break  # the first processor's block is enough
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    model = fields.get("model name") or platform.processor()
    if fields.get("cpu family") and fields.get("model"):
        # A VM's model name ("AMD EPYC") can cover several generations, each with its peak.
        model += f" (family {fields['cpu family']}, model {fields['model']})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} | {cores} cores | jax {jax.__version__}"


def measured_cpu_peak(size: int = 2048, repeats: int = 5,
                      cache: str | None = CPU_PEAK_CACHE) -> float:
    """The best FLOP/s this host's CPU has shown on a float32 [size, size] matmul (compiled and
    warmed up, best of `repeats` timings), `cpu_peak`'s first value."""
    return cpu_peak(size, repeats, cache)[0]


def cpu_peak(size: int = 2048, repeats: int = 5,
             cache: str | None = CPU_PEAK_CACHE) -> tuple[float, float]:
    """(the best matmul FLOP/s seen on this host, this call's measurement). Measured at every
    call, fully (`repeats` timings) the first time and cheaply (2) once a value is cached per
    CPU model, core count and jax version; the cache keeps the best. A measurement taken while
    the machine was busy reads low and is then outdone, never kept as the peak."""
    key = _host_id()
    entries, cached = {}, 0.0
    if cache and os.path.isfile(cache):
        try:
            with open(cache) as f:
                entries = json.load(f)
            cached = float(entries.get(key) or 0.0)
        except (OSError, ValueError):
            entries = {}
    cpu = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size)), cpu)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(2 if cached else repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    now = 2 * size**3 / best
    if cache and now > cached:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            fileio.write_atomic(cache, json.dumps({**entries, key: now}, indent=1))
        except (OSError, ValueError):
            pass  # an unwritable home: measure again next time
    return max(now, cached), now


def peak_flops(config, devices=None) -> tuple[float | None, str]:
    """(peak FLOP/s per device, where it comes from) for MFU; (None, why) where there is no
    honest figure. `config.peak_flops_per_device` > 0 wins; accelerators use `PEAK_FLOPS` by
    device_kind and compute dtype; CPU devices share the host's measured peak."""
    if configured := config.get("peak_flops_per_device", 0.0):
        return float(configured), "config.peak_flops_per_device"
    devices = devices or jax.devices()
    device = devices[0]
    if device.platform == "cpu":
        local = sum(d.process_index == device.process_index for d in devices)
        host, now = cpu_peak()
        return host / local, (f"measured: best float32 2048x2048 matmul seen on this host, "
                              f"{host / 1e9:.0f} GFLOP/s (this start: {now / 1e9:.0f}) shared "
                              f"by {local} CPU device(s)")
    bf16 = config.model.get("dtype") == "bfloat16"
    for prefix, bf16_peak, float32_peak in PEAK_FLOPS:
        if device.device_kind.startswith(prefix):
            return (bf16_peak if bf16 else float32_peak,
                    f"published {'bf16' if bf16 else 'float32'} dense peak of "
                    f"{device.device_kind}")
    return None, (f"no published peak for device_kind {device.device_kind!r}: set "
                  "peak_flops_per_device for MFU")


def format_eta(seconds: float) -> str:
    """H:MM:SS, rounded up (0:00:00 only when nothing is left)."""
    seconds = math.ceil(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def read_records(path: str, damaged_ok: bool = False) -> list[tuple[str, dict]]:
    """(line, record) of each record in a metrics.jsonl ([] without the file). A last line
    that does not parse is dropped: a run killed mid-write leaves it half-written. One
    elsewhere is damage, refused in one line naming the file and line (`damaged_ok`: dropped
    too, with a warning naming it)."""
    if not fileio.path(path).exists():
        return []
    lines = fileio.path(path).read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            why = "" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        except json.JSONDecodeError as error:
            why = f"column {error.colno}: {error.msg}"
        if not why:
            records.append((line, record))
        elif i != last:
            damage = f"{path}: line {i + 1} is not a JSON record ({why})"
            if not damaged_ok:
                raise ValueError(f"{damage}: expected a record a line, only the last one "
                                 "half-written (by a run killed mid-write): mend or delete "
                                 "that line")
            print(f"warning: {damage}: dropped", file=sys.stderr)
    return records


def keep_records_up_to(path: str, step: int) -> list[str]:
    """Drops the metrics a killed run logged after its last checkpoint (they are trained and
    logged again on resume) and any line it left half-written; rewrites the file atomically
    and returns the kept lines."""
    if not fileio.path(path).exists():
        return []
    kept = [line + "\n" for line, record in read_records(path, damaged_ok=True)
            if record.get("step", 0) <= step]
    fileio.write_atomic(path, "".join(kept))
    return kept


# What tensorboardX imports at its own import for what a run's logger may never need: torch
# (2 s) to accept torch tensors, where we log floats; boto3 and google.cloud.storage (0.65 s) to
# write s3:// and gs:// log directories, which a local workdir does not use.
_NOT_FOR_FLOATS = ("torch",)
_NOT_FOR_LOCAL = ("boto3", "google.cloud.storage")
_imported_without_clients = False


def summary_writer_class(remote: bool = True):
    """tensorboardX's SummaryWriter, imported without the modules it would load in vain.

    A `None` in sys.modules makes an `import` fail as if the module were absent, which
    tensorboardX allows; the entries are removed again, so a later import (export, HF) loads
    them as usual. `remote`: the writer's directory is a URL, so its object-store client must
    load. tensorboardX's gs:// and s3:// writers work only where their client imported with its
    record writer: a remote logger after a local one in the same process reloads that module.
    """
    global _imported_without_clients
    if "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter, record_writer
        if remote and _imported_without_clients:
            importlib.reload(record_writer)
            _imported_without_clients = False
        return SummaryWriter
    blocked = [name for name in _NOT_FOR_FLOATS + (() if remote else _NOT_FOR_LOCAL)
               if name not in sys.modules]
    _imported_without_clients = any(name in _NOT_FOR_LOCAL for name in blocked)
    sys.modules.update(dict.fromkeys(blocked))
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            del sys.modules[name]
    return SummaryWriter


def _stopped_at(workdir: str, step: int) -> float:
    """The `elapsed` of the start that stopped at checkpoint `step` and said so (a signal, the
    run's end: its summary.json is of that step), which counts its final save and evaluations
    after its last record; 0.0 where the summary is of another step, or there is none."""
    try:
        summary = json.loads(fileio.path(fileio.join(workdir, "summary.json")).read_text())
        return float(summary["elapsed"]) if summary.get("step") == step else 0.0
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


class MetricsLogger:
    """Metrics to JSONL + TensorBoard (process 0), progress lines to the terminal.

    On a resume from `start_step`, the records a killed run logged after it are dropped: from
    metrics.jsonl (`keep_records_up_to`) and from TensorBoard's view of the old event files.
    The records kept are in `kept`; one an earlier start logged at `start_step` itself is never
    written again (`earlier`: a start resumed at the last step re-runs only the after-training
    evaluations it lacks). Every record carries `elapsed`: seconds of this run so far, summed
    over resumes (the time a killed run spent after its last checkpoint is dropped with its
    records; a start that stopped on a signal counts to its summary, its final save included).
    `sink` (W&B: transformer.training.wandb_logging.Sink) gets every record too, and the
    summary at `finish`.
    """

    sink = None

    def __init__(self, workdir: str, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.interactive = sys.stdout.isatty()
        self.prefix = ""  # before every printed line ("seed 1: ": transformer.batched)
        self.start = time.perf_counter()
        self.elapsed_before = 0.0
        self.start_step, self.kept = start_step, []
        if enabled:
            SummaryWriter = summary_writer_class(fileio.is_remote(workdir))
            self.path = fileio.join(workdir, "metrics.jsonl")
            lines = keep_records_up_to(self.path, start_step)
            self.kept = [json.loads(line) for line in lines]
            if lines:
                self.elapsed_before = self.kept[-1].get("elapsed", 0.0)
                self.elapsed_before = max(self.elapsed_before, _stopped_at(workdir, start_step))
            # Object stores cannot append: a remote file is kept in memory and rewritten whole
            # at each record; a local one is appended to.
            remote = fileio.is_remote(self.path)
            self.lines = lines if remote else None
            self.jsonl = None if remote else open(self.path, "a")  # noqa: SIM115
            # Event files cannot be trimmed like metrics.jsonl: the new one opens with a
            # SessionLog START at start_step + 1 (tensorboardX's purge_step), and TensorBoard
            # then drops the earlier files' events at that step or later, the steps trained
            # again.
            self.tensorboard = SummaryWriter(fileio.join(workdir, "tensorboard"),
                                             purge_step=start_step + 1)
            # It warns at every NaN scalar; the run itself stops at the first one, in one line.
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.start

    def earlier(self, step: int, split: str) -> dict | None:
        """The metrics of the `split` record an earlier start logged at `step`, if kept (only
        at start_step: the steps after it are trained and logged again), else None."""
        if step != self.start_step:
            return None
        return next(({k: v for k, v in r.items() if k not in ("step", "split", "elapsed")}
                     for r in self.kept if r.get("step") == step and r.get("split") == split), None)

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled or self.earlier(step, split) is not None:
            return  # (already in metrics.jsonl, TensorBoard and W&B)
        line = json.dumps({"step": step, "split": split, **metrics,
                           "elapsed": self.elapsed()}) + "\n"
        # TensorBoard first: a record metrics.jsonl holds is never written again (`earlier`),
        # so one killed between the two would stay missing from TensorBoard for good
        for name, value in metrics.items():
            if isinstance(value, int | float):  # e.g. not new_data's list of changes
                self.tensorboard.add_scalar(f"{split}/{name}", value, step)
        self.tensorboard.flush()
        if self.jsonl is None:
            self.lines.append(line)
            fileio.write_atomic(self.path, "".join(self.lines))
        else:
            self.jsonl.write(line)
            self.jsonl.flush()
        if self.sink is not None:
            self.sink.log(step, split, metrics)

    def print(self, line: str, transient: bool = False) -> None:
        if not self.enabled:
            return
        line = self.prefix + line
        if self.interactive and transient:
            print("\r" + line.ljust(120), end="", flush=True)
        else:
            print(("\r" if self.interactive else "") + line, flush=True)

    def close(self):
        if self.enabled:
            if self.jsonl is not None:
                self.jsonl.close()
            self.tensorboard.close()

    def finish(self, summary: dict | None) -> None:
        """Ends the sink's run after close: with the run's summary, or as failed (None)."""
        sink, self.sink = self.sink, None
        if sink is not None:
            if summary is not None:
                sink.summary(summary)
            sink.finish(exit_code=0 if summary is not None else 1)
