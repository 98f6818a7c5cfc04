"""Engine threads sized from the CPUs this process may use (issue 21): affinity and the cgroup v2
quota, less what other processes keep busy (measured at start and again while the engine runs),
overridable, applied to the loaded BLAS, shown by doctor."""

from __future__ import annotations

import ctypes
import os

import pytest

from batchmlx.config import THREADS_ENV as ENV
from batchmlx.config import load_host_settings
from batchmlx.engine.host.threads import (
    ComputeThreads,
    CpuBudget,
    CpuSample,
    ThreadChoice,
    ThreadGovernor,
    apply_threads,
    cgroup_quota,
    choose_threads,
    cpu_budget,
    free_cpus,
    others_busy,
    read_cpu_sample,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5), ("", None),
     ("junk here", None), ("0 100000", None)],
)  # fmt: skip
def test_cgroup_quota_reads_cpu_max(text: str, cpus: float | None) -> None:
    assert cgroup_quota(text) == cpus


def test_the_budget_is_the_fewer_of_affinity_and_quota() -> None:
    assert cpu_budget(affinity=8, cpu_max="max 100000").cpus == 8
    assert cpu_budget(affinity=8, cpu_max="250000 100000").cpus == 2  # --cpus 2.5: 2 busy
    assert cpu_budget(affinity=2, cpu_max="400000 100000").cpus == 2  # taskset -c 0,1
    assert cpu_budget(affinity=4, cpu_max="50000 100000").cpus == 1  # half a CPU: still one


@pytest.mark.parametrize(
    ("cpus", "others", "threads"),
    [(2, 0.0, 2), (2, 0.2, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 5.0, 1), (1, 0.0, 1),
     (16, 0.0, 16), (16, 3.2, 13), (16, 40.0, 1)],
)  # fmt: skip
def test_the_default_takes_the_cpus_other_processes_leave_free(
    cpus: int, others: float, threads: int
) -> None:
    choice = choose_threads(None, CpuBudget(cpus, None), others=others)
    assert choice.threads == threads == free_cpus(CpuBudget(cpus, None), others)
    assert choice.auto
    assert f"{cpus} CPUs in this process's affinity" in choice.why
    assert f"busy on {others:.1f}" in choice.why


PROC_STAT = (
    "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\ncpu1 50 0 25 400 25 0 0 0\n"
)
SELF_STAT = "4242 (python -m x) S " + " ".join(["0"] * 10) + " 30 20 0 0"


def test_cpu_samples_read_the_host_and_this_process() -> None:
    sample = read_cpu_sample(PROC_STAT, SELF_STAT)
    assert sample == CpuSample(busy=150, total=1000, own=50, cpus=2)
    assert read_cpu_sample("garbage", SELF_STAT) is None
    live = read_cpu_sample()  # this machine's /proc
    assert live is not None and live.total > 0 and live.cpus >= 1


def test_others_are_the_host_busy_time_less_this_process() -> None:
    before = CpuSample(busy=0, total=0, own=0, cpus=2)
    # 2 CPUs for 100 ticks each: the host busy 150 ticks, 60 of them ours -> others on 0.9 CPUs
    assert others_busy(before, CpuSample(busy=150, total=200, own=60, cpus=2)) == pytest.approx(0.9)
    assert others_busy(before, CpuSample(busy=50, total=200, own=60, cpus=2)) == 0.0
    assert others_busy(before, before) == 0.0  # no time passed


def test_the_governor_follows_neighbours_that_come_and_go() -> None:
    clock = [0.0]
    samples = iter(
        [
            CpuSample(0, 0, 0, 2),  # the governor's first look
            CpuSample(100, 200, 100, 2),  # alone: all busy time is ours -> 2
            CpuSample(300, 400, 200, 2),  # a neighbour busy on 1 CPU -> 1
            CpuSample(400, 600, 300, 2),  # it left -> 2
        ]
    )
    applied: list[int] = []
    gov = ThreadGovernor(
        ThreadChoice(2, "test", CpuBudget(2, None), auto=True), review_s=5.0,
        clock=lambda: clock[0], sample=lambda: next(samples), apply=applied.append,
    )  # fmt: skip
    assert gov.review() is None  # too soon
    clock[0] = 5.0
    assert gov.review() is None and gov.threads == 2
    clock[0] = 10.0
    assert gov.review() == 1 and applied == [1]
    clock[0] = 15.0
    assert gov.review() == 2 and applied == [1, 2]


def test_a_count_asked_for_is_never_changed() -> None:
    def no_sample() -> CpuSample:
        raise AssertionError("an asked-for count reads no load")

    gov = ThreadGovernor(
        ThreadChoice(2, "--threads 2", CpuBudget(2, None)), review_s=0.0, sample=no_sample,
        apply=lambda n: pytest.fail("changed"),
    )  # fmt: skip
    assert gov.review() is None and gov.threads == 2


def test_the_flag_then_the_variable_override_the_default() -> None:
    budget = CpuBudget(2, 1.5)
    flag = choose_threads(2, budget)
    assert flag.threads == 2 and flag.why.startswith("--threads 2") and "quota of 1.5" in flag.why
    assert not flag.auto
    # the variable reaches the engine as a setting (config.py reads it; the flag wins over it)
    assert load_host_settings({ENV: "3"}).threads == 3
    assert load_host_settings({ENV: " "}).threads is None
    with pytest.raises(ValueError, match=f"{ENV} must be a whole number"):
        load_host_settings({ENV: "many"})
    with pytest.raises(ValueError, match="at least 1"):
        choose_threads(0, budget)


def test_apply_sets_the_loaded_blas_and_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (ENV, "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, "0")  # restored after the test, whatever apply sets
    get = getattr(ctypes.CDLL(None), "openblas_get_num_threads", None)
    before = get() if get is not None else None
    live = ComputeThreads()
    try:
        done = apply_threads(ThreadChoice(1, "test", CpuBudget(2, None)), live)
        assert live.n == 1  # the host kernels' count: passed, not read back from the environment
        assert os.environ["OPENBLAS_NUM_THREADS"] == os.environ["OMP_NUM_THREADS"] == "1"
        assert os.environ[ENV] == "0"  # the user's variable is not written
        if get is not None:  # pytest runs on the preloaded OpenBLAS where one is installed
            assert "openblas_set_num_threads(1)" in done and get() == 1
    finally:
        if before is not None:
            ctypes.CDLL(None).openblas_set_num_threads(before)


def test_doctor_says_the_threads_chosen_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchmlx.engine.host.fast_blas import doctor_report

    report = doctor_report(measure=False)["engine_threads"]
    budget = cpu_budget()
    assert 1 <= report["threads"] <= budget.cpus
    assert report["affinity_cpus"] == len(os.sched_getaffinity(0))
    assert "usable" in report["why"]


def test_the_first_look_spans_the_model_load() -> None:
    """build_engine starts on all the budget's CPUs (no wait of its own) and looks again as soon
    as the model is in, whatever the review period."""
    choice = choose_threads(None, CpuBudget(2, None), measure=False)
    assert choice.threads == 2 and choice.auto
    samples = iter([CpuSample(0, 0, 0, 2), CpuSample(190, 200, 90, 2)])  # others busy on 1.0
    applied: list[int] = []
    live = ComputeThreads(2)  # what the host kernels read (oneDNN, numpy's BLAS, attention)
    gov = ThreadGovernor(choice, live, review_s=1e9, clock=lambda: 0.0,
                         sample=lambda: next(samples), apply=applied.append)  # fmt: skip
    assert gov.review() is None  # the period has not passed
    assert gov.review(now=True) == 1 and applied == [1]
    assert live.n == 1  # the kernels' next call uses the new count
