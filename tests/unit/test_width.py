"""The width controller against fake machines: a throughput curve, a KV pool, a queue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from batchmlx.core.width import StepReport, WidthController, WidthPhase, WidthPolicy


@dataclass
class FakeMachine:
    """tok/s as a function of the running width; sequences hold `blocks_per_seq` blocks."""

    curve: Callable[[int], float]
    demand: int = 10_000  # sequences that want to run (waiting = demand - running)
    blocks_total: int = 100_000
    blocks_per_seq: float = 4.0
    preempt_above: int | None = None  # running past this preempts (memory pressure)
    longest_blocks: float = 8.0  # blocks a queued sequence would hold at its longest
    widths: list[int] = field(default_factory=list)  # the limit after every step

    def run(self, ctl: WidthController, steps: int, noise: float = 0.0) -> None:
        running = 0
        for i in range(steps):
            running = min(ctl.limit, self.demand)
            preempted = 0
            if self.preempt_above is not None and running > self.preempt_above:
                preempted = running - self.preempt_above
                running = self.preempt_above
            rate = self.curve(running) * (1.0 + noise * ((i * 7919 % 13) / 6.0 - 1.0))
            ctl.observe(StepReport(
                generated=running, seconds=running / rate, running=running,
                waiting=self.demand > running, blocks_used=int(running * self.blocks_per_seq),
                blocks_total=self.blocks_total, preempted=preempted,
                queued=self.demand - running,
                queued_blocks=int((self.demand - running) * self.longest_blocks),
            ))  # fmt: skip
            self.widths.append(ctl.limit)


def saturating(knee: int, per_seq: float = 10.0) -> Callable[[int], float]:
    """Throughput rises linearly with the width up to `knee`, then stays flat."""
    return lambda w: per_seq * min(w, knee)


def visited(widths: list[int]) -> list[int]:
    out: list[int] = []
    for w in widths:
        if not out or out[-1] != w:
            out.append(w)
    return out


def test_grows_while_throughput_rises_then_settles_on_the_best_width():
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(saturating(knee=128))
    m.run(ctl, 400)
    assert visited(m.widths) == [32, 64, 128, 256, 128]  # 256 was no faster: back to 128
    assert ctl.phase is WidthPhase.SETTLED
    assert ctl.limit == 128
    assert ctl.measured[128] == pytest.approx(1280.0)


def test_a_flat_curve_keeps_the_initial_width():
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(lambda w: 500.0)
    m.run(ctl, 200)
    assert visited(m.widths) == [32, 64, 32]
    assert ctl.limit == 32


def test_the_hard_cap_bounds_growth():
    ctl = WidthController(WidthPolicy(cap=48, initial=32))
    m = FakeMachine(saturating(knee=10_000))
    m.run(ctl, 200)
    assert visited(m.widths) == [32, 48]
    assert ctl.phase is WidthPhase.SETTLED


def test_growth_stops_where_the_kv_pool_could_not_hold_the_wider_batch():
    # 10 blocks a sequence, 1,000 blocks: 64 fit with room to grow (960), 128 would not
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(saturating(knee=10_000), blocks_total=1000, blocks_per_seq=10)
    m.run(ctl, 300)
    assert visited(m.widths) == [32, 64]
    assert ctl.changes[-1].reason == "memory-bound"


def test_memory_pressure_shrinks_once_and_never_grows_back_into_it():
    # the pool holds 80 sequences at once; the controller's estimate thinks more fit
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(saturating(knee=10_000), preempt_above=80)
    m.run(ctl, 1000)
    assert visited(m.widths) == [32, 64, 128, 60]  # 80 running * 0.75
    shrinks = [c for c in ctl.changes if c.reason == "memory"]
    assert len(shrinks) == 1  # one preemption step, then no storm
    assert ctl.ceiling == 60


def test_noisy_plateau_does_not_oscillate():
    ctl = WidthController(WidthPolicy(cap=256, initial=16))
    m = FakeMachine(saturating(knee=64))
    m.run(ctl, 3000, noise=0.02)
    settle = m.widths.index(64, 100)  # the width it came back to
    assert set(m.widths[settle:]) == {64}
    assert len(visited(m.widths)) <= 5


def test_an_idle_engine_measures_the_next_workload_afresh():
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    FakeMachine(lambda w: 500.0).run(ctl, 200)
    assert ctl.limit == 32 and ctl.phase is WidthPhase.SETTLED
    ctl.observe(StepReport(0, 0.01, running=0, waiting=False, blocks_used=0, blocks_total=100))
    assert ctl.phase is WidthPhase.GROWING
    m = FakeMachine(saturating(knee=128))
    m.run(ctl, 400)
    assert ctl.limit == 128


def test_a_width_the_work_never_fills_is_not_measured():
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(saturating(knee=10_000), demand=20)
    m.run(ctl, 200)
    assert visited(m.widths) == [32]
    assert ctl.measured == {}


def test_online_requests_cap_batch_admissions_but_are_never_refused():
    ctl = WidthController(WidthPolicy(cap=256, initial=128, online_cap=32))
    assert ctl.admission_limit(online_running=0) == 128
    assert ctl.admission_limit(online_running=3) == 32
    assert ctl.admission_limit(online_running=40) == 40
    small = WidthController(WidthPolicy(cap=256, initial=16, online_cap=32))
    assert small.admission_limit(online_running=2) == 16


def test_bad_policies_are_refused():
    with pytest.raises(ValueError):
        WidthPolicy(cap=0)
    with pytest.raises(ValueError):
        WidthPolicy(cap=8, shrink=1.0)


def test_steps_held_below_the_width_do_not_count_toward_its_measurement():
    ctl = WidthController(WidthPolicy(cap=256, initial=64, window_steps=4))
    full = StepReport(64, 0.1, running=64, waiting=True, blocks_used=64, blocks_total=10_000)
    for _ in range(5):
        ctl.observe(full)  # filled, then 4 steps at 640 tok/s: measured, grows to 128
    assert ctl.limit == 128 and ctl.measured == {64: pytest.approx(640.0)}
    # online requests hold batch admissions back: 20 run, slowly, while work waits
    held = StepReport(20, 1.0, running=20, waiting=True, blocks_used=20, blocks_total=10_000)
    ctl.observe(
        StepReport(128, 0.1, running=128, waiting=True, blocks_used=128, blocks_total=10_000)
    )  # 128 running: the window opens
    for _ in range(50):
        ctl.observe(held)
    assert ctl.limit == 128 and 128 not in ctl.measured  # no plateau from the narrow steps


def test_queued_work_that_fits_is_admitted_at_once():
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(saturating(knee=10_000), demand=64)
    m.run(ctl, 100)
    assert m.widths[0] == 64  # after the first step, not after a window at 32
    assert (ctl.changes[0].old, ctl.changes[0].new, ctl.changes[0].reason) == (32, 64, "fits")
    assert ctl.measured == {64: pytest.approx(640.0)}  # still measured at the width it runs


def test_queued_work_over_the_cap_or_the_pool_ramps_by_measurement():
    over_cap = WidthController(WidthPolicy(cap=256, initial=32))
    FakeMachine(saturating(knee=10_000), demand=300).run(over_cap, 100)
    # 15 blocks each at their longest: the 32 queued (480) and the 32 running (64, grown
    # by half) do not fit 500 blocks
    over_pool = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(saturating(knee=10_000), demand=64, blocks_total=500, blocks_per_seq=2,
                    longest_blocks=15)  # fmt: skip
    m.run(over_pool, 100)
    for ctl in (over_cap, over_pool):
        assert ctl.changes[0].reason == "faster" and ctl.changes[0].step == 13  # fill + window
    assert visited(m.widths)[:2] == [32, 64]


def test_admitting_at_once_keeps_the_memory_ceiling():
    # the pool holds 80 at once though the estimate said 100 fit: shrink, and stay under it
    ctl = WidthController(WidthPolicy(cap=256, initial=32))
    m = FakeMachine(saturating(knee=10_000), demand=100, preempt_above=80)
    m.run(ctl, 200)
    assert visited(m.widths) == [100, 60]  # 80 running * 0.75, then no jump back to 100
    assert ctl.ceiling == 60 and ctl.phase is WidthPhase.SETTLED
