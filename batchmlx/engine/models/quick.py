"""A model folder batchmlx converted (the default model, a GGUF file), dense or quantized, loaded
without importing transformers: about 0.9 s of every start of a small job (mlx_lm's package
imports transformers and huggingface_hub through mlx_lm.utils, and AutoTokenizer takes another
0.2 s), where the job needs a llama module of mlx_lm, the `tokenizers` library and jinja2.

What it returns is what `mlx_lm.load` would: the same model class with the same weights, and a
tokenizer whose chat template renders, encodes and decodes as mlx-lm's TokenizerWrapper over
transformers does (the same jinja2 environment, the same `tokenizers` tokenizer underneath;
tests/engine/test_quick_load.py compares them). Anything else asked of the tokenizer (the
grammar's Hugging Face tokenizer, a streaming detokenizer, another keyword) loads that wrapper,
once, and asks it. Folders it does not know how to read exactly (another quantization, another
architecture, a template for thinking or a custom renderer) go through `mlx_lm.load`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import threading
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

# what mlx_lm.load reads that the quick load does not (an affine `quantization` it does read)
_OTHER_LOADS = ("quantization_config", "quantize_activations", "model_file")
# tokenizer_config.json keys that make mlx-lm's wrapper render or parse differently
_WRAPPER_KEYS = ("chat_template_type", "tool_parser_type", "tool_call_start", "response_format")
# transformers' own tag (assistant masks): its extension is not in the environment below
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_lock = threading.Lock()


def quick_loadable(folder: Path) -> bool:
    """Whether `folder` (one batchmlx wrote) loads here exactly as `mlx_lm.load` loads it."""
    try:
        config = json.loads((folder / "config.json").read_text())
        tok = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    template = tok.get("chat_template")
    return (
        config.get("model_type") == "llama"
        and not any(k in config for k in _OTHER_LOADS)
        and config.get("quantization", {}).get("mode", "affine") == "affine"
        and any(folder.glob("model*.safetensors"))
        and (folder / "tokenizer.json").is_file()
        and not (folder / "chat_template.jinja").exists()
        and tok.get("tokenizer_class") == "PreTrainedTokenizerFast"
        and tok.get("clean_up_tokenization_spaces") is False
        and not any(k in tok for k in _WRAPPER_KEYS)
        and isinstance(template, str)
        and "thinking" not in template
        and not _GENERATION_TAG.search(template)
    )


def load_quick(folder: Path, *, lazy: bool) -> tuple[Any, QuickTokenizer, dict[str, Any]]:
    """(model, tokenizer, config) of a `quick_loadable` folder, as `mlx_lm.load(folder,
    return_config=True, lazy=lazy)` gives them."""
    import mlx.core as mx

    defer_mlx_lm_init()
    from mlx_lm.models import llama

    config = _config(folder)
    weights: dict[str, Any] = {}
    for file in sorted(folder.glob("model*.safetensors")):
        loaded = mx.load(str(file))  # a safetensors file: a dict of arrays
        assert isinstance(loaded, dict)
        weights.update(loaded)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = model.sanitize(weights)
    if "quantization" in config:
        _quantize(model, config["quantization"], weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    return model, QuickTokenizer(folder, config.get("eos_token_id")), config


def _quantize(model: Any, quantization: dict[str, Any], weights: dict[str, Any]) -> None:
    """The layers stored quantized made QuantizedLinear/QuantizedEmbedding, as mlx_lm.load
    makes them: a layer's own entry, else the default where the layer has `scales`."""
    import mlx.nn as nn

    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        if path in quantization:
            entry: dict[str, Any] = quantization[path]
            return entry
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                mode=quantization.get("mode", "affine"), class_predicate=predicate)  # fmt: skip


def _config(folder: Path) -> dict[str, Any]:
    """config.json with generation_config.json's eos_token_id over it (mlx_lm's load_config)."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    generation = folder / "generation_config.json"
    if generation.exists():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id", False)
        except ValueError:
            eos = False
        if eos:
            config["eos_token_id"] = eos
    return config


def defer_mlx_lm_init() -> None:
    """Let `mlx_lm.models.*` be imported without running mlx_lm's package __init__ (which
    imports transformers): the package module is made, not run, and runs the first time any
    of its own names is read (`mlx_lm.load`, `from mlx_lm import generate`), so code that uses
    the package sees it whole. Nothing happens where mlx_lm is imported already."""
    with _lock:
        if "mlx_lm" in sys.modules:
            return
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or spec.loader is None:
            return
        package = importlib.util.module_from_spec(spec)
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # as mlx_lm's __init__ sets it
        loader = spec.loader
        running = threading.RLock()

        def __getattr__(name: str) -> Any:
            with running:
                if package.__dict__.get("__getattr__") is __getattr__:
                    del package.__dict__["__getattr__"]
                    loader.exec_module(package)
            try:
                return package.__dict__[name]
            except KeyError:
                raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

        package.__getattr__ = __getattr__  # type: ignore[method-assign]
        sys.modules["mlx_lm"] = package


class QuickTokenizer:
    """The tokenizer of a `quick_loadable` folder: chat template, encode, decode and the EOS
    ids without transformers; every other attribute from mlx-lm's TokenizerWrapper, loaded
    on first need."""

    def __init__(self, folder: Path, eos_token_ids: int | Iterable[int] | None) -> None:
        import tokenizers

        self._folder = folder
        self._eos_arg = eos_token_ids
        self._full: Any = None
        self._full_lock = threading.Lock()
        self._tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self._special = _special_tokens(folder, config)
        self._template = _compile_template(config["chat_template"])
        eos = self._special.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos else None
        ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
        self.eos_token_ids = set(ids)
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        self.chat_template: str = config["chat_template"]

    def apply_chat_template(self, *args: Any, tokenize: bool = True, **kwargs: Any) -> Any:
        """As mlx-lm's wrapper renders a list of plain messages (enable_thinking=False: the
        vocabulary has no think tokens, and the template does not read it); any other call
        goes to that wrapper."""
        if tokenize or len(args) != 1 or set(kwargs) - {"add_generation_prompt"}:
            return self.wrapper.apply_chat_template(*args, tokenize=tokenize, **kwargs)
        messages = args[0]
        if not isinstance(messages, list | tuple) or not all(
            isinstance(m, dict) and all(type(v) is str for v in m.values()) for m in messages
        ):
            return self.wrapper.apply_chat_template(*args, tokenize=tokenize, **kwargs)
        return self._template.render(
            messages=[dict(m) for m in messages], tools=None, documents=None,
            add_generation_prompt=kwargs.get("add_generation_prompt", False),
            **{**self._special, "enable_thinking": False},
        )  # fmt: skip

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):
            return self.wrapper.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        if kwargs:
            return self.wrapper.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    @property
    def wrapper(self) -> Any:
        """mlx-lm's TokenizerWrapper over transformers for this folder, as `mlx_lm.load`
        makes it (loaded once, on first need)."""
        with self._full_lock:
            if self._full is None:
                import mlx_lm

                mlx_lm.load  # noqa: B018 - the whole package, its __init__ run where deferred
                from mlx_lm.utils import load_tokenizer

                self._full = load_tokenizer(self._folder, eos_token_ids=self._eos_arg)
            return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_full_lock", "_folder", "_eos_arg"):
            raise AttributeError(name)
        return getattr(self.wrapper, name)


def _special_tokens(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The special tokens a chat template sees by name (transformers' special_tokens_map)."""
    found: dict[str, str] = {}
    sources = [config]
    path = folder / "special_tokens_map.json"
    if path.is_file():
        sources.append(json.loads(path.read_text()))
    for source in sources:
        for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                    "cls_token", "mask_token"):  # fmt: skip
            value = source.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def _compile_template(template: str) -> Any:
    """The jinja2 environment transformers renders chat templates in (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, its tojson, raise_exception and strftime_now)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
