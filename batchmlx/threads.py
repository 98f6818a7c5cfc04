"""How many compute threads the engine uses: sized from the CPUs this process may actually use,
so that BLAS thread teams do not spin against the neighbours.

The CPUs a process may use are the fewer of its affinity mask (`os.sched_getaffinity`: taskset,
cpusets) and its cgroup v2 CPU quota (`/sys/fs/cgroup/cpu.max`: a container's `--cpus`). Of
those the engine takes all but one, and at least one: OpenBLAS's threads meet at a barrier in
every matmul and busy-wait there, so one descheduled thread stalls the rest for a time slice.
Measured on 2 cores shared with other work (benchmarks/threads_neighbours.py, a 32-token chat
on the default model): 2 threads 32.2 s, 1 thread 6.5 s; with two more busy neighbours 59.7 s
and 10.8 s (issue 21 saw 35-46 s against 3.8-4.0 s). The core left over serves the event loop,
the database and the other processes of the host.

`--threads N` (or BATCHMLX_THREADS) overrides the choice; `batchmlx doctor` shows it. The count
goes to the BLAS MLX's CPU backend calls (OpenBLAS or MKL, set at run time through the preloaded
library), to the variables a library loaded later reads, and to the host-attention pool
(engine/kernels/host_attention.py reads BATCHMLX_THREADS). Pure apart from reading /proc-like
files and the loaded BLAS; imports no MLX.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV = "BATCHMLX_THREADS"  # the --threads flag's variable; host_attention reads it too
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
# variables of the BLAS and OpenMP runtimes, for libraries loaded after the choice is made
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


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
    environ: Mapping[str, str] | None = None,
) -> ThreadChoice:
    """`requested` (the flag), else BATCHMLX_THREADS, else all the budget's CPUs but one."""
    budget = budget or cpu_budget()
    environ = os.environ if environ is None else environ
    if requested is None and environ.get(ENV, "").strip():
        try:
            requested = int(environ[ENV])
        except ValueError:
            msg = f"{ENV} must be a whole number of threads, not {environ[ENV]!r}"
            raise ValueError(msg) from None
        how = f"{ENV}={requested}"
    else:
        how = f"--threads {requested}"
    quota = f", a cgroup quota of {budget.quota:g}" if budget.quota is not None else ""
    seen = f"{budget.affinity} CPUs in this process's affinity{quota}"
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, not {requested}")
        return ThreadChoice(requested, f"{how} ({seen})", budget)
    n = max(1, budget.cpus - 1)
    return ThreadChoice(
        n, f"{seen}: {budget.cpus} usable, one left to the event loop and neighbours", budget
    )


def apply_threads(choice: ThreadChoice) -> list[str]:
    """Size the BLAS of this process to `choice` now (its run-time setter, found among the
    preloaded library's symbols) and for what loads later (the variables); returns what was
    set, for the log."""
    n = choice.threads
    for key in (ENV, *THREAD_VARIABLES):
        os.environ[key] = str(n)
    done = [f"{ENV}={n}"]
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


def threads_report(requested: int | None = None) -> dict[str, object]:
    """For doctor: what the engine would choose here, and why."""
    choice = choose_threads(requested)
    return {
        "threads": choice.threads,
        "why": choice.why,
        "affinity_cpus": choice.budget.affinity,
        "cgroup_cpu_quota": choice.budget.quota,
    }
