"""A GGUF file converted once into an MLX model folder that `mlx_lm.load` reads: config.json
from its metadata (families.py), model.safetensors written a tensor at a time (weights.py), the
tokenizer files (tokenizer.py); the folder built once, atomically and under a lock."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchmlx.core.gguf_support import gguf_problem
from batchmlx.engine.models.first_run import disk_use, note, size_text, wrote
from batchmlx.engine.models.gguf.families import model_config, placements
from batchmlx.engine.models.gguf.reader import GGUFConversionError, open_gguf, summary
from batchmlx.engine.models.gguf.tokenizer import write_tokenizer
from batchmlx.engine.models.gguf.weights import quantization, write_safetensors

MARKER_NAME = ".batchmlx-converted.json"
# Bump when the output layout changes so old conversions are redone. 2: dequantized by gguf-py
# (float32 for quantized types), every family of families.py, SentencePiece tokenizers.
# 3: quantized matrices keep their bits, as MLX's affine format (weights.py, affine.py).
CONVERTER_VERSION = 3


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock across processes (another worker may be converting the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into `out_dir` once; later calls reuse the folder if the source is
    unchanged (same size and mtime). The folder appears atomically, fully written or not at all."""
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    stamp = {
        "source": str(gguf_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }
    keys = ("size", "mtime_ns", "converter_version")
    what = f"converting {gguf_path.name} ({size_text(st.st_size)}) into an MLX model folder, once"
    return build_folder_once(
        Path(out_dir), stamp, keys, lambda tmp: _write_model_folder(gguf_path, tmp), what=what
    )


def build_folder_once(
    out_dir: Path,
    stamp: dict[str, Any],
    keys: tuple[str, ...],
    write: Callable[[Path], None],
    *,
    what: str = "writing",
) -> Path:
    """`out_dir`, written by `write(tmp)` unless its marker already holds `stamp`'s `keys`.
    Written under a file lock (another process may be building it), into a temp folder that
    replaces any stale one atomically: readers see the old folder or the complete new one.
    A build is told (notes.py): `what`, where, then its size and time."""
    if _is_built(out_dir, stamp, keys):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _is_built(out_dir, stamp, keys):
            return out_dir
        note("%s: %s ...", what, out_dir)
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            write(tmp)
            (tmp / MARKER_NAME).write_text(json.dumps(stamp, indent=2))
            tmp.chmod(0o755)  # mkdtemp makes it owner-only
            if out_dir.exists():  # a stale build of an older source
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        wrote()
        note("wrote %s (%s) in %.1fs", out_dir.name, size_text(disk_use(out_dir)),
             time.monotonic() - t0)  # fmt: skip
    return out_dir


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The stamp a folder built by `build_folder_once` was written with, or None."""
    try:
        saved = json.loads((Path(folder) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def _is_built(out_dir: Path, stamp: dict[str, Any], keys: tuple[str, ...]) -> bool:
    saved = read_marker(out_dir)
    return saved is not None and all(saved.get(k) == stamp[k] for k in keys)


def _write_model_folder(gguf_path: Path, dest: Path) -> None:
    f = open_gguf(gguf_path)
    problem = gguf_problem(summary(f))
    if problem is not None:
        raise GGUFConversionError(f"{gguf_path.name}: {problem}")
    config = model_config(f)
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    placed = placements(f)
    write_safetensors(f, placed, heads, dest / "model.safetensors")
    quantized = quantization(f, placed)
    if quantized is not None:
        config["quantization"] = quantized
    _write_json(dest / "config.json", config)
    write_tokenizer(f.meta, dest, context_length=config["max_position_embeddings"])
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(dest / "generation_config.json", gen)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def looks_like_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False
