"""A cached dense copy of a converted (quantized) model folder.

On the CPU a quantized model is dequantized to float32 at every start (loader.py), which costs
about 1.5 s for SmolLM2-135M; reading back a saved float32 copy takes about 0.2 s. The first
start writes the copy next to the folder it came from (`<folder>-float32`), stamped with that
folder's own conversion stamp, so a re-converted source invalidates it. Only folders batchmlx
converted itself (the default model, .gguf files) get a copy; hub ids and local folders load
as mlx-lm loads them.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from batchmlx.engine.models.first_run import size_text
from batchmlx.engine.models.gguf import MARKER_NAME, build_folder_once, read_marker

# Bump when the copy's layout changes so old copies are rewritten.
DENSE_VERSION = 1
# Models whose dense weights are larger are dequantized at each start rather than copied to disk.
MAX_DENSE_BYTES = 4 << 30
_STAMP_KEYS = ("source_stamp", "dtype", "dense_version")
_QUANTIZATION_KEYS = ("quantization", "quantization_config")
log = logging.getLogger("batchmlx.engine")


def dense_folder(folder: Path, dtype: str) -> Path:
    return folder.with_name(f"{folder.name}-{dtype}")


def _stamp(folder: Path, dtype: str) -> dict[str, Any] | None:
    source = read_marker(folder)
    if source is None:
        return None  # not a folder batchmlx converted: nothing to key a copy on
    return {"source": str(folder), "source_stamp": source, "dtype": dtype,
            "dense_version": DENSE_VERSION}  # fmt: skip


def cached_dense(folder: Path, dtype: str) -> Path | None:
    """The dense copy of `folder` in `dtype` when one matches the folder as it is now."""
    stamp = _stamp(folder, dtype)
    out = dense_folder(folder, dtype)
    saved = read_marker(out)
    if stamp is None or saved is None:
        return None
    return out if all(saved.get(k) == stamp[k] for k in _STAMP_KEYS) else None


def save_dense(folder: Path, dtype: str, model: Any) -> Path | None:
    """Write `model`'s (already dequantized) weights as the dense copy of `folder`, with its
    config less the quantization and its tokenizer files. None when `folder` is not one
    batchmlx converted, the weights exceed MAX_DENSE_BYTES, or the copy cannot be written (the
    copy only saves time: a full disk must not stop the model loading)."""
    stamp = _stamp(folder, dtype)
    if stamp is None:
        return None
    weights = dict(tree_flatten(model.parameters()))
    size = sum(w.nbytes for w in weights.values())
    if size > MAX_DENSE_BYTES:
        log.info("%s: %d MB as %s, not cached (over %d MB)", folder.name, size >> 20, dtype,
                 MAX_DENSE_BYTES >> 20)  # fmt: skip
        return None

    def write(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        config = json.loads((folder / "config.json").read_text())
        for key in _QUANTIZATION_KEYS:
            config.pop(key, None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in folder.iterdir():
            if (
                f.is_file()
                and f.name not in (MARKER_NAME, "config.json")
                and not (f.name.startswith("model") and f.name.endswith((".safetensors", ".json")))
            ):
                shutil.copy2(f, tmp / f.name)

    what = (f"saving a {dtype} copy of {folder.name} ({size_text(size)} of weights), so that "
            "later starts read it instead of dequantizing again")  # fmt: skip
    try:
        return build_folder_once(dense_folder(folder, dtype), stamp, _STAMP_KEYS, write,
                                 what=what)  # fmt: skip
    except OSError as exc:
        log.warning("%s: dense %s copy not written (%s)", folder.name, dtype, exc)
        return None
