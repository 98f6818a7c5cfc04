"""A GGUF file batchmlx cannot serve is refused when the batch is submitted, naming what it
lacks (core/gguf_support.py), never accepted and then failed line by line: an unknown
architecture, an unknown tensor type, through `submit --model FILE.gguf` and through a body's
`model` naming the file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from openai.types import Batch

from tests.e2e.helpers import chat_body, describe, make_cli, request_line, write_jsonl
from tests.gguf_files import CASES, hf_weights, random_model, write_gguf


def _weights() -> dict[str, np.ndarray]:
    return hf_weights(random_model(CASES["llama"].config))


def test_unknown_architecture_is_refused_at_submit(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    model = write_gguf(tmp_path / "m.gguf", CASES["llama"], _weights(), architecture="mamba")
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    proc = cli("submit", path, "--model", model)
    assert proc.returncode != 0, describe(proc)
    assert "its architecture 'mamba' is not one batchmlx loads from GGUF" in proc.stderr
    assert "llama, olmo2, olmoe, phi3" in proc.stderr
    assert cli.json("list") == []


def test_unknown_tensor_type_is_refused_at_validation(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)

    def iq(name: str, value: np.ndarray):
        if name != "blk.0.attn_v.weight":
            return None
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
        raw = np.zeros((value.shape[0], value.shape[1] // block * size), np.uint8)
        return raw, gguf.GGMLQuantizationType.IQ4_NL

    model = write_gguf(tmp_path / "m.gguf", CASES["llama"], _weights(), quantize=iq)
    path = write_jsonl(tmp_path / "one.jsonl",
                       [request_line("r", chat_body("hi", model=str(model)))])  # fmt: skip
    proc = cli("submit", path, "--json")
    assert proc.returncode == 1, describe(proc)
    batch = Batch.model_validate_json(proc.stdout)
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    err = batch.errors.data[0]
    assert err.code == "model_not_found" and err.param == "body.model"
    assert "its tensor type IQ4_NL ('blk.0.attn_v.weight') is not one batchmlx reads" in (
        err.message or ""
    )


def test_a_mixture_of_experts_llama_file_is_refused_at_submit(tmp_path: Path) -> None:
    """Mixtral-style files say `llama` but carry a router and experts: named, not accepted."""
    cli = make_cli(tmp_path)
    weights = {**_weights(), "model.layers.0.block_sparse_moe.gate.weight":
               np.zeros((4, 64), np.float32)}  # fmt: skip
    model = write_gguf(tmp_path / "moe.gguf", CASES["llama"], weights)
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    proc = cli("submit", path, "--model", model)
    assert proc.returncode != 0, describe(proc)
    assert "its tensor 'blk.0.ffn_gate_inp.weight' is not one batchmlx maps" in proc.stderr
