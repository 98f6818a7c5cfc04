"""The CPU backend's settings (issue 50): read once in config.py, carried by one HostBackend,
the thread count passed to the kernels as a live object rather than read back from the
environment."""

from __future__ import annotations

import pytest

from batchmlx.config import (
    HOST_CACHE_ENV,
    HOST_STEPS_ENV,
    ONEDNN_LIB_ENV,
    THREADS_ENV,
    HostSettings,
    load_host_settings,
    load_settings,
)


def test_the_variables_become_host_settings() -> None:
    assert load_host_settings({}) == HostSettings()
    assert HostSettings() == HostSettings(None, True, True, None)  # the defaults
    got = load_host_settings({THREADS_ENV: "3", HOST_STEPS_ENV: "off", HOST_CACHE_ENV: "0",
                              ONEDNN_LIB_ENV: "/opt/libdnnl.so.3"})  # fmt: skip
    assert got == HostSettings(threads=3, host_steps=False, weights_cache=False,
                               onednn_library="/opt/libdnnl.so.3")  # fmt: skip
    for off in ("0", "false", "No", " off "):
        assert not load_host_settings({HOST_STEPS_ENV: off}).host_steps
    assert load_host_settings({HOST_CACHE_ENV: "off"}).weights_cache  # only "0" turns it off
    with pytest.raises(ValueError, match=THREADS_ENV):
        load_host_settings({THREADS_ENV: "two"})


def test_settings_carry_them() -> None:
    s = load_settings({"BATCHMLX_HOME": "/tmp/h", HOST_STEPS_ENV: "0"})
    assert s.cpu == HostSettings(host_steps=False)


def test_the_governors_count_reaches_onednn_from_its_next_call() -> None:
    from batchmlx.engine.host.onednn import OneDNN, _Local
    from batchmlx.engine.host.threads import ComputeThreads

    live = ComputeThreads()
    lib = OneDNN.__new__(OneDNN)  # no library needed: only the thread fitting
    set_to: list[int] = []
    lib.threads, lib._local, lib._omp_set = live, _Local(), set_to.append
    lib._fit_threads()
    assert set_to == []  # no count chosen: OpenMP's own
    live.n = 2
    lib._fit_threads()
    lib._fit_threads()
    live.n = 1
    lib._fit_threads()
    assert set_to == [2, 1]


def test_the_attention_pool_takes_the_count_when_it_starts() -> None:
    from batchmlx.engine.host.backend import ATTENTION_THREADS, HostBackend
    from batchmlx.engine.host.threads import ComputeThreads

    one = HostBackend(threads=ComputeThreads(1))
    assert one.pool_threads == ATTENTION_THREADS  # the cap until the pool starts
    pool = one.pool()
    try:
        assert one.pool_threads == 1 and one.pool() is pool
    finally:
        pool.shutdown()
    assert HostBackend(HostSettings(threads=4)).threads.n == 4
