"""The model files each peer reads, all made from the same weights.

- `default`: SmolLM2-135M-Instruct Q4_1 GGUF, the file batchmlx itself fetches
  (`ensure_default_gguf`); llama.cpp and OpenVINO GenAI read it as it is. For
  benchmarks/fidelity.py, `llama-quantize` dequantizes it to an F32 GGUF and quantizes that to
  Q8_0 and Q4_0 (`default_requantized`). vLLM needs a Hugging
  Face folder: batchmlx's float32 weights of that GGUF (its own loader), with llama.cpp's q/k
  row permutation undone (GGUF stores them permuted for interleaved RoPE, which batchmlx's
  converter answers with `rope_traditional`), as float32 safetensors.
- `360m`, `1.7b`, `8b`: random weights of SmolLM2-360M's, SmolLM2-1.7B's and Llama-3-8B's shapes
  (the 8B one with SmolLM2's 49152-token vocabulary, so every peer shares one tokenizer: 7.5B
  parameters), built from `mlx_lm.models.llama`, saved bf16 as a folder batchmlx loads (and vLLM
  reads: it is a Hugging Face llama folder), plus GGUFs of the same weights at Q8_0, Q4_0 and
  Q4_K_M (gguf-py from the llama.cpp tree writes a BF16 GGUF, the built `llama-quantize`
  quantizes it). Random weights produce no eos, so every request runs to max_tokens. Built
  lazily, on first use.
- `qwen3-1.7b`, `gemma3-1b`: the same for Qwen3-1.7B's shape (q/k norms, 16 heads of 128, 8 KV
  heads) from `mlx_lm.models.qwen3` and Gemma-3-1B's (1,152 wide, 4 heads of 256, one KV head,
  five sliding-window layers of 512 to one global, its norms and embedding scale) from
  `mlx_lm.models.gemma3_text`, both with SmolLM2's 49152-token vocabulary in place of their own
  (151,936 and 262,144): 1.5B and 0.76B parameters. Their GGUFs are written as llama.cpp's
  converter writes these architectures (`qwen3`, `gemma3`: gguf-py's tensor names, no q/k row
  permutation, Gemma's norms stored as 1 + w).

    python -m benchmarks.peers.models [--model default|360m|1.7b|8b|qwen3-1.7b|gemma3-1b]
                                      [--format mlx|hf|Q8_0|Q4_0|Q4_K_M]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers.setup import CACHE as BENCH_CACHE
from benchmarks.peers.setup import ensure, llama_tool

# batchmlx's own model cache (where `ensure_default_gguf` puts the GGUF), as whole_process.py.
BMX_CACHE = Path(os.environ.get("BATCHMLX_CACHE_DIR", "~/.cache/batchmlx-test")).expanduser()
MODELS = BENCH_CACHE / "models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
QUANTS = ("Q8_0", "Q4_0")  # what the default model is requantized to (benchmarks/fidelity.py)
RANDOM_QUANTS = (*QUANTS, "Q4_K_M")  # a random shape's GGUFs
_COMMON = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "360m": _COMMON | {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                       "num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64,
                       "rope_theta": 100000.0, "tie_word_embeddings": True},
    "1.7b": _COMMON | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                       "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64,
                       "rope_theta": 130000.0, "tie_word_embeddings": True},
    "8b": _COMMON | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "rope_theta": 500000.0, "tie_word_embeddings": False},
    "qwen3-1.7b": _COMMON | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                             "hidden_size": 2048, "intermediate_size": 6144,
                             "num_hidden_layers": 28, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
                             "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "gemma3-1b": _COMMON | {"model_type": "gemma3_text", "hidden_act": "gelu_pytorch_tanh",
                            "architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152,
                            "intermediate_size": 6912, "num_hidden_layers": 26,
                            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                            "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
                            "sliding_window": 512, "sliding_window_pattern": 6,
                            "tie_word_embeddings": True},
}  # fmt: skip
# general.architecture of each model_type, as llama.cpp's converter names it
GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}
_SHARD_BYTES = 2 << 30


def log(msg: str) -> None:
    print(f"[peers-models] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """Where each peer finds one model. `mlx` is what batchmlx's `model` field takes."""

    name: str
    mlx: str  # "default" or an MLX folder
    tokenizer: Path  # a folder with tokenizer.json + chat template (prompts, token counts)
    random: bool  # random weights: no eos, every request runs to max_tokens


# -- q/k rows: llama.cpp's convert permutes them for interleaved RoPE --------------------------


def permute(w: Any, n_head: int) -> Any:
    """llama.cpp convert's `permute` (HF's half-split RoPE rows -> interleaved), on any array."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w: Any, n_head: int) -> Any:
    """The inverse of `permute`: GGUF's interleaved q/k rows back to Hugging Face's order."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _heads(path: str, config: dict[str, Any]) -> int | None:
    if path.endswith("self_attn.q_proj.weight"):
        return config["num_attention_heads"]
    if path.endswith("self_attn.k_proj.weight"):
        return config.get("num_key_value_heads", config["num_attention_heads"])
    return None


# -- the default model ------------------------------------------------------------------------


def default_gguf() -> Path:
    from batchmlx.engine.models.default_model import ensure_default_gguf

    return ensure_default_gguf(BMX_CACHE)


def default_mlx_folder() -> Path:
    """batchmlx's conversion of the default GGUF (its tokenizer files, its config)."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import model_folder

    return Path(model_folder(resolve_model("default", cache_dir=BMX_CACHE), cache_dir=BMX_CACHE))


def default_requantized(kind: str) -> Path:
    """The default model's weights (its Q4_1 GGUF) through the built `llama-quantize`: "F32" is
    the Q4_1 file dequantized (--allow-requantize: the float32 weights batchmlx's float32 computes
    with), "Q8_0" and "Q4_0" that F32 file quantized, as llama.cpp quantizes a model
    (benchmarks/fidelity.py)."""
    if kind not in ("F32", *QUANTS):
        raise ValueError(f"kind must be F32 or one of {QUANTS}, got {kind!r}")
    dest = MODELS / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if dest.is_file():
        return dest
    src, extra = (default_gguf(), ["--allow-requantize"]) if kind == "F32" else (
        default_requantized("F32"), [])  # fmt: skip
    MODELS.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.{os.getpid()}")
    threads = str(len(os.sched_getaffinity(0)))
    out = subprocess.run(["nice", "-n", "10", llama_tool("llama-quantize"), *extra, str(src),
                          str(part), kind, threads], capture_output=True, text=True)  # fmt: skip
    if out.returncode != 0:
        part.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {kind} failed: {out.stderr[-2000:]}")
    os.replace(part, dest)
    log(f"default: {dest.name} ({dest.stat().st_size >> 20} MB)")
    return dest


def default_hf_folder() -> Path:
    """The default model's float32 weights as a Hugging Face llama folder, for vLLM."""
    dest = MODELS / "SmolLM2-135M-Instruct-hf-float32"
    if (dest / "config.json").is_file():
        return dest
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    loaded = load_model(resolve_model("default", cache_dir=BMX_CACHE), cache_dir=BMX_CACHE,
                        dtype="float32")  # fmt: skip
    config = json.loads((loaded.path / "config.json").read_text())
    config.pop("rope_traditional", None)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    weights = {}
    for key, w in tree_flatten(loaded.model.parameters()):
        n = _heads(key, config)
        weights[key] = (unpermute(w, n) if n else w).astype(mx.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".hf-", dir=MODELS if MODELS.exists() else None))
    MODELS.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(loaded.path, tmp)
    gen = loaded.path / "generation_config.json"
    if gen.is_file():
        shutil.copyfile(gen, tmp / gen.name)
    tmp.chmod(0o755)  # mkdtemp makes it owner-only
    os.replace(tmp, dest)
    return dest


def _copy_tokenizer(src: Path, dest: Path) -> None:
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, dest / f)


# -- random-weight models ---------------------------------------------------------------------


def random_mlx_folder(shape: str) -> Path:
    """Random bf16 weights of `shape` from mlx-lm's class of its model_type, saved in shards
    (mlx arrays are lazy: only one shard is in memory at a time, so the 8B shape builds in
    about 2 GB)."""
    return random_folder(SHAPES[shape], MODELS / f"random-{shape}-mlx-bf16")


def random_folder(config: dict[str, Any], dest: Path) -> Path:
    """Random bf16 weights of `config` (its model_type's mlx-lm class, seed 0) saved at `dest`
    with the default model's tokenizer, unless a folder is there already."""
    if (dest / "config.json").is_file():
        return dest
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    shape = dest.name
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=dest.parent))
    mx.random.seed(0)
    model = family.Model(family.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)  # lazy: the float32 inits are freed as each shard evaluates
    params = dict(tree_flatten(model.parameters()))
    del model  # the dict holds the only references: a saved shard leaves memory
    shards: list[list[str]] = [[]]
    size = total = 0
    for key, w in params.items():
        nbytes = w.size * 2
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
        total += nbytes
    index: dict[str, str] = {}
    for i, keys in enumerate(shards):
        name = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                else "model.safetensors")  # fmt: skip
        arrays = {k: params.pop(k) for k in keys}
        mx.eval(arrays)
        mx.save_safetensors(str(tmp / name), arrays, metadata={"format": "pt"})
        index |= dict.fromkeys(keys, name)
        del arrays
        log(f"random {shape}: shard {i + 1}/{len(shards)} written")
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2)
        )
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(default_mlx_folder(), tmp)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only
    os.replace(tmp, dest)
    return dest


def _gguf_name(key: str, names: Any) -> str:
    """A weight's GGUF name from gguf-py's own table (llama.cpp's converter's names)."""
    base, _, suffix = key.rpartition(".")
    name = names.get_name(base)
    if name is None:
        raise KeyError(f"gguf-py names no tensor for {key}")
    return f"{name}.{suffix}"


def _tensor_order(folder: Path) -> list[tuple[str, str]]:
    """(key, safetensors file) for every weight of the folder, embeddings first, layers in
    order, as llama.cpp's converter writes them."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        items = list(json.loads(index.read_text())["weight_map"].items())
    else:
        items = [
            (k, "model.safetensors") for k in _safetensors_shapes(folder / "model.safetensors")
        ]

    def rank(key: str) -> tuple[int, int, str]:
        parts = key.split(".")
        if parts[:2] == ["model", "layers"]:
            return (1, int(parts[2]), key)
        return (0 if "embed" in key else 2, 0, key)

    return sorted(items, key=lambda kv: rank(kv[0]))


def write_bf16_gguf(folder: Path, out: Path) -> Path:
    """A BF16 GGUF of an MLX folder (Hugging Face row order) of a GGUF_ARCH family, its
    tokenizer metadata copied from the default GGUF (the same SmolLM2 tokenizer), written one
    tensor at a time as llama.cpp's converter would: llama's q/k rows permuted for its
    interleaved RoPE, Gemma's norms stored as 1 + w, norms float32."""
    import mlx.core as mx
    import numpy as np

    gguf = _gguf_module()
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config.get("model_type", "llama")]
    llama, gemma = arch == "llama", arch == "gemma3"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    reader = gguf.GGUFReader(str(default_gguf()))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"random-{folder.name}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    if gemma:
        writer.add_sliding_window(config["sliding_window"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    order = _tensor_order(folder)
    files: dict[str, dict[str, Any]] = {}

    def tensor(key: str, file: str) -> Any:
        if file not in files:
            files.clear()  # one shard open at a time
            files[file] = mx.load(str(folder / file))
        w = files[file][key]
        n = _heads(key, config) if llama else None
        w = permute(w, n) if n else w
        if w.ndim == 1:  # norms stay float32, as llama.cpp's converter keeps them
            return np.array(w.astype(mx.float32) + (1.0 if gemma else 0.0))
        return np.array(w.astype(mx.bfloat16).view(mx.uint16))

    shapes: dict[str, list[int]] = {}
    for file in {f for _, f in order}:
        shapes |= _safetensors_shapes(folder / file)
    for key, _ in order:  # the headers first: shapes and types, no data
        shape = shapes[key]
        norm = len(shape) == 1
        kind = gguf.GGMLQuantizationType.F32 if norm else gguf.GGMLQuantizationType.BF16
        dtype = np.dtype(np.float32 if norm else np.uint16)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        writer.add_tensor_info(_gguf_name(key, names), shape, dtype, nbytes, raw_dtype=kind)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for key, file in order:
        writer.write_tensor_data(tensor(key, file))
    writer.close()
    return out


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors file's JSON header (no data read)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _gguf_module() -> Any:
    """gguf-py from the llama.cpp tree: there as soon as setup has unpacked the sdist (reading a
    GGUF must not wait for, or start, the build)."""
    unpacked = BENCH_CACHE / "llama" / "src" / "gguf-py"
    gguf_py = str(unpacked) if (unpacked / "gguf").is_dir() else ensure("llama").gguf_py
    if gguf_py not in sys.path:
        sys.path.insert(0, gguf_py)
    import gguf

    return gguf


def random_gguf(shape: str, quant: str) -> Path:
    """`shape`'s random weights (the MLX folder's) as a GGUF at `quant` (RANDOM_QUANTS)."""
    if quant not in RANDOM_QUANTS:
        raise ValueError(f"quant must be one of {RANDOM_QUANTS}, got {quant!r}")
    dest = MODELS / f"random-{shape}.{quant}.gguf"
    if dest.is_file():
        return dest
    folder = random_mlx_folder(shape)
    quantize = ensure("llama").quantize
    with tempfile.TemporaryDirectory(prefix=f".gguf-{shape}-", dir=MODELS) as tmp:
        bf16 = write_bf16_gguf(folder, Path(tmp) / "bf16.gguf")
        # both at once (the BF16 file is the expensive part), but for the 8B shape only the one
        # asked for: its BF16 file, both GGUFs and the folder would hold ~45 GB at once
        for q in (quant,) if shape == "8b" else RANDOM_QUANTS:
            target = MODELS / f"random-{shape}.{q}.gguf"
            if target.is_file():
                continue
            part = Path(tmp) / f"{q}.gguf"
            threads = str(len(os.sched_getaffinity(0)))
            out = subprocess.run(["nice", "-n", "10", quantize, str(bf16), str(part), q, threads],
                                 capture_output=True, text=True)  # fmt: skip
            if out.returncode != 0:
                raise RuntimeError(f"llama-quantize {q} failed: {out.stderr[-2000:]}")
            os.replace(part, target)
            log(f"random {shape}: {target.name} ({target.stat().st_size >> 20} MB)")
    return dest


# -- what a benchmark asks for ----------------------------------------------------------------


def model_files(name: str) -> ModelFiles:
    """The model's identity and tokenizer; the files themselves come from `path_for`."""
    if name == "default":
        return ModelFiles("default", "default", default_mlx_folder(), random=False)
    if name not in SHAPES:
        raise ValueError(f"model must be 'default' or one of {sorted(SHAPES)}, got {name!r}")
    folder = random_mlx_folder(name)
    return ModelFiles(name, str(folder), folder, random=True)


def path_for(name: str, fmt: str) -> Path | str:
    """The file or folder of model `name` in `fmt`: "mlx" (what batchmlx's `model` takes), "hf"
    (a Hugging Face folder, for vLLM), a GGUF type ("Q4_1", and "F32"/"Q8_0"/"Q4_0" made from it,
    for the default; RANDOM_QUANTS for the random shapes). Built on first use."""
    if name == "default":
        if fmt == "mlx":
            return "default"
        if fmt == "hf":
            return default_hf_folder()
        if fmt in ("gguf", "Q4_1"):
            return default_gguf()
        if fmt in ("F32", *QUANTS):
            return default_requantized(fmt)
        raise ValueError(f"the default model comes as mlx, hf, Q4_1, F32, Q8_0 or Q4_0, not "
                         f"{fmt!r}")  # fmt: skip
    if fmt in ("mlx", "hf"):
        return random_mlx_folder(name)
    return random_gguf(name, fmt)


def gguf_type(path: Path) -> str:
    """The GGUF's weight types, most common first (e.g. "Q4_1 (+Q8_0, F32)")."""
    from collections import Counter

    gguf = _gguf_module()
    reader = gguf.GGUFReader(str(path))
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    main = counts.most_common(1)[0][0]
    others = sorted(set(counts) - {main})
    return main + (f" (+{', '.join(others)})" if others else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", choices=["default", *SHAPES])
    p.add_argument("--format", action="append", default=[],
                   help="mlx, hf, Q4_1, F32 (default model), Q8_0, Q4_0, Q4_K_M "
                        "(repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    for fmt in args.format or (["mlx", "hf", "Q4_1"] if args.model == "default"
                               else ["mlx", *RANDOM_QUANTS]):  # fmt: skip
        print(f"{args.model} {fmt}: {path_for(args.model, fmt)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
