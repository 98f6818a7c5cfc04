"""Section 12's cases and targets (benchmarks/peers/section.py), on runs made up here: pure logic,
no peer is started."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.peers import section
from benchmarks.peers.run_peer import PeerRun


def _run(peer: str, model: str, precision: str, wall_s: float, rss: float,
         system: str | None = None) -> PeerRun:  # fmt: skip
    name = system or ("batchmlx (defaults)" if peer == "batchmlx" else peer)
    return PeerRun(name, peer, model, precision, wall_s, 1.0, 100.0, 1000, rss)


def test_only_the_models_asked_for_are_measured() -> None:
    seen: list[tuple[str, str]] = []

    def runner(peer: str, workload, model: str, **options) -> PeerRun:
        seen.append((model, peer))
        return _run(peer, model, options.get("quant", "int8"), 10.0, 500.0)

    original = section.measure
    try:
        section.measure = lambda case: original(case, runner)  # type: ignore[assignment]
        results = section.run_all(quick=True, models=("gemma3-1b",))
    finally:
        section.measure = original  # type: ignore[assignment]
    assert set(results) == {("gemma3-1b", "chats")}
    assert {m for m, _ in seen} == {"gemma3-1b"}
    # the peers at the bits people download: Q8_0 and Q4_K_M, each peer
    assert sorted(p for _, p in seen).count("llama") == 2
    lines = "\n".join(section.markdown(results, quick=True))
    assert "gemma3-1b" in lines and "qwen3-1.7b" not in lines


def test_the_family_shapes_targets_read_speed_and_memory_against_the_peers() -> None:
    runs = [
        _run("batchmlx", "qwen3-1.7b", "int8", 10.0, 2600.0),
        _run("llama", "qwen3-1.7b", "Q8_0", 14.0, 2000.0),
        _run("llama", "qwen3-1.7b", "Q4_K_M", 16.0, 1400.0),
        _run("openvino", "qwen3-1.7b", "Q8_0", 20.0, 3000.0),
    ]
    got = {name: (value, ok) for name, value, ok in
           section.targets({("qwen3-1.7b", "chats"): runs})}  # fmt: skip
    speed = got[">= 1.5x the best of llama.cpp and OpenVINO GenAI, Qwen3-1.7B shape"]
    assert speed == ("1.40x", False)  # 100 tok/s against llama Q8_0's 71.4
    memory = got["peak RSS <= 1.25x llama.cpp Q8_0's, Qwen3-1.7B shape"]
    assert memory == ("1.30x", False)
    assert not any("Gemma" in name for name in got)  # not measured: no rows


def test_a_case_of_rounds_alternates_the_systems_and_keeps_each_ones_median_run() -> None:
    order: list[str] = []
    walls = {"batchmlx": iter([12.0, 10.0, 11.0]), "openvino": iter([20.0, 14.0, 15.0])}
    steady = {"batchmlx": iter([600.0, 700.0, 650.0]), "openvino": iter([500.0, 560.0, 520.0])}
    rss = iter([600.0, 640.0, 610.0])

    def runner(peer: str, workload, model: str, **options) -> PeerRun:
        if workload.requests == 1:  # batchmlx's untimed warm-up
            return _run(peer, model, "int8", 1.0, 100.0)
        order.append(peer)
        run = _run(peer, model, "int8", next(walls[peer]),
                   next(rss) if peer == "batchmlx" else 700.0)  # fmt: skip
        return replace(run, steady_tok_s=next(steady[peer]))

    pair = (section.System("batchmlx"), section.System("openvino"))
    case = section.Case("default", section.workload("unique", quick=True), pair, rounds=3)
    section._warm.discard(("default", "[]"))
    mine, theirs = section.measure(case, runner)
    assert order == ["batchmlx", "openvino"] * 3  # in turn, round by round
    assert isinstance(mine, PeerRun) and isinstance(theirs, PeerRun)
    assert (mine.wall_s, theirs.wall_s) == (11.0, 15.0)  # the median run of each
    assert (mine.steady_tok_s, theirs.steady_tok_s) == (650.0, 520.0)
    assert mine.peak_rss_mb == 640.0  # the highest of its runs
    assert [r["wall_s"] for r in mine.extra["rounds"]] == [12.0, 10.0, 11.0]
    lines = "\n".join(section.table(case, [mine, theirs]))
    assert "Each system 3 times" in lines and "12.0 s / 600" in lines


def test_a_system_that_fails_in_any_round_reads_as_failed() -> None:
    calls: list[int] = []

    def runner(peer: str, workload, model: str, **options) -> PeerRun:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("it crashed")
        return _run(peer, model, "Q4_1", 10.0, 500.0)

    case = section.Case("default", section.workload("unique", quick=True),
                        (section.System("llama"),), rounds=3)  # fmt: skip
    (row,) = section.measure(case, runner)
    assert isinstance(row, str) and "it crashed" in row
    assert len(calls) == 2  # no third run after the failure


def test_a_system_whose_run_is_long_runs_once() -> None:
    seen: list[str] = []

    def runner(peer: str, workload, model: str, **options) -> PeerRun:
        seen.append(peer)
        return _run(peer, model, "Q4_1", 250.0 if peer == "llama" else 10.0, 500.0)

    pair = (section.System("llama"), section.System("openvino"))
    case = section.Case("default", section.workload("shared", quick=True), pair, rounds=3)
    rows = section.measure(case, runner)
    assert seen == ["llama", "openvino", "openvino", "openvino"]
    lines = section.table(case, rows)
    assert "- llama: 250.0 s / 100 (once)" in lines
