"""Section 12's cases and targets (benchmarks/peers/section.py), on runs made up here: pure logic,
no peer is started."""

from __future__ import annotations

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
