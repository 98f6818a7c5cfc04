"""Model resolution (is this `model` string something we can serve?) and loading via mlx-lm."""

from __future__ import annotations

import gc
import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from batchmlx.core.models import DEFAULT_MODEL_NAME, ModelSpec
from batchmlx.engine.host.backend import HostBackend, current
from batchmlx.engine.host.linear import HostFormat
from batchmlx.engine.models import first_run as notes
from batchmlx.engine.models import quick
from batchmlx.engine.models.default_model import ensure_default_gguf
from batchmlx.engine.models.gguf import convert_gguf

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_FALLBACK_CONTEXT = 2048
_QUANTIZATION_KEYS = ("quantization", "quantization_config")
log = logging.getLogger("batchmlx.engine")
# The host formats' packed weights must leave room for the KV cache, the step's buffers and the
# OS: at most this share of the memory available as the model loads.
HOST_MEMORY_SHARE = 0.75
# bytes a weight takes packed in each host format (int8: a float32 scale and an int32 offset
# per group of 32 besides the byte: engine/host/q8.py's Q8Weights; its head and embedding,
# one table where tied, 1.125: a byte and a float32 scale per 32, engine/host/head8.py; q4's
# are bf16)
_PACKED_BYTES = {
    HostFormat.F32: 4.0,
    HostFormat.BF16: 2.0,
    HostFormat.INT8: 1.25,
    HostFormat.Q4: 1.25,  # int8's, but for the 4-bit layers it keeps:
    HostFormat.W8: 1.125,
}
_Q4_KEPT_BYTES = 0.75  # a 4-bit value and a float32 scale and bias per 32 (host/q4.py)


class ModelTooLarge(ValueError):
    """The weights in the host format asked for would not fit in the memory available."""


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: Any  # the mlx_lm nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    path: Path  # folder the weights were loaded from
    context_length: int
    eos_token_ids: frozenset[int]


def model_folder(spec: ModelSpec, *, cache_dir: Path) -> Path | str:
    """Where mlx_lm.load finds the model, converting GGUF files into the cache on first use."""
    models = Path(cache_dir) / "models"
    if spec.kind == "default":
        gguf = ensure_default_gguf(Path(cache_dir))
        return convert_gguf(gguf, models / f"{DEFAULT_MODEL_NAME}-mlx")
    if spec.kind == "gguf":
        src = Path(spec.source)
        digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:10]
        return convert_gguf(src, models / f"{src.stem}-{digest}")
    if spec.kind in ("mlx_dir", "hub"):
        return spec.source  # hub ids go through mlx_lm's own download path
    raise ValueError(f"unknown model kind {spec.kind!r}")


def load_model(
    spec: ModelSpec, *, cache_dir: Path, dtype: str = "auto", backend: HostBackend | None = None
) -> LoadedModel:
    """Load `spec` with mlx-lm. dtype "auto" on MLX's CPU backend gives the grouped int8
    weights of engine/host/q8.py on AVX-512 VNNI, else bf16 weights computed by oneDNN
    (engine/host/linear.py; float32 where oneDNN cannot load), elsewhere it keeps
    weights as stored (quantized stays quantized); "stored" keeps them as stored anywhere;
    "float32"/"float16" dequantize every layer to that dtype; "bfloat16" is the host bf16
    format on the CPU (MLX's own bf16 elsewhere); "int8" gives int8 weights computed by oneDNN
    (CPU only); "q4" keeps a 4-bit GGUF's layers in their own bits (engine/host/q4.py), the
    others int8 (CPU only). A GGUF file is converted once (engine/models/gguf), its quantized
    matrices kept in their bits as MLX's affine format: every load reads that folder. `backend`: the
    CPU backend the host formats compute with (oneDNN, threads, the weights cache's switch;
    default: the process's, engine/host/backend.py)."""
    backend = backend or current()
    if dtype not in ("auto", "stored", "int8", "q4") and dtype not in _DTYPES:
        raise ValueError(
            f"dtype must be 'auto', 'stored', 'int8', 'q4' or one of {sorted(_DTYPES)}, "
            f"got {dtype!r}"
        )
    # before the load: without oneDNN, say what to install at once
    host = host_format(dtype, backend=backend)
    written = notes.writes()
    with collector_paused():
        folder = model_folder(spec, cache_dir=cache_dir)
        ours = spec.kind in ("default", "gguf")  # a folder batchmlx converted
        # the host formats convert every model layer by layer as it is stored (a quantized
        # layer dequantized as it is packed: never the whole model in float32 at once)
        source = "stored" if host else dtype
        # lazy for the host formats: each layer's weights are read as it is converted, so the
        # float weights never all sit in memory beside the converted ones
        if ours and quick.quick_loadable(Path(folder)):  # no transformers: ~0.9 s less
            model, tokenizer, config = quick.load_quick(Path(folder), lazy=host is not None)
        else:
            import mlx_lm  # heavy import (transformers); keep it off module import

            model, tokenizer, config = mlx_lm.load(str(folder), return_config=True,
                                                   lazy=host is not None)  # fmt: skip
    quantized = "quantization" in config
    source = effective_dtype(source, quantized=quantized)
    if source in _DTYPES and (quantized or host is None):  # (a host format casts as it goes)
        dequantize_model(model, _DTYPES[source])
    if host or source in _DTYPES:
        config = {k: v for k, v in config.items() if k not in _QUANTIZATION_KEYS}
    path = Path(folder) if spec.kind != "hub" else _hub_path(tokenizer, folder)
    if host and not _fits(model, host, spec.name, asked=dtype):
        host = None  # "auto": MLX's kernels on the weights as stored
    writing = bool(host) and _to_host(model, host, path, Path(cache_dir), backend)
    log.info("model %s: weights as %s on %s, from %s", spec.name,
             _computed_by(host) if host else source, mx.default_device(),
             Path(folder).name)  # fmt: skip
    if notes.writes() != written and not writing:  # a first run: what the cache holds now
        _say_cache_holds(Path(cache_dir))
    context = config.get("max_position_embeddings") or _FALLBACK_CONTEXT
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        config=config,
        path=path,
        context_length=int(context),
        eos_token_ids=frozenset(int(i) for i in tokenizer.eos_token_ids),
    )


def _computed_by(fmt: HostFormat) -> str:
    """The format and what computes its GEMMs, for the log ("int8 (grouped int8 kernel)")."""
    from batchmlx.engine.host import q8

    if fmt is HostFormat.INT8 and q8.available():
        return f"{fmt.value} (grouped int8 kernel)"
    if fmt is HostFormat.Q4:
        return f"{fmt.value} (grouped 4-bit kernel; other layers int8)"
    return f"{fmt.value} (oneDNN)"


def packed_bytes(model: nn.Module, fmt: HostFormat) -> int:
    """What `model`'s weights take packed in `fmt`: each matrix's values (a quantized one's
    unpacked count) at the format's width. Counted from shapes: nothing is evaluated."""
    from mlx.utils import tree_flatten

    from batchmlx.engine.host import head8

    values = kept = head = 0  # kept: the values q4 keeps in their 4 bits; head: its and the
    for name, module in model.named_modules():  # embedding's (int8 and q4: W8 or bf16)
        weight = module.get("weight") if isinstance(module, nn.Module) else None
        if not isinstance(weight, mx.array) or weight.ndim < 2:
            continue
        bits = getattr(module, "bits", None) if "scales" in module else None
        n = weight.size * 32 // bits if bits else weight.size
        values += n
        if fmt is HostFormat.Q4 and bits == 4 and getattr(module, "group_size", 0) == 32:
            kept += n
        elif isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)) or name == "lm_head":
            head += n
    if values == 0:  # not a module tree of layers (a test double): count every array
        values = sum(a.size for _, a in tree_flatten(model.parameters()))
    head_fmt = fmt  # as linear.head_format
    if fmt in (HostFormat.INT8, HostFormat.Q4):
        w8 = fmt is HostFormat.INT8 and head8.available()
        head_fmt = HostFormat.W8 if w8 else HostFormat.BF16
    rest = values - kept - head
    return int(rest * _PACKED_BYTES[fmt] + kept * _Q4_KEPT_BYTES + head * _PACKED_BYTES[head_fmt])


def _fits(model: nn.Module, fmt: HostFormat, name: str, *, asked: str) -> bool:
    """Whether `model` packed in `fmt` fits in HOST_MEMORY_SHARE of the memory available. When
    it does not, "auto" says so and keeps the weights as stored (MLX's kernels); a format asked
    for by name is refused (ModelTooLarge) rather than run the machine out of memory."""
    from batchmlx.engine.kv.budget import available_memory_bytes

    need = packed_bytes(model, fmt)
    have = available_memory_bytes(on_gpu=False)
    if need <= HOST_MEMORY_SHARE * have:
        return True
    why = (f"model {name}: its weights as {fmt.value} would take {need / 2**30:.1f} GiB, more "
           f"than {HOST_MEMORY_SHARE:.0%} of the {have / 2**30:.1f} GiB available")  # fmt: skip
    if asked != "auto":
        raise ModelTooLarge(f"{why}; --dtype stored runs it on MLX's kernels as stored")
    log.warning("%s: running it on MLX's kernels, weights as stored", why)
    return False


def _say_cache_holds(cache_dir: Path) -> None:
    notes.note("the model cache %s now holds %s", cache_dir,
               notes.size_text(notes.disk_use(cache_dir)))  # fmt: skip


def _to_host(
    model: nn.Module, fmt: HostFormat, source: Path, cache_dir: Path, backend: HostBackend
) -> bool:
    """The model's layers in `fmt`, read from the host weights cache where it holds them
    (host_cache.py), packed where not. True when the packed weights are being written to the
    cache behind the start (a first start need not take a warm one plus the write); the
    writer says what the cache holds once the file is in place."""
    from batchmlx.engine.host import weights_cache as host_cache
    from batchmlx.engine.host.linear import to_host_format

    # float32 is not packed: its rows load as fast from a float32 folder as from a cache
    if fmt is HostFormat.F32 or not backend.settings.weights_cache or not source.is_dir():
        to_host_format(model, fmt, backend=backend)
        return False
    where = host_cache.cache_path(cache_dir, source, fmt)
    sig = host_cache.signature(source, fmt, backend.onednn())
    cache = host_cache.open_cache(where, sig)
    arena = None  # a first start packs into the file it writes (PackArena), where it can
    if not cache.found and host_cache.PackArena.usable():
        try:
            arena = host_cache.PackArena(where)
            cache.room = arena.room
        except OSError as exc:
            log.info("host weights cache: packing into fresh memory (%s)", exc)
    try:
        to_host_format(model, fmt, cache, backend)
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    return host_cache.save_cache(where, cache, sig, fmt, background=True, arena=arena,
                                 then=lambda: _say_cache_holds(cache_dir))  # fmt: skip


def host_format(
    dtype: str, *, on_cpu: bool | None = None, backend: HostBackend | None = None
) -> HostFormat | None:
    """The host weight format `dtype` asks for, or None for MLX's own kernels. On MLX's CPU
    backend "auto" means int8 in groups of 32 through our own kernel (engine/host/q8.py: as
    faithful as llama.cpp's Q8_0, batch-invariant, faster than bf16 at every width measured)
    where the CPU runs it (AVX-512 VNNI), else bf16 weights through oneDNN as "bfloat16" does
    (MLX's own bf16 CPU matmul runs at a few GFLOP/s). Where this CPU's oneDNN has no bf16
    matmul (3.2's needs AVX-512: an AVX2-only CPU), "auto" means float32 weights through
    oneDNN, which the host steps run as fast as any format there, and "bfloat16" MLX's own
    bf16. "float32" means float32 weights through oneDNN's brgemm kernels where it has them
    (AVX-512), else MLX's float32.
    Where oneDNN cannot load they fall back, with a warning, to float32 and to MLX's bf16.
    "int8" needs oneDNN and its int8 matmul (OneDNNUnavailable says what is missing); "q4"
    int8's and the grouped 4-bit kernel (AVX-512 VNNI)."""
    from batchmlx.engine.host import onednn, q4, q8

    backend = backend or current()
    if on_cpu is None:
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if dtype in ("int8", "q4"):
        if not on_cpu:
            raise onednn.OneDNNUnavailable(
                f"--dtype {dtype} runs on MLX's CPU backend only; on a GPU use --dtype auto"
            )
        if not backend.onednn().supports(onednn.DataType.S8, scaled=True):
            raise onednn.OneDNNUnavailable("this CPU's oneDNN has no int8 matmul: use --dtype "
                                           "auto")  # fmt: skip
        if dtype == "q4" and not (q4.available() and q8.available()):
            raise onednn.OneDNNUnavailable("--dtype q4 needs AVX-512 VNNI (see the log): use "
                                           "--dtype auto")  # fmt: skip
        return HostFormat.Q4 if dtype == "q4" else HostFormat.INT8
    if not on_cpu or dtype not in ("auto", "bfloat16", "float32"):
        return None
    try:
        lib = backend.onednn()
    except onednn.OneDNNUnavailable as exc:
        if dtype == "float32":  # MLX's own float32
            return None
        fallback = "float32" if dtype == "auto" else "bfloat16 in MLX's own (slow) CPU kernels"
        log.warning("weights as %s: %s", fallback, exc)
        return None
    if dtype == "float32":
        # the same float32 arithmetic on the host (host steps) where oneDNN has float32 brgemm
        # kernels (AVX-512): batch-invariant there (docs/engine.md), and far faster than MLX's
        # float32 path (a 2,048-token step 2.5 s against 146 s: benchmarks/fidelity.py)
        return HostFormat.F32 if lib.brgemm(onednn.DataType.F32) else None
    # int8's layers the grouped kernel does not take (N or K not a multiple of 16) run
    # oneDNN's per-channel int8: the default asks for both
    if dtype == "auto" and q8.available() and lib.supports(onednn.DataType.S8, scaled=True):
        return HostFormat.INT8
    if lib.supports(onednn.DataType.BF16):
        return HostFormat.BF16
    if dtype == "bfloat16":
        log.warning(
            "weights as bfloat16 in MLX's own (slow) CPU kernels: this CPU's oneDNN has "
            "no bf16 matmul (it needs AVX-512); --dtype auto computes in float32"
        )
        return None
    log.info("this CPU's oneDNN has no bf16 matmul (it needs AVX-512): weights as float32")
    return HostFormat.F32


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while mlx-lm (transformers) imports and a model loads: they
    make hundreds of thousands of objects that live on, and the full collections they set off
    only walk them (~0.17 s of a start, measured; the host step's construction after the load
    set off ~2.5 s of them at Python's default thresholds, a 1.7B model's first start in a
    script: build_engine pauses over it too). Not frozen after: a worker switching models
    must still collect the old one's reference cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def effective_dtype(dtype: str, *, quantized: bool, on_cpu: bool | None = None) -> str:
    """ "auto": quantized weights become float32 on MLX's CPU backend, whose quantized matmul
    runs several times slower than float32 (measured: 9 vs 12.5 tok/s decode for SmolLM2-135M
    at batch 1, before the fast BLAS); on a GPU (Metal, or CUDA with `batchmlx[cuda12]`) they
    stay quantized, where quantized kernels are the fast path and memory is what is scarce.
    "stored" keeps them as stored anywhere. on_cpu: the default device is the CPU (None:
    asked of MLX)."""
    if dtype != "auto":
        return dtype
    if on_cpu is None:
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
    return "float32" if (quantized and on_cpu) else "stored"


def _hub_path(tokenizer: Any, folder: Path | str) -> Path:
    # mlx_lm does not return the snapshot folder; the HF tokenizer remembers where it came from.
    name = getattr(getattr(tokenizer, "_tokenizer", None), "name_or_path", None)
    return Path(name or folder)


def dequantize_model(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Replace every QuantizedLinear/QuantizedEmbedding by a plain layer of `dtype` and cast the
    remaining floating parameters (norms) too. Plain matmuls are the fast path on the CPU, where
    quantized kernels are slower than dense ones for a model this small. Mutates and returns."""
    replacements = []
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            weight = _dequantized_weight(module, dtype)
            out_dims, in_dims = weight.shape
            has_bias = "bias" in module
            layer = nn.Linear(in_dims, out_dims, bias=has_bias)
            layer.weight = weight
            if has_bias:
                layer.bias = module.bias.astype(dtype)
            replacements.append((path, layer))
        elif isinstance(module, nn.QuantizedEmbedding):
            weight = _dequantized_weight(module, dtype)
            layer = nn.Embedding(*weight.shape)
            layer.weight = weight
            replacements.append((path, layer))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _dequantized_weight(module: nn.Module, dtype: mx.Dtype) -> mx.array:
    return mx.dequantize(
        module.weight,
        module.scales,
        module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        mode=getattr(module, "mode", "affine"),
    ).astype(dtype)
