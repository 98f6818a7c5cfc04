"""What a GGUF file must hold to be served (core/gguf_support.py), and the model rule asking it
of a .gguf file before a batch starts (core/model_rule.py): pure, the header given."""

from __future__ import annotations

from pathlib import Path

from batchmlx.core.gguf_support import GGUFSummary, gguf_problem
from batchmlx.core.model_rule import Chosen, ModelRule, Refused, Via, Why, choose_model

GOOD = GGUFSummary("qwen3", {"Q4_K": "blk.0.attn_q.weight", "F32": "output_norm.weight"},
                   "gpt2", None)  # fmt: skip


def summary(**changes) -> GGUFSummary:
    return GGUFSummary(**{**{f: getattr(GOOD, f) for f in GOOD.__slots__}, **changes})


def test_a_servable_header_has_no_problem() -> None:
    assert gguf_problem(GOOD) is None
    assert gguf_problem(summary(tokenizer="llama", rope_scaling="yarn")) is None


def test_each_problem_names_what_is_missing() -> None:
    arch = gguf_problem(summary(architecture="rwkv7"))
    assert arch == ("its architecture 'rwkv7' is not one batchmlx loads from GGUF (gemma2, "
                    "gemma3, granite, llama, olmo2, olmoe, phi3, qwen2, qwen3, qwen3moe, "
                    "smollm3)")  # fmt: skip
    types = gguf_problem(summary(tensor_types={"IQ2_XS": "blk.3.ffn_up.weight", "TQ1_0": "x",
                                               "Q4_K": "y"}))  # fmt: skip
    assert types is not None
    assert types.startswith("its tensor type IQ2_XS ('blk.3.ffn_up.weight' and others) is not")
    assert gguf_problem(summary(tokenizer="bert")) == (
        "its tokenizer 'bert' is not one batchmlx reads (gpt2, llama)"
    )
    assert gguf_problem(summary(pre_tokenizer="gpt-4o")) == (
        "its pre-tokenizer 'gpt-4o' is not one batchmlx reads (dbrx, default, gpt-2, llama-bpe, "
        "llama3, olmo, qwen2, refact, smaug-bpe, smollm, starcoder)"
    )
    assert gguf_problem(summary(tokenizer="llama", pre_tokenizer="gpt-4o")) is None  # BPE only
    moe = gguf_problem(summary(unknown_tensor="blk.0.ffn_gate_inp.weight"))
    assert moe == ("its tensor 'blk.0.ffn_gate_inp.weight' is not one batchmlx maps to a model "
                   "(a mixture of experts' or another layer's)")  # fmt: skip
    rope = gguf_problem(summary(rope_scaling="longrope"))
    assert rope is not None and rope.startswith("its RoPE scaling 'longrope' is not one")


def test_known_tensor_names() -> None:
    from batchmlx.core.gguf_support import first_unknown, known_tensor

    for name in ("token_embd.weight", "output.weight", "rope_freqs.weight",
                 "blk.12.attn_q.bias", "blk.0.post_ffw_norm.weight"):  # fmt: skip
        assert known_tensor(name), name
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight", "v.blk.0.attn_q.weight",
                 "mm.0.weight", "blk.attn_q.weight"):  # fmt: skip
        assert not known_tensor(name), name
    assert first_unknown(["output.weight", "blk.1.ffn_up_exps.weight", "x"]) == (
        "blk.1.ffn_up_exps.weight"
    )
    # a mixture of experts' router and experts: in the architectures whose model has them only
    # (Mixtral's files say "llama": refused at submit, not at the load)
    experts = ["blk.0.ffn_gate_inp.weight", "blk.3.ffn_gate_exps.weight",
               "blk.3.ffn_up_exps.weight", "blk.3.ffn_down_exps.weight"]  # fmt: skip
    for arch in ("qwen3moe", "olmoe"):
        assert first_unknown(["token_embd.weight", *experts], arch) is None
    assert first_unknown(experts, "llama") == "blk.0.ffn_gate_inp.weight"
    assert not known_tensor("blk.0.ffn_gate_inp_shexp.weight", "qwen3moe")  # shared experts
    assert not known_tensor("blk.ffn_gate_exps.weight", "qwen3moe")


def test_the_rule_asks_a_gguf_file_and_refuses_it(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    asked: list[str] = []

    def problem(path: str) -> str | None:
        asked.append(path)
        return "its architecture 'rwkv7' is not one batchmlx loads from GGUF (…)"

    choice = choose_model(str(model), ModelRule(), hub_problem=lambda _: None,
                          gguf_problem=problem)  # fmt: skip
    assert asked == [str(model.resolve())]
    assert isinstance(choice, Refused) and choice.why is Why.UNSERVABLE
    assert choice.message == (
        f"The provided model {str(model)!r} is not supported by the Batch API. The GGUF file "
        "'m.gguf' cannot be served: its architecture 'rwkv7' is not one batchmlx loads from "
        "GGUF (…)."
    )
    alias = ModelRule(aliases={"gpt-4o-mini": str(model)})
    refused = choose_model("gpt-4o-mini", alias, hub_problem=lambda _: None, gguf_problem=problem)
    assert isinstance(refused, Refused) and refused.why is Why.UNSERVABLE
    fine = choose_model(str(model), ModelRule(), hub_problem=lambda _: None,
                        gguf_problem=lambda _: None)  # fmt: skip
    assert fine == Chosen(str(model), Via.NAMED)
    assert choose_model(str(model), ModelRule(), hub_problem=lambda _: None) == fine  # not asked


def test_scan_header_reads_keys_skips_arrays_and_refuses_junk() -> None:
    import io
    import struct

    import pytest

    from batchmlx.core.gguf_support import HeaderError, scan_header

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    body = (
        b"GGUF" + struct.pack("<IQQ", 3, 1, 3)
        + string("general.architecture") + struct.pack("<I", 8) + string("qwen3")
        + string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + string("a")
        + string("bc")
        + string("qwen3.block_count") + struct.pack("<II", 4, 28)
        + string("blk.0.attn_q.weight") + struct.pack("<IQQIQ", 2, 256, 64, 12, 0)
    )  # fmt: skip
    header = scan_header(io.BytesIO(body))
    assert header.values == {"general.architecture": "qwen3", "qwen3.block_count": 28}
    assert header.tensor_types == {"blk.0.attn_q.weight": 12}
    for junk, words in ((b"PK\x03\x04", "magic"), (body[:40], "ends early"),
                        (b"GGUF" + struct.pack("<I", 7), "version 7")):  # fmt: skip
        with pytest.raises(HeaderError, match=words):
            scan_header(io.BytesIO(junk))
