"""engine/models/quick.py: a folder batchmlx converted (dense or quantized), loaded without
transformers, gives what `mlx_lm.load` gives: the same weights and config, the same chat
template text, the same token ids both ways and the same EOS ids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from batchmlx.engine.models import quick

REPO = Path(__file__).resolve().parents[2]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2? <|im_start|> ünïcode 日本 \n\n  spaces  {{ x }} {% y %}"},
    ],
    [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": ""},
    ],
]


def test_a_converted_dense_llama_folder_is_quick_loadable(tiny_model_dir: Path) -> None:
    assert quick.quick_loadable(tiny_model_dir)


@pytest.mark.parametrize(
    "change",
    [
        {"config": {"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}},
        {"config": {"quantization_config": {"quant_method": "awq"}}},
        {"config": {"model_type": "qwen2"}},
        {"tokenizer": {"chat_template_type": "x"}},
        {"tokenizer": {"chat_template": "{% generation %}{{ messages }}{% endgeneration %}"}},
        {"tokenizer": {"chat_template": "{% if enable_thinking %}x{% endif %}"}},
        {"tokenizer": {"clean_up_tokenization_spaces": True}},
    ],
)
def test_what_it_cannot_read_exactly_goes_to_mlx_lm(
    tiny_model_dir: Path, tmp_path: Path, change: dict
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    for name, extra in change.items():
        path = folder / f"{name}_config.json" if name == "tokenizer" else folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    assert not quick.quick_loadable(folder)


def _assert_same_parameters(model, ref_model) -> None:
    ours = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(ref_model.parameters()))
    assert ours.keys() == theirs.keys()
    for k, v in ours.items():
        assert v.dtype == theirs[k].dtype and mx.array_equal(v, theirs[k]).item(), k


def test_it_loads_what_mlx_lm_loads(tiny_model_dir: Path) -> None:
    import mlx_lm

    model, tok, config = quick.load_quick(tiny_model_dir, lazy=False)
    ref_model, ref_tok, ref_config = mlx_lm.load(str(tiny_model_dir), return_config=True)
    assert type(model) is type(ref_model) and config == ref_config
    _assert_same_parameters(model, ref_model)
    assert (tok.eos_token_id, tok.eos_token_ids) == (ref_tok.eos_token_id, ref_tok.eos_token_ids)
    for chat in CHATS:
        for prompt in (True, False):
            text = tok.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            assert text == ref_tok.apply_chat_template(
                chat, add_generation_prompt=prompt, tokenize=False
            )
            for special in (True, False):
                ids = tok.encode(text, add_special_tokens=special)
                assert ids == ref_tok.encode(text, add_special_tokens=special)
            assert tok.decode(ids) == ref_tok.decode(ids)
    assert tok.encode("plain text") == ref_tok.encode("plain text")
    for i in range(0, ref_tok.vocab_size, 97):  # every special token among them
        assert tok.decode([i]) == ref_tok.decode([i]), i
    assert tok.vocab_size == ref_tok.vocab_size  # anything else: mlx-lm's wrapper's answer


def test_a_quantized_gguf_folder_loads_as_mlx_lm_loads_it(tmp_path: Path) -> None:
    """A GGUF whose matrices keep their bits (Q4_1, Q8_0 and Q4_K layers: mixed bits, an F16
    embedding) converts into a folder the quick load reads, into the same quantized layers and
    the same arrays as mlx_lm.load."""
    from dataclasses import replace

    import gguf
    import mlx_lm
    import numpy as np

    from batchmlx.engine.models.gguf import convert_gguf
    from tests.engine.test_gguf_types import CONFIG, random_blocks
    from tests.gguf_files import CASES, hf_weights, random_model, write_gguf

    rng = np.random.default_rng(0)
    types = {"attn": gguf.GGMLQuantizationType.Q4_1, "ffn_down": gguf.GGMLQuantizationType.Q4_K}

    def quantize(name: str, value: np.ndarray):
        if value.ndim != 2:
            return None
        if name.startswith("token_embd"):
            return value.astype(np.float16), gguf.GGMLQuantizationType.F16
        qtype = next((t for k, t in types.items() if k in name), gguf.GGMLQuantizationType.Q8_0)
        return random_blocks(qtype, value.shape, rng), qtype

    case = replace(CASES["llama"], config=CONFIG)
    path = write_gguf(tmp_path / "q.gguf", case, hf_weights(random_model(CONFIG)), quantize)
    folder = convert_gguf(path, tmp_path / "folder")
    assert quick.quick_loadable(folder)
    model, _, config = quick.load_quick(folder, lazy=False)
    ref_model, _, ref_config = mlx_lm.load(str(folder), return_config=True)
    assert config == ref_config and config["quantization"]["bits"] == 4  # the most common
    layers = dict(model.named_modules())
    for name, ref in ref_model.named_modules():
        assert type(layers[name]) is type(ref), name
        assert getattr(layers[name], "bits", None) == getattr(ref, "bits", None), name
    assert layers["model.layers.0.self_attn.q_proj"].bits == 4
    assert layers["model.layers.0.mlp.up_proj"].bits == 8
    _assert_same_parameters(model, ref_model)


def test_it_imports_no_transformers_until_asked(tiny_model_dir: Path) -> None:
    """In a fresh process: the model and tokenizer without transformers; mlx_lm whole again on
    its first use (its __init__ run), and the wrapper's answers when asked for more."""
    code = f"""
import sys
from pathlib import Path
from batchmlx.engine.models import quick
model, tok, _ = quick.load_quick(Path({str(tiny_model_dir)!r}), lazy=True)
tok.apply_chat_template([{{"role": "user", "content": "hi"}}], add_generation_prompt=True,
                        tokenize=False)
tok.decode(tok.encode("hi"))
assert "transformers" not in sys.modules, "transformers imported"
import mlx_lm
assert callable(mlx_lm.load) and mlx_lm.__version__
assert tok.get_vocab()["<|im_end|>"] == tok.eos_token_id
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
