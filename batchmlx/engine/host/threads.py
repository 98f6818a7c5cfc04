"""How many compute threads the engine uses: sized from the CPUs this process may actually use,
so that BLAS thread teams do not spin against the neighbours.

The CPUs a process may use are the fewer of its affinity mask (`os.sched_getaffinity`: taskset,
cpusets) and its cgroup v2 CPU quota (`/sys/fs/cgroup/cpu.max`: a container's `--cpus`). Of
those the engine takes the ones other processes leave free, at least one: OpenBLAS's threads
meet at a barrier in every matmul and busy-wait there, so one descheduled thread stalls the rest
for a time slice. Measured on 2 cores shared with other work (benchmarks/threads_neighbours.py,
a 32-token chat on the default model): 2 threads 32.2 s, 1 thread 6.5 s; with two more busy
neighbours 59.7 s and 10.8 s (issue 21 saw 35-46 s against 3.8-4.0 s). On a quiet machine both
cores compute (a step's matmuls take about half the time on two threads).

"Free" is measured, not guessed: the CPU time the whole host spent busy (/proc/stat) less this
process's own (/proc/self/stat), over a short window at start and then again every `REVIEW_S`
while the engine runs (`ThreadGovernor`), so a neighbour that starts or stops later moves the
count. Where /proc cannot be read (macOS) the budget's CPUs are used.

`--threads N` (or BATCHMLX_THREADS, read by batchmlx/config.py) overrides the choice; `batchmlx
doctor` shows it. The count goes to the BLAS MLX's CPU backend calls (OpenBLAS or MKL, set at run
time through the preloaded library), to the variables a C library loaded later reads (written
here, the one place the CPU backend writes the environment), and to the host kernels through
the `ComputeThreads` their HostBackend holds (oneDNN's OpenMP team, numpy's BLAS in float32
GEMMs, the host-attention pool), which the governor moves. Pure apart from reading /proc-like
files and the loaded BLAS; imports no MLX.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("batchmlx.engine.host.threads")

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
PROC_STAT = Path("/proc/stat")  # the host's CPU time, summed over its CPUs, in clock ticks
SELF_STAT = Path("/proc/self/stat")  # this process's (every thread's) utime and stime
SAMPLE_S = 0.2  # the window of the first look, at start
REVIEW_S = 5.0  # the governor looks again at most this often, over the time since its last look
SPARE = 0.3  # a CPU counts as free while others keep it busy less than 30% of the time
# variables of the BLAS and OpenMP runtimes, for libraries loaded after the choice is made
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
# between two GEMMs MLX evaluates the layer's other ops (~0.1-0.3 ms): OpenMP's threads spin
# through such a gap and then sleep, where sleeping at once cost a wake-up per GEMM (decode tok/s
# at width 8: 88 -> 124, measured, 3 runs each). The spin is short (20,000 rounds: ~0.2 ms of
# CPU after a GEMM here; 2,000,000 spun ~50 ms), as a spinning team holds both cores while host
# attention splits its tiles over two threads of its own: at 2,000,000 a 944-token prompt's
# attention took 0.65-0.69 s against 0.36-0.46, and 63 chunks behind a shared prefix 2.0-2.1 s
# against 1.3-1.4 (three pairs, 2-core Zen 4, 2026-12-03), decode steps and width-8 runs level.
# Written before oneDNN loads (libgomp reads them when it starts); a value the user set is kept
OPENMP_DEFAULTS = (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "20000"))


@functools.cache
def _cpu_count() -> int:
    # looked up once: os.cpu_count() reads /sys each call (~2 us), and an engine built outside
    # a worker (benchmarks, tests: no count chosen) asks per GEMM, ~150 times a decode step
    return os.cpu_count() or 1


@dataclass(slots=True)
class ComputeThreads:
    """The engine's compute thread count now: made with the HostBackend, set by the worker's
    choice and moved by the ThreadGovernor between steps; the host kernels read `n` per call
    (oneDNN's OpenMP team, numpy's BLAS in float32 GEMMs) or when their pool starts (host
    attention). None: no count chosen (no engine built here): each keeps its default."""

    n: int | None = None

    def or_cpus(self) -> int:
        """The count, else the CPUs here."""
        return max(1, self.n or _cpu_count())


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """The CPUs this process may run on."""

    affinity: int  # CPUs in its affinity mask
    quota: float | None  # cgroup v2 quota in CPUs (quota / period); None: no quota

    @property
    def cpus(self) -> int:
        """Whole CPUs it may keep busy (a quota of 1.5 CPUs keeps one busy without throttle)."""
        limit = self.affinity if self.quota is None else min(self.affinity, math.floor(self.quota))
        return max(1, limit)


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    threads: int  # compute threads of the engine (BLAS, host kernels)
    why: str  # one line for doctor and the log
    budget: CpuBudget
    auto: bool = False  # chosen from the load (the governor may change it), not asked for


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Cumulative CPU time at one moment, in clock ticks."""

    busy: int  # the host's, every CPU summed: all but idle and iowait
    total: int  # the host's, every CPU summed
    own: int  # this process's, every thread
    cpus: int  # CPUs the host's figures are summed over


def read_cpu_sample(proc_stat: str | None = None, self_stat: str | None = None) -> CpuSample | None:
    """Now's CPU times (None where /proc cannot be read)."""
    try:
        host = PROC_STAT.read_text() if proc_stat is None else proc_stat
        me = SELF_STAT.read_text() if self_stat is None else self_stat
        lines = host.splitlines()
        fields = [int(x) for x in lines[0].split()[1:]]  # user nice system idle iowait ...
        cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
        after_name = me.rsplit(")", 1)[1].split()  # the name may hold spaces
        own = int(after_name[11]) + int(after_name[12])  # fields 14 and 15: utime, stime
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    except (OSError, IndexError, ValueError):
        return None
    total = sum(fields[:8])  # guest time is already inside user
    return CpuSample(busy=total - idle, total=total, own=own, cpus=max(1, cpus))


def others_busy(before: CpuSample, after: CpuSample) -> float:
    """CPUs other processes kept busy between two samples, on average."""
    window = (after.total - before.total) / after.cpus  # ticks of one CPU's time
    if window <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / window)


def free_cpus(budget: CpuBudget, others: float) -> int:
    """Of the budget's CPUs, those the others leave free; at least one."""
    return max(1, min(budget.cpus, math.floor(budget.cpus - others + SPARE)))


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity masks
        return os.cpu_count() or 1


def cgroup_quota(text: str | None = None) -> float | None:
    """CPUs of a cgroup v2 `cpu.max` ("200000 100000" -> 2.0; "max 100000" -> None)."""
    if text is None:
        try:
            text = CPU_MAX.read_text()
        except OSError:
            return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_budget(affinity: int | None = None, cpu_max: str | None = None) -> CpuBudget:
    return CpuBudget(_affinity() if affinity is None else affinity, cgroup_quota(cpu_max))


def choose_threads(
    requested: int | None = None,
    budget: CpuBudget | None = None,
    others: float | None = None,
    *,
    measure: bool = True,
) -> ThreadChoice:
    """`requested` (--threads or BATCHMLX_THREADS, through the settings), else the budget's
    CPUs that other processes leave free (`others`: the CPUs they keep busy; measured over
    SAMPLE_S when not given and `measure`, else all the budget's CPUs until a ThreadGovernor
    first looks)."""
    budget = budget or cpu_budget()
    how = f"--threads {requested}"
    quota = f", a cgroup quota of {budget.quota:g}" if budget.quota is not None else ""
    seen = f"{budget.affinity} CPUs in this process's affinity{quota}"
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, not {requested}")
        return ThreadChoice(requested, f"{how} ({seen})", budget)
    if others is None and measure:
        others = measure_others(SAMPLE_S)
    if others is None:
        return ThreadChoice(budget.cpus, f"{seen}: {budget.cpus} usable", budget, auto=True)
    n = free_cpus(budget, others)
    why = f"{seen}: {budget.cpus} usable, other processes busy on {others:.1f}"
    return ThreadChoice(n, why, budget, auto=True)


def measure_others(window_s: float) -> float | None:
    """CPUs other processes keep busy over the next `window_s` (None: /proc unreadable)."""
    before = read_cpu_sample()
    if before is None:
        return None
    time.sleep(window_s)
    after = read_cpu_sample()
    return None if after is None else others_busy(before, after)


def apply_threads(choice: ThreadChoice, live: ComputeThreads) -> list[str]:
    """Size the BLAS of this process to `choice` now (its run-time setter, found among the
    preloaded library's symbols), the host kernels (`live`) and what loads later (the
    variables); returns what was set, for the log."""
    n = live.n = choice.threads
    for key in THREAD_VARIABLES:
        os.environ[key] = str(n)  # written for C libraries; never read back here
    return [f"{'/'.join(THREAD_VARIABLES)}={n}", *set_blas_threads(n)]


def set_openmp_defaults() -> None:
    """OPENMP_DEFAULTS into the environment where the user set none (before oneDNN loads)."""
    for key, value in OPENMP_DEFAULTS:
        os.environ.setdefault(key, value)


def set_blas_threads(n: int) -> list[str]:
    """The loaded BLAS's thread count, now (OpenBLAS's or MKL's run-time setter)."""
    done: list[str] = []
    try:
        exported = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - no global symbol table (not Linux or macOS)
        return done
    for name in ("openblas_set_num_threads", "MKL_Set_Num_Threads"):
        setter = getattr(exported, name, None)
        if setter is not None:
            setter(ctypes.c_int(n))
            done.append(f"{name}({n})")
    return done


class ThreadGovernor:
    """Keeps an automatic choice fitted to the load: at most every REVIEW_S (called between
    engine steps, on the engine thread), the CPUs others kept busy since the last look decide
    the thread count again: the BLAS's (`apply`) and the host kernels' (`live`). A count that
    was asked for is left alone."""

    def __init__(
        self,
        choice: ThreadChoice,
        live: ComputeThreads | None = None,
        *,
        review_s: float = REVIEW_S,
        clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], CpuSample | None] = read_cpu_sample,
        apply: Callable[[int], object] = set_blas_threads,
    ) -> None:
        self.live = ComputeThreads(choice.threads) if live is None else live
        self.threads = choice.threads
        self.budget = choice.budget
        self.active = choice.auto
        self.review_s = review_s
        self._clock, self._sample, self._apply = clock, sample, apply
        self._last = sample() if self.active else None
        self._at = clock()

    def review(self, *, now: bool = False) -> int | None:
        """The new thread count when it changed, else None. `now`: look whatever the time
        since the last look (after the model load, which was the first window)."""
        if not self.active or (not now and self._clock() - self._at < self.review_s):
            return None
        now = self._sample()
        if now is None or self._last is None:
            self.active = False  # /proc went away: keep what we have
            return None
        others = others_busy(self._last, now)
        self._last, self._at = now, self._clock()
        n = free_cpus(self.budget, others)
        if n == self.threads:
            return None
        log.info("engine threads: %d -> %d (other processes busy on %.1f CPUs)",
                 self.threads, n, others)  # fmt: skip
        self.threads = self.live.n = n  # the host kernels read it from their next call
        self._apply(n)
        return n


def threads_report(requested: int | None = None) -> dict[str, object]:
    """For doctor: what the engine would choose here, and why."""
    choice = choose_threads(requested)
    return {
        "threads": choice.threads,
        "why": choice.why,
        "affinity_cpus": choice.budget.affinity,
        "cgroup_cpu_quota": choice.budget.quota,
    }
