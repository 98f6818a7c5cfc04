"""Engine threads sized from the CPUs this process may use (issue 21): affinity and the cgroup v2
quota, all but one of them, overridable, applied to the loaded BLAS, shown by doctor."""

from __future__ import annotations

import ctypes
import os

import pytest

from batchmlx.threads import (
    ENV,
    CpuBudget,
    ThreadChoice,
    apply_threads,
    cgroup_quota,
    choose_threads,
    cpu_budget,
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


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_the_default_leaves_one_cpu_to_the_loop_and_the_neighbours(cpus: int, threads: int):
    choice = choose_threads(None, CpuBudget(cpus, None), environ={})
    assert choice.threads == threads
    assert f"{cpus} CPUs in this process's affinity" in choice.why


def test_the_flag_then_the_variable_override_the_default() -> None:
    budget = CpuBudget(2, 1.5)
    flag = choose_threads(2, budget, environ={ENV: "3"})
    assert flag.threads == 2 and flag.why.startswith("--threads 2") and "quota of 1.5" in flag.why
    env = choose_threads(None, budget, environ={ENV: "3"})
    assert env.threads == 3 and env.why.startswith(f"{ENV}=3")
    with pytest.raises(ValueError, match=f"{ENV} must be a whole number"):
        choose_threads(None, budget, environ={ENV: "many"})
    with pytest.raises(ValueError, match="at least 1"):
        choose_threads(0, budget, environ={})


def test_apply_sets_the_loaded_blas_and_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (ENV, "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, "0")  # restored after the test, whatever apply sets
    get = getattr(ctypes.CDLL(None), "openblas_get_num_threads", None)
    before = get() if get is not None else None
    try:
        done = apply_threads(ThreadChoice(1, "test", CpuBudget(2, None)))
        assert os.environ[ENV] == os.environ["OPENBLAS_NUM_THREADS"] == "1"
        if get is not None:  # pytest runs on the preloaded OpenBLAS where one is installed
            assert "openblas_set_num_threads(1)" in done and get() == 1
    finally:
        if before is not None:
            ctypes.CDLL(None).openblas_set_num_threads(before)


def test_doctor_says_the_threads_chosen_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchmlx.accel import doctor_report

    monkeypatch.delenv(ENV, raising=False)
    report = doctor_report(measure=False)["engine_threads"]
    budget = cpu_budget()
    assert report["threads"] == max(1, budget.cpus - 1)
    assert report["affinity_cpus"] == len(os.sched_getaffinity(0))
    assert "usable" in report["why"]
