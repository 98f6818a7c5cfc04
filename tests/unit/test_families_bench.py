"""benchmarks/families.py's pure parts: each family's config over the one shape, the per-family
medians and ratios to llama, and the table."""

from __future__ import annotations

import pytest

from benchmarks.families import (
    FAMILIES,
    STEP_SKIP,
    Run,
    StepPair,
    config_of,
    decode_median,
    step_table,
    summarize,
    table,
)


def _run(family: str, wall: float, tok_s: float = 100.0, tokens: int = 2048, **kw) -> Run:
    return Run(family, wall, tok_s, tokens, "int8", **kw)


def test_every_family_keeps_the_shape_and_names_its_model_type():
    for fam in FAMILIES:
        c = config_of(fam)
        assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (
            576, 30, 9, 3, 64, 49152)  # fmt: skip
        assert c["model_type"] == ("llama" if fam in ("llama", "mistral") else fam)
    moe = config_of("qwen3_moe")  # the same active MLP as llama's
    assert moe["num_experts_per_tok"] * moe["moe_intermediate_size"] == 1536


def test_summary_takes_medians_and_divides_by_llamas_median():
    runs = [_run("llama", 10.0, 400), _run("qwen3", 12.0, 300), _run("llama", 8.0, 500),
            _run("qwen3", 13.0, 320, tokens=2000), _run("llama", 9.0, 450),
            _run("qwen3", 30.0, 100, mlx_steps="architecture x")]  # fmt: skip
    llama, qwen3 = summarize(runs)
    assert (llama.family, llama.walls, llama.wall_s, llama.steady_tok_s, llama.ratio) == (
        "llama", (10.0, 8.0, 9.0), 9.0, 450, 1.0)  # fmt: skip
    assert (qwen3.wall_s, qwen3.steady_tok_s, qwen3.tokens) == (13.0, 300, 2000)
    assert qwen3.ratio == pytest.approx(13.0 / 9.0)
    # rounds: 12 / 10, 13 / 8, 30 / 9
    assert qwen3.round_ratio == pytest.approx(13.0 / 8.0)
    assert qwen3.mlx_steps == "architecture x"
    assert llama.within and not qwen3.within


def test_summary_needs_the_reference():
    with pytest.raises(ValueError, match="llama"):
        summarize([_run("qwen3", 1.0)])


def test_table_marks_short_runs_mlx_steps_and_the_target():
    rows = summarize([_run("llama", 10.0), _run("gemma2", 11.5),
                      _run("phi3", 11.6, tokens=2000, mlx_steps="why")])  # fmt: skip
    lines = table(rows, 2048)
    assert lines[2] == "| llama | 10.00 | 10.0 | 100.0 | 2048 | **1.00x** | yes | 1.00x |"
    assert lines[3] == "| gemma2 | 11.50 | 11.5 | 100.0 | 2048 | **1.15x** | yes | 1.15x |"
    assert lines[4] == ("| phi3 (MLX steps: why) | 11.60 | 11.6 | 100.0 | 2000 (of 2048) | "
                        "**1.16x** | no | 1.16x |")  # fmt: skip


def test_decode_median_leaves_the_prefill_and_the_last_steps_out():
    prefill, tail = [9.0] * STEP_SKIP, [5.0] * STEP_SKIP
    assert decode_median([*prefill, 0.010, 0.030, 0.020, *tail]) == pytest.approx(20.0)
    assert decode_median([0.001, 0.003, 0.002]) == pytest.approx(2.0)  # too short: all of it


def test_step_table_gives_each_familys_ratio_to_llamas_step():
    pair = StepPair("qwen3_moe", 40.0, 58.0)
    assert pair.ratio == pytest.approx(1.45)
    assert step_table([pair], 32)[2] == "| qwen3_moe | 40.0 | 58.0 | **1.45x** |"
