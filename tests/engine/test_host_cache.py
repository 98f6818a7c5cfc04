"""The host weights cache (engine/host/weights_cache.py): oneDNN's packed bytes read back at the
next start instead of converted again, the same GEMMs bit for bit, and packed anew whenever
the source, the format or the library differs."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.config import HostSettings
from batchmlx.core.models import resolve_model
from batchmlx.engine.host import onednn
from batchmlx.engine.host import weights_cache as host_cache
from batchmlx.engine.host.backend import HostBackend, current
from batchmlx.engine.host.linear import HostFormat, PackedCache, runs_here, to_host_format
from batchmlx.engine.models.loader import load_model
from tests.engine.helpers import host_formats

TOKENS = mx.array([[5, 17, 99, 3, 250, 8]])
# a format oneDNN packs, that this CPU runs (oneDNN 3.2: bf16 needs AVX-512, exact int8 VNNI)
PACKED = next((f for f in (HostFormat.BF16, HostFormat.INT8) if runs_here(f)), HostFormat.BF16)
pytestmark = pytest.mark.skipif(not runs_here(PACKED), reason="no packed format on this CPU")


def _poisoned(model) -> None:
    """Every linear and embedding weight NaN: a layer built from them gives NaN."""
    import mlx.nn as nn

    for _, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight = mx.full(m.weight.shape, float("nan"), m.weight.dtype)


@pytest.mark.parametrize("fmt", host_formats(packed_only=True))  # float32: never cached
def test_a_cached_model_computes_the_same_without_reading_its_float_weights(
        tiny_model, fmt, tmp_path):  # fmt: skip
    weights = [(k, mx.array(v)) for k, v in _flat(tiny_model)]
    args = tiny_model.args
    first = PackedCache()
    to_host_format(tiny_model, fmt, first)
    want = np.array(tiny_model(TOKENS))
    assert first.packed > 0 and first.kept
    path = tmp_path / "m.safetensors"
    assert host_cache.save_cache(path, first, "sig")

    again = _fresh(args, weights)
    _poisoned(again)  # the cache must be all the second model reads
    second = host_cache.open_cache(path, "sig")
    to_host_format(again, fmt, second)
    assert second.packed == 0
    assert not host_cache.save_cache(path, second, "sig")  # nothing new: not rewritten
    np.testing.assert_array_equal(np.array(again(TOKENS)), want)
    control = _fresh(args, weights)
    _poisoned(control)
    to_host_format(control, fmt)  # the poison shows where no cache is read
    assert np.isnan(np.array(control(TOKENS))).all()


def test_another_signature_packs_again(tiny_model, tmp_path):
    first = PackedCache()
    to_host_format(tiny_model, PACKED, first)
    path = tmp_path / "m.safetensors"
    host_cache.save_cache(path, first, "sig-a")
    assert host_cache.open_cache(path, "sig-b").found == {}
    assert host_cache.open_cache(tmp_path / "missing.safetensors", "sig-a").found == {}
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert host_cache.open_cache(tmp_path / "junk.safetensors", "sig-a").found == {}
    for header in (b'{"__metadata__": 5}', b'{"a": {"dtype": "U8", "shape": [-4],'
                   b' "data_offsets": [0, 4]}}', b"[1]"):  # fmt: skip
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
        assert host_cache.open_cache(bad, "sig-a").found == {}


def test_a_damaged_file_is_packed_again_and_rewritten(tiny_model, tmp_path):
    weights = [(k, mx.array(v)) for k, v in _flat(tiny_model)]
    args = tiny_model.args
    first = PackedCache()
    to_host_format(tiny_model, PACKED, first)
    want = np.array(tiny_model(TOKENS))
    path = tmp_path / "m.safetensors"
    host_cache.save_cache(path, first, "sig")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut in the middle of the layers' bytes
    again = _fresh(args, weights)
    cache = host_cache.open_cache(path, "sig")
    to_host_format(again, PACKED, cache)
    np.testing.assert_array_equal(np.array(again(TOKENS)), want)
    assert cache.packed > 0 and host_cache.save_cache(path, cache, "sig")
    assert host_cache.open_cache(path, "sig").found  # whole again


def test_the_packed_bytes_are_used_from_the_mapped_file_where_they_lie(tiny_model, tmp_path):
    """Read back, each layer's packed bytes and the embedding's lookup rows are read-only views
    of the file's mapping (no copy into fresh memory), 64-byte aligned; the file stays
    safetensors that MLX reads as it is."""
    import mmap

    first = PackedCache()
    to_host_format(tiny_model, PACKED, first)
    path = tmp_path / "m.safetensors"
    assert host_cache.save_cache(path, first, "sig")
    found = host_cache.open_cache(path, "sig").found
    assert set(found) == set(first.kept)  # the padding entries are not parts
    packed = {k: v for k, v in found.items() if k.endswith((".packed", ".plain"))}
    assert any(k.endswith(".plain") for k in packed)  # the embedding's rows, mapped too
    assert packed  # the small parts (int8: scales) are MLX arrays
    for key, view in packed.items():
        assert isinstance(view, np.ndarray) and not view.flags.writeable
        assert view.ctypes.data % 64 == 0
        base = view
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)
        kept = first.kept[key]
        np.testing.assert_array_equal(view, np.asarray(
            kept.view(mx.uint16) if kept.dtype == mx.bfloat16 else kept))  # fmt: skip
    for key, a in found.items():
        if key not in packed:
            assert isinstance(a, mx.array) and a.dtype == first.kept[key].dtype
            assert mx.array_equal(a, first.kept[key]).item()
    by_mlx = mx.load(str(path))
    for key, a in first.kept.items():
        assert mx.array_equal(by_mlx[key], mx.array(np.asarray(a))
                              if isinstance(a, np.ndarray) else a).item()  # fmt: skip


def test_the_file_is_synced_as_it_is_written_and_reads_back_whole(tiny_model, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """The writer syncs every _SYNC_BYTES as it goes (Linux would start writing a 2.1 GB file
    back only at its final fsync), each array cut into pieces of that size: the file reads
    back byte for byte."""
    first = PackedCache()
    to_host_format(tiny_model, PACKED, first)
    syncs = []
    monkeypatch.setattr(host_cache, "_SYNC_BYTES", 4096)
    monkeypatch.setattr(host_cache, "_datasync", lambda fd: syncs.append(os.fstat(fd).st_size))
    path = tmp_path / "m.safetensors"
    assert host_cache.save_cache(path, first, "sig")
    assert len(syncs) >= path.stat().st_size // 4096 // 2 and syncs == sorted(syncs)
    found = host_cache.open_cache(path, "sig").found
    assert set(found) == set(first.kept)
    for key, a in first.kept.items():
        np.testing.assert_array_equal(_bits(found[key]), _bits(a))


def _bits(a: mx.array | np.ndarray) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def test_packed_bytes_of_another_size_are_not_adopted():
    lib = current().onednn()
    dt, scaled = PACKED.data_type, PACKED.scaled
    w = np.zeros((64, 32), np.uint16 if PACKED is HostFormat.BF16 else np.int8)
    packed = lib.pack(w, dt, scaled=scaled)
    assert lib.adopt(packed.buffer, 64, 32, dt, scaled=scaled) is not None
    assert lib.adopt(packed.buffer[:-64], 64, 32, dt, scaled=scaled) is None


def test_the_signature_follows_the_source_files_and_the_format(tiny_model_dir):
    lib = current().onednn()
    sig = host_cache.signature(tiny_model_dir, PACKED, lib)
    assert sig == host_cache.signature(tiny_model_dir, PACKED, lib)
    assert sig != host_cache.signature(tiny_model_dir, HostFormat.INT8, lib)
    weights = sorted(tiny_model_dir.glob("*.safetensors"))[0]
    st = weights.stat()
    try:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert sig != host_cache.signature(tiny_model_dir, PACKED, lib)
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_load_model_writes_the_cache_once_then_reads_it(tiny_model_dir, tmp_path, monkeypatch):
    spec = resolve_model(str(tiny_model_dir), cache_dir=tmp_path)
    first = load_model(spec, cache_dir=tmp_path, dtype=PACKED.value)
    assert host_cache.wait_written(60)
    files = list((tmp_path / "host").glob(f"*.{PACKED.value}.safetensors"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    calls = []
    real_pack = onednn.OneDNN.pack
    monkeypatch.setattr(
        onednn.OneDNN, "pack", lambda self, *a, **k: calls.append(1) or real_pack(self, *a, **k)
    )
    second = load_model(spec, cache_dir=tmp_path, dtype=PACKED.value)
    assert calls == [] and files[0].stat().st_mtime_ns == stamp  # read back, not packed
    np.testing.assert_array_equal(np.array(second.model(TOKENS)), np.array(first.model(TOKENS)))
    off = HostBackend(HostSettings(weights_cache=False))  # BATCHMLX_HOST_CACHE=0
    load_model(spec, cache_dir=tmp_path, dtype=PACKED.value, backend=off)
    assert calls  # off: packed at the start, as without a cache


@pytest.mark.skipif(not (runs_here(HostFormat.INT8) and host_cache.PackArena.usable()),
                    reason="no int8 host format here")  # fmt: skip
@pytest.mark.parametrize("case", ["arena", "header too large", "disk too full"])
def test_a_first_start_packs_into_the_file_it_writes(tiny_model_dir, tmp_path, monkeypatch,
                                                     case):  # fmt: skip
    """int8's packed bytes go straight into the cache file's mapping as the layers are packed
    (no copy into the file after: `_write` is never called), and the finished file is
    safetensors the next start reads back. A header too large for its room, or a disk too
    full for a window: the file is written anew as usual, whole."""
    writes = []
    real_write = host_cache._write
    monkeypatch.setattr(
        host_cache, "_write", lambda *a, **k: writes.append(1) or real_write(*a, **k)
    )
    header_fits = case == "arena"
    if case == "header too large":
        monkeypatch.setattr(host_cache, "_HEADER_ROOM", 0)  # (no room at all)
    if case == "disk too full":
        monkeypatch.setattr(host_cache, "_FREE_MARGIN", 1 << 62)  # every window refused
    spec = resolve_model(str(tiny_model_dir), cache_dir=tmp_path)
    first = load_model(spec, cache_dir=tmp_path, dtype="int8")
    gemm = first.model.model.layers[0].self_attn.q_proj._gemm
    assert gemm._q8 is not None
    assert host_cache.wait_written(60)
    assert writes == ([] if header_fits else [1])
    (final,) = (tmp_path / "host").glob("*.int8.safetensors")
    assert not list((tmp_path / "host").glob(".*"))  # no temporary file left
    views, _ = host_cache._map(final)
    assert np.array_equal(views["model.layers.0.self_attn.q_proj+k_proj+v_proj.packed"][0],
                          gemm.packed)  # fmt: skip
    by_mlx = mx.load(str(final))  # every byte covered, as the format asks
    assert set(by_mlx) >= {k for k in views}
    again = load_model(spec, cache_dir=tmp_path, dtype="int8")
    cached = again.model.model.layers[0].self_attn.q_proj._gemm
    assert not cached.packed.flags.writeable  # the finished file's read-only mapping
    np.testing.assert_array_equal(np.array(again.model(TOKENS)), np.array(first.model(TOKENS)))


def test_the_start_does_not_wait_for_the_cache_file(tiny_model_dir, tmp_path, monkeypatch):
    """load_model returns while the packed weights are still being written; the file appears
    whole (renamed from a temporary name) once the writer ends."""
    import threading

    release = threading.Event()
    real_write = host_cache._write

    def slow_write(*args, **kw):
        assert release.wait(60)
        real_write(*args, **kw)

    monkeypatch.setattr(host_cache, "_write", slow_write)
    spec = resolve_model(str(tiny_model_dir), cache_dir=tmp_path)
    load_model(spec, cache_dir=tmp_path, dtype=PACKED.value)  # returns: the writer waits
    assert not list((tmp_path / "host").glob(f"*.{PACKED.value}.safetensors"))
    assert not host_cache.wait_written(0.05)
    release.set()
    assert host_cache.wait_written(60)
    assert len(list((tmp_path / "host").glob(f"*.{PACKED.value}.safetensors"))) == 1
    assert not list((tmp_path / "host").glob(".*"))  # no temporary file left


def test_a_process_that_ends_at_once_still_leaves_the_whole_file(tiny_model_dir, tmp_path):
    """The writer is not a daemon, even started from one (models load on the engine's thread,
    a daemon): a process that loads a model and exits at once (a short `submit --wait`)
    leaves a file the next start reads without packing."""
    import subprocess
    import sys

    code = (f"import threading\n"
            f"from batchmlx.core.models import resolve_model\n"
            f"from batchmlx.engine.models.loader import load_model\n"
            f"spec = resolve_model({str(tiny_model_dir)!r}, cache_dir={str(tmp_path)!r})\n"
            f"t = threading.Thread(target=load_model, args=(spec,), daemon=True,\n"
            f"    kwargs=dict(cache_dir={str(tmp_path)!r}, dtype={PACKED.value!r}))\n"
            f"t.start(); t.join()\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True)
    files = list((tmp_path / "host").glob(f"*.{PACKED.value}.safetensors"))
    assert len(files) == 1
    views, meta = host_cache._map(files[0])  # whole: every entry within the file, signed
    assert views and host_cache._SIGNATURE_KEY in meta


def test_temporary_files_of_dead_writers_are_swept(tiny_model_dir, tmp_path):
    """A writer killed mid-file leaves `.PID.N.<name>`; the next save removes those of
    processes no longer alive, and leaves a live one's alone."""
    import subprocess
    import sys

    spec = resolve_model(str(tiny_model_dir), cache_dir=tmp_path)
    load_model(spec, cache_dir=tmp_path, dtype=PACKED.value)
    assert host_cache.wait_written(60)
    (final,) = (tmp_path / "host").glob(f"*.{PACKED.value}.safetensors")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    stale = final.with_name(f".{dead}.0.{final.name}")
    live = final.with_name(f".{os.getppid()}.0.{final.name}")
    stale.write_bytes(b"cut short")
    live.write_bytes(b"still writing")
    final.unlink()  # the next start packs and saves again
    load_model(spec, cache_dir=tmp_path, dtype=PACKED.value)
    assert host_cache.wait_written(60)
    assert not stale.exists() and live.exists() and final.exists()


def _flat(model):
    from mlx.utils import tree_flatten

    return [(k, np.array(v)) for k, v in tree_flatten(model.parameters())]


def _fresh(args, weights):
    """A second tiny model with the first one's weights (before its conversion)."""
    from mlx_lm.models.llama import Model

    model = Model(args)
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model
