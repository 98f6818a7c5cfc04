"""The one rule that maps a request's `model` name to the model that answers it, for every path
(`submit`, the inbox, the HTTP API's batches and online routes). Pure: whether a hub id can be
fetched is asked of the caller (`hub_problem`), so no network, MLX or SQL here. docs/models.md
tells it to users.

In order: an alias (`--model-alias NAME=MODEL`) sends its name to its model; a name of the
serving model answers with it; a name of another model batchmlx can load (a local MLX folder, a
.gguf file, a hub id) is that model, where this process may load other models (not `serve`,
which runs one); any other name (`gpt-4o-mini`) is answered by the serving model, or refused
with OpenAI's `model_not_found` under `--strict-models`. A hub id that cannot be fetched is
refused in either mode: the user asked for that model, and replacing it silently would hide a
missing download that would otherwise fail every line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from batchmlx.core.models import DEFAULT_MODEL_ALIAS, ModelSpec, resolve_model

STRICT_MODELS_ENV = "BATCHMLX_STRICT_MODELS"  # 1/true/yes: unknown names are refused
MODEL_ALIASES_ENV = "BATCHMLX_MODEL_ALIASES"  # "NAME=MODEL,NAME=MODEL"

# Why a hub id cannot be fetched (None: it can); the caller's, as it touches cache and network.
HubProblem = Callable[[str], "str | None"]
# Why a .gguf file cannot be served (None: it can), from its header; the caller's (file I/O).
FileProblem = Callable[[str], "str | None"]


class Via(Enum):
    """How a name found its model (what logs and tests look at)."""

    NAMED = "named"  # the name is a model this process serves or loads
    ALIAS = "alias"  # the alias map sent the name to a model
    FALLBACK = "fallback"  # no model by that name here: the serving model answers


@dataclass(frozen=True, slots=True)
class ModelRule:
    serving: str = DEFAULT_MODEL_ALIAS  # answers names that are no model here
    aliases: Mapping[str, str] = field(default_factory=dict)  # name -> model string
    strict: bool = False  # refuse names that are no model here instead of serving them
    # one model runs here (`serve`'s worker): names of other models are not loaded, so a
    # client of the HTTP API never makes the server read a path or download a repository
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class Chosen:
    model: str  # the model string the batch stores and the worker loads
    via: Via


class Why(Enum):
    """Why a name is refused."""

    UNKNOWN = "unknown"  # no model by that name, and the rule is strict
    NO_FILE = "no_file"  # a path with no model there
    UNFETCHABLE = "unfetchable"  # a hub model neither cached nor fetchable
    BAD_ALIAS = "bad_alias"  # its alias names a model that cannot run here
    UNSERVABLE = "unservable"  # a .gguf file of an architecture or type batchmlx cannot load


@dataclass(frozen=True, slots=True)
class Refused:
    message: str  # OpenAI's sentence first, then why, or what would be accepted
    why: Why


def not_supported(name: str) -> str:
    """OpenAI's validation message for a model its Batch API cannot serve (recorded in
    llama-stack's tests/integration/batches/test_batches_errors.py)."""
    return f"The provided model {name!r} is not supported by the Batch API."


def choose_model(
    name: str, rule: ModelRule, *, hub_problem: HubProblem, gguf_problem: FileProblem | None = None
) -> Chosen | Refused:
    """The model that answers `name` under `rule`, or why it is refused. gguf_problem: asked of
    a .gguf file this process would load (None: not asked)."""
    target = rule.aliases.get(name)
    if target is not None:
        return _alias(name, target, rule, hub_problem, gguf_problem)
    spec = resolve_model(name, cache_dir=Path())
    if spec is not None and _same(spec, rule.serving):
        return Chosen(rule.serving, Via.NAMED)
    if not rule.pinned:
        if spec is not None:
            problem = hub_problem(name) if spec.kind == "hub" else None
            if problem is not None:
                return Refused(_unfetchable(name, name, problem), Why.UNFETCHABLE)
            unservable = _unservable(name, spec, gguf_problem)
            return unservable or Chosen(name, Via.NAMED)
        if _looks_like_path(name):  # a model asked for by its place: never replaced silently
            return Refused(f"{not_supported(name)} There is no MLX model folder (with a "
                           f"config.json) or .gguf file at {name!r}.", Why.NO_FILE)  # fmt: skip
    if rule.strict:
        return Refused(f"{not_supported(name)} {served_hint(rule)}", Why.UNKNOWN)
    return Chosen(rule.serving, Via.FALLBACK)


def served_hint(rule: ModelRule) -> str:
    """What a refused name could have been instead."""
    names = [_shown(rule.serving)] + [repr(a) for a in sorted(rule.aliases)]
    if rule.pinned:
        what = f"This server serves {_listed(names)}"
    else:
        what = f"Use {_listed(names)}, a local MLX folder, a .gguf file or a hub id (org/name)"
    return (
        f"{what}; map another name with --model-alias NAME=MODEL, or serve every unknown name "
        f"with {rule.serving!r} by leaving out --strict-models."
    )


def parse_aliases(items: Iterable[str], *, what: str = "--model-alias") -> dict[str, str]:
    """`NAME=MODEL` items as a map (a later one wins); ValueError names a malformed one."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, target = item.partition("=")
        name, target = name.strip(), target.strip()
        if not sep or not name or not target:
            raise ValueError(f"{what} expects NAME=MODEL, got {item!r}")
        if resolve_model(target, cache_dir=Path()) is None:
            raise ValueError(
                f"{what} {item!r}: {target!r} is no model ('default', a local MLX folder, "
                "a .gguf file or a hub id)"
            )
        out[name] = target
    return out


def split_aliases(text: str) -> list[str]:
    """The items of $BATCHMLX_MODEL_ALIASES (commas or new lines between them)."""
    return [part for chunk in text.splitlines() for part in chunk.split(",") if part.strip()]


def truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def _alias(
    name: str, target: str, rule: ModelRule, hub_problem: HubProblem,
    gguf_problem: FileProblem | None,
) -> Chosen | Refused:  # fmt: skip
    spec = resolve_model(target, cache_dir=Path())
    if spec is None:  # parse_aliases refuses these; a folder may have gone since
        return Refused(
            f"{not_supported(name)} Its alias names {target!r}, which is no model.", Why.BAD_ALIAS
        )
    if _same(spec, rule.serving):
        return Chosen(rule.serving, Via.ALIAS)
    if rule.pinned:
        return Refused(f"{not_supported(name)} Its alias names {target!r}, which this server "
                       f"does not run; it serves {rule.serving!r}.", Why.BAD_ALIAS)  # fmt: skip
    problem = hub_problem(target) if spec.kind == "hub" else None
    if problem is not None:
        return Refused(_unfetchable(name, target, problem), Why.UNFETCHABLE)
    return _unservable(name, spec, gguf_problem) or Chosen(target, Via.ALIAS)


def _unservable(name: str, spec: ModelSpec, gguf_problem: FileProblem | None) -> Refused | None:
    """A .gguf file whose header says it cannot be served: refused before the batch starts."""
    if spec.kind != "gguf" or gguf_problem is None:
        return None
    problem = gguf_problem(spec.source)
    if problem is None:
        return None
    return Refused(f"{not_supported(name)} The GGUF file {Path(spec.source).name!r} cannot be "
                   f"served: {problem}.", Why.UNSERVABLE)  # fmt: skip


def _unfetchable(name: str, hub_id: str, problem: str) -> str:
    what = "It names" if hub_id == name else "Its alias names"
    return (
        f"{not_supported(name)} {what} the Hugging Face hub model {hub_id!r}, which is not in "
        f"the local cache and cannot be fetched: {problem}. Fetch it once where there is a "
        "network (it is then loaded from the cache), or name a local model."
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.lower().endswith(".gguf")


def _shown(model: str) -> str:
    """'default' (SmolLM2-135M-Instruct): the model string, and the name bodies give it."""
    spec = resolve_model(model, cache_dir=Path())
    shown = "" if spec is None or spec.name == model else f" ({spec.name})"
    return f"{model!r}{shown}"


def _same(spec: ModelSpec, serving: str) -> bool:
    """Whether `spec` is the serving model (by its alias, its shown name or its source)."""
    other = resolve_model(serving, cache_dir=Path())
    return other is not None and (spec.kind, spec.source) == (other.kind, other.source)


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
