"""Issue 49's targets as section 13 reads them from its rows (benchmarks/peers/online.py
`tail_targets`): p99 beside a batch within 2x alone, one stream's ITL against llama-server's,
and the batch's lost throughput against the streams' share of the tokens."""

from __future__ import annotations

from benchmarks.peers.online import Row, Setup, tail_targets

SETUP = Setup(streams=(1, 8), batch=100, batch_max_tokens=10, settle_s=2.0)


def _row(system: str, n: int, under: bool, ttft: float, itl: float, **kw) -> Row:
    return Row(system, n, under, ttft=[ttft] * 10, itl=[itl] * 10, **kw)


def test_each_target_is_met_or_not_by_its_own_figures() -> None:
    rows = [
        _row("batchmlx", 1, False, 0.050, 0.010),
        _row("llama", 1, False, 0.060, 0.008),
        _row(
            "batchmlx",
            1,
            True,
            0.090,
            0.019,
            chunks=100,
            wall_s=10.0,
            batch_s=12.0,
            batch_alone_s=11.0,
        ),  # fmt: skip
        _row("batchmlx", 8, False, 0.100, 0.020),
        _row(
            "batchmlx",
            8,
            True,
            0.300,
            0.030,
            chunks=1000,
            wall_s=10.0,
            batch_s=22.0,
            batch_alone_s=11.0,
        ),  # fmt: skip
    ]
    lines = tail_targets(rows, SETUP)
    text = "\n".join(lines)
    one, eight = (next(ln for ln in lines if ln.startswith(f"- {n} streams, p99")) for n in (1, 8))
    assert one.endswith("**met**")  # 90 <= 2 x 50 and 19 <= 2 x 10
    assert eight.endswith("**not met**")  # TTFT p99 300 > 2 x 100
    assert "10 ms against 8.0 ms: **not met**" in text  # the lone stream's ITL p50
    # 1 stream: 1 - 11/12 = 8% lost; 100 chunks over 10 s, all in the batch's 10 s window:
    # a share of 100 / 1100 = 9%, so met; 8 streams: 50% lost against 1000 / 2000 = 50%
    lost = [ln for ln in lines if "throughput lost" in ln]
    assert "8% lost against a 9% share" in lost[0] and lost[0].endswith("**met**")
    assert "50% lost against a 50% share" in lost[1] and lost[1].endswith("**met**")


def test_a_batch_that_lost_more_than_the_streams_took_is_not_met() -> None:
    rows = [_row("batchmlx", 8, True, 0.1, 0.02, chunks=100, wall_s=10.0, batch_s=20.0,
                 batch_alone_s=10.0)]  # fmt: skip
    (line,) = [ln for ln in tail_targets(rows, SETUP) if "throughput lost" in ln]
    assert "50% lost" in line and line.endswith("**not met**")
