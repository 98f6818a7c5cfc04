"""What the benchmark commands share: the report's sizes (`Settings`, `QUICK`), read by
`benchmarks.run` and the sections it calls (scale), and the move onto a fast BLAS each command
makes before any timing. Kept apart so the sections need not import `benchmarks.run`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    model: str = "default"
    dtype: str = "auto"
    concurrency: tuple[int, ...] = (1, 5, 16, 32)  # section 1 rows
    max_tokens: int = 64  # sections 1 and 2
    ttft_concurrency: int = 16  # section 2's workload and the 3x target's row
    shared_requests: int = 64  # section 3
    shared_system_tokens: int = 500
    shared_max_tokens: int = 128
    memory_requests: int = 16  # section 4
    memory_system_tokens: int = 500
    memory_max_tokens: int = 32
    prefix_max_tokens: int = 8  # section 5
    max_batch_size: int = 32  # ours (max running) and the peer (completion_batch_size)
    block_size: int = 16
    kv_grow_blocks: int = 64  # sections 1, 2, 5
    memory_grow_blocks: int = 8  # sections 3 and 4: allocated KV tracks the blocks in use
    peer_models: tuple[str, ...] = ()  # section 12's models (benchmarks/peers/section.py); () all
    peer_without: tuple[str, ...] = ()  # section 12's peers left out (their rows: not measured)


QUICK = Settings(
    concurrency=(1, 4, 8),
    max_tokens=16,
    ttft_concurrency=8,
    shared_requests=8,
    shared_system_tokens=128,
    shared_max_tokens=16,
    memory_requests=8,
    memory_system_tokens=128,
    memory_max_tokens=8,
    prefix_max_tokens=4,
)


def fast_blas() -> None:
    """Re-execute onto a fast BLAS when engine/host/fast_blas.py finds one
    (BATCHMLX_FAST_BLAS=0: don't)."""
    try:
        from batchmlx.engine.host.fast_blas import ensure_fast_blas
    except Exception:  # noqa: BLE001 - optional: without it we run on MLX's own BLAS
        return
    ensure_fast_blas()
