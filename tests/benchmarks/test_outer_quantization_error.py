"""The encodings' error benchmark in its smoke form: every row and figure it reports.

``benchmarks/outer_quantization_error.py --smoke`` trains a tiny LM for a few
steps and encodes its pseudo-gradients and two synthetic sets with each
encoding.  Its figures measure nothing at that size, but their order holds at
any size, so a broken encoding shows here: bf16 moves a value less than 8-bit
integers, which move it less than either 4-bit form; every error is below 1 and
every cosine near 1; and on the heavy-tailed set the 4-bit floats beat the
uniform 4-bit integers (their levels are dense near 0, where most of its values
are), which is what the benchmark's conclusion rests on.
"""

from __future__ import annotations

import pytest

from tests.benchmarks.runner import run_benchmark

pytestmark = [pytest.mark.bench_smoke, pytest.mark.timeout(120)]


def test_every_encoding_is_measured_on_every_data_set() -> None:
    result, _ = run_benchmark("outer_quantization_error", ["--smoke"], timeout=100)
    assert result["smoke"] is True and result["lm_parameters"] > 0, result
    for data in ("lm", "gaussian", "student_t3"):
        errors = [result[f"{data}_{kind}_rel_l2"] for kind in ("bf16", "8bit", "4bit", "e3m0")]
        assert 0 < errors[0] < errors[1] < min(errors[2:]) and max(errors) < 1, (data, result)
        assert all(result[f"{data}_{kind}_cosine"] > 0.9 for kind in ("4bit", "e3m0")), result
    assert result["student_t3_e3m0_rel_l2"] < result["student_t3_4bit_rel_l2"], result
    assert result["better_4bit_form"]["student_t3"] == "e3m0", result
    # both 4-bit forms cost the same on the wire: half a byte a value, and a scale a block
    assert result["4bit_bytes_per_value"] == result["e3m0_bytes_per_value"] == 0.5156, result
