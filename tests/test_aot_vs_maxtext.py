"""benchmarks/aot_vs_maxtext.py's pure parts on canned output: each side's result line, the
version check, the table and the peak buffers of an XLA dump (no venv, TPU or compile)."""

import importlib.util
import json
import pathlib
import sys

import pytest

from transformer import configs

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("aot_vs_maxtext",
                                               REPO / "benchmarks" / "aot_vs_maxtext.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

GIB = 2**30
VERSIONS = {"jax": "0.12.0.1", "jaxlib": "0.12.0.1", "libtpu": "0.0.52", "flax": "0.12.12",
            "maxtext": "", "python": "3.12.1"}


def result(side, attention, temp_gib, **changes):
    r = {"side": side, "shape": "dense", "attention": attention, "topology": "v5p-32",
         "num_params": 1_713_735_680, "flops": 1.0e14,
         "error": "", "argument_bytes": int(1.2 * GIB), "output_bytes": int(1.2 * GIB),
         "alias_bytes": int(1.2 * GIB), "temp_bytes": int(temp_gib * GIB),
         "code_bytes": 40 * 2**20, "seconds": 100.0, "versions": dict(VERSIONS)}
    r.update(changes)
    return r


def test_parse_result_takes_the_marker_line_among_the_logs():
    line = bench.MARKER + json.dumps(result("maxtext", "splash", 5.2))
    output = ("Starting train_compile.py...\nWARNING: could not determine TPU accelerator type\n"
              f"Memory analysis: CompiledMemoryStats(temp_size_in_bytes=1)\n{line}\nbye\n")
    parsed = bench.parse_result(output)
    assert parsed["side"] == "maxtext" and parsed["temp_bytes"] == int(5.2 * GIB)


def test_parse_result_without_a_result_shows_the_end_of_the_output():
    output = "\n".join(f"line {i}" for i in range(40)) + "\nRuntimeError: no libtpu"
    with pytest.raises(ValueError,
                       match="(?s)no AOT_VS_MAXTEXT_RESULT line.*RuntimeError: no libtpu"):
        bench.parse_result(output)


def test_total_counts_outputs_not_aliased_and_the_program():
    r = result("ours", "splash", 6.0, output_bytes=int(1.2 * GIB) + 4096)
    assert bench.total_bytes(r) == int(1.2 * GIB) + 4096 + int(6.0 * GIB) + 40 * 2**20


def test_versions_must_match_on_every_side():
    same = [result("ours", "splash", 6), result("maxtext", "splash", 5)]
    assert bench.version_mismatch(same) == ""
    other = result("maxtext", "dense", 5)
    other["versions"]["libtpu"] = "0.0.51"
    assert bench.version_mismatch(same + [other]) == "libtpu: 0.0.51 vs 0.0.52"
    other["versions"].pop("jax")
    assert "jax: (none) vs 0.12.0.1" in bench.version_mismatch(same + [other])


def test_table_has_a_row_per_compile_and_the_ratio_per_shape_and_attention():
    table = bench.format_table([
        result("ours", "splash", 6.63, kernels=["splash"]), result("maxtext", "splash", 5.20),
        result("ours", "dense", 6.0), result("maxtext", "dense", 6.70, flops=2.0e14),
        result("ours", "splash", 3.0, shape="moe", flops=3.0e14),
        result("maxtext", "splash", 3.5, shape="moe", flops=2.0e14)])
    rows = table.splitlines()
    assert rows[0].startswith("| shape | side | attention | params |")
    assert rows[2] == ("| dense | ours | splash | 1,713,735,680 | 1.20 GiB | 0.00 GiB | "
                       "6.63 GiB | 0.04 GiB | 7.87 GiB | 1.000e+14 |")
    assert rows[3].startswith("| dense | MaxText | flash (splash) |")
    assert rows[5].startswith("| dense | MaxText | dot_product (dense) |")
    assert rows[6].startswith("| moe | ours | splash |")
    assert "dense / splash: ours / MaxText total 1.222x (+1.43 GiB), temporaries 1.275x, " \
           "XLA FLOPs 1.000x; target ours <= MaxText: not met" in table
    assert "dense / dense: ours / MaxText total 0.912x (-0.70 GiB), temporaries 0.896x, " \
           "XLA FLOPs 0.500x; target ours <= MaxText: met" in table
    assert "moe / splash: ours / MaxText total 0.894x (-0.50 GiB), temporaries 0.857x, " \
           "XLA FLOPs 1.500x; target ours <= MaxText: met" in table


def test_table_reads_results_from_before_shapes_as_the_dense_shape():
    old = [result("ours", "splash", 6.0), result("maxtext", "splash", 6.0)]
    for r in old:
        del r["shape"], r["flops"]
    table = bench.format_table(old)
    assert "| dense | ours | splash |" in table and " | - |" in table
    assert "dense / splash: ours / MaxText total 1.000x (+0.00 GiB), temporaries 1.000x; " \
           "target" in table


def test_table_reports_a_side_that_does_not_compile_and_skips_its_ratio():
    table = bench.format_table([result("ours", "dense", 0, error="RESOURCE_EXHAUSTED: HBM"),
                                result("maxtext", "dense", 6.7)])
    assert "| dense | ours | dense | 1,713,735,680 | does not compile: RESOURCE_EXHAUSTED: HBM" \
        in table
    assert "ours / MaxText" not in table


def test_maxtext_overrides_describe_the_same_model_and_batch():
    overrides = dict(o.split("=", 1) for o in bench.maxtext_overrides("v5p-32", "dense"))
    assert overrides["per_device_batch_size"] == "8"  # 128 sequences over 16 chips
    assert overrides["attention"] == "dot_product"
    assert (overrides["base_emb_dim"], overrides["base_mlp_dim"], overrides["vocab_size"]) == \
        ("2048", "8192", "50304")
    assert overrides["remat_policy"] == "full" and overrides["logits_via_embedding"] == "true"
    assert dict(o.split("=", 1) for o in bench.maxtext_overrides("v6e-16", "splash"))[
        "per_device_batch_size"] == "8"
    assert len(overrides) == len(bench.maxtext_overrides("v5p-32", "dense"))  # no key twice


def test_the_moe_shape_is_the_same_model_and_mesh_on_both_sides():
    overrides = dict(o.split("=", 1) for o in bench.maxtext_overrides("v5p-32", "splash", "moe"))
    config = bench.ours_config("v5p-32", "splash", "moe")
    moe = config.model.moe
    assert (overrides["decoder_block"], overrides["attention"]) == ("mixtral", "flash")
    assert (int(overrides["num_experts"]), int(overrides["num_experts_per_tok"])) == \
        (moe.num_experts, moe.top_k) == (8, 2)
    assert int(overrides["base_moe_mlp_dim"]) == int(overrides["base_mlp_dim"]) == \
        config.model.d_ff
    assert moe.every_n_layers == 1 and moe.normalize_gates
    # dropless on both sides: MaxText's capacity_factor -1, ours 0 (ragged, no slots)
    assert float(overrides["capacity_factor"]) == -1 and moe.capacity_factor == 0
    assert overrides["sparse_matmul"] == overrides["megablox"] == "true"
    assert int(overrides["ici_expert_parallelism"]) == config.mesh.expert == 4
    assert overrides["ici_fsdp_parallelism"] == "-1" and config.mesh.fsdp == -1
    assert configs.experiment("mixtral_2b").mesh.expert == 1  # validates on one device
    assert int(overrides["per_device_batch_size"]) * 16 == config.batch_size == 128
    assert int(overrides["max_target_length"]) == config.seq_len == 2048
    assert float(overrides["load_balance_loss_weight"]) == moe.load_balance_loss
    assert int(overrides["base_num_decoder_layers"]) == config.model.num_layers
    assert int(overrides["base_emb_dim"]) == config.model.d_model


def test_the_long_shape_splits_the_length_over_context_on_both_sides():
    overrides = dict(o.split("=", 1) for o in bench.maxtext_overrides("v5p-32", "splash", "long"))
    config = bench.ours_config("v5p-32", "splash", "long")
    assert int(overrides["max_target_length"]) == config.seq_len == config.model.max_len == 32768
    assert int(overrides["ici_context_parallelism"]) == config.mesh.sequence == 4
    assert overrides["context_parallel_strategy"] == config.model.sequence_parallel == "all_gather"
    # batch = chips / context on both sides: 16 chips x 0.25 rows = 4 rows
    assert float(overrides["per_device_batch_size"]) * 16 == config.batch_size == 4
    assert (config.mesh.fsdp, config.model.attention_impl) == (-1, "splash")
    assert bench.ours_config("v5p-32", "dense", "dense").seq_len == 2048  # dense kept as it was


@pytest.mark.parametrize("shape, repeats", [("pipeline", 1), ("circular", 2),
                                            ("circular40", 40)])
def test_the_pipeline_shapes_are_the_same_model_stages_and_slices_on_both_sides(shape, repeats):
    overrides = dict(o.split("=", 1) for o in bench.maxtext_overrides("v5p-32", "splash", shape))
    config = bench.ours_config("v5p-32", "splash", shape)
    m = config.model
    assert (int(overrides["base_num_decoder_layers"]), int(overrides["base_emb_dim"]),
            int(overrides["base_num_query_heads"]), int(overrides["base_num_kv_heads"]),
            int(overrides["head_dim"]), int(overrides["base_mlp_dim"]),
            int(overrides["vocab_size"])) == \
        (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.d_ff,
         m.vocab_size) == (80, 8192, 64, 8, 128, 28672, 128256)
    assert overrides["logits_via_embedding"] == "false" and not m.tie_embeddings
    # two slices on both sides, the stages across them, fsdp over each slice's 16 chips
    assert int(overrides["compile_topology_num_slices"]) == bench.SHAPES[shape].slices == 2
    assert int(overrides["dcn_pipeline_parallelism"]) == config.mesh.stage == 2
    assert overrides.get("ici_pipeline_parallelism", "1") == "1"
    assert overrides["ici_fsdp_parallelism"] == "-1" and config.mesh.fsdp == -1
    assert int(overrides["num_pipeline_microbatches"]) == config.pipeline.microbatches == 8
    assert int(overrides["num_pipeline_repeats"]) == config.pipeline.repeats == repeats
    # MaxText's stages x repeats x layers per stage is its depth; ours stage x repeats blocks
    assert 2 * repeats * int(overrides["num_layers_per_pipeline_stage"]) == m.num_layers
    assert overrides["scan_layers_per_stage"] == "true" and m.scan_layers
    # batch 128 x 2048: 4 rows a chip on MaxText's 32 chips
    assert int(overrides["per_device_batch_size"]) * 32 == config.batch_size == 128
    assert int(overrides["max_target_length"]) == config.seq_len == 2048
    assert configs.experiment("llama_70b").mesh.stage == 1  # validates on one device
    assert f"bubble {bench.bubble(2, 8, repeats):.1%}" in bench.SHAPES[shape].doc


def test_the_one_slice_70b_is_the_same_model_without_a_pipeline():
    overrides = dict(o.split("=", 1) for o in bench.maxtext_overrides("v5p-32", "splash",
                                                                       "fsdp70b"))
    config = bench.ours_config("v5p-32", "splash", "fsdp70b")
    assert int(overrides["compile_topology_num_slices"]) == bench.SHAPES["fsdp70b"].slices == 1
    assert not any(k.startswith(("dcn_pipeline", "num_pipeline")) for k in overrides)
    assert config.mesh.stage == 1 and config.pipeline.microbatches == 1
    assert int(overrides["per_device_batch_size"]) * 16 == config.batch_size == 128
    assert int(overrides["base_mlp_dim"]) == config.model.d_ff == 28672


def test_bubble_is_the_idle_fraction_of_the_schedule():
    assert bench.bubble(2, 8) == 1 / 9 and bench.bubble(2, 8, 2) == 1 / 17
    assert bench.bubble(1, 8) == 0 and bench.bubble(4, 4) == 3 / 7


def test_plan_compiles_each_shapes_paths_and_refuses_unknown_names():
    assert bench.plan([s for s in bench.SHAPES if bench.SHAPES[s].by_default], []) == [
        ("dense", "splash"), ("dense", "dense"), ("moe", "splash"), ("long", "splash")]
    assert bench.plan(["dense", "long"], ["dense"]) == [("dense", "dense")]
    with pytest.raises(bench.app.UsageError, match="^mixtral, flash: expected shapes from "
                       "dense, moe, long, pipeline, circular, circular40, fsdp70b and "
                       "attentions from splash, dense$"):
        bench.plan(["mixtral"], ["flash"])


def test_int8_asks_both_sides_for_int8_through_qwix_and_bfloat16_stays_as_it_was():
    plain = bench.maxtext_overrides("v5p-32", "splash")
    assert bench.maxtext_overrides("v5p-32", "splash", "dense", "none") == plain
    assert not any(o.startswith(("quantization=", "use_qwix")) for o in plain)
    overrides = dict(o.split("=", 1) for o in bench.maxtext_overrides("v6e-8", "splash",
                                                                      "dense", "int8"))
    assert (overrides["quantization"], overrides["use_qwix_quantization"]) == ("int8", "true")
    assert float(overrides["per_device_batch_size"]) * 8 == 128  # v6e counts chips
    assert bench.ours_config("v5p-32", "splash").model.quantization == ""
    config = bench.ours_config("v6e-8", "splash", "dense", "int8")
    assert (config.model.quantization, config.batch_size) == ("int8", 128)
    configs.validate_config(config, 8)
    assert bench.run_name("ours", "dense", "splash") == "ours-dense-splash"  # reuses old logs
    assert bench.run_name("maxtext", "dense", "splash", "int8") == "maxtext-dense-splash-int8"


def test_run_names_hold_the_topology_and_slices():
    assert bench.run_name("ours", "dense", "splash", "none", "v5p-32") == "ours-v5p-32-dense-splash"
    assert (bench.run_name("maxtext", "dense", "splash", "int8", "v6e-8")
            == "maxtext-v6e-8-dense-splash-int8")
    pipeline = next(s for s in bench.SHAPES if bench.SHAPES[s].slices > 1)
    assert bench.run_name("ours", pipeline, "splash", "none", "v5p-32").startswith(
        f"ours-v5p-32x{bench.SHAPES[pipeline].slices}-")
    assert (bench.run_name("ours", "dense", "splash", "none", "v5p-32")
            != bench.run_name("ours", "dense", "splash", "none", "v6e-8"))


def test_reuse_takes_only_a_log_compiled_for_the_same_topology(tmp_path, monkeypatch):
    assert bench.reusable(result("ours", "splash", 5.0), "v5p-32")
    assert not bench.reusable(result("ours", "splash", 5.0), "v6e-8")
    assert not bench.reusable({"side": "ours"}, "v6e-8")
    # A v5p-32 log under the name logs had before the topology: reused for v5p-32 only.
    old = result("ours", "splash", 5.0, topology="v5p-32")
    (tmp_path / "ours-dense-splash.log").write_text(bench.MARKER + json.dumps(old))
    compiled = []

    def compile_(command, stdout, **kwargs):
        compiled.append(command)
        topology = next(c.split("=", 1)[1] for c in command if c.startswith("--topology="))
        stdout.write(bench.MARKER + json.dumps(result("ours", "splash", 9.0,
                                                       topology=topology)) + "\n")

    monkeypatch.setattr(bench.subprocess, "run", compile_)
    for topology, temp_gib in (("v5p-32", 5.0), ("v6e-8", 9.0)):
        fake = type("F", (), {"topology": topology, "reuse": True})
        monkeypatch.setattr(bench, "flags", type("M", (), {"FLAGS": fake}))
        got = bench._run("python", "ours", "dense", "splash", str(tmp_path), "")
        assert (got["topology"], got["temp_bytes"]) == (topology, int(temp_gib * GIB))
    assert len(compiled) == 1  # v6e-8 compiled, into its own log
    assert (tmp_path / "ours-v6e-8-dense-splash.log").exists()


def test_table_pairs_int8_with_int8_and_bfloat16_with_bfloat16():
    old = result("ours", "splash", 5.0)
    del old["shape"]  # a log from before shapes and quantization: dense, bfloat16
    table = bench.format_table([
        old, result("maxtext", "splash", 5.0),
        result("ours", "splash", 4.0, quantization="int8"),
        result("maxtext", "splash", 8.0, quantization="int8")])
    assert "| dense int8 | ours | splash |" in table
    assert "| dense int8 | MaxText | flash (splash) |" in table
    assert "dense / splash: ours / MaxText total 1.000x" in table
    assert "dense int8 / splash: ours / MaxText total 0.567x (-4.00 GiB), temporaries 0.500x" \
        in table


BUFFER_ASSIGNMENT = """\
BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}, maybe-live-out:
 value: <1 param.0 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 5000, color 1, page 0, preallocated-temp:
 value: <2 vmem.1 @0> (size=5000,offset=0): f32[1250]{0}
allocation 2: size 1000, page 0, preallocated-temp:
 value: <3 logits @0> (size=600,offset=0): f32[150]{0:T(128)}
 value: <4 while.1{2} (phi) @1> (size=300,offset=600): bf16[150]{0}
 value: <5 grad @0> (size=400,offset=600): bf16[200]{0}
 value: <6 copy.1 @0> (size=600,offset=0): bf16[300]{0}
 value: <7 tuple.2{} @0> (size=16,offset=984): (bf16[200]{0}, bf16[300]{0})
"""
LIVE_RANGE = """\
HloLiveRange (max 5):
  InstructionSequence:
    0:param.0
    1:logits
    2:grad
    3:copy.1
    4:tuple.2
  BufferLiveRange:
    param.0{}:0-5
    logits{}:1-2
    while.1{2}:0-1
    grad{}:2-3
    copy.1{}:3-4
    tuple.2{}:4-4
  Live ranges at 5 (peak):
"""
HLO = """\
ENTRY %main {
  %logits = f32[150]{0} dot(%a, %b), metadata={op_name="jit(train_step)/embed.attend/dot_general" stack_frame_id=1}
  ROOT %grad = bf16[200]{0} fusion(%logits), kind=kLoop, metadata={op_name="jit(train_step)/transpose(jvp())/div"}
  %copy.1 = bf16[300]{0:T(128)} copy(%grad), backend_config={"flag_configs":[]}
}
"""  # noqa: E501


def test_peak_buffers_finds_the_most_live_temp_bytes_and_who_made_them():
    peak = bench.peak_buffers(BUFFER_ASSIGNMENT, LIVE_RANGE, HLO)
    assert peak.allocation_bytes == 1000  # the default memory space's, not the colored one
    assert (peak.time, peak.instruction, peak.live_bytes) == (2, "grad", 1000)
    assert [(b.name, b.size, b.op_name) for b in peak.buffers] == [
        ("logits{}", 600, "jit(train_step)/embed.attend/dot_general"),
        ("grad{}", 400, "jit(train_step)/transpose(jvp())/div")]
    text = bench.format_peak(peak, top=1, hlo=HLO)
    assert text.splitlines()[0].startswith(
        "peak at schedule step 2 (grad: jit(train_step)/transpose(jvp())/div): 0.00 GiB live")
    assert "f32[150]" in text and "logits{}" in text and "in the 1 smaller ones" in text
    assert bench.op_names(HLO)["copy.1"] == "copy of grad"  # no metadata: what it copies


def test_loop_carried_values_count_and_overlaps_count_once():
    assert bench._union([(0, 10), (5, 15), (20, 25)]) == 20
    size, values = bench.temp_buffers(BUFFER_ASSIGNMENT)
    assert size == 1000 and "while.1{2}" in [v.name for v in values]
    ranges, sequence = bench.live_ranges(LIVE_RANGE)
    assert ranges["while.1{2}"] == (0, 1) and sequence[3] == "copy.1"


def test_dump_files_finds_the_train_step_module(tmp_path):
    for name in ("module_0001.jit_stage.cpu_after_optimizations-buffer-assignment.txt",
                 "module_0000.jit_train_step.cl_1.after_optimizations-buffer-assignment.txt",
                 "module_0000.jit_train_step.cl_1.after_optimizations-live-range.txt",
                 "module_0000.jit_train_step.cl_1.after_optimizations.txt",
                 "module_0000.jit_train_step.cl_1.after_optimizations-memory-usage-report.txt"):
        (tmp_path / name).write_text("")
    found = bench.dump_files(str(tmp_path))
    assert {k: pathlib.Path(v).name for k, v in found.items()} == {
        "buffer_assignment":
            "module_0000.jit_train_step.cl_1.after_optimizations-buffer-assignment.txt",
        "live_range": "module_0000.jit_train_step.cl_1.after_optimizations-live-range.txt",
        "hlo": "module_0000.jit_train_step.cl_1.after_optimizations.txt"}
