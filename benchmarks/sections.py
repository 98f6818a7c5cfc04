"""The sections of `python -m benchmarks.run`, each a function of the run's `Bench` returning
its markdown lines under a "## N. Title" heading; `SECTIONS` maps the numbers to them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import workloads as wl
from benchmarks.bench import Bench
from benchmarks.measure import agreement, summary
from benchmarks.prefix_trie import block_prefix_lower_bound


def _f(x: float, nd: int = 1) -> str:
    return f"{x:,.{nd}f}"


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def section_throughput(b: Bench) -> list[str]:
    s = b.s
    lines = [
        "## 1. Continuous batching throughput (the seed's table)",
        "",
        f"Unique prompts ({wl.length_summary(b.unique(max(s.concurrency)))}, different user "
        f"questions through the chat template), {s.max_tokens} new tokens each, greedy, no "
        "early stop. tok/s = generated tokens / wall time from submitting all requests to the "
        "last token (prefill included). Simple mode runs the requests one after another; its "
        f"row n is the first n requests of one sequential pass over {max(s.concurrency)}.",
        "",
    ]
    rows = []
    for n in s.concurrency:
        simple, cont, peer = b.simple(n), b.continuous(n), b.peer(n)
        rows.append(
            [
                f"{n}",
                _f(simple.tok_s),
                _f(cont.tok_s),
                f"**{cont.tok_s / simple.tok_s:.2f}x**",
                _f(peer.tok_s),
                f"{cont.tok_s / peer.tok_s:.2f}x",
                f"{agreement(cont, peer):.0%}",
            ]
        )
    header = [
        "Concurrent requests",
        "Simple mode tok/s",
        "Continuous tok/s",
        "Speedup",
        "batch_generate tok/s",
        "Ours / batch_generate",
        "Same tokens as batch_generate",
    ]
    return lines + _table(header, rows)


def section_ttft(b: Bench) -> list[str]:
    n = b.s.ttft_concurrency
    lines = [
        "## 2. Time to first token and generation speed",
        "",
        f"TTFT = submission to first token, per request, over the {n}-concurrent workload of "
        "section 1 (all submitted at once, so simple mode's TTFT includes waiting for the "
        "requests ahead). Generation speed = per request, (tokens - 1) / (last token - first "
        "token): the speed one stream sees. The single-request row is the seed's streaming "
        "table.",
        "",
    ]
    rows = []
    cases = [
        ("Single request, simple mode", b.simple(1)),
        ("Single request, continuous", b.continuous(1)),
        (f"{n} concurrent, simple mode", b.simple(n)),
        (f"{n} concurrent, continuous", b.continuous(n)),
        (f"{n} concurrent, batch_generate", b.peer(n)),
    ]
    for name, r in cases:
        mean, p50, mx_ = summary(r.ttft_s)
        speed = summary(r.decode_speeds())[0] if r.decode_speeds() else float("nan")
        rows.append(
            [name, f"{mean * 1e3:,.0f}", f"{p50 * 1e3:,.0f}", f"{mx_ * 1e3:,.0f}", _f(speed)]
        )
    header = ["Workload", "TTFT mean ms", "TTFT p50 ms", "TTFT max ms", "Generation tok/s/stream"]
    return lines + _table(header, rows)


def section_shared(b: Bench) -> list[str]:
    s = b.s
    prompts = b.shared()
    ours, unshared, peer = b.shared_run("ours"), b.shared_run("no-sharing"), b.shared_run("peer")
    bound = block_prefix_lower_bound(prompts, s.block_size)
    total = sum(len(p) for p in prompts)
    computed = ours.sched["prefill_tokens_computed"]
    lines = [
        "## 3. Shared system prompt",
        "",
        f"{s.shared_requests} requests, one common system prompt of "
        f"{s.shared_system_tokens}+ tokens and different user turns (prompts "
        f"{wl.length_summary(prompts)}), {s.shared_max_tokens} new tokens each, "
        f"kv_grow_blocks={s.memory_grow_blocks}.",
        "",
    ]
    rows = []
    for name, r in [
        ("batchmlx (block sharing)", ours),
        ("batchmlx (no sharing)", unshared),
        ("mlx_lm batch_generate", peer),
    ]:
        rows.append(
            [
                name,
                _f(r.tok_s),
                f"{r.tok_s / peer.tok_s:.2f}x",
                _f(r.wall_s),
                _mib(r.engine["peak_kv_bytes"]) if r.engine else "n/a",
                str(r.engine["storage_blocks"]) if r.engine else "n/a",
                str(r.sched["peak_blocks_in_use"]) if r.sched else "n/a",
                _mib(r.mlx_peak_bytes),
                str(r.sched.get("preemptions", "n/a")) if r.sched else "n/a",
            ]
        )
    header = [
        "Engine",
        "tok/s",
        "vs batch_generate",
        "wall s",
        "Peak KV allocated",
        "Blocks allocated",
        "Peak blocks in use",
        "MLX peak memory above weights",
        "Preemptions",
    ]
    lines += _table(header, rows)
    if ours.engine["storage_blocks"] > ours.sched["peak_blocks_in_use"] + s.memory_grow_blocks + 1:
        lines += [
            "Blocks allocated exceed the peak in use with sharing: blocks of finished requests "
            "stay in the prefix cache (back of the free queue) and never-used blocks are handed "
            "out before them, so the KV arrays grow rather than reuse them.",
            "",
        ]
    lines += [
        "Prefill work (batchmlx with block sharing):",
        "",
    ]
    lines += _table(
        ["Prompt tokens", "Computed", "Reused", "Trie lower bound", "Computed / lower bound"],
        [
            [
                f"{total:,}",
                f"{computed:,}",
                f"{ours.sched['prefill_tokens_reused']:,}",
                f"{bound:,}",
                f"**{computed / bound:.3f}**",
            ]
        ],
    )
    lines += [
        f"Same tokens as batch_generate: {agreement(ours, peer):.0%} of requests; "
        f"as batchmlx without sharing: {agreement(ours, unshared):.0%}.",
        "",
    ]
    return lines


def section_memory(b: Bench) -> list[str]:
    s = b.s
    on, off = b.memory_run(True), b.memory_run(False)
    kv_on, kv_off = on.engine["peak_kv_bytes"], off.engine["peak_kv_bytes"]
    blk_on, blk_off = on.sched["peak_blocks_in_use"], off.sched["peak_blocks_in_use"]
    lines = [
        "## 4. KV memory with and without block sharing",
        "",
        f"{s.memory_requests} concurrent requests sharing a {s.memory_system_tokens}+-token "
        f"system prompt ({wl.length_summary(b.memory_prompts())}), {s.memory_max_tokens} new "
        f"tokens each, kv_grow_blocks={s.memory_grow_blocks}. Peak KV = bytes of KV arrays "
        "actually allocated (`eng.runner.stats.peak_kv_bytes`).",
        "",
    ]
    rows = [
        [
            "Block sharing (`use_paged_cache=True`)",
            _mib(kv_on),
            str(blk_on),
            _mib(on.mlx_peak_bytes),
            _f(on.tok_s),
        ],
        [
            "No sharing (`use_paged_cache=False`)",
            _mib(kv_off),
            str(blk_off),
            _mib(off.mlx_peak_bytes),
            _f(off.tok_s),
        ],
        [
            "**Saving**",
            f"**{1 - kv_on / kv_off:.1%}**",
            f"{1 - blk_on / blk_off:.1%}",
            f"{1 - on.mlx_peak_bytes / off.mlx_peak_bytes:.1%}",
            "",
        ],
    ]
    header = [
        "Configuration",
        "Peak KV allocated",
        "Peak blocks in use",
        "MLX peak above weights",
        "tok/s",
    ]
    return lines + _table(header, rows)


def section_prefix(b: Bench) -> list[str]:
    lines = [
        "## 5. Prefix cache",
        "",
        "One engine, requests one after another, "
        f"{b.s.prefix_max_tokens} new tokens each. HIT = the whole prompt but its last token "
        "reused (block-granular); PREFIX_HIT = part of it (here the chat template's shared "
        "system block).",
        "",
    ]
    rows = []
    for step, desc, expected, out in b.prefix_steps():
        actual = out.cache_outcome.value
        rows.append(
            [
                step,
                desc,
                " or ".join(sorted(expected, key=len)),
                actual,
                f"{out.cached_tokens}/{out.prompt_tokens}",
                "PASS" if actual in expected else "**FAIL**",
            ]
        )
    header = ["Step", "Description", "Expected", "Actual", "Cached/prompt tokens", "Status"]
    return lines + _table(header, rows)


def process_runs(b: Bench) -> dict[Any, list[Any]]:
    from benchmarks import whole_process

    return b._once(("process",), lambda: whole_process.measure(quick=b.quick,
                                                                baseline=b.baseline))  # fmt: skip


def section_process(b: Bench) -> list[str]:
    from benchmarks import whole_process

    return ["## 6. Whole process: a batch file in, results in hand", "",
            *whole_process.section(process_runs(b))]  # fmt: skip


def section_width(b: Bench) -> list[str]:
    from benchmarks import width

    lines = width.section(quick=b.quick, loaded=b.loaded)
    return ["## 7. Running width", *lines[1:]]


def section_mixed(b: Bench) -> list[str]:
    from benchmarks import mixed_steps

    lines = mixed_steps.section(b.loaded, quick=b.quick)
    return ["## 8. Mixed steps: decodes never wait for a prefill", *lines[1:]]


def prefill_results(b: Bench) -> tuple[list[str], dict[str, Any]]:
    from benchmarks import prefill_mfu

    def run() -> tuple[list[str], dict[str, Any]]:
        found: dict[str, Any] = {}
        cfg = prefill_mfu.QUICK if b.quick else prefill_mfu.Settings()
        return prefill_mfu.section(b.loaded, cfg, found=found), found

    return b._once(("prefill",), run)


def section_prefill(b: Bench) -> list[str]:
    lines, _ = prefill_results(b)
    return ["## 9. Prefill against its floor, decode MFU, where the time goes", *lines[1:]]


def section_scale(b: Bench) -> list[str]:
    from benchmarks import ingest_scale, scale

    lines = scale.section(quick=b.quick)
    ingest = ingest_scale.section(quick=b.quick)
    return ["## 10. Scale with the work", *lines[1:], *ingest]


def issue_targets(b: Bench) -> list[tuple[str, str, bool]]:
    """The engine-speed targets (issue 11): whole process, shared prompt, MFU, parity."""
    out = []
    runs = {wl.name: rows for wl, rows in process_runs(b).items()}
    uniq = runs.get("unique", [])
    ours = uniq[0] if uniq else None
    peer = next((r for r in uniq if "batch_generate" in r.system), None)
    if ours and peer:
        ratio = ours.tok_s / peer.tok_s
        out.append((">= 2x batch_generate, unique prompts, whole process", f"{ratio:.2f}x",
                    ratio >= 2))  # fmt: skip
        same = sum(1 for k, v in ours.texts.items() if peer.texts.get(k) == v)
        out.append(("Greedy texts identical to batch_generate (whole process, unique)",
                    f"{same}/{len(ours.texts)}", same == len(ours.texts)))  # fmt: skip
    shared = runs.get("shared", [])
    base = next((r for r in shared[1:] if "batchmlx at" in r.system), None)
    if shared and base:
        ratio = shared[0].tok_s / base.tok_s
        out.append((f">= 3x batchmlx at {b.baseline}, shared ~900-token system prompt, whole "
                    "process", f"{ratio:.2f}x", ratio >= 3))  # fmt: skip
    _, found = prefill_results(b)
    if "mfu" in found:
        w, mfu = max(found["mfu"].items(), key=lambda kv: kv[1])
        out.append((">= 30% decode model FLOP utilisation of the measured sgemm peak",
                    f"{mfu:.0%} (width {w})", mfu >= 0.30))  # fmt: skip
    if "prefill_vs_floor" in found:
        x = found["prefill_vs_floor"]
        out.append(("1,000-token prefill within 2x of its FLOP floor", f"{x:.1f}x", x <= 2))
    return out


def targets(b: Bench) -> list[tuple[str, str, bool]]:
    s = b.s
    n = s.ttft_concurrency
    out = []
    speedup = b.continuous(n).tok_s / b.simple(n).tok_s
    out.append((f"Continuous >= 3x simple mode at {n} concurrent", f"{speedup:.2f}x", speedup >= 3))
    for m in sorted({n, max(s.concurrency)}):
        ratio = b.continuous(m).tok_s / b.peer(m).tok_s
        out.append(
            (
                f">= 1.0x batch_generate on unique prompts, {m} concurrent",
                f"{ratio:.2f}x",
                ratio >= 1.0,
            )
        )
    ratio = b.shared_run("ours").tok_s / b.shared_run("peer").tok_s
    out.append((">= 2x batch_generate on the shared-prompt workload", f"{ratio:.2f}x", ratio >= 2))
    on, off = b.memory_run(True), b.memory_run(False)
    saving = 1 - on.engine["peak_kv_bytes"] / off.engine["peak_kv_bytes"]
    out.append(("KV memory saving with block sharing >= 80%", f"{saving:.1%}", saving >= 0.8))
    bound = block_prefix_lower_bound(b.shared(), s.block_size)
    ratio = b.shared_run("ours").sched["prefill_tokens_computed"] / bound
    out.append(
        (
            "Prefill tokens computed within 10% of the trie lower bound",
            f"{ratio:.3f}x",
            ratio <= 1.1,
        )
    )
    return out


def peer_results(b: Bench) -> dict[tuple[str, str], list]:
    from benchmarks.peers import section

    models, without = b.s.peer_models, frozenset(b.s.peer_without)
    return b._once(("peers", b.quick, models, without), section.run_all, b.quick,
                   Path("/tmp/batchmlx-peers.json"), without, models)  # fmt: skip


def section_peers(b: Bench) -> list[str]:
    from benchmarks.peers import section

    results = peer_results(b)
    rows = [[t, v, "MET" if ok else "not measured" if v == "not measured" else "**MISSED**"]
            for t, v, ok in section.targets(results)]  # fmt: skip
    return ["## 12. CPU peers: llama.cpp, OpenVINO GenAI, vLLM CPU at every model size", "",
            *section.markdown(results, b.quick), "Targets (issues 47 and 48):", "",
            *_table(["Target", "Measured", "Status"], rows)]  # fmt: skip


def section_online_peers(b: Bench) -> list[str]:
    from benchmarks.peers import online

    lines = online.section(b.quick, title="13. Online serving beside llama-server", level=2)
    return ["## 13. Online serving beside llama-server", *lines[1:]]


def section_fidelity(b: Bench) -> list[str]:
    from benchmarks.peers import fidelity

    return ["## 14. Every precision, and how close each system's answers are to float32", "",
            *fidelity.section(b.quick)]  # fmt: skip


def section_targets(b: Bench) -> list[str]:
    """The engine's own targets (issues 11 and 3); the peers' are section 12's."""
    rows = [[t, v, "MET" if ok else "**MISSED**"] for t, v, ok in targets(b) + issue_targets(b)]
    return ["## 11. Targets", ""] + _table(["Target", "Measured", "Status"], rows)


SECTIONS = {
    1: section_throughput,
    2: section_ttft,
    3: section_shared,
    4: section_memory,
    5: section_prefix,
    6: section_process,
    7: section_width,
    8: section_mixed,
    9: section_prefill,
    10: section_scale,
    11: section_targets,
    12: section_peers,
    13: section_online_peers,
    14: section_fidelity,
}
ALL_SECTIONS = tuple(SECTIONS)
