"""benchmarks/fidelity.py's pure parts: llama-perplexity's chunking and the KLD / same-top /
perplexity arithmetic, and the parsing of llama-perplexity's output and base file."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.fidelity import Tally, chunks_of, log_softmax, read_text, scored, tokenize
from benchmarks.peers.perplexity import base_tokens, parse_base, parse_kld


def test_chunks_are_consecutive_runs_tail_dropped() -> None:
    tokens = list(range(10, 31))  # 21 tokens
    assert chunks_of(tokens, 4) == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21],
                                    [22, 23, 24, 25], [26, 27, 28, 29]]  # fmt: skip
    assert chunks_of(tokens, 4, max_chunks=2) == [[10, 11, 12, 13], [14, 15, 16, 17]]


def test_bos_replaces_each_chunks_first_token() -> None:
    assert chunks_of(list(range(8)), 4, bos=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]


def test_needs_two_chunks() -> None:
    with pytest.raises(ValueError, match="at least"):
        chunks_of(list(range(7)), 4)


def test_scored_positions_are_the_second_half_less_the_last() -> None:
    assert list(scored(8)) == [4, 5, 6]
    assert len(scored(512)) == 255  # llama.cpp: n_ctx - 1 - n_ctx/2


class _Tok:
    def __init__(self, bos: bool) -> None:
        self.bos = bos

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [ord(c) for c in text]
        return [1, *ids] if add_special_tokens and self.bos else ids


def test_tokenize_finds_the_bos_the_tokenizer_adds() -> None:
    assert tokenize(_Tok(bos=False), "ab") == ([97, 98], None)
    assert tokenize(_Tok(bos=True), "ab") == ([1, 97, 98], 1)


def test_read_text_drops_one_trailing_newline(tmp_path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("a\nb\n\n")
    assert read_text(f) == "a\nb\n"


def test_log_softmax_normalizes() -> None:
    lp = log_softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 1000.0, 0.0]], dtype=np.float32))
    assert np.allclose(np.exp(lp).sum(-1), 1.0)
    assert np.allclose(lp[1, :2], math.log(0.5))


def test_tally_of_the_reference_itself() -> None:
    ref = np.array([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    t = Tally()
    t.add(ref, ref, np.array([0, 2]))
    got = t.summary()
    assert got["positions"] == 2 and got["same_top"] == 1.0 and got["kld_mean"] == 0.0
    assert got["ppl"] == pytest.approx(got["ppl_float32"])


def test_tally_arithmetic_on_a_tiny_case() -> None:
    p = np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    q = np.array([[0.25, 0.5, 0.25], [0.2, 0.2, 0.6]])
    targets = np.array([1, 2])
    t = Tally()
    t.add(np.log(p), np.log(q) + 3.0, targets)  # logits: any shift is the same distribution
    got = t.summary()
    kl = [(p[i] * np.log(p[i] / q[i])).sum() for i in range(2)]
    assert got["kld_mean"] == pytest.approx(np.mean(kl))
    assert got["same_top"] == 0.5  # row 0's argmax moved (0 -> 1), row 1's did not
    assert got["ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.6)) / 2))
    assert got["ppl_float32"] == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.7)) / 2))


def test_llama_perplexity_output_parsed() -> None:
    base = ("perplexity: calculating perplexity over 32 chunks, n_ctx=512, batch_size=2048, "
            "n_seq=4\n[1]9.1,[2]9.3,\nFinal estimate: PPL = 20.2524 +/- 0.51234\n")  # fmt: skip
    assert parse_base(base) == (32, 20.2524)
    kld = (
        "kl_divergence: computing over 32 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
        "Mean PPL(Q)                   :  20.612345 ±   0.52\n"
        "Mean PPL(base)                :  20.252400 ±   0.51\n"
        "Mean    KLD:   0.012345 ±   0.000200\n"
        "Same top p: 93.456 ± 0.270 %\n"
    )
    got = parse_kld(kld)
    assert got == {"chunks": 32, "ppl": 20.612345, "ppl_base": 20.2524, "kld_mean": 0.012345,
                   "same_top": pytest.approx(0.93456)}  # fmt: skip


def test_base_file_tokens(tmp_path) -> None:
    f = tmp_path / "base.kld"
    tokens = np.arange(8, dtype="<i4")
    header = np.array([4, 49152, 2], dtype="<i4").tobytes()
    f.write_bytes(b"_logits_" + header + tokens.tobytes() + b"\0" * 64)
    n_ctx, n_vocab, got = base_tokens(f)
    assert (n_ctx, n_vocab) == (4, 49152)
    assert got.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
