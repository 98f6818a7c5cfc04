"""Grammar-constrained decoding with llguidance: a JSON schema → a token mask per step.

Each distinct schema is compiled once (keyed by a hash of its canonical text) into a template
matcher; every request gets a cheap deep copy of it, so its state is its own. The cache of
templates is bounded by count and by an estimate of their bytes (llguidance does not say what a
compiled grammar holds; measured on SmolLM2's 49,152-token vocabulary, about 100 bytes of memory
per byte of schema text), and the schemas that failed to compile are remembered in a bounded LRU
of their own, so neither grows with the number of distinct schemas ever sent. One step's masks are
filled for all constrained rows in a single `LLExecutor` call (parallel, outside the GIL), and
applied to the logits on the device; unconstrained rows are left untouched.

Numbers are bounded (core/json_bounds.py): llguidance's JSON grammar lets a `number` run on
without end, so each sequence also gets a matcher of "any JSON whose numbers keep the bound", and
its mask is ANDed with the schema's. Where the schema itself asks for more (a range such as
[1e-22, 2e-22], which llguidance writes without an exponent) the AND comes out empty at some
step; the bound is then dropped for the rest of that sequence and the schema alone decides, so
decoding is never left stuck. (A `const` or `enum` number cannot ask for more: llguidance writes
it as float64's shortest text.)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NoReturn

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from batchmlx.core.json_bounds import NUMBER_BOUNDS, NumberBounds, bounded_json_lark

# Compact JSON the way json.dumps writes it: small models do not wander off into whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED_GRAMMARS = 256  # compiled schemas kept, at most (least recently used dropped)
MAX_GRAMMAR_CACHE_BYTES = 128 * 1024 * 1024  # their estimated memory, at most (the newest stays)
GRAMMAR_BYTES_PER_SCHEMA_BYTE = 100  # the estimate: memory per byte of canonical schema text
GRAMMAR_BASE_BYTES = 64 * 1024  # ... plus this per compiled schema
MAX_CACHED_ERRORS = 256  # schemas remembered as failing to compile (least recently used dropped)
MAX_ERROR_CHARS = 2000  # of one remembered compile error


class GrammarError(ValueError):
    """A schema llguidance cannot compile; the message names the unsupported keyword."""


@dataclass(slots=True)
class GrammarStats:
    compiled: int = 0  # distinct schemas compiled (cache misses)
    matchers: int = 0  # matchers handed out (one per constrained sequence)
    unbounded: int = 0  # sequences whose schema needed longer numbers than the bound allows
    cached_bytes: int = 0  # the estimated memory of the templates in the cache now


@dataclass(slots=True)
class _Template:
    matcher: llguidance.LLMatcher
    cost: int  # estimated bytes (estimated_bytes)


@dataclass(slots=True)
class Constraint:
    """One constrained sequence: its schema's matcher and the number bound's (None when off, or
    once the schema needed more than the bound allows)."""

    schema: llguidance.LLMatcher
    bound: llguidance.LLMatcher | None


def estimated_bytes(schema: str) -> int:
    """What a compiled schema is taken to cost in the cache's byte budget."""
    return GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_SCHEMA_BYTE * len(schema.encode())


def _key(schema: str) -> bytes:
    # a digest, not the text: a cache entry must not keep a large schema's text alive
    return hashlib.sha256(schema.encode()).digest()


class Grammars:
    """The compiled-grammar cache and the batched mask step of one engine."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None,
        number_bounds: NumberBounds | None = NUMBER_BOUNDS,
    ) -> None:
        self._source = tokenizer  # its Hugging Face tokenizer is read on first use (a
        # quick-loaded one loads transformers for it)
        self._eos = getattr(tokenizer, "eos_token_id", None)
        self.vocab_size = vocab_size
        self._lltok: llguidance.LLTokenizer | None = None  # built on first use (about 1 s)
        self._executor: llguidance.LLExecutor | None = None
        self._templates: OrderedDict[bytes, _Template] = OrderedDict()
        self._errors: OrderedDict[bytes, str] = OrderedDict()
        self._number_bounds = number_bounds  # None: numbers as long as the schema allows
        self._bound: llguidance.LLMatcher | None = None  # its template, built on first use
        self.stats = GrammarStats()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            import llguidance.hf  # imports transformers: only once a schema needs it

            hf = getattr(self._source, "_tokenizer", self._source)  # mlx_lm's TokenizerWrapper
            self._lltok = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self._eos
            )
        return self._lltok

    def check(self, schema: str) -> str | None:
        """None when `schema` compiles, else llguidance's reason (it names the keyword)."""
        try:
            self._template(schema)
        except GrammarError as exc:
            return str(exc)
        return None

    def matcher(self, schema: str) -> Constraint:
        """A fresh constraint for one sequence; raises GrammarError for a bad schema."""
        self.stats.matchers += 1
        template = self._template(schema)
        bound = self._bound_template()
        return Constraint(template.deep_copy(), None if bound is None else bound.deep_copy())

    def _bound_template(self) -> llguidance.LLMatcher | None:
        if self._number_bounds is not None and self._bound is None:
            lark = bounded_json_lark(self._number_bounds)
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            self._bound = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if self._bound.is_error():  # a defect of json_bounds, not of any request
                raise RuntimeError(f"the number bound grammar: {self._bound.get_error()}")
        return self._bound

    def _template(self, schema: str) -> llguidance.LLMatcher:
        key = _key(schema)
        if key in self._errors:
            self._errors.move_to_end(key)
            raise GrammarError(self._errors[key])
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            return template.matcher
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self.tokenizer
            )
        except ValueError as exc:  # not a JSON object at all
            is_error, messages = True, [str(exc)]
        if is_error:
            self._failed(key, "; ".join(messages) or "the schema cannot be compiled")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            self._failed(key, matcher.get_error())
        self.stats.compiled += 1
        self._keep(key, _Template(matcher, estimated_bytes(schema)))
        return matcher

    def _keep(self, key: bytes, template: _Template) -> None:
        """Cache a template, dropping the least recently used past either bound."""
        self._templates[key] = template
        self.stats.cached_bytes += template.cost
        while len(self._templates) > 1 and (
            len(self._templates) > MAX_CACHED_GRAMMARS
            or self.stats.cached_bytes > MAX_GRAMMAR_CACHE_BYTES
        ):
            _, old = self._templates.popitem(last=False)
            self.stats.cached_bytes -= old.cost

    def _failed(self, key: bytes, message: str) -> NoReturn:
        """Remember a schema's compile error (bounded) and raise it."""
        self._errors[key] = message[:MAX_ERROR_CHARS]
        while len(self._errors) > MAX_CACHED_ERRORS:
            self._errors.popitem(last=False)
        raise GrammarError(self._errors[key])

    @property
    def cached(self) -> tuple[int, int]:
        """(templates, remembered errors) in the caches now."""
        return len(self._templates), len(self._errors)

    def mask(self, logits: mx.array, rows: list[tuple[Constraint, int]]) -> mx.array:
        """logits [S, V] with each listed row (constraint, row index) limited to the tokens its
        grammar allows next; the other rows unchanged."""
        if not rows:
            return logits
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        n_rows, vocab = logits.shape
        bounded = [(c, j) for c, j in rows if c.bound is not None]
        # the bounds' masks go below the S rows, all filled in the one parallel call
        bitmask = allocate_token_bitmask(n_rows + len(bounded), self.tokenizer.vocab_size)
        fills = [(c.schema, j) for c, j in rows]
        fills += [(c.bound, n_rows + k) for k, (c, _) in enumerate(bounded)]
        fill_next_token_bitmask_par(self._executor, fills, bitmask)
        if bounded:
            at = np.array([j for _, j in bounded])
            both = bitmask[at] & bitmask[n_rows:]
            kept = both.any(axis=1)
            bitmask[at[kept]] = both[kept]
            for k in np.flatnonzero(~kept):  # the schema needs more than the bound: it wins
                bounded[k][0].bound = None
                self.stats.unbounded += 1
        return apply_bitmask(logits, bitmask[:n_rows], vocab)

    @staticmethod
    def advance(constraint: Constraint, token: int) -> bool:
        """Feed the sampled token; True when the grammar is complete (the sequence stops)."""
        constraint.schema.consume_token(token)
        if constraint.bound is not None and not constraint.bound.consume_token(token):
            constraint.bound = None  # a token the bound refused (not sampled under its mask)
        return Grammars.complete(constraint)

    @staticmethod
    def complete(constraint: Constraint) -> bool:
        """Whether the schema's grammar is complete (or its matcher failed): the sequence
        stops."""
        return constraint.schema.is_stopped() or constraint.schema.is_error()


_BITS = mx.arange(32, dtype=mx.uint32)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray, vocab: int) -> mx.array:
    """Set logits whose bit is 0 to -inf; token ids past the mask's width are disallowed."""
    words = mx.array(bitmask.view(np.uint32))  # [S, W]
    allowed = ((words[:, :, None] >> _BITS) & 1).reshape(words.shape[0], -1)  # [S, 32W]
    width = allowed.shape[1]
    if width >= vocab:
        allowed = allowed[:, :vocab]
    else:
        pad = mx.zeros((allowed.shape[0], vocab - width), dtype=allowed.dtype)
        allowed = mx.concatenate([allowed, pad], axis=1)
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))
