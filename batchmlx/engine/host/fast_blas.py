"""Make MLX's Linux CPU backend use a fast BLAS instead of the reference one it ships with.

The Linux `mlx-cpu` wheel links netlib's reference BLAS (~4-8 GFLOP/s for a float32 1024^3
matmul). libmlx imports plain `cblas_sgemm` (and LAPACK `sgetrf_`, ...) as undefined dynamic
symbols, so a library that exports the same names and sits in the global scope before libmlx
loads wins symbol resolution. The CLI loads it into its own process with RTLD_GLOBAL before
MLX is imported (`load_fast_blas`); where that cannot be done it re-executes itself once with
LD_PRELOAD set (`ensure_fast_blas`), as child processes and shell scripts get it (`reexec_env`).
Candidates, in order of preference:

- Debian's `libopenblas0-pthread` (apt, ~36 MB): fastest GEMM here; it needs OPENBLAS_CORETYPE
  set to the CPU family, since a generic or inherited core type can cost 2-5x.
- Intel's `mkl` wheel (pip, ~650 MB installed): `libmkl_rt` under sys.prefix/lib, with
  MKL_THREADING_LAYER=SEQUENTIAL (no OpenMP runtime needed; faster at small decode matmuls).

cmeel-openblas needs the Fortran runtime (`libgfortran.so.5`, which needs libquadmath) and a fresh
machine may lack it. numpy's wheel vendors both under hashed names in `numpy.libs/`; a private
folder in the cache holds a copy of that libgfortran renamed `libgfortran.so.5` (engine/host/elf.py)
and a link to the libquadmath it names (`fortran_runtime_dir`): loaded first in process, or on
LD_LIBRARY_PATH for a re-executed one, so no system package is needed.

PyPI's scipy-openblas wheels prefix their symbols (`scipy_cblas_sgemm`), so they cannot stand
in. This module imports no MLX at import time; only `measure_matmul_gflops` and
`doctor_report` do, lazily.

    python -m batchmlx.engine.host.fast_blas   # doctor report as JSON (on the fast BLAS)
    eval "$(python -m batchmlx.engine.host.fast_blas --exports)"   # for shell scripts and CI
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import platform
import shlex
import site
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from batchmlx.engine.host.elf import renamed_copy

# Set in the re-executed child to the chosen BLAS's name; its presence stops further re-execs.
REEXEC_MARKER = "BATCHMLX_BLAS_REEXEC"
# "0" disables the preload; "mkl" / "openblas" force one route; unset or "auto" picks the best.
SWITCH = "BATCHMLX_FAST_BLAS"

_MKL_NAMES = ("libmkl_rt.so", "libmkl_rt.so.3", "libmkl_rt.so.2")
_OPENBLAS_FLAVOURS = ("openblas-pthread", "openblas-openmp")  # pthread first: no OpenMP needed
_BLAS_HINTS = ("mkl_rt", "openblas", "blis", "libblas")  # LD_PRELOAD entries we treat as BLAS


@dataclass(frozen=True, slots=True)
class BlasChoice:
    name: str  # "mkl", "openblas", "reference (slow)", "accelerate" (macOS)
    library: str | None  # path preloaded, or None
    env: dict[str, str] = field(default_factory=dict)  # variables set for it
    note: str = ""  # one line for logs / doctor
    runtime: str | None = None  # a folder of libraries it needs (fortran_runtime_dir)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (its first processor; empty where there is
    none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_coretype(cpuinfo: str | None = None) -> str | None:
    """OpenBLAS core type for this CPU from /proc/cpuinfo flags: "SKYLAKEX" (avx512f),
    "HASWELL" (avx2), else None. Both are valid in every OpenBLAS since 0.3.x, and on AMD
    Zen they pick the same kernels as the Zen names."""
    flags = cpu_flags(cpuinfo)
    if "avx512f" in flags:
        return "SKYLAKEX"
    if "avx2" in flags:
        return "HASWELL"
    return None


def python_prefixes() -> list[Path]:
    """This Python's prefixes, where wheels put their data files (the mkl and onednn wheels
    install their .so files as <prefix>/lib, next to site-packages)."""
    prefixes = [Path(sys.prefix), Path(sys.base_prefix)]
    try:
        prefixes.append(Path(site.getuserbase()))
    except Exception:  # pragma: no cover - site customisations can make this fail
        pass
    return list(dict.fromkeys(prefixes))


def _default_lib_dirs() -> list[Path]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return [Path("/usr/lib") / multiarch, Path("/usr/lib64"), Path("/usr/lib")]


def _find_mkl(prefixes: Sequence[Path]) -> BlasChoice | None:
    for prefix in prefixes:
        for name in _MKL_NAMES:
            lib = prefix / "lib" / name
            if lib.is_file():
                return BlasChoice(
                    name="mkl",
                    library=str(lib),
                    env={"MKL_THREADING_LAYER": "SEQUENTIAL"},
                    note=f"Intel MKL ({lib}), sequential threading layer",
                )
    return None


def _site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return [Path(d) for d in sorted(dirs)]


# Run by _loads in a child: load the library and run two small sgemms (a small-matrix kernel
# and a blocked one). A build for one CPU family only (cmeel-openblas 0.3.31: SKYLAKEX, AVX-512,
# whatever OPENBLAS_CORETYPE says) loads on an AVX2-only CPU and dies there of SIGILL at the
# first matmul, so loading alone proves nothing.
_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
n = 96
a = (ctypes.c_float * (n * n))(*([1.0] * (n * n)))
c = (ctypes.c_float * (n * n))()
f = lib.cblas_sgemm
f.restype = None
f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
for m in (4, n):
    f(101, 111, 111, m, n, n, 1.0, a, n, a, n, 0.0, c, n)
sys.exit(0 if abs(c[0] - n) < 1e-3 else 3)
"""


def _loads(lib: Path, lib_dir: Path | None = None) -> bool:
    """Whether `lib` loads and runs its sgemm here, with `lib_dir` first on the linker's
    search path (its own dependencies, libgfortran for one, may be missing on a bare machine)
    and the core type it would run with: else we keep the slow BLAS rather than fail at exec
    or at the first matmul. A child process, since LD_LIBRARY_PATH is read only when a
    process starts and an illegal instruction would end this one."""
    import subprocess

    core = cpu_coretype()
    mark = _probe_mark(lib, lib_dir, core)
    if mark is not None and mark.exists():
        return True
    env = dict(os.environ)
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = _prepend_path(str(lib_dir), env.get("LD_LIBRARY_PATH", ""))
    env.pop("LD_PRELOAD", None)
    if core:
        env["OPENBLAS_CORETYPE"] = core
    env["OPENBLAS_NUM_THREADS"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _PROBE, str(lib)], env=env, capture_output=True,
            timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        return False
    if mark is not None:
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
        except OSError:
            pass  # probed again next time
    return True


def _probe_mark(lib: Path, lib_dir: Path | None, core: str | None) -> Path | None:
    """The file whose presence says `lib` passed the probe before, so each command need not
    start a child again (~40 ms of every re-executed start, measured). Its name hashes what the
    verdict depends on: the library file, the runtime folder, the core type, this CPU's flags
    (a home folder shared by machines of several CPU kinds) and this Python. Failures are not
    remembered: a library fixed later is found at the next start."""
    try:
        st = lib.stat()
    except OSError:
        return None
    from batchmlx.config import load_settings  # no MLX, no SQL

    key = "\0".join([
        str(lib.resolve()), str(st.st_size), str(st.st_mtime_ns), str(lib_dir), core or "",
        " ".join(sorted(cpu_flags())), sys.executable,
    ])  # fmt: skip
    name = hashlib.sha1(key.encode()).hexdigest()[:16]
    return Path(load_settings().cache_dir) / "blas-probes" / name


def _prepend_path(first: str, rest: str) -> str:
    kept = [p for p in rest.split(":") if p and p != first]
    return ":".join([first, *kept])


def _numpy_runtime_libs(site_dirs: Sequence[Path]) -> tuple[Path, Path] | None:
    """numpy's vendored (libgfortran, libquadmath), or None where numpy has none."""
    for d in site_dirs:
        libs = d / "numpy.libs"
        gfortran = sorted(libs.glob("libgfortran-*.so.5*"))
        quadmath = sorted(libs.glob("libquadmath-*.so.0*"))
        if gfortran and quadmath:
            return gfortran[0], quadmath[0]
    return None


def vendored_gomp(site_dirs: Sequence[Path], *, system_has: bool | None = None) -> Path | None:
    """A wheel's vendored GNU OpenMP runtime (sentencepiece's, a dependency through mlx-lm) for
    oneDNN (engine/host/onednn.py) where the system has no libgomp.so.1; else None."""
    if system_has is None:
        system_has = ctypes.util.find_library("gomp") is not None
    if system_has:
        return None
    for d in site_dirs:
        for libs in sorted(d.glob("*.libs")):
            found = sorted(libs.glob("libgomp-*.so.1*"))
            if found:
                return found[0]
    return None


def fortran_runtime_dir(
    cache_dir: Path | None = None,
    site_dirs: Sequence[Path] | None = None,
    *,
    system_gomp: bool | None = None,
) -> Path | None:
    """A private folder that makes numpy's vendored Fortran runtime loadable under its usual
    soname: `libgfortran.so.5` links to numpy's hashed copy, which itself names its libquadmath
    by the hashed file name, so that name is linked too; and `libgomp.so.1` to a vendored one
    where the system has none (`vendored_gomp`). None where numpy vendors none or the cache
    cannot be written."""
    site_dirs = _site_dirs() if site_dirs is None else site_dirs
    found = _numpy_runtime_libs(site_dirs)
    if found is None:
        return None
    gfortran, quadmath = found
    if cache_dir is None:
        from batchmlx.config import load_settings  # no MLX, no SQL

        cache_dir = load_settings().cache_dir
    # one folder per numpy build and per environment: an upgraded numpy never meets stale
    # links, and two environments with the same numpy build (two venvs) do not re-point each
    # other's links (deleting one venv left the other's children unable to load libgfortran)
    where = hashlib.sha1(str(gfortran.parent).encode()).hexdigest()[:8]
    folder = Path(cache_dir) / "fortran-runtime" / f"{gfortran.name.split('-')[1]}-{where}"
    links = {"libgfortran.so.5": gfortran, quadmath.name: quadmath}
    gomp = vendored_gomp(site_dirs, system_has=system_gomp)
    if gomp is not None:
        links["libgomp.so.1"] = gomp
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            if name in _SONAMES and renamed_copy(target, folder / name):
                continue
            link = folder / name
            if link.is_symlink() and Path(os.readlink(link)) == target:
                continue
            tmp = folder / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            tmp.replace(link)  # atomic: a concurrent process sees the old link or the new one
    except OSError:
        return None
    return folder


# the runtime folder's libraries another one names in its DT_NEEDED: copies renamed (elf.py), so
# that loaded first inside a process (load_fast_blas) they are what that name finds
_SONAMES = ("libgfortran.so.5", "libgomp.so.1")


def _default_openblas_candidates() -> list[Path]:
    # the cmeel-openblas wheel (a batchmlx dependency on Linux x86_64) first: a pip install
    # gives it, with its symbols unprefixed, unlike scipy-openblas32; then Debian's packages
    found = [d / "cmeel.prefix" / "lib" / "libopenblas.so.0" for d in _site_dirs()]
    return found + _openblas_in(_default_lib_dirs())


def _openblas_in(lib_dirs: Sequence[Path]) -> list[Path]:
    return [base / flavour / "libopenblas.so.0" for base in lib_dirs
            for flavour in _OPENBLAS_FLAVOURS]  # fmt: skip


def _find_openblas(
    candidates: Sequence[Path],
    cpuinfo: str | None,
    loads: Callable[[Path, Path | None], bool],
    runtime_dir: Callable[[], Path | None] = lambda: None,
) -> BlasChoice | None:
    """The first candidate that loads. With a Fortran runtime folder it is tried first, so the
    same libgfortran (numpy's) serves on every machine, with or without the system's."""
    runtime: Path | None = None
    for lib in candidates:
        if not lib.exists():
            continue
        if runtime is None:
            runtime = runtime_dir()
        for lib_dir in ([runtime] if runtime is not None else []) + [None]:
            if not loads(lib, lib_dir):
                continue
            core = cpu_coretype(cpuinfo)
            # Overrides an inherited OPENBLAS_CORETYPE too: a mismatched one halves GEMM speed.
            env = {"OPENBLAS_CORETYPE": core} if core else {}
            # Its idle threads sleep at once instead of spinning ~0.1 s after each matmul, so
            # the numpy attention between two matmuls (engine/host/attention.py) gets both
            # cores: a 1,000-token prefill 1.17 -> 1.03 s; decode steps no slower.
            env["OPENBLAS_THREAD_TIMEOUT"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "4")
            if lib_dir is not None:
                env["LD_LIBRARY_PATH"] = _prepend_path(
                    str(lib_dir), os.environ.get("LD_LIBRARY_PATH", "")
                )
            via = f", Fortran runtime from numpy ({lib_dir})" if lib_dir else ""
            return BlasChoice(
                name="openblas",
                library=str(lib),
                env=env,
                note=f"OpenBLAS ({lib}), core type {core or 'auto-detected'}{via}",
                runtime=str(lib_dir) if lib_dir is not None else None,
            )
    return None


def find_fast_blas(
    *,
    prefixes: Sequence[Path] | None = None,
    lib_dirs: Sequence[Path] | None = None,
    cpuinfo: str | None = None,
    system: str | None = None,
    prefer: str | None = None,
) -> BlasChoice | None:
    """The fast BLAS to preload, or None (not Linux, or nothing installed).

    OpenBLAS comes before MKL because on the machines measured it was as fast or faster (about
    2x on large GEMMs); `prefer` ("mkl"/"openblas", default from BATCHMLX_FAST_BLAS) forces one."""
    system = system if system is not None else sys.platform
    if not system.startswith("linux"):
        return None  # macOS: MLX already uses Accelerate / Metal
    prefer = (prefer if prefer is not None else os.environ.get(SWITCH, "auto")).lower()
    finders = {
        "openblas": lambda: (
            _find_openblas(_openblas_in(lib_dirs), cpuinfo, lambda _lib, _dir: True)  # fakes
            if lib_dirs is not None
            else _find_openblas(
                _default_openblas_candidates(), cpuinfo, _loads, fortran_runtime_dir
            )
        ),
        "mkl": lambda: _find_mkl(prefixes if prefixes is not None else python_prefixes()),
    }
    order = [prefer] if prefer in finders else list(finders)
    for name in order:
        choice = finders[name]()
        if choice is not None:
            return choice
    return None


def _preloaded_blas(ld_preload: str) -> str | None:
    """The BLAS-looking entry of an LD_PRELOAD value, if any (ld.so splits on ':' and ' ')."""
    for entry in ld_preload.replace(":", " ").split():
        if any(hint in Path(entry).name for hint in _BLAS_HINTS):
            return entry
    return None


CUDA_BACKENDS = ("mlx-cuda-12", "mlx-cuda-13")  # MLX's CUDA wheels (`batchmlx[cuda12]`, ...)


def mlx_backend(installed: Callable[[str], bool] | None = None) -> str:
    """ "cuda" when MLX's CUDA wheel is installed without the CPU one (the GPU install in the
    README removes mlx-cpu, since both ship mlx/lib/libmlx.so), else "cpu". Read from package
    metadata, so the CLI knows before importing MLX."""
    installed = _installed if installed is None else installed
    if any(installed(d) for d in CUDA_BACKENDS) and not installed("mlx-cpu"):
        return "cuda"
    return "cpu"


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def _wanted(environ: Mapping[str, str], backend: str | None = None) -> BlasChoice | None:
    """The fast BLAS this process should run on, or None: disabled, nothing installed, a
    BLAS already preloaded in `environ`, or MLX on its CUDA backend (the GPU's matmuls)."""
    if environ.get(SWITCH, "auto") == "0" or environ.get(REEXEC_MARKER):
        return None
    if environ.get(SWITCH, "auto") == "auto" and (backend or mlx_backend()) == "cuda":
        return None
    if _preloaded_blas(environ.get("LD_PRELOAD", "")):
        return None  # someone preloaded their own BLAS: leave it and its env alone
    choice = find_fast_blas(prefer=environ.get(SWITCH, "auto"))
    return None if choice is None or choice.library is None else choice


def reexec_env(
    environ: Mapping[str, str] | None = None, backend: str | None = None
) -> dict[str, str] | None:
    """Variables to add to a process's environment so it starts on the fast BLAS (a child
    process, a shell script), or None where `_wanted` finds none."""
    environ = os.environ if environ is None else environ
    choice = _wanted(environ, backend)
    if choice is None or choice.library is None:
        return None
    existing = environ.get("LD_PRELOAD", "")
    preload = f"{existing}:{choice.library}" if existing else choice.library
    return {"LD_PRELOAD": preload, REEXEC_MARKER: choice.name, **choice.env}


# what load_fast_blas loaded into this process (LD_PRELOAD tells the re-executed route)
_loaded: list[BlasChoice] = []


def load_fast_blas() -> BlasChoice | None:
    """Load the fast BLAS into this process, ahead of MLX: its cblas symbols, in the global
    scope, are what libmlx binds to when it loads (an LD_PRELOAD without the restart: ~80 ms
    of every model command, a second interpreter start and the imports before it). Its
    Fortran runtime (and a vendored libgomp) comes first, as renamed copies (elf.py). None
    where nothing is wanted (`_wanted`), MLX is already imported, or a library fails to load."""
    if _loaded or not sys.platform.startswith("linux"):
        return _loaded[0] if _loaded else None
    if "mlx.core" in sys.modules:
        return None  # too late: libmlx has bound its BLAS
    choice = _wanted(os.environ)
    if choice is None or choice.library is None:
        return None
    libs = [Path(choice.library)]
    if choice.runtime is not None:
        folder = Path(choice.runtime)
        if (folder / "libgfortran.so.5").is_symlink():
            return None  # no renamed copy: only LD_LIBRARY_PATH (a restart) finds it
        quadmath = sorted(folder.glob("libquadmath-*"))  # libgfortran's own DT_NEEDED
        libs = quadmath + [folder / n for n in _SONAMES if (folder / n).is_file()] + libs
    # read by the libraries when they start (OPENBLAS_CORETYPE, MKL_THREADING_LAYER, ...)
    env = {k: v for k, v in choice.env.items() if k != "LD_LIBRARY_PATH"}
    before = {k: os.environ[k] for k in env if k in os.environ}
    os.environ.update(env)
    try:
        for lib in libs:
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        for k in env:  # as it was, for the re-execution's own choice
            os.environ.pop(k)
        os.environ.update(before)
        return None
    _loaded.append(replace(choice, env=env, note=f"{choice.note}; loaded in this process"))
    return _loaded[0]


def ensure_fast_blas(argv: list[str] | None = None) -> None:
    """Put this process on the fast BLAS: loaded in process (`load_fast_blas`), else by
    re-executing this interpreter once with it preloaded; else return quietly.

    Call it first thing in the console-script entry point, before MLX is imported (never from
    code pytest runs in process). `argv` is what follows the interpreter for a re-execution;
    the default `sys.orig_argv[1:]` keeps interpreter flags and `-m module`, so `batchmlx ...`
    and `python -m ...` rerun identically."""
    if not sys.platform.startswith("linux") or load_fast_blas() is not None:
        return
    extra = reexec_env()
    if extra is None:
        return
    args = list(sys.orig_argv[1:]) if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *args], {**os.environ, **extra})
    except OSError:
        return  # degrade to the slow BLAS rather than fail the command


def active_blas(environ: Mapping[str, str] | None = None) -> BlasChoice:
    """The BLAS this process runs with: what load_fast_blas loaded, else judged from
    LD_PRELOAD (read at process start)."""
    environ = os.environ if environ is None else environ
    if sys.platform == "darwin":
        return BlasChoice("accelerate", None, {}, "macOS: MLX uses Accelerate / Metal")
    if _loaded and environ is os.environ:
        return _loaded[0]
    lib = _preloaded_blas(environ.get("LD_PRELOAD", ""))
    if lib is None:
        hint = "install libopenblas0-pthread (apt) or mkl (pip) to speed up CPU matmuls"
        return BlasChoice("reference (slow)", None, {}, f"netlib reference BLAS; {hint}")
    name = "mkl" if "mkl" in Path(lib).name else "openblas" if "openblas" in lib else "other"
    keys = ("MKL_THREADING_LAYER", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS",
            "OPENBLAS_THREAD_TIMEOUT", "LD_LIBRARY_PATH")  # fmt: skip
    env = {k: environ[k] for k in keys if k in environ}
    how = "re-executed by batchmlx" if environ.get(REEXEC_MARKER) else "preloaded by caller"
    return BlasChoice(name, lib, env, f"{name} via LD_PRELOAD ({how})")


def slow_blas_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """One loud line when MLX runs on the reference BLAS on Linux, else None."""
    blas = active_blas(environ)
    if blas.name != "reference (slow)":
        return None
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH) == "0":
        why, fix = f"{SWITCH}=0 is set", f"unset {SWITCH}"
    else:
        why = "no fast BLAS could be loaded"
        if "avx512f" in cpu_flags() or not cpu_flags():
            fix = ("`pip install --force-reinstall cmeel-openblas numpy` (or apt install "
                   "libopenblas0-pthread)")  # fmt: skip
        else:  # cmeel-openblas is built for AVX-512 alone: it cannot run on this CPU
            fix = "apt install libopenblas0-pthread (or pip install mkl)"
    return (
        f"WARNING: MLX is on the slow reference BLAS ({why}); CPU matmuls run ~50x slower. "
        f"Fix: {fix}, then check with `batchmlx doctor`."
    )


def measure_matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` float32 n x n matmul throughput on MLX's CPU device, in GFLOP/s."""
    import mlx.core as mx  # lazy: this module must stay importable without MLX loaded

    key_a, key_b = mx.random.split(mx.random.key(0))
    a = mx.random.normal((n, n), dtype=mx.float32, key=key_a, stream=mx.cpu)
    b = mx.random.normal((n, n), dtype=mx.float32, key=key_b, stream=mx.cpu)
    mx.eval(a, b)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))  # warm-up: first call pays thread/pack setup
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e9


def doctor_report(*, measure: bool = True, threads: int | None = None) -> dict[str, object]:
    """Platform, MLX version and device, the active BLAS and its measured matmul speed, and the
    engine threads `threads` (--threads / BATCHMLX_THREADS; None: chosen) would give."""
    import mlx.core as mx

    from batchmlx.engine.host.threads import threads_report

    blas = active_blas()
    available = find_fast_blas()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx_version": mx.__version__,
        "default_device": str(mx.default_device()),
        "mlx_backend": mlx_backend(),
        "cuda_available": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
        "cpu_coretype": cpu_coretype() if sys.platform.startswith("linux") else None,
        "active_blas": asdict(blas),
        "note": blas.note,
        "fast_blas_available": asdict(available) if available else None,
        "engine_threads": threads_report(threads),
        "matmul_gflops_1024_f32": round(measure_matmul_gflops(), 1) if measure else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--exports" in args:
        for key, value in (reexec_env() or {}).items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if "--no-reexec" not in args:
        ensure_fast_blas()  # so the report shows what the CLI would run with
    from batchmlx.config import load_host_settings

    threads = load_host_settings().threads
    print(json.dumps(doctor_report(measure="--no-measure" not in args, threads=threads), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
