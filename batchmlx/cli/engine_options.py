"""The engine options `worker`, `serve` and `submit --wait` share, declared once: the signature
of `engine_choice` is their declaration, and `engine_options` adds them to a command, which
receives what they decide (an `EngineChoice`) as its `engine` argument."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from batchmlx.core.engine_api import ENGINE_DEFAULTS as D
from batchmlx.core.engine_api import EngineSettings

PANEL = "Engine options"  # their own section of each command's --help
DTYPE_HELP = (
    "Weights: auto (on the CPU int8 in groups of 32, as llama.cpp's Q8_0, where it has AVX-512 "
    "VNNI, else bf16 GEMMs with float32 sums, float32 without AVX-512; as stored on "
    "Metal/CUDA), int8, q4 (a 4-bit GGUF's layers kept in their bits, the rest int8), "
    "bfloat16, float32, stored. README, 'Precision per --dtype'"
)


@dataclass(frozen=True, slots=True)
class EngineChoice:
    settings: EngineSettings  # the engine's
    dtype: str = "auto"  # the weights' (the model loader's, not the engine's)


def _option(help: str) -> Any:
    return typer.Option(help=help, rich_help_panel=PANEL)


def engine_choice(
    simple: Annotated[bool, _option("Simple mode: one request at a time")] = D.simple,
    max_batch_size: Annotated[
        int, _option("Hard cap on the running batch (the adaptive width grows up to it)")
    ] = D.max_batch_size,
    adaptive_width: Annotated[
        bool,
        _option(
            "Size the running batch of queued work by measured throughput and KV "
            "memory (--no-adaptive-width: always --max-batch-size)"
        ),
    ] = D.adaptive_width,
    block_size: Annotated[int, _option("Tokens per KV block")] = D.block_size,
    use_paged_cache: Annotated[
        bool, _option("Share prefix blocks between requests (on by default)")
    ] = D.use_paged_cache,
    cache_memory_mb: Annotated[int | None, _option("Explicit KV memory bound")] = (
        D.cache_memory_mb
    ),
    cache_memory_percent: Annotated[
        float, _option("KV memory bound as a share of available memory")
    ] = D.cache_memory_percent,
    memory_aware_cache: Annotated[
        bool, _option("Bound the cache by memory; off: by --cache-max-blocks")
    ] = D.memory_aware,
    cache_max_blocks: Annotated[
        int, _option("Block bound without memory awareness")
    ] = D.cache_max_blocks,
    batch_prefill_beside_online: Annotated[
        int,
        typer.Option(
            min=0,
            rich_help_panel=PANEL,
            help="Batch prompt tokens a step feeds while online requests run, so their "
            "tokens keep coming at decode speed (0: batch prompts wait for online work); in "
            "serve, with none running, a step's rows (decodes and batch prompt tokens), so "
            "one that arrives waits for a short step",
        ),
    ] = D.batch_prefill_beside_online,
    batch_decodes_beside_online: Annotated[
        int,
        typer.Option(
            min=1,
            rich_help_panel=PANEL,
            help="Batch decodes a step feeds while online requests run (the earliest "
            "admitted; the rest keep their KV and wait), so a step carrying online tokens "
            "stays near a narrow decode step's time",
        ),
    ] = D.batch_decodes_beside_online,
    online_linger_s: Annotated[
        float,
        typer.Option(
            min=0.0,
            rich_help_panel=PANEL,
            help="Seconds the two bounds above still hold after the last online request "
            "ended, so a client's next request does not wait for a step of the whole batch "
            "(0: they lift at once)",
        ),
    ] = D.online_linger_s,
    online_step_ratio: Annotated[
        float,
        typer.Option(
            min=0.0,
            rich_help_panel=PANEL,
            help="Beside online requests a step carries no more batch prompt tokens than keep "
            "it within this many times a step of its decodes alone, as measured while it runs "
            "(0: --batch-prefill-beside-online alone)",
        ),
    ] = D.online_step_ratio,
    priority_aging_s: Annotated[
        float,
        typer.Option(
            min=0.0,
            rich_help_panel=PANEL,
            help="Queued batch work rises one priority level per this many seconds waited, "
            "so no batch starves behind more urgent ones (0: strict priorities)",
        ),
    ] = D.priority_aging_s,
    dtype: Annotated[str, _option(DTYPE_HELP)] = "auto",
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            envvar="BATCHMLX_THREADS",
            rich_help_panel=PANEL,
            help="Compute threads (BLAS, host kernels); default: the CPUs this process "
            "may use (affinity, cgroup quota) that other processes leave free, looked at "
            "again every 5 s; `batchmlx doctor` shows it",
        ),
    ] = D.threads,
) -> EngineChoice:
    """The engine options into what they decide."""
    settings = EngineSettings(
        simple=simple, max_batch_size=max_batch_size, adaptive_width=adaptive_width,
        block_size=block_size, use_paged_cache=use_paged_cache, cache_memory_mb=cache_memory_mb,
        cache_memory_percent=cache_memory_percent, memory_aware=memory_aware_cache,
        cache_max_blocks=cache_max_blocks, threads=threads,
        batch_prefill_beside_online=batch_prefill_beside_online,
        batch_decodes_beside_online=batch_decodes_beside_online,
        online_linger_s=online_linger_s, online_step_ratio=online_step_ratio,
        priority_aging_s=priority_aging_s,
    )  # fmt: skip
    return EngineChoice(settings, dtype=dtype)


_DECLARED = inspect.signature(engine_choice, eval_str=True).parameters


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with the engine options after its own: typer reads the signature made here,
    and the command is called with `engine=` their EngineChoice in place of them."""
    own = inspect.signature(command, eval_str=True)
    params = [p for p in own.parameters.values() if p.name != "engine"]
    params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in _DECLARED.values()]

    @functools.wraps(command)
    def with_engine(**kwargs: Any) -> Any:
        chosen = engine_choice(**{name: kwargs.pop(name) for name in _DECLARED})
        return command(**kwargs, engine=chosen)

    with_engine.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    with_engine.__annotations__ = {p.name: p.annotation for p in params}
    return with_engine
