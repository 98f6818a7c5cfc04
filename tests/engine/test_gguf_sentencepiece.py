"""A SentencePiece vocabulary (tokenizer.ggml.model = "llama": pieces, scores, token types)
becomes a tokenizer that splits as llama.cpp's SPM tokenizer does: the best-scored merges
first, "▁" for spaces with one prepended, unknown characters as <0xNN> byte pieces."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from batchmlx.engine.models.gguf.tokenizer import spm_merges, write_tokenizer

S = "\u2581"
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = [S, "a", "b", "c", f"{S}a", "ab", f"{S}ab", "bc", f"{S}abc"]
SCORES = [-1.0, -2.0, -2.0, -2.0, -3.0, -4.0, -5.0, -3.5, -6.0]
TOKENS = ["<unk>", "<s>", "</s>", *BYTES, *PIECES]
TYPES = [2, 3, 3, *[6] * 256, *[1] * len(PIECES)]


def _meta(**extra) -> dict:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, *[0.0] * 256, *SCORES],
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
        "{% endfor %}",
        **extra,
    }


def ids(*pieces: str) -> list[int]:
    return [TOKENS.index(p) for p in pieces]


def test_merges_follow_the_scores() -> None:
    merges = spm_merges(PIECES, SCORES)
    # "▁a" (-3) before "bc" (-3.5) before "ab" (-4) before "▁ab" (-5), "▁abc" (-6) last
    assert merges.index((S, "a")) < merges.index(("b", "c")) < merges.index(("a", "b"))
    assert merges.index(("a", "b")) < merges.index((S + "a", "b")) < merges.index((S + "ab", "c"))


@pytest.fixture
def tokenizer(tmp_path: Path):
    from transformers import PreTrainedTokenizerFast

    write_tokenizer(_meta(), tmp_path, context_length=64)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<s>" and config["add_bos_token"] is True
    return PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                   bos_token="<s>", eos_token="</s>")  # fmt: skip


def test_encodes_as_sentencepiece(tokenizer) -> None:
    # "abc": "▁a" merges first (-3), then "bc" (-3.5), then "▁a"+"bc" = "▁abc" (as llama.cpp's
    # SPM: the best-scored pair whose join is a piece, until none is)
    assert tokenizer.encode("abc") == [1, *ids(f"{S}abc")]
    assert tokenizer.encode("cab") == [1, *ids(S, "c", "ab")]  # no "▁c" piece
    assert tokenizer.encode("ab ab") == [1, *ids(f"{S}ab", f"{S}ab")]
    # "é" is no piece: its UTF-8 bytes as byte pieces
    assert tokenizer.encode("é") == [1, *ids(S, "<0xC3>", "<0xA9>")]
    assert tokenizer.encode("</s>", add_special_tokens=False) == [2]


def test_decodes_back(tokenizer) -> None:
    for text in ("abc", "ab ab", "é a", "cab  ba"):
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_no_space_prefix_when_the_file_says_so(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    write_tokenizer(_meta(**{"tokenizer.ggml.add_space_prefix": False,
                             "tokenizer.ggml.add_bos_token": False}), tmp_path,
                    context_length=64)  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert tok.encode("ab ab") == ids("ab", f"{S}ab")


def test_a_sentencepiece_gguf_loads_with_its_tokenizer(tmp_path: Path) -> None:
    """A llama file with a SentencePiece vocabulary (as Llama 2 and Mistral files have),
    through the real loader: the tokenizer adds BOS and splits as above, the model answers."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model
    from tests.gguf_files import CASES, hf_weights, random_model, write_gguf

    case = CASES["llama"]
    config = {**case.config, "vocab_size": len(TOKENS)}
    meta = _meta()

    def spm(w) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(TOKENS)
        w.add_token_scores(meta["tokenizer.ggml.scores"])
        w.add_token_types(TYPES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_chat_template(meta["tokenizer.chat_template"])

    path = write_gguf(tmp_path / "spm.gguf", replace(case, config=config),
                      hf_weights(random_model(config)), tokenizer=spm)  # fmt: skip
    spec = resolve_model(str(path), cache_dir=tmp_path / "cache")
    loaded = load_model(spec, cache_dir=tmp_path / "cache", dtype="float32")
    tok = loaded.tokenizer
    assert tok.encode("ab ab") == [1, *ids(f"{S}ab", f"{S}ab")]
    assert tok.decode(tok.encode("é cab")[1:]) == "é cab"
    rendered = tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False)
    assert rendered == "<s>abc"
    assert 2 in loaded.eos_token_ids
