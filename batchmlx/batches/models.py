"""The model rule (core/model_rule.py) as each path applies it: built from the settings, with
the hub check that the pure rule asks of its caller, and the inbox's duplicate key."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import replace

from batchmlx.batches.errors import BatchError
from batchmlx.config import Settings
from batchmlx.core.gguf_support import HeaderError, scan_header, summary_of
from batchmlx.core.gguf_support import gguf_problem as problem_of
from batchmlx.core.model_rule import (
    Chosen,
    ModelRule,
    Refused,
    Why,
    choose_model,
    not_supported,
    truthy,
)

log = logging.getLogger("batchmlx.models")

HUB_TIMEOUT_S = 10.0  # one look at the hub: no network fails fast, a slow one is waited for


def rule_of(settings: Settings, *, serving: str | None = None, pinned: bool = False) -> ModelRule:
    """The rule of this process: `serving` (default: the settings' default model) answers names
    that are no model here; `pinned` when only it runs (serve)."""
    return ModelRule(
        serving=serving or settings.default_model,
        aliases=dict(settings.model_aliases),
        strict=settings.strict_models,
        pinned=pinned,
    )


def hub_problem(hub_id: str) -> str | None:
    """Why the hub model `hub_id` cannot be loaded here (None: it is cached, or the hub has
    it). No MLX: huggingface_hub (mlx-lm's own download path) is asked directly."""
    try:
        import huggingface_hub as hub
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - mlx-lm depends on it
        return None
    try:
        if isinstance(hub.try_to_load_from_cache(hub_id, "config.json"), str):
            return None  # loaded from the cache without a network
    except Exception:  # a malformed id is the hub's to judge below
        pass
    if truthy(os.environ.get("HF_HUB_OFFLINE")):
        return "HF_HUB_OFFLINE is set and the model is not in the cache"
    try:
        hub.model_info(hub_id, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return "the repository is gated: log in (huggingface-cli login) and accept its terms"
    except RepositoryNotFoundError:
        return "the hub has no such repository (or it is private)"
    except Exception as exc:  # no network, a proxy, DNS: one line, no traceback
        log.info("hub lookup of %s failed: %r", hub_id, exc)
        return f"the hub cannot be reached ({type(exc).__name__})"
    return None


def gguf_problem(path: str) -> str | None:
    """Why the GGUF file at `path` cannot be served (None: it can), judged from its header
    alone (no tensor is read) by core/gguf_support's rule, the one the converter applies; so an
    unknown architecture or tensor type fails validation, not every line of a started batch."""
    import gguf  # the names of ggml's tensor types

    try:
        with open(path, "rb") as fh:
            header = scan_header(fh)
    except (OSError, HeaderError) as exc:
        return f"it cannot be read as GGUF: {exc}"
    names = {int(t): t.name for t in gguf.GGMLQuantizationType}
    return problem_of(summary_of(header, names))


def choose(name: str, rule: ModelRule) -> Chosen | Refused:
    """`choose_model` with the hub and GGUF headers really asked (validation)."""
    return choose_model(name, rule, hub_problem=hub_problem, gguf_problem=gguf_problem)


def chosen_override(name: str, rule: ModelRule) -> str:
    """The model `--model NAME` runs the whole file with: a model (or an alias of one) — never
    replaced by the serving model, as it was asked for by name. BatchError otherwise."""
    choice = choose(name, replace(rule, strict=True, pinned=False))
    if isinstance(choice, Chosen):
        return choice.model
    if choice.why is Why.UNKNOWN:
        detail = "use 'default', a local MLX folder, a .gguf file, a hub id (org/name) or an alias"
    else:
        detail = choice.message.removeprefix(not_supported(name)).strip()
    raise BatchError(f"model {name!r} cannot be resolved: {detail}")


def expected_model(body_model: object, override: str | None, rule: ModelRule) -> str | None:
    """The model a file whose first body names `body_model` would run with (the inbox's
    duplicate check, before validation): what validation would choose, the hub not asked (a
    hub id it refuses fails the batch, and failed batches are never duplicates)."""
    name = override if override is not None else body_model
    if not isinstance(name, str) or not name:
        return None
    choice = choose_model(name, rule, hub_problem=lambda _: None)
    return choice.model if isinstance(choice, Chosen) else None


def dedup_key(file_sha256: str, model: str | None) -> str:
    """What a batch stores as its `content_hash`: its file's content and the model it runs
    with, so the same file with another model is no duplicate."""
    return hashlib.sha256(f"{file_sha256}\0{model or ''}".encode()).hexdigest()


def serving_rule(settings: Settings, model: str) -> ModelRule:
    """`serve`'s rule: `model` is the one model it runs, so every alias must name it
    (ValueError, at start, where one does not)."""
    rule = rule_of(settings, serving=model, pinned=True)
    for name in rule.aliases:
        choice = choose_model(name, rule, hub_problem=lambda _: None)
        if isinstance(choice, Refused):
            raise ValueError(f"--model-alias {name}={rule.aliases[name]}: serve runs one model "
                             f"({model!r}, its --model); an alias must name it")  # fmt: skip
    return rule
