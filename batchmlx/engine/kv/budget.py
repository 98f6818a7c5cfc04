"""How much memory the KV cache may take, and MLX's buffer cache on the CPU backend."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from batchmlx.core.engine_api import EngineSettings


def available_memory_bytes(
    on_gpu: bool | None = None, device_info: dict[str, Any] | None = None
) -> int:
    """Memory the KV cache's share is taken of: the GPU's free memory on MLX's CUDA backend
    (where the KV arrays live; MLX reports it as `free_memory`), else the host's available
    memory (CPU, and Metal's unified memory). Arguments: for tests (None: asked of MLX)."""
    if on_gpu is None:
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
    info = (mx.device_info() if device_info is None else device_info) if on_gpu else {}
    free = info.get("free_memory")
    if isinstance(free, int) and free > 0:
        return free
    available = _mem_available()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # macOS has no SC_AVPHYS_PAGES
        info = info or mx.device_info()
        return int(info.get("memory_size") or info.get("total_memory") or 8 << 30)


def _mem_available(path: str = "/proc/meminfo") -> int | None:
    """Linux's MemAvailable: free memory plus the page cache and buffers the kernel can drop.
    SC_AVPHYS_PAGES counts free pages only, so on a machine that just read or wrote a few GB of
    files it read as a few hundred MB (measured: 237 MB of 23 GB available)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Freed buffers MLX's CPU allocator keeps for reuse. Its default, 32 MiB, is less than a
# decode step of the MLX path frees (activations, gathered keys, logits: ~30 MB at width 64
# for a 135M model), so every step took part of its buffers fresh from the OS and paid a page
# fault per 4 KB (7,500 a step, measured; 1,300 at 128 MiB, and decode steps 132 -> 125 ms).
# The host steps free far less through MLX (their activations are numpy's): 64 chats x 128
# tokens at int8 peaked at 1,435 MB with 254 MB of it this cache at 256 MiB, 1,248 MB at
# 64 MiB, in 17.2 and 16.7-16.8 s (2026-12-06, 2-core Xeon, load 0.8, two runs each).
CPU_BUFFER_CACHE = 64 << 20


def size_buffer_cache(on_cpu: bool | None = None) -> int:
    """Raise MLX's buffer cache limit to CPU_BUFFER_CACHE on the CPU backend (never lower a
    limit already set higher; never above 1/16 of the available memory). Returns the limit in
    force."""
    if on_cpu is None:
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
    limit = min(CPU_BUFFER_CACHE, available_memory_bytes(on_gpu=False) // 16)
    current = mx.set_cache_limit(limit)
    if not on_cpu or current > limit:
        mx.set_cache_limit(current)
        return current
    return limit


def kv_block_budget(cfg: EngineSettings, bytes_per_block: int) -> int:
    """Blocks the KV cache may hold, block 0 (scratch) included."""
    if not cfg.memory_aware:
        return cfg.cache_max_blocks + 1
    if cfg.cache_memory_mb is not None:
        budget = cfg.cache_memory_mb << 20
    else:
        budget = int(available_memory_bytes() * cfg.cache_memory_percent)
    return max(2, budget // bytes_per_block)
