"""Writes docs/config.md, the config reference: every key of `transformer.configs.base_config()`
(nested groups flattened: `optimizer.learning_rate`, `model.moe.top_k`) with its default, its
allowed values and what it means.

    PYTHONPATH=. python docs/gen_config_reference.py      # rewrites docs/config.md

Allowed values come from the code's choice tables (`config.POSITIONS`, `kernels.IMPLS`, ...),
else from `configs.CHECKS` where the key has a line there, else from `ALLOWED` below; meanings
from `MEANINGS`. tests/test_docs.py fails when a key of base_config() has no meaning here, or when
the committed page is not what this script writes.
"""

from __future__ import annotations

import os
import sys

import ml_collections

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.md")

# One line per key: what it does (the allowed values and default are added from the code).
MEANINGS: dict[str, str] = {
    # top level
    "experiment": "The experiment's name; the default workdir is `runs/<experiment>`.",
    "seed": "Seeds the init, dropout, data order and the sampled validation windows.",
    "steps": "Training steps in all; may change on resume.",
    "batch_size": "Global batch size in rows, across all processes.",
    "seq_len": "Tokens per row (the model's context during training).",
    "log_every": "Steps between progress lines and train records in `metrics.jsonl`.",
    "eval_every": "Steps between validation evaluations.",
    "eval_steps": "Validation batches per evaluation (a fixed seeded sample of the windows).",
    "eval_seq_lens": "Extra validation lengths evaluated at the end of training (length "
                     "extrapolation), e.g. `(256, 512)`.",
    "eval_tasks": "lm-eval tasks scored during training (`training.task_eval`): task names "
                  "or local task YAML files.",
    "eval_tasks_every": "Steps between task evaluations.",
    "eval_tasks_limit": "Documents scored per task.",
    "checkpoint_every": "Steps between checkpoint saves.",
    "keep_checkpoints": "How many of the run's own newest checkpoints are kept.",
    "fresh_start": "Set the workdir's old run aside (`checkpoints.set-aside-<time>/`) and start "
                   "at step 0; a one-off.",
    "new_data": "Resume the checkpoint's params and optimizer on a different data stream, from "
                "that stream's start (otherwise a changed stream is refused).",
    "nonfinite": "What a NaN/Inf loss or gradient does: `stop` (keep the last good checkpoint) "
                 "or `skip` the update.",
    "max_nonfinite_skips": "With `nonfinite=\"skip\"`: stop after this many bad steps in a row.",
    "max_grad_norm": "A step whose gradient norm exceeds it counts as bad, like NaN.",
    "z_loss": "Weight of the z-loss, the squared log of the softmax normalizer.",
    "label_smoothing": "Label smoothing of the cross-entropy.",
    "peak_flops_per_device": "MFU's peak FLOP/s per device; 0: the accelerator's published peak "
                             "or, on CPU, this host's measured float32 matmul peak.",
    "compiler_options": "XLA options for the jitted steps on top of the CPU defaults, e.g. "
                        "`{'xla_cpu_multi_thread_eigen': False}`; checked by XLA before anything "
                        "compiles.",
    "init_from": "Fine-tuning: start the params from `WORKDIR`, `WORKDIR@STEP` or `hf:DIR` (a "
                 "Hugging Face save_pretrained directory); \"\": a fresh init.",
    # data
    "data.path": "\"\": the embedded corpus; or a text file, directory, glob, a `prepare` "
                 "output directory or a directory of `.bin` token shards.",
    "data.unit": "How text becomes documents: `paragraph` or `file` (hash-split, packed with "
                 "segment ids) or `stream` (each file one token stream, the last "
                 "`validation_fraction` validates).",
    "data.validation_path": "Explicit validation text (file, directory or glob): no split is "
                            "applied to it or to `data.path`.",
    "data.test_path": "Held-out test text, evaluated whole at the end of training and by "
                      "`transformer.evaluate --split=test`.",
    "data.validation_fraction": "The share of the text (stream) or of the documents (hash "
                                "split) that validates.",
    "data.sources": "A weighted mixture instead of `data.path`: one `key=value,...` string per "
                    "source (path and weight required; unit, validation_path, name optional).",
    "data.tokenizer": "The tokenizer kind; `hf` loads a Hugging Face tokenizer.json.",
    "data.tokenizer_path": "With `tokenizer=\"hf\"`: a tokenizer.json or a directory holding one; "
                           "\"\" with `init_from=\"hf:DIR\"` reads DIR's.",
    "data.vocab_size": "SentencePiece vocabulary size.",
    "data.num_sentinels": "T5 sentinel ids appended above the vocabulary (or the vocabulary's "
                          "own `<extra_id_i>`); 0 keeps a pretrained vocabulary's size.",
    "data.objective": "The training objective; \"\": the model family's.",
    "data.mlm_rate": "MLM: the share of non-special tokens selected (80/10/10).",
    "data.noise_density": "Span corruption: the share of tokens in noise spans.",
    "data.mean_span_length": "Span corruption: the mean noise span length.",
    "data.prefetch": "Batches the input pipeline prepares ahead.",
    "data.task": "A labeled task: `speakers` (play text at `data.path`) or `modules` (the "
                 "embedded corpus); \"\": none.",
    "data.num_classes": "The task's most frequent labels kept as classes.",
    "data.sft_truncate": "`objective=\"sft\"`: cut conversations longer than seq_len + 1 "
                         "tokens (and say how many); False: such a conversation is an error.",
    # optimizer
    "optimizer.name": "The update rule (optax's own); structural: a resume keeps the "
                      "checkpoint's.",
    "optimizer.learning_rate": "The peak learning rate (under muon: the AdamW part's).",
    "optimizer.warmup_steps": "Steps of linear warmup to the peak.",
    "optimizer.decay": "The schedule after the warmup; `schedule_free_adamw` takes `constant`.",
    "optimizer.min_learning_rate_ratio": "Where cosine, linear and wsd end, as a share of the "
                                         "peak.",
    "optimizer.decay_fraction": "wsd: the last share of the steps that decays.",
    "optimizer.decay_shape": "wsd: the shape of the final decay.",
    "optimizer.b1": "Adam's (and Lion's, schedule-free's) first-moment decay.",
    "optimizer.b2": "Adam's (and Lion's, schedule-free's) second-moment decay.",
    "optimizer.weight_decay": "Decoupled weight decay (matrices only for adamw, lion; every "
                              "param for schedule_free_adamw; L2 for sgd).",
    "optimizer.momentum": "sgd's momentum.",
    "optimizer.nesterov": "sgd: Nesterov momentum.",
    "optimizer.muon_learning_rate": "muon: the hidden matrices' peak rate (the rest take "
                                    "`learning_rate`).",
    "optimizer.muon_momentum": "muon's (Nesterov) momentum.",
    "optimizer.adafactor_decay_rate": "adafactor: second moments decay as 1 - step^-rate.",
    "optimizer.adafactor_clipping_threshold": "adafactor: update RMS clipping.",
    "optimizer.adafactor_parameter_scale": "adafactor: the rate is relative to each param's RMS.",
    "optimizer.adafactor_min_dim_size_to_factor": "adafactor: smallest dimension whose second "
                                                  "moments are factored.",
    "optimizer.adafactor_momentum": "adafactor's first-moment decay.",
    "optimizer.grad_clip_norm": "Global-norm gradient clipping.",
    "optimizer.grad_accumulation_steps": "Micro-batches per step (the batch is split into "
                                         "them).",
    "optimizer.freeze": "Regex of param names (`encoder/layers/...`) that stay fixed.",
    "optimizer.head": "Regex of param names trained at `head_learning_rate`.",
    "optimizer.head_learning_rate": "The head's peak rate.",
    # model
    "model.family": "The model family (`transformer.models.FAMILIES`).",
    "model.vocab_size": "Vocabulary size.",
    "model.tie_embeddings": "The output head shares the token embedding.",
    "model.num_layers": "Blocks in the stack (the encoder's, for T5).",
    "model.d_model": "Width of the residual stream.",
    "model.num_heads": "Query heads.",
    "model.num_kv_heads": "Key/value heads: None = num_heads (MHA); 1: MQA; otherwise GQA.",
    "model.head_dim": "Width of a head; None: d_model // num_heads.",
    "model.d_ff": "Hidden units of the feed-forward layer (and of each expert).",
    "model.activation": "The feed-forward nonlinearity; swiglu and geglu are gated.",
    "model.norm": "The norm.",
    "model.norm_placement": "pre x + f(N(x)); post N(x + f(x)); sandwich x + N'(f(N(x))) (Gemma "
                            "2); post_sublayer x + N'(f(x)) (OLMo 2).",
    "model.norm_epsilon": "The norms' epsilon.",
    "model.qk_norm": "RMSNorm with a learned scale on q and k, before RoPE (Qwen3, Gemma 3, "
                     "OLMo 2).",
    "model.qk_norm_scope": "qk_norm over each head (`head`) or the whole projection "
                           "(`projection`).",
    "model.attention_softcap": "Caps the scaled attention logits: cap * tanh(logits / cap) "
                               "(Gemma 2: 50); 0: off.",
    "model.final_logit_softcap": "The same cap on a decoder LM's output logits (Gemma 2: 30); "
                                 "0: off.",
    "model.parallel_block": "x + attn(N(x)) + mlp(N(x)) with one norm (GPT-J, PaLM); pre-norm "
                            "blocks without cross-attention.",
    "model.scale_residual_init": "Kernels writing into the residual stream start with their "
                                 "std / sqrt(2 num_layers) (GPT-2).",
    "model.parametrization": "`mup`: muP, a model wider than `mup_base_width` trains like the "
                             "base (GPT and prefix LM).",
    "model.mup_base_width": "muP: the width the hyperparameters were tuned at; 0: d_model.",
    "model.position": "Positional encoding (`t5`: relative buckets).",
    "model.max_len": "Positions of a learned position table.",
    "model.rope_theta": "RoPE's base.",
    "model.rope_layout": "RoPE pairs the two halves (`half`) or neighbours (`interleaved`).",
    "model.rope_scale": "> 1: positions stretched by this factor, as `rope_scaling` says.",
    "model.rope_scaling": "`linear` (position interpolation) or `llama3` (Llama 3.1).",
    "model.rope_low_freq_factor": "llama3 scaling's low-frequency factor.",
    "model.rope_high_freq_factor": "llama3 scaling's high-frequency factor.",
    "model.rope_original_max_len": "llama3 scaling: the context length trained at.",
    "model.t5_num_buckets": "T5 relative-position buckets.",
    "model.t5_max_distance": "T5 relative positions: the distance the largest bucket starts at.",
    "model.use_bias": "Biases on the projections and the feed-forward layer.",
    "model.qkv_bias": "Biases on q/k/v only; None: = use_bias (Qwen2: True).",
    "model.sliding_window": "Decoder LMs: each token sees the last W positions, itself "
                            "included (Mistral); None: no limit.",
    "model.sliding_window_pattern": "With sliding_window: layers P-1, 2P-1, ... attend to every "
                                    "earlier position (Gemma 2: 2, Gemma 3: 6); 0: every layer "
                                    "windowed.",
    "model.attention_scale": "Attention logit scale; None: 1/sqrt(head_dim) (T5: 1.0).",
    "model.embedding_norm": "A norm after adding absolute positions (BERT).",
    "model.scale_embeddings": "Inputs times sqrt(d_model) before positions.",
    "model.dropout_rate": "Dropout on the residual branches and embeddings.",
    "model.attention_dropout_rate": "Dropout on the attention weights (runs the dense kernel).",
    "model.init_std": "Normal init std of the kernels; None: fan-in scaling (GPT-2: 0.02).",
    "model.dtype": "Compute dtype (softmax and loss stay float32).",
    "model.param_dtype": "Dtype the params are kept in.",
    "model.quantization": "Quantized training through Qwix: '' (none), 'int8' or 'fp8' for the "
                          "attention projections and MLPs (params stay float; it may change on "
                          "resume). See docs/performance.md.",
    "model.quantize_head": "With model.quantization: quantize the output head too (the tied "
                           "embedding's logits or lm_head).",
    "model.scan_layers": "Run the stack as one `nn.scan` over layers (faster compiles).",
    "model.remat_policy": "What the backward pass recomputes: none, everything (`full`) or all "
                          "but the matmuls.",
    "model.attention_impl": "The attention kernel; `auto`: splash on TPU (per device under a "
                            "`sequence` axis too), cuDNN on GPU, chunked for long sequences, "
                            "else dense; `reference`: the plain float32 formula by autodiff, "
                            "for prototyping.",
    "model.sequence_parallel": "Under a `sequence` mesh axis: how attention reaches the other "
                               "devices' keys.",
    "model.sequence_load_balance": "Under a `sequence` mesh axis: lay decoder LMs' sequences out "
                                   "zig-zag so every device does the same causal work.",
    "model.lora.rank": "LoRA adapters' rank on the kernels `model.lora.targets` matches; 0: no "
                       "adapters (the whole model trains). Needs `init_from`.",
    "model.lora.alpha": "The adapters' output is scaled by alpha / rank (peft's lora_alpha).",
    "model.lora.targets": "Regex over the kernels' param paths (`decoder/layers_0/mlp/wi`) "
                          "that get adapters; default attention's q/k/v/out and the MLP's.",
    "model.lora.dropout": "Dropout on the adapters' input during training.",
    "model.lora.base_quantization": "QLoRA: the frozen targeted kernels stored as Qwix int8 (a "
                                    "scale per output channel), dequantized on the fly; \"\": "
                                    "float.",
    "model.moe.num_experts": "Experts per MoE layer; 0 keeps dense feed-forward layers.",
    "model.moe.top_k": "Experts per token.",
    "model.moe.every_n_layers": "Layer i (from 0) is MoE when (i + 1) % n == 0; n divides "
                                "num_layers.",
    "model.moe.capacity_factor": "Slots per expert and row, ceil(cf x T x k / E); choices over "
                                 "capacity are dropped; 0: dropless.",
    "model.moe.num_shared": "Always-on shared experts (DeepSeek), num_shared x the experts' "
                            "width hidden units.",
    "model.moe.d_ff": "Each expert's hidden width; 0: `model.d_ff` (Qwen-MoE's "
                      "moe_intermediate_size).",
    "model.moe.normalize_gates": "A token's top-k gates renormalised to sum 1 (Mixtral); False: "
                                 "its router probabilities (Qwen2-MoE). Top-1 keeps the "
                                 "probability.",
    "model.moe.shared_gate": "The shared experts' output times sigmoid(x . w) per token "
                             "(Qwen2-MoE).",
    "model.moe.load_balance_loss": "Weight of the load-balancing loss (Switch / GShard).",
    "model.moe.router_z_loss": "Weight of the router z-loss (ST-MoE).",
    "model.num_decoder_layers": "Encoder-decoder: decoder depth; None: = num_layers.",
    "model.scale_decoder_output": "Encoder-decoder: scale the decoder output by d_model^-0.5 "
                                  "before the head (T5 v1.0).",
    "model.type_vocab_size": "BERT: the sentence A/B vocabulary.",
    "model.head": "BERT and GPT: `mlm` (the LM head), `classify` (a sequence classifier) or "
                  "`none` (the last layer's vectors).",
    "model.num_classes": "Classifier classes.",
    "model.image_size": "Images (vit, clip): square images of this side.",
    "model.patch_size": "Images: side of the square patches.",
    "model.channels": "Images: channels.",
    "model.pooling": "Images: the pooled vector, [CLS] or the mean; none: every patch's vector "
                     "(the captioner's cross-attention).",
    "model.patch_position": "Images: patch positions (the stack's own `position` should then be "
                            "`none`).",
    "model.projection_dim": "CLIP: the shared embedding width of the two towers.",
    # pipeline
    "pipeline.microbatches": "With `mesh.stage` > 1: the microbatches each (accumulation) step's "
                             "rows split into on the pipeline; the bubble is (S-1)/(M*R+S-1).",
    "pipeline.repeats": "With `mesh.stage` > 1: > 1 runs the circular schedule, each stage "
                        "holding this many blocks of layers spread through the stack (needs "
                        "microbatches >= stages).",
    # profile, wandb
    "profile.start_step": "The first step traced by `jax.profiler` into `WORKDIR/profile/`.",
    "profile.num_steps": "Steps traced.",
    "profile.all_hosts": "Trace on every host, not process 0 alone.",
    "wandb.project": "Weights & Biases project; \"\": no W&B (set, it needs the `wandb` extra).",
    "wandb.entity": "W&B entity (user or team).",
    "wandb.name": "W&B run name; \"\": the experiment's.",
    "wandb.mode": "`offline` writes files under `WORKDIR/wandb/`.",
    "wandb.variant": "Set by `transformer.sweep`: the variant, a W&B config field.",
}

# Allowed values of the keys without a CHECKS line and without a choice table in the code.
ALLOWED: dict[str, str] = {
    "compiler_options": "a dict of XLA option names to values",
    "model.vocab_size": "an int >= 0 (0: the tokenizer's)",
    "model.tie_embeddings": "a bool",
    "model.num_layers": "an int > 0",
    "model.d_model": "an int > 0",
    "model.num_heads": "an int > 0",
    "model.num_kv_heads": "None, or an int > 0 dividing num_heads",
    "model.head_dim": "None, or an int > 0 (even with RoPE)",
    "model.d_ff": "an int > 0",
    "model.norm_epsilon": "a number > 0",
    "model.qk_norm": "a bool",
    "model.attention_softcap": "a number >= 0 (0: off)",
    "model.final_logit_softcap": "a number >= 0 (0: off; gpt and prefix_lm)",
    "model.parallel_block": "a bool (with norm_placement 'pre')",
    "model.scale_residual_init": "a bool",
    "model.mup_base_width": "an int >= 0 (0: d_model)",
    "model.max_len": "an int > 0",
    "model.rope_theta": "a number > 0",
    "model.rope_scale": "a number (1: no scaling)",
    "model.rope_low_freq_factor": "a number, 0 < low < high",
    "model.rope_high_freq_factor": "a number > rope_low_freq_factor",
    "model.rope_original_max_len": "an int > 0",
    "model.t5_num_buckets": "an int > 0",
    "model.t5_max_distance": "an int > 0",
    "model.use_bias": "a bool",
    "model.qkv_bias": "None or a bool",
    "model.sliding_window": "None, or an int > 0 (family gpt)",
    "model.sliding_window_pattern": "an int >= 0",
    "model.attention_scale": "None or a number",
    "model.embedding_norm": "a bool",
    "model.scale_embeddings": "a bool",
    "model.dropout_rate": "a number in [0, 1)",
    "model.attention_dropout_rate": "a number in [0, 1)",
    "model.init_std": "None or a number > 0",
    "model.scan_layers": "a bool",
    "model.sequence_load_balance": "a bool",
    "model.moe.num_experts": "an int >= 0 (0: dense)",
    "model.moe.top_k": "an int in [1, num_experts]",
    "model.moe.every_n_layers": "an int >= 1",
    "model.moe.capacity_factor": "a number >= 0 (0: dropless)",
    "model.moe.num_shared": "an int >= 0",
    "model.moe.d_ff": "an int >= 0 (0: model.d_ff)",
    "model.moe.normalize_gates": "a bool",
    "model.moe.shared_gate": "a bool",
    "model.moe.load_balance_loss": "a number >= 0",
    "model.moe.router_z_loss": "a number >= 0",
    "model.num_decoder_layers": "None or an int > 0",
    "model.scale_decoder_output": "a bool",
    "model.type_vocab_size": "an int > 0",
    "model.image_size": "an int > 0, a multiple of patch_size",
    "model.patch_size": "an int > 0",
    "model.channels": "an int > 0",
    "model.projection_dim": "an int > 0",
}

GROUPS = (  # (title, key prefix); a key goes to the first group whose prefix it starts with
    ("Model: `model.moe.*` (mixture of experts)", "model.moe."),
    ("Model: `model.*`", "model."),
    ("Data: `data.*`", "data."),
    ("Optimizer: `optimizer.*`", "optimizer."),
    ("Device mesh: `mesh.*`", "mesh."),
    ("Pipeline: `pipeline.*`", "pipeline."),
    ("Profiling: `profile.*`", "profile."),
    ("Weights & Biases: `wandb.*`", "wandb."),
    ("Top level", ""),
)
ORDER = ("Top level", "Data: `data.*`", "Optimizer: `optimizer.*`", "Model: `model.*`",
         "Model: `model.moe.*` (mixture of experts)", "Device mesh: `mesh.*`",
         "Pipeline: `pipeline.*`", "Profiling: `profile.*`", "Weights & Biases: `wandb.*`")


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, default) for every leaf; an empty group (compiler_options) is a leaf."""
    out = []
    for key in config.keys():
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict) and len(value.keys()):
            out += flat_keys(value, f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


def _choices() -> dict[str, str]:
    """Allowed values of the model keys that name a choice, from the code's own tables."""
    from transformer.data import pipeline
    from transformer.models import bert, vision
    from transformer.nn import activations, config, kernels, sequence_parallel
    from transformer.parallel import sharding

    tables = {"activation": tuple(activations.ACTIVATIONS), "norm": config.NORMS,
              "norm_placement": config.NORM_PLACEMENTS, "qk_norm_scope": config.QK_NORM_SCOPES,
              "parametrization": config.PARAMETRIZATIONS, "position": config.POSITIONS,
              "rope_layout": ("half", "interleaved"), "rope_scaling": ("linear", "llama3"),
              "remat_policy": tuple(config.REMAT_POLICIES), "attention_impl": kernels.IMPLS,
              "sequence_parallel": sequence_parallel.STRATEGIES, "head": bert.HEADS,
              "pooling": vision.POOLINGS, "patch_position": vision.PATCH_POSITIONS}
    out = {f"model.{key}": f"one of {tuple(choices)}" for key, choices in tables.items()}
    objectives = pipeline.OBJECTIVES + pipeline.TASK_OBJECTIVES + pipeline.IMAGE_OBJECTIVES + \
        pipeline.CHAT_OBJECTIVES
    out["data.objective"] = f"\"\" or one of {objectives}"
    out["data.task"] = "\"\" or one of ('speakers', 'modules')"
    for axis in sharding.MESH_AXIS_TABLE:
        out[f"mesh.{axis.name}"] = "an int >= 1, or -1: the devices the other axes leave"
    return out


def meanings() -> dict[str, str]:
    """MEANINGS, with each mesh axis's from `sharding.MESH_AXIS_TABLE`."""
    from transformer.parallel import sharding

    out = dict(MEANINGS)
    for axis in sharding.MESH_AXIS_TABLE:
        out[f"mesh.{axis.name}"] = f"Devices on the `{axis.name}` axis: {axis.doc}."
    return out


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(value) -> str:
    if isinstance(value, ml_collections.ConfigDict):
        value = value.to_dict()
    return f"`{_cell(repr(value))}`"


def render() -> str:
    """The page; a KeyError names the keys of base_config() without a meaning."""
    from transformer import configs

    keys = flat_keys(configs.base_config())
    meaning, choices = meanings(), _choices()
    missing = [key for key, _ in keys if not meaning.get(key)]
    if missing:
        raise KeyError(f"keys of base_config() without a meaning in "
                       f"docs/gen_config_reference.py MEANINGS: {missing}")
    rows = {title: [] for title in ORDER}
    for key, value in keys:
        title = next(title for title, prefix in GROUPS if key.startswith(prefix))
        allowed = choices.get(key) or (configs.CHECKS[key][1] if key in configs.CHECKS else
                                        ALLOWED.get(key, ""))
        rows[title].append(f"| `{key}` | {_default(value)} | {_cell(allowed)} | "
                           f"{_cell(meaning[key])} |")
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by docs/gen_config_reference.py from transformer.configs.base_config();",
        "     do not edit by hand: rerun `PYTHONPATH=. python docs/gen_config_reference.py`. -->",
        "",
        "Every key of `transformer.configs.base_config()`, the config every experiment file "
        "starts from,",
        "with its default there (an experiment may change it), the values it accepts and what "
        "it does.",
        "Set any of them with `--config.KEY=VALUE` (see [Experiments](experiments.md)); a bad "
        "value stops",
        "the run with one line before anything is written. The allowed values are "
        "the code's choice tables, else",
        "`configs.CHECKS`' where the key has a line there, else the model's own checks.",
    ]
    for title in ORDER:
        lines += ["", f"## {title}", "", "| key | default | allowed | meaning |",
                  "| --- | --- | --- | --- |", *rows[title]]
    return "\n".join(lines) + "\n"


def main() -> None:
    text = render()
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {PAGE} ({text.count(chr(10))} lines)", file=sys.stderr)


if __name__ == "__main__":
    main()
