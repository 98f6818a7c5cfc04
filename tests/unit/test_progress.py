"""Throughput and ETA from progress samples (core/progress.py): exact figures, no clock."""

from __future__ import annotations

from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.progress import (
    Estimate,
    RateMeter,
    Sample,
    batch_meter,
    estimate_batch,
    format_eta,
    format_rate,
)
from batchmlx.core.records import BatchRecord, BatchUsage, RequestCounts


def record(status: BatchStatus, *, done: int, total: int, tokens: int, **times: float):
    """Created at 990, in progress (validated) at 1000, and a worker on it from then on
    (unless `work_started_at` says otherwise)."""
    times = {"work_started_at": 1000.0, **times}
    return BatchRecord(
        id="batch_x", endpoint="/v1/chat/completions", model="m", input_file_id="file-x",
        completion_window="24h", status=status, created_at=990, in_progress_at=1000,
        request_counts=RequestCounts(total=total, completed=done), usage=BatchUsage(
            input_tokens=10 * done, output_tokens=tokens), **times,
    )  # fmt: skip


def test_fewer_than_two_samples_measure_nothing():
    meter = RateMeter()
    assert meter.estimate(10) == Estimate(None, None)
    meter.add(Sample(5.0, 1, 100))
    assert meter.estimate(10) == Estimate(None, None)


def test_rates_over_the_window_and_eta_from_requests_per_second():
    meter = RateMeter(window_s=10)
    meter.add(Sample(0.0, 0, 0))
    meter.add(Sample(10.0, 10, 1000))
    assert meter.estimate(30) == Estimate(100.0, 20.0)  # 1 request/s, 20 left
    # the engine slows down: the window forgets the old pace
    meter.add(Sample(20.0, 15, 1500))
    meter.add(Sample(30.0, 20, 2000))
    assert [s.t for s in meter.samples] == [20.0, 30.0]
    assert meter.estimate(30) == Estimate(50.0, 20.0)  # 0.5 request/s, 10 left


def test_the_window_keeps_one_sample_at_or_before_its_start():
    meter = RateMeter(window_s=10)
    for t in (0.0, 4.0, 8.0, 12.0, 16.0):
        meter.add(Sample(t, int(t), int(t) * 10))
    assert [s.t for s in meter.samples] == [4.0, 8.0, 12.0, 16.0]


def test_a_sample_at_the_same_instant_replaces_the_newest():
    meter = RateMeter()
    meter.add(Sample(0.0, 0, 0))
    meter.add(Sample(2.0, 1, 10))
    meter.add(Sample(2.0, 2, 20))
    assert list(meter.samples) == [Sample(0.0, 0, 0), Sample(2.0, 2, 20)]


def test_no_request_finished_in_the_window_goes_by_tokens_per_request():
    meter = RateMeter(window_s=10)
    meter.add(Sample(0.0, 4, 400))
    meter.add(Sample(10.0, 4, 600))  # 20 tok/s, nothing finished: 150 tokens per finished one
    assert meter.estimate(10) == Estimate(20.0, 6 * 150 / 20)


def test_nothing_generated_and_nothing_finished_has_no_eta():
    meter = RateMeter()
    meter.add(Sample(0.0, 0, 0))
    meter.add(Sample(3.0, 0, 0))
    assert meter.estimate(5) == Estimate(0.0, None)


def test_all_done_is_eta_zero():
    meter = RateMeter()
    meter.add(Sample(0.0, 0, 0))
    meter.add(Sample(4.0, 5, 40))
    assert meter.estimate(5) == Estimate(10.0, 0.0)


def test_a_running_batch_from_one_look_is_the_average_since_it_started():
    rec = record(BatchStatus.IN_PROGRESS, done=20, total=100, tokens=4000)
    # 40 s since in_progress_at: 100 tok/s, 0.5 request/s, 80 left
    assert estimate_batch(rec, 1040.0) == Estimate(100.0, 160.0)


def test_in_flight_tokens_count_toward_the_rate():
    rec = record(BatchStatus.IN_PROGRESS, done=0, total=10, tokens=0)
    meter = batch_meter(rec)
    assert estimate_batch(rec, 1010.0, meter, inflight_tokens=500) == Estimate(50.0, None)


def test_a_finished_batch_reports_its_average_and_no_eta():
    rec = record(BatchStatus.COMPLETED, done=10, total=10, tokens=3000, finalizing_at=1030,
                 completed_at=1031)  # fmt: skip
    assert estimate_batch(rec, 5000.0) == Estimate(100.0, None)


def test_time_queued_before_a_worker_took_it_up_is_not_slowness():
    # in progress since 1000, but no worker until 1030: 10 s of work at 100 tok/s, 1 request/s
    rec = record(BatchStatus.IN_PROGRESS, done=10, total=100, tokens=1000, work_started_at=1030.0)
    assert estimate_batch(rec, 1040.0) == Estimate(100.0, 90.0)
    assert estimate_batch(rec, 1040.0, batch_meter(rec)) == Estimate(100.0, 90.0)
    # a meter made while it was still queued is seeded once work starts
    queued = record(BatchStatus.IN_PROGRESS, done=0, total=100, tokens=0, work_started_at=None)
    meter = batch_meter(queued)
    assert estimate_batch(queued, 1020.0, meter) == Estimate(None, None)
    assert estimate_batch(rec, 1040.0, meter) == Estimate(100.0, 90.0)
    # finished: over its work, from the first claim to the last result
    done = record(BatchStatus.COMPLETED, done=100, total=100, tokens=3000, work_started_at=1030.0,
                  work_ended_at=1060.0, finalizing_at=1061, completed_at=1061)  # fmt: skip
    assert estimate_batch(done, 5000.0) == Estimate(100.0, None)


def test_a_batch_that_never_ran_has_no_estimate():
    rec = BatchRecord(
        id="b",
        endpoint="/v1/completions",
        model=None,
        input_file_id="f",
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=1,
    )
    assert estimate_batch(rec, 100.0) == Estimate(None, None)


def test_formats():
    assert [format_eta(x) for x in (None, 0.4, 59, 61, 3599, 3600 * 2 + 61)] == [
        "n/a",
        "0s",
        "59s",
        "1m 01s",
        "59m 59s",
        "2h 01m",
    ]
    assert format_rate(None) == "n/a"
    assert format_rate(1234.56) == "1,234.6 tok/s"
