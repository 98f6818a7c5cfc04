"""Run one workload on one CPU peer as a whole process, timed from spawn to exit (load included).

Each function returns a `PeerRun`: wall (spawn to exit), load (spawn to ready for work),
steady-state tok/s (completion tokens over the time from ready to the last token: load
excluded, prefill included), peak RSS of the process tree (sampled every 0.2 s), completion
tokens, the texts by custom_id (for parity checks) and the precision the peer computes in.

- `run_llama`: `llama-server -np N -c N*(per-slot ctx) --cont-batching` on 127.0.0.1, threads =
  the CPUs this process may use; the requests go concurrently to /v1/chat/completions,
  temperature 0. Precision: the GGUF's weight types.
- `run_vllm`: `python -m vllm.entrypoints.openai.run_batch` on an OpenAI Batch JSONL (usage
  stats off, hub offline). Ready = its "Reading batch" log line. Precision: `--dtype`.
- `run_openvino`: `ov_worker.py` in OpenVINO GenAI's venv: `LLMPipeline(gguf, "CPU",
  scheduler_config=...)` with max_num_seqs = the request count and prefix caching on, one
  greedy `generate` over the chat-templated prompts. Precision: the CPU plugin's
  INFERENCE_PRECISION_HINT (bf16 on AVX512_BF16 CPUs) over the GGUF's weight types.
- `run_vllm_mlx`: `vllm_mlx_worker.py` in vllm-mlx's venv: the continuous-batching engine of
  `vllm-mlx serve --continuous-batching` (`BatchedEngine`, scheduler defaults), every request
  submitted at once, greedy, on a float32 MLX folder of the default model (batchmlx's weights,
  `dequantize_model` to float32). It runs under the BLAS batchmlx re-executes onto (the
  variables of `python -m batchmlx.engine.host.fast_blas --exports`),
  threads = the CPUs this process may use.
  Precision: float32.

    python -m benchmarks.peers.run_peer --peer llama --workload unique --requests 8 --model default
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.peers.models import MODELS, default_mlx_folder, gguf_type, model_files, path_for
from benchmarks.peers.setup import ensure
from benchmarks.peers.watched import Watched
from benchmarks.whole_process import QUICK, WORKLOADS, ProcessRun, Workload

HERE = Path(__file__).resolve().parent
PEERS = ("llama", "openvino", "vllm", "vllm-mlx")
_REQUEST_TIMEOUT_S = 3600


def log(msg: str) -> None:
    print(f"[peers-run] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class PeerRun:
    """One whole-process run of a peer; `as_process_run()` gives whole_process.py's row."""

    system: str  # e.g. "llama.cpp server (64 slots)"
    peer: str  # llama | openvino | vllm | vllm-mlx | batchmlx
    model: str  # default | 360m | 1.7b | 8b
    precision: str  # what it computes in
    wall_s: float  # spawn to exit
    load_s: float  # spawn to ready for work
    steady_tok_s: float  # completion tokens / (last token - ready)
    output_tokens: int
    peak_rss_mb: float  # the process tree's, sampled
    texts: dict[str, str] = field(default_factory=dict)  # custom_id -> text
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def as_process_run(self) -> ProcessRun:
        extra = {"precision": self.precision, "load_s": self.load_s,
                 "steady_tok_s": self.steady_tok_s, "peak_rss_mb": self.peak_rss_mb,
                 **self.extra}  # fmt: skip
        return ProcessRun(self.system, self.wall_s, dict(self.texts), self.output_tokens, extra)

    def summary(self) -> str:
        return (f"{self.system} [{self.model}, {self.precision}]: {self.wall_s:.1f} s whole "
                f"process, {self.output_tokens} tokens, {self.tok_s:.1f} tok/s; load "
                f"{self.load_s:.1f} s, steady {self.steady_tok_s:.1f} tok/s; peak RSS "
                f"{self.peak_rss_mb:.0f} MB")  # fmt: skip


# -- the workload -----------------------------------------------------------------------------


def requests_of(wl: Workload, tokenizer: Any) -> list[tuple[str, list[dict[str, str]]]]:
    return [(f"r{i}", m) for i, m in enumerate(wl.messages(tokenizer))]


def _prompt_lengths(tokenizer: Any, reqs: list[tuple[str, list[dict[str, str]]]]) -> list[int]:
    out = []
    for _, m in reqs:
        ids = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        out.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_files(model).tokenizer))


def _folder_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _default_quant(model: str) -> str:
    return "Q4_1" if model == "default" else "Q8_0"


def _threads() -> int:
    return len(os.sched_getaffinity(0))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ignore_eos(model: str, ignore_eos: bool | None) -> bool:
    # Random weights emit no eos by chance only; ignoring it makes every count exactly max_tokens.
    return model_files(model).random if ignore_eos is None else ignore_eos


# -- llama.cpp --------------------------------------------------------------------------------


def _post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=_REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"llama-server {path}: HTTP {resp.status}: {data[:500]!r}")
        return json.loads(data)
    finally:
        conn.close()


def _wait_healthy(w: Watched, port: int, timeout: float = 600) -> float:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if w.proc.poll() is not None:
            raise RuntimeError(f"llama-server exited ({w.proc.returncode}):\n{w.tail()}")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return w.now()
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    raise TimeoutError(f"llama-server not healthy after {timeout} s:\n{w.tail()}")


def llama_server_cmd(server: str, gguf: Path, port: int, slots: int, per_slot: int,
                     threads: int | None = None) -> list[str]:  # fmt: skip
    """`llama-server` on 127.0.0.1:`port`, `slots` slots of `per_slot` context each, continuous
    batching, `threads` (default: the CPUs this process may use)."""
    threads = threads or _threads()
    return [server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * per_slot), "--cont-batching", "-t", str(threads),
            "-tb", str(threads), "--no-webui"]  # fmt: skip


def run_llama(wl: Workload, model: str = "default", quant: str | None = None, *,
              slots: int | None = None, ignore_eos: bool | None = None) -> PeerRun:  # fmt: skip
    inst = ensure("llama")
    gguf = Path(path_for(model, quant or _default_quant(model)))
    tok = _tokenizer(model)
    reqs = requests_of(wl, tok)
    n = slots or len(reqs)
    per_slot = max(_prompt_lengths(tok, reqs)) + wl.max_tokens + 64
    port, threads = _free_port(), _threads()
    cmd = llama_server_cmd(inst.server, gguf, port, n, per_slot, threads)
    skip_eos = _ignore_eos(model, ignore_eos)
    w = Watched(cmd, log_path=Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1]))
    try:
        ready = _wait_healthy(w, port)

        def one(req: tuple[str, list[dict[str, str]]]) -> tuple[str, str, int, float]:
            body = {"model": "default", "messages": req[1], "max_tokens": wl.max_tokens,
                    "temperature": 0, "cache_prompt": True, "ignore_eos": skip_eos}  # fmt: skip
            out = _post(port, "/v1/chat/completions", body)
            return (req[0], out["choices"][0]["message"]["content"],
                    int(out["usage"]["completion_tokens"]), w.now())  # fmt: skip

        with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            done = list(pool.map(one, reqs))
    finally:
        wall = w.stop()
    tokens = sum(d[2] for d in done)
    last = max(d[3] for d in done)
    return PeerRun(
        f"llama.cpp server ({n} slots)", "llama", model, gguf_type(gguf), wall, ready,
        tokens / (last - ready), tokens, w.peak / 2**20, {d[0]: d[1] for d in done},
        {"gguf": gguf.name, "threads": threads, "ctx": n * per_slot, "version": inst.version},
    )  # fmt: skip


# -- vLLM CPU ---------------------------------------------------------------------------------


def _batch_lines(reqs: list[tuple[str, list[dict[str, str]]]], wl: Workload,
                 extra: dict[str, Any], model: str = "default") -> str:  # fmt: skip
    lines = []
    for cid, m in reqs:
        body = {"model": model, "messages": m, "max_tokens": wl.max_tokens,
                "temperature": 0, **extra}  # fmt: skip
        lines.append(json.dumps({"custom_id": cid, "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))  # fmt: skip
    return "\n".join(lines) + "\n"


def peer_env(**more: str) -> dict[str, str]:
    """The environment a peer runs in: no hub, no usage reports, nothing leaves the machine."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONPATH")}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "VLLM_DO_NOT_TRACK": "1", **more}  # fmt: skip
    return env


def run_vllm(wl: Workload, model: str = "default", *, dtype: str = "float32",
             ignore_eos: bool | None = None, kv_gb: int = 4) -> PeerRun:  # fmt: skip
    inst = ensure("vllm")
    folder = Path(path_for(model, "hf"))
    tok = _tokenizer(model)
    reqs = requests_of(wl, tok)
    ctx = max(_prompt_lengths(tok, reqs)) + wl.max_tokens + 64
    work = Path(tempfile.mkdtemp(prefix="peer-vllm-"))
    extra = {"ignore_eos": True} if _ignore_eos(model, ignore_eos) else {}
    (work / "in.jsonl").write_text(_batch_lines(reqs, wl, extra))
    cmd = [inst.python, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(work / "in.jsonl"),
           "-o", str(work / "out.jsonl"), "--model", str(folder), "--served-model-name",
           "default", "--dtype", dtype, "--max-model-len", str(ctx), "--max-num-seqs",
           str(len(reqs)), "--disable-log-stats"]  # fmt: skip
    # its torch.compile cache stays in the bench cache, beside the install
    env = peer_env(
        VLLM_CPU_KVCACHE_SPACE=str(kv_gb), VLLM_CACHE_ROOT=str(Path(inst.root) / "cache")
    )
    w = Watched(cmd, env=env, cwd=work, log_path=work / "vllm.log")
    wall = w.wait()
    if w.proc.returncode != 0 or not (work / "out.jsonl").is_file():
        raise RuntimeError(f"vLLM run_batch failed ({w.proc.returncode}):\n{w.tail()}")
    texts, tokens = {}, 0
    for line in (work / "out.jsonl").read_text().splitlines():
        rec = json.loads(line)
        body = (rec.get("response") or {}).get("body") or {}
        if not body.get("choices"):
            raise RuntimeError(f"vLLM request {rec.get('custom_id')} failed: {rec.get('error')}")
        texts[rec["custom_id"]] = body["choices"][0]["message"]["content"]
        tokens += int(body["usage"]["completion_tokens"])
    ready = w.first("Reading batch from") or 0.0
    last = w.first("Writing outputs") or wall
    return PeerRun(
        "vLLM CPU run_batch", "vllm", model, dtype, wall, ready, tokens / (last - ready), tokens,
        w.peak / 2**20, texts, {"version": inst.version, "log": str(work / "vllm.log")},
    )  # fmt: skip


# -- OpenVINO GenAI ---------------------------------------------------------------------------


def run_openvino(wl: Workload, model: str = "default", quant: str | None = None, *,
                 ignore_eos: bool | None = None, cache_gb: int = 2,
                 props: dict[str, str] | None = None) -> PeerRun:  # fmt: skip
    """`props`: CPU plugin properties over its defaults, e.g. DYNAMIC_QUANTIZATION_GROUP_SIZE=0
    and KV_CACHE_PRECISION=bf16 to run it at batchmlx's precision (bf16 activations and KV)."""
    inst = ensure("openvino")
    gguf = Path(path_for(model, quant or _default_quant(model)))
    reqs = requests_of(wl, _tokenizer(model))
    work = Path(tempfile.mkdtemp(prefix="peer-openvino-"))
    job = {"gguf": str(gguf), "messages": [m for _, m in reqs], "max_tokens": wl.max_tokens,
           "ignore_eos": _ignore_eos(model, ignore_eos), "max_num_seqs": len(reqs),
           "threads": _threads(), "cache_gb": cache_gb, "props": props or {}}  # fmt: skip
    (work / "in.json").write_text(json.dumps(job))
    cmd = [inst.python, str(HERE / "ov_worker.py"), str(work / "in.json"), str(work / "out.json")]
    w = Watched(cmd, env=peer_env(), cwd=work, log_path=work / "openvino.log")
    wall = w.wait()
    if w.proc.returncode != 0 or not (work / "out.json").is_file():
        raise RuntimeError(f"OpenVINO GenAI failed ({w.proc.returncode}):\n{w.tail()}")
    res = json.loads((work / "out.json").read_text())
    tokens = int(res["generated_tokens"])
    ready = w.first("[ov_worker] loaded") or res["t_loaded"]
    last = w.first("[ov_worker] generated") or res["t_done"]
    label = "".join(f", {k}={v}" for k, v in (props or {}).items())
    return PeerRun(
        f"OpenVINO GenAI ({len(reqs)} seqs, prefix caching{label})", "openvino", model,
        f"{res['precision'].lower()} activations, {gguf_type(gguf)} weights", wall,
        ready, tokens / (last - ready), tokens,
        w.peak / 2**20, {cid: t for (cid, _), t in zip(reqs, res["texts"], strict=True)},
        {"gguf": gguf.name, "version": inst.version, "token_counts": res["token_counts"]},
    )  # fmt: skip


# -- vllm-mlx --------------------------------------------------------------------------------


def fast_blas_env(threads: int | None = None) -> dict[str, str]:
    """The variables `python -m batchmlx.engine.host.fast_blas --exports` prints (LD_PRELOAD of
    the fast BLAS,
    its core type...), worked out afresh as for a new process (an LD_PRELOAD or re-exec marker
    this process inherited is ignored), plus `threads` for the BLAS and OpenMP runtimes."""
    from batchmlx.engine.host.fast_blas import REEXEC_MARKER, reexec_env
    from batchmlx.engine.host.threads import THREAD_VARIABLES

    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXEC_MARKER)}
    env = dict(reexec_env(base) or {})
    if threads:
        env |= dict.fromkeys(THREAD_VARIABLES, str(threads))
    return env


def default_float32_folder() -> Path:
    """The default model as an MLX folder in float32: batchmlx's conversion of the GGUF loaded
    with mlx-lm and `dequantize_model(model, mx.float32)` (what batchmlx runs at --dtype float32
    and whole_process.py's batch_generate peer runs), saved with mlx-lm's utilities. Written
    once into the bench cache."""
    dest = MODELS / "SmolLM2-135M-Instruct-mlx-float32"
    if (dest / "config.json").is_file():
        return dest
    import shutil

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import save_config, save_model

    from batchmlx.engine.models.loader import dequantize_model

    src = default_mlx_folder()
    model, _, config = mlx_lm.load(str(src), return_config=True)
    dequantize_model(model, mx.float32)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    config["torch_dtype"] = "float32"
    MODELS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".mlx-float32-", dir=MODELS))
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json"):  # fmt: skip
        if (src / f).is_file():
            shutil.copyfile(src / f, tmp / f)
    tmp.chmod(0o755)  # mkdtemp makes it owner-only
    os.replace(tmp, dest)
    return dest


def run_vllm_mlx(wl: Workload, model: str = "default", *, ignore_eos: bool | None = None,
                 **_: Any) -> PeerRun:  # fmt: skip
    """vllm-mlx's continuous-batching engine in its own venv (`vllm_mlx_worker.py`), on the
    float32 weights, under batchmlx's BLAS; ready = the worker's "loaded" line (engine started),
    steady = completion tokens over ready -> "generated". Tokens are counted without the eos
    token (as batchmlx counts them; its own completion_tokens, with it, are in `extra`). Texts
    are its server's (special tokens removed, stripped); `extra["raw_texts"]`: its tokens
    decoded, for a parity check that a trailing newline does not spoil. The random-weight
    models run from their bf16 MLX folder (batchmlx's); its engine has no ignore_eos, so they
    stop at eos if they emit it by chance (`ignore_eos` is recorded, not applied)."""
    inst = ensure("vllm-mlx")
    if model == "default":
        folder, precision = default_float32_folder(), "float32"
    else:
        folder, precision = Path(path_for(model, "mlx")), "bfloat16"
    reqs = requests_of(wl, _tokenizer(model))
    work = Path(tempfile.mkdtemp(prefix="peer-vllm-mlx-"))
    job = {"model": str(folder), "messages": [m for _, m in reqs], "max_tokens": wl.max_tokens}
    (work / "in.json").write_text(json.dumps(job))
    threads = _threads()
    blas = fast_blas_env(threads)
    cmd = [inst.python, str(HERE / "vllm_mlx_worker.py"), str(work / "in.json"),
           str(work / "out.json")]  # fmt: skip
    w = Watched(cmd, env=peer_env(**blas), cwd=work, log_path=work / "vllm-mlx.log")
    wall = w.wait()
    if w.proc.returncode != 0 or not (work / "out.json").is_file():
        raise RuntimeError(f"vllm-mlx failed ({w.proc.returncode}):\n{w.tail()}")
    res = json.loads((work / "out.json").read_text())
    tokens = int(res["generated_tokens"])
    ready = w.first("[vllm_mlx_worker] loaded") or res["t_loaded"]
    last = w.first("[vllm_mlx_worker] generated") or res["t_done"]
    return PeerRun(
        "vllm-mlx BatchedEngine (continuous batching, defaults)", "vllm-mlx", model, precision,
        wall, ready, tokens / (last - ready), tokens, w.peak / 2**20,
        {cid: t for (cid, _), t in zip(reqs, res["texts"], strict=True)},
        {"version": res["version"], "install": inst.version, "model_folder": str(folder),
         "threads": threads, "blas": res["blas"], "blas_env": blas, "device": res["device"],
         "token_counts": res["token_counts"], "completion_tokens": res["completion_tokens"],
         "finish_reasons": res["finish_reasons"],
         "raw_texts": {cid: t for (cid, _), t in zip(reqs, res["raw_texts"], strict=True)},
         "ignore_eos_asked": _ignore_eos(model, ignore_eos), "log": str(work / "vllm-mlx.log")},
    )  # fmt: skip


_BATCHMLX_CLI = (
    "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
    "from batchmlx.cli import main; main()"
)  # its load log line marks "ready"


_MLX_STEPS = "steps run in MLX, not on the host alone:"  # engine/host/step.py's log line


def run_batchmlx(wl: Workload, model: str = "default", *, dtype: str | None = None,
                 quant: str | None = None, folder: Path | None = None,
                 cache: Path | None = None, **_: Any) -> PeerRun:  # fmt: skip
    """batchmlx as a user runs it on the very requests the peers get: `submit --wait` then
    `results -o`, a fresh process each (the defaults, or `--dtype`); ready = the line that
    says how the weights were loaded. `quant`: the peers' GGUF of that type as the model (for
    `--dtype q4` on a 4-bit file), not the MLX folder. `folder`: an MLX folder of any model
    (its own tokenizer) in place of `model`'s files (benchmarks/families.py). `cache`: the
    model cache its processes use (default: the benchmarks' own, whole_process.CACHE)."""
    from benchmarks.whole_process import REPO, _env, read_output

    tok = _tokenizer(model) if folder is None else _folder_tokenizer(folder)
    reqs = requests_of(wl, tok)
    work = Path(tempfile.mkdtemp(prefix="bmx-peers-"))
    source = folder or path_for(model, quant or "mlx")
    (work / "requests.jsonl").write_text(
        _batch_lines(reqs, wl, {}, model=str(source)))  # fmt: skip
    env = _env(home=str(work / "home"), pythonpath=str(REPO), cache=cache)
    cli = [sys.executable, "-c", _BATCHMLX_CLI]
    more = ["--dtype", dtype] if dtype else []
    w = Watched([*cli, "submit", "requests.jsonl", "--wait", "--json", *more], env=env, cwd=work)
    submit_s = w.wait()
    if w.proc.returncode != 0:
        raise RuntimeError(f"batchmlx submit failed ({w.proc.returncode}): {w.tail()}")
    lines = [line for _, line in w.lines]
    start = max(i for i, line in enumerate(lines) if line == "{")
    # (raw_decode: the log may go on after the JSON, e.g. a first start's cache note at exit)
    batch, _ = json.JSONDecoder().raw_decode("\n".join(lines[start:]))
    loaded = next(line for _, line in w.lines if ": weights as " in line)
    ready = w.first(": weights as ") or 0.0
    t0 = time.perf_counter()
    subprocess.run([*cli, "results", batch["id"], "-o", "out.jsonl"], cwd=work, env=env,
                   check=True, capture_output=True)  # fmt: skip
    wall = submit_s + time.perf_counter() - t0
    texts, tokens = read_output(work / "out.jsonl")
    shutil.rmtree(work, ignore_errors=True)  # (its queue, files and results: ~2 MB a run)
    precision = loaded.split(": weights as ", 1)[1].split(" on ", 1)[0]
    label = "batchmlx" + (f" --dtype {dtype}" if dtype else " (defaults)")
    extra = {"usage": batch.get("usage")} | ({"gguf": str(source)} if quant else {})
    mlx = next((line for _, line in w.lines if _MLX_STEPS in line), None)
    if mlx:
        extra["mlx_steps"] = mlx.split(_MLX_STEPS, 1)[1].strip()
    return PeerRun(label, "batchmlx", model, precision, wall, ready,
                   tokens / max(submit_s - ready, 1e-9), tokens, w.peak / 2**20, texts,
                   extra)  # fmt: skip


def run_batchmlx_same(wl: Workload, model: str = "default") -> ProcessRun:
    """batchmlx's defaults on the requests the peers get, for the parity column."""
    return run_batchmlx(wl, model).as_process_run()


def same_texts(a: dict[str, str], b: dict[str, str]) -> str:
    return f"{sum(1 for k, v in a.items() if b.get(k) == v)}/{len(a)}"


RUNNERS = {"llama": run_llama, "openvino": run_openvino, "vllm": run_vllm,
           "vllm-mlx": run_vllm_mlx, "batchmlx": run_batchmlx}  # fmt: skip


def run(peer: str, wl: Workload, model: str = "default", **kw: Any) -> PeerRun:
    return RUNNERS[peer](wl, model, **kw)


def workload(name: str, requests: int | None = None, max_tokens: int | None = None,
             quick: bool = False) -> Workload:  # fmt: skip
    wl = (QUICK if quick else WORKLOADS)[name]
    return replace(wl, requests=requests or wl.requests, max_tokens=max_tokens or wl.max_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", action="append", choices=[*PEERS, "batchmlx", "all"], default=[])
    p.add_argument("--dtype", help="batchmlx's --dtype (default: its own)")
    p.add_argument("--workload", default="unique", choices=sorted(WORKLOADS))
    p.add_argument("--requests", type=int, help="default: the workload's (64)")
    p.add_argument("--max-tokens", type=int, help="default: the workload's (128 / 32)")
    p.add_argument("--quick", action="store_true", help="whole_process.py's quick workloads")
    p.add_argument("--model", default="default", help="default | 360m | 1.7b | 8b")
    p.add_argument(
        "--quant",
        help="GGUF type for llama/openvino (default: Q4_1 / Q8_0); for "
        "batchmlx, that GGUF instead of the MLX folder",
    )
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--ov-prop", action="append", default=[], metavar="KEY=VALUE",
                   help="an OpenVINO CPU plugin property (repeatable)")  # fmt: skip
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for random-weight models")  # fmt: skip
    p.add_argument("--parity", action="store_true",
                   help="also run batchmlx on the same requests and count equal texts")  # fmt: skip
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    wl = workload(args.workload, args.requests, args.max_tokens, args.quick)
    peers = PEERS if "all" in args.peer or not args.peer else tuple(args.peer)
    runs, failed = [], 0
    for peer in peers:
        kw: dict[str, Any] = {"ignore_eos": args.ignore_eos}
        if peer == "vllm":
            kw["dtype"] = args.vllm_dtype
        elif peer == "batchmlx":
            kw["dtype"] = args.dtype
            if args.quant:
                kw["quant"] = args.quant
        elif peer == "vllm-mlx":
            pass  # float32, its engine's defaults: nothing to choose
        else:
            if args.quant:
                kw["quant"] = args.quant
            if peer == "openvino" and args.ov_prop:
                kw["props"] = dict(kv.split("=", 1) for kv in args.ov_prop)
        log(f"{peer}: {wl.name}, {wl.requests} x {wl.max_tokens} tokens, model {args.model}")
        try:
            r = run(peer, wl, args.model, **kw)
        except Exception as exc:  # one peer failing must not stop the others
            failed += 1
            log(f"{peer}: FAILED: {exc}")
            continue
        runs.append(r)
        print(r.summary(), flush=True)
    if args.parity and runs:
        ref = run_batchmlx_same(wl, args.model)
        print(f"batchmlx (defaults): {ref.wall_s:.1f} s whole process, {ref.output_tokens} "
              f"tokens, {ref.tok_s:.1f} tok/s", flush=True)  # fmt: skip
        for r in runs:
            print(f"  same texts as batchmlx: {r.system}: {same_texts(ref.texts, r.texts)}")
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"system": r.system, "peer": r.peer, "model": r.model, "precision": r.precision,
             "wall_s": r.wall_s, "load_s": r.load_s, "steady_tok_s": r.steady_tok_s,
             "tok_s": r.tok_s, "output_tokens": r.output_tokens, "peak_rss_mb": r.peak_rss_mb,
             "texts": r.texts, "extra": r.extra} for r in runs], indent=2))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
