"""benchmarks/aot_vs_maxtext.py's pure parts on canned output: each side's result line, the
version check, the table and the peak buffers of an XLA dump (no venv, TPU or compile)."""

import importlib.util
import json
import pathlib
import sys

import pytest

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
    r = {"side": side, "attention": attention, "topology": "v5p-32", "num_params": 1_713_735_680,
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


def test_table_has_a_row_per_compile_and_the_ratio_per_attention():
    table = bench.format_table([result("ours", "splash", 6.63), result("maxtext", "splash", 5.20),
                                result("ours", "dense", 6.0), result("maxtext", "dense", 6.70)])
    rows = table.splitlines()
    assert rows[0].startswith("| side | attention | params |")
    assert rows[2] == ("| ours | splash | 1,713,735,680 | 1.20 GiB | 0.00 GiB | 6.63 GiB | "
                       "0.04 GiB | 7.87 GiB |")
    assert rows[3].startswith("| MaxText | flash (splash) |")
    assert rows[5].startswith("| MaxText | dot_product (dense) |")
    assert "splash: ours / MaxText total 1.222x (+1.43 GiB), temporaries 1.275x; " \
           "target ours <= MaxText: not met" in table
    assert "dense: ours / MaxText total 0.912x (-0.70 GiB)" in table
    assert "target ours <= MaxText: met" in table


def test_table_reports_a_side_that_does_not_compile_and_skips_its_ratio():
    table = bench.format_table([result("ours", "dense", 0, error="RESOURCE_EXHAUSTED: HBM"),
                                result("maxtext", "dense", 6.7)])
    assert "does not compile: RESOURCE_EXHAUSTED: HBM" in table
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
