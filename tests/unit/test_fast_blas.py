"""engine/host/fast_blas.py: core-type
parsing, BLAS discovery on fake trees, the re-exec decision."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchmlx.engine.host import fast_blas as accel

CPUINFO_AVX512 = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
    "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw\n\n"
    "processor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma avx512f\n"
)
CPUINFO_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
CPUINFO_OLD = "processor\t: 0\nflags\t\t: fpu sse2 sse4_2\n"
CPUINFO_ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (CPUINFO_AVX512, "SKYLAKEX"),
        (CPUINFO_AVX2, "HASWELL"),
        (CPUINFO_OLD, None),
        (CPUINFO_ARM, None),
        ("", None),
    ],
)
def test_cpu_coretype_from_flags(text: str, expected: str | None) -> None:
    assert accel.cpu_coretype(text) == expected


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """A fake interpreter prefix with the mkl wheel's lib, and a fake Debian multiarch dir."""
    prefix = tmp_path / "venv"
    lib_dir = tmp_path / "usr/lib/x86_64-linux-gnu"
    return {
        "prefix": prefix,
        "lib_dir": lib_dir,
        "mkl": prefix / "lib/libmkl_rt.so.3",
        "openblas": lib_dir / "openblas-pthread/libopenblas.so.0",
    }


def _find(tree: dict[str, Path], **kwargs) -> accel.BlasChoice | None:
    kwargs = {"prefer": "auto", "system": "linux", "cpuinfo": CPUINFO_AVX512, **kwargs}
    return accel.find_fast_blas(prefixes=[tree["prefix"]], lib_dirs=[tree["lib_dir"]], **kwargs)


def test_find_fast_blas_nothing_installed(tree) -> None:
    assert _find(tree) is None


def test_find_fast_blas_mkl_wheel(tree) -> None:
    _touch(tree["mkl"])
    assert _find(tree) == accel.BlasChoice(
        name="mkl",
        library=str(tree["mkl"]),
        env={"MKL_THREADING_LAYER": "SEQUENTIAL"},
        note=f"Intel MKL ({tree['mkl']}), sequential threading layer",
    )


def test_find_fast_blas_prefers_openblas_with_coretype(tree) -> None:
    _touch(tree["mkl"])
    _touch(tree["openblas"])
    choice = _find(tree)
    assert choice is not None
    assert (choice.name, choice.library) == ("openblas", str(tree["openblas"]))
    # idle OpenBLAS threads sleep at once (a user's own setting wins)
    assert choice.env == {"OPENBLAS_CORETYPE": "SKYLAKEX", "OPENBLAS_THREAD_TIMEOUT": "4"}
    forced = _find(tree, prefer="mkl")
    assert forced is not None and forced.name == "mkl"


def test_find_fast_blas_openblas_unknown_cpu_sets_no_coretype(tree) -> None:
    _touch(tree["openblas"])
    choice = accel.find_fast_blas(
        prefixes=[], lib_dirs=[tree["lib_dir"]], cpuinfo=CPUINFO_OLD, system="linux", prefer="auto"
    )
    assert choice is not None and "OPENBLAS_CORETYPE" not in choice.env


def test_find_fast_blas_none_on_macos(tree) -> None:
    _touch(tree["mkl"])
    assert _find(tree, system="darwin") is None


@pytest.fixture
def recorded_exec(monkeypatch, tree) -> list[tuple[str, list[str], dict[str, str]]]:
    """Linux with a fake mkl found, a clean environment, and os.execve recording its call."""
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "execve", lambda exe, args, env: calls.append((exe, args, env)))
    monkeypatch.setattr(accel, "python_prefixes", lambda: [tree["prefix"]])
    monkeypatch.setattr(accel, "_default_lib_dirs", lambda: [tree["lib_dir"]])
    monkeypatch.setattr(accel, "_site_dirs", lambda: [])  # no pip-installed OpenBLAS
    monkeypatch.setattr(accel, "_loaded", [])  # (pytest's own, loaded by conftest.py)
    for key in ("LD_PRELOAD", accel.REEXEC_MARKER, accel.SWITCH):
        monkeypatch.delenv(key, raising=False)
    _touch(tree["mkl"])
    return calls


def test_ensure_fast_blas_reexecs_with_preload(recorded_exec, tree) -> None:
    accel.ensure_fast_blas(["-m", "batchmlx.cli", "run"])
    [(exe, args, env)] = recorded_exec
    assert exe == sys.executable
    assert args == [sys.executable, "-m", "batchmlx.cli", "run"]
    assert env["LD_PRELOAD"] == str(tree["mkl"])
    assert env[accel.REEXEC_MARKER] == "mkl"
    assert env["MKL_THREADING_LAYER"] == "SEQUENTIAL"


def test_ensure_fast_blas_reruns_the_whole_command_line(recorded_exec, monkeypatch) -> None:
    """The CLI passes its options (the database URL among them) in argv, not the environment:
    the re-executed process gets the interpreter's own command line, as given."""
    line = ["/usr/bin/python3", "-X", "utf8", "-m", "batchmlx.cli", "worker", "--database-url",
            "sqlite:///q.db"]  # fmt: skip
    monkeypatch.setattr(sys, "orig_argv", line)
    accel.ensure_fast_blas()
    [(_, args, _)] = recorded_exec
    assert args == [sys.executable, *line[1:]]


def test_ensure_fast_blas_keeps_other_preloads(recorded_exec, tree, monkeypatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/opt/libjemalloc.so")
    accel.ensure_fast_blas(["x"])
    assert recorded_exec[0][2]["LD_PRELOAD"] == f"/opt/libjemalloc.so:{tree['mkl']}"


@pytest.mark.parametrize(
    "env",
    [
        {accel.SWITCH: "0"},
        {accel.REEXEC_MARKER: "mkl"},
        {"LD_PRELOAD": "/somewhere/libopenblas.so.0"},
    ],
    ids=["disabled", "already-reexeced", "already-preloaded"],
)
def test_ensure_fast_blas_noop(recorded_exec, monkeypatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    accel.ensure_fast_blas(["x"])
    assert recorded_exec == []
    assert accel.reexec_env() is None


def test_ensure_fast_blas_noop_when_nothing_found(recorded_exec, tree) -> None:
    tree["mkl"].unlink()
    accel.ensure_fast_blas(["x"])
    assert recorded_exec == []


def test_active_blas_reads_ld_preload(monkeypatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    assert accel.active_blas({}).name == "reference (slow)"
    env = {"LD_PRELOAD": "/p/lib/libmkl_rt.so.3", "MKL_THREADING_LAYER": "SEQUENTIAL"}
    mkl = accel.active_blas(env)
    assert (mkl.name, mkl.library, mkl.env) == (
        "mkl",
        "/p/lib/libmkl_rt.so.3",
        {"MKL_THREADING_LAYER": "SEQUENTIAL"},
    )
    ob = accel.active_blas({"LD_PRELOAD": "/usr/lib/x/openblas-pthread/libopenblas.so.0"})
    assert ob.name == "openblas"


def test_module_does_not_import_mlx() -> None:
    code = "import sys, batchmlx.engine.host.fast_blas; print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_doctor_cli_prints_json() -> None:
    # Real path: loads whatever fast BLAS this machine has, then measures a matmul.
    out = subprocess.run(
        [sys.executable, "-m", "batchmlx.engine.host.fast_blas"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    assert set(report["active_blas"]) == {"name", "library", "env", "note", "runtime"}
    assert report["matmul_gflops_1024_f32"] > 0


LINUX_X86 = sys.platform.startswith("linux") and os.uname().machine == "x86_64"
# cmeel-openblas 0.3.31 is built for SKYLAKEX alone (AVX-512), not for every x86-64 CPU
AVX512 = "avx512f" in accel.cpu_flags() if LINUX_X86 else False
needs_cmeel = pytest.mark.skipif(
    not (LINUX_X86 and AVX512),
    reason="cmeel-openblas: a dependency on Linux x86_64, built for AVX-512 CPUs only",
)


@needs_cmeel
def test_the_pip_installed_openblas_is_found_and_loads() -> None:
    choice = accel.find_fast_blas(prefer="openblas")
    assert choice is not None and choice.name == "openblas"
    assert "cmeel.prefix" in choice.library


@needs_cmeel
def test_a_passed_probe_is_remembered_and_a_failed_one_is_not(tmp_path: Path, monkeypatch) -> None:
    # each re-executed command probed its BLAS in a child again (~40 ms of every start)
    monkeypatch.setenv("BATCHMLX_CACHE_DIR", str(tmp_path))
    lib = next(iter(accel._default_openblas_candidates()))
    runtime = accel.fortran_runtime_dir(tmp_path)
    assert accel._loads(lib, runtime)
    assert len(list((tmp_path / "blas-probes").iterdir())) == 1
    bad = tmp_path / "libopenblas.so.0"
    bad.write_bytes(b"not a library")
    assert not accel._loads(bad, runtime)
    assert len(list((tmp_path / "blas-probes").iterdir())) == 1

    def no_child(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("probed again")

    monkeypatch.setattr(subprocess, "run", no_child)
    assert accel._loads(lib, runtime)  # remembered: no child
    with pytest.raises(AssertionError, match="probed again"):
        accel._loads(lib, tmp_path / "elsewhere")  # another runtime folder: another verdict


def test_an_openblas_that_cannot_load_is_skipped(tmp_path: Path) -> None:
    # e.g. its libgfortran is missing on a bare machine: keep the slow BLAS rather than fail
    lib = tmp_path / "cmeel.prefix" / "lib" / "libopenblas.so.0"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not a library")
    assert accel._find_openblas([lib], "", accel._loads) is None
    assert accel._find_openblas([lib], "", lambda _p, _d: True) is not None


def test_a_library_that_loads_but_runs_no_sgemm_is_not_preloaded() -> None:
    # the probe runs an sgemm in a child: libm loads, has none, so it is refused
    libm = Path("/lib/x86_64-linux-gnu/libm.so.6")
    if not libm.is_file():
        pytest.skip("no Debian libm here")
    assert not accel._loads(libm)


@pytest.mark.skipif(not LINUX_X86 or AVX512, reason="a CPU without AVX-512")
def test_an_openblas_built_for_avx512_is_refused_on_a_cpu_without_it() -> None:
    # it loads, and died of SIGILL at the first matmul (the main job crashed on an AVX2 host)
    lib = next(iter(accel._default_openblas_candidates()), None)
    assert lib is not None and "cmeel.prefix" in str(lib)
    assert not accel._loads(lib, accel.fortran_runtime_dir())
    assert accel.find_fast_blas(prefer="openblas") is None


def test_fortran_runtime_dir_links_numpys_vendored_libs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    libs = site / "numpy.libs"
    libs.mkdir(parents=True)
    gf = libs / "libgfortran-040039e1-0352e75f.so.5.0.0"
    qm = libs / "libquadmath-96973f99-934c22de.so.0.0.0"
    for f in (gf, qm):
        f.write_bytes(b"")
    folder = accel.fortran_runtime_dir(tmp_path / "cache", [site], system_gomp=True)
    assert folder.parent == tmp_path / "cache" / "fortran-runtime"
    assert folder.name.startswith("040039e1-")
    assert sorted(p.name for p in folder.iterdir()) == sorted(["libgfortran.so.5", qm.name])
    assert (folder / "libgfortran.so.5").resolve() == gf
    assert (folder / qm.name).resolve() == qm
    assert accel.fortran_runtime_dir(tmp_path / "cache", [site], system_gomp=True) == folder
    assert accel.fortran_runtime_dir(tmp_path / "cache", [tmp_path / "empty"]) is None
    # another environment with the same numpy build gets a folder of its own
    other = tmp_path / "venv2" / "numpy.libs"
    other.mkdir(parents=True)
    for f in (gf, qm):
        (other / f.name).write_bytes(b"")
    theirs = accel.fortran_runtime_dir(tmp_path / "cache", [other.parent], system_gomp=True)
    assert theirs != folder and (theirs / "libgfortran.so.5").resolve() == other / gf.name
    assert (folder / "libgfortran.so.5").resolve() == gf  # ours untouched


def test_a_vendored_openmp_runtime_is_linked_only_where_the_system_has_none(tmp_path) -> None:
    site = tmp_path / "site"
    for name in ("numpy.libs/libgfortran-040039e1-0352e75f.so.5.0.0",
                 "numpy.libs/libquadmath-96973f99-934c22de.so.0.0.0",
                 "sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"):  # fmt: skip
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(b"")
    gomp = site / "sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"
    folder = accel.fortran_runtime_dir(tmp_path / "cache", [site], system_gomp=False)
    assert (folder / "libgomp.so.1").resolve() == gomp  # oneDNN's libgomp.so.1 found there
    assert accel.vendored_gomp([site], system_has=True) is None


def test_the_runtime_folder_is_tried_first(tmp_path: Path) -> None:
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    tried: list[Path | None] = []

    def loads(_lib: Path, lib_dir: Path | None) -> bool:
        tried.append(lib_dir)
        return lib_dir is not None

    choice = accel._find_openblas([lib], "", loads, lambda: tmp_path / "rt")
    assert tried == [tmp_path / "rt"]
    assert choice is not None
    assert choice.env["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path / "rt")


_BOUND_TO = """
import ctypes, sys
from batchmlx.engine.host.fast_blas import active_blas, ensure_fast_blas
ensure_fast_blas()
import mlx.core as mx
a = mx.ones((256, 256)); mx.eval(mx.matmul(a, a, stream=mx.cpu))
# the cblas_sgemm libmlx binds to: the first one in the process's global scope
at = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
owner = [l.split()[-1] for l in open("/proc/self/maps") if len(l.split()) > 5
         and int(l.split("-")[0], 16) <= at < int(l.split()[0].split("-")[1], 16)]
print(active_blas().name, owner[0])
sys.stdout.write(open("/proc/self/maps").read())
"""


@needs_cmeel
@pytest.mark.parametrize("route", ["in process", "re-executed"])
def test_fast_blas_loads_without_any_system_libgfortran(tmp_path: Path, route: str) -> None:
    # Loaded in this process (or, where that cannot be, in a re-executed one), the chosen
    # OpenBLAS is what MLX's matmul binds to, with numpy's vendored Fortran runtime (renamed
    # in the cache, or found on LD_LIBRARY_PATH), whatever /usr/lib holds.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", accel.REEXEC_MARKER)}
    env["BATCHMLX_CACHE_DIR"] = str(tmp_path / "cache")
    env[accel.SWITCH] = "openblas"
    code = _BOUND_TO
    if route == "re-executed":  # MLX imported first: too late to load it in this process
        code = ("import mlx.core\nfrom batchmlx.engine.host.fast_blas import ensure_fast_blas\n"
                f"ensure_fast_blas(['-c', {_BOUND_TO!r}])\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    first, maps = out.stdout.split("\n", 1)
    name, owner = first.split()
    assert name == "openblas", out.stderr
    assert "cmeel.prefix/lib/libopenblas" in owner  # not MLX's reference BLAS
    gfortran = {line.split()[-1] for line in maps.splitlines() if "libgfortran" in line}
    # numpy's copy serves OpenBLAS (mlx_cpu.libs may map its own for MLX's LAPACK); no system one
    ours = str(tmp_path / "cache" / "fortran-runtime")
    assert any("numpy.libs" in path or path.startswith(ours) for path in gfortran), gfortran
    assert not any(path.startswith(("/usr/", "/lib")) for path in gfortran), gfortran


def test_slow_blas_warning(monkeypatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    line = accel.slow_blas_warning({accel.SWITCH: "0"})
    assert line is not None and line.startswith("WARNING") and "BATCHMLX_FAST_BLAS=0" in line
    assert "batchmlx doctor" in (accel.slow_blas_warning({}) or "")
    assert accel.slow_blas_warning({"LD_PRELOAD": "/x/libopenblas.so.0"}) is None


@pytest.mark.parametrize(
    ("installed", "backend"),
    [
        ({"mlx-cpu"}, "cpu"),
        ({"mlx-cuda-12"}, "cuda"),
        ({"mlx-cuda-13"}, "cuda"),
        ({"mlx-cpu", "mlx-cuda-12"}, "cpu"),  # both ship libmlx.so: which one won is unknown
    ],
)
def test_mlx_backend_from_installed_wheels(installed, backend) -> None:
    assert accel.mlx_backend(installed.__contains__) == backend


def test_no_reexec_on_the_cuda_backend(recorded_exec, monkeypatch) -> None:
    """On MLX's CUDA backend the matmuls run on the GPU: the CLI starts as it is."""
    monkeypatch.setattr(accel, "_installed", {"mlx-cuda-12"}.__contains__)
    accel.ensure_fast_blas(["-m", "batchmlx.cli", "run"])
    assert recorded_exec == []
    monkeypatch.setenv(accel.SWITCH, "mkl")  # asked for by name: preloaded anyway
    accel.ensure_fast_blas(["-m", "batchmlx.cli", "run"])
    assert len(recorded_exec) == 1


def test_the_slow_blas_line_is_left_out_for_weights_computed_off_mlx(monkeypatch, capsys) -> None:
    from batchmlx.cli import common
    from batchmlx.engine.host.backend import HostBackend

    monkeypatch.setattr(accel, "slow_blas_warning", lambda environ=None: "WARNING: slow BLAS")
    monkeypatch.setattr(HostBackend, "onednn_available", lambda self: True)
    common.warn_if_slow_blas("auto")  # host weights: their GEMMs are oneDNN's or numpy's
    assert "slow BLAS" not in capsys.readouterr().err
    common.warn_if_slow_blas("float32")  # MLX's own matmuls
    assert "slow BLAS" in capsys.readouterr().err
