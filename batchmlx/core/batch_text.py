"""A batch in words, shared by the CLI (`status`, `submit`) and the worker's log: its requests,
tokens, prefix-cache figures and model, said the same way in both. Pure."""

from __future__ import annotations

from batchmlx.core.records import BatchRecord


def counts_text(rec: BatchRecord) -> str:
    c = rec.request_counts
    return f"{c.completed + c.failed}/{c.total} done ({c.completed} ok, {c.failed} failed)"


def tokens_text(rec: BatchRecord) -> str:
    u = rec.usage
    return (
        f"{u.input_tokens} prompt ({u.cached_tokens} from the prefix cache), "
        f"{u.output_tokens} generated"
    )


def hit_rate_text(rec: BatchRecord) -> str:
    """The share of done requests whose prompt reused a cached prefix ("n/a": none done)."""
    rate = rec.outcomes.hit_rate
    return "n/a" if rate is None else f"{rate:.0%}"


def cache_text(rec: BatchRecord) -> str:
    o, u = rec.outcomes, rec.usage
    return (
        f"hit rate {hit_rate_text(rec)} (HIT {o.hits}, PREFIX_HIT {o.prefix_hits}, "
        f"MISS {o.misses}); prefill tokens computed {u.input_tokens - u.cached_tokens}, "
        f"reused {u.cached_tokens}"
    )


def model_text(rec: BatchRecord) -> str:
    """The batch's model; a batch with none (a file without requests, one that failed before
    any body named one) says so rather than print None."""
    if rec.model:
        return rec.model
    return "none (no requests)" if rec.request_counts.total == 0 else "none"
