"""OpenVINO GenAI's steps, one at a time, for `benchmarks.profile_steps`; run by the interpreter
of its own venv (no batchmlx import: only the standard library, numpy and openvino_genai).

    <openvino venv>/bin/python ov_steps.py GGUF THREADS

Reads one JSON command a line on stdin and answers one JSON line on stdout:
- {"cmd": "info"}: versions and the CPU plugin's precisions (inference, KV cache, dynamic
  quantization group size of the activations).
- {"cmd": "steps", "width", "budget", "prompts": [[ids]], "max_tokens"}: a
  `ContinuousBatchingPipeline` per (width, budget) (`SchedulerConfig`: max_num_seqs = width,
  max_num_batched_tokens = budget, prefix caching on), built once and kept; every prompt added
  at once (token ids, greedy, ignore_eos), then `step()` until done, each step timed alone
  (reading the handles happens between steps, untimed). Answer: per step [ms, requests with a
  first token before, after, tokens generated in the step].
- {"cmd": "generate", ...same}: one `generate()` over the prompts on that pipeline; answer: its
  own PerfMetrics (TTFT, TPOT, inference duration) and raw per-step figures (the duration and
  the tokens of each step that generated tokens).
"""

import json
import sys
import time

GGUF = sys.argv[1] if len(sys.argv) > 1 else ""
THREADS = int(sys.argv[2]) if len(sys.argv) > 2 else 0
_PIPES = {}


def _pipe(width, budget):
    import openvino_genai as genai

    key = (width, budget)
    if key not in _PIPES:
        sched = genai.SchedulerConfig()
        sched.max_num_seqs = width
        sched.max_num_batched_tokens = budget
        sched.enable_prefix_caching = True
        sched.cache_size = 1
        props = {"INFERENCE_NUM_THREADS": THREADS} if THREADS else {}
        t0 = time.perf_counter()
        _PIPES[key] = genai.ContinuousBatchingPipeline(GGUF, sched, "CPU", props)
        print(f"[ov_steps] pipeline {key} built in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    return _PIPES[key]


def _config(max_tokens):
    import openvino_genai as genai

    cfg = genai.GenerationConfig()
    cfg.max_new_tokens = max_tokens
    cfg.do_sample = False
    cfg.ignore_eos = True
    return cfg


def _tensor(ids):
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.array([ids], dtype=np.int64))


def steps(job):
    pipe = _pipe(job["width"], job["budget"])
    cfg = _config(job["max_tokens"])
    handles = [pipe.add_request(i, _tensor(p), cfg) for i, p in enumerate(job["prompts"])]
    counts = [0] * len(handles)
    out = []
    while pipe.has_non_finished_requests():
        before = sum(1 for c in counts if c)
        total = sum(counts)
        t0 = time.perf_counter()
        pipe.step()
        ms = (time.perf_counter() - t0) * 1e3
        for i, h in enumerate(handles):
            while h.can_read():
                for o in h.read().values():
                    counts[i] += len(o.generated_ids)
        out.append([ms, before, sum(1 for c in counts if c), sum(counts) - total])
    return {"steps": out, "tokens": counts}


def generate(job):
    pipe = _pipe(job["width"], job["budget"])
    cfg = _config(job["max_tokens"])
    t0 = time.perf_counter()
    res = pipe.generate([_tensor(p) for p in job["prompts"]], [cfg] * len(job["prompts"]))
    wall = time.perf_counter() - t0
    pm = res[0].perf_metrics
    raw = pm.raw_metrics
    return {
        "wall_s": wall,
        "ttft_ms": pm.get_ttft().mean,
        "tpot_ms": pm.get_tpot().mean,
        "inference_ms": pm.get_inference_duration().mean,
        "generate_ms": pm.get_generate_duration().mean,
        "step_ms": [d / 1e3 for d in raw.token_infer_durations],
        "step_tokens": list(raw.m_batch_sizes),
        "tokens": [len(r.m_generation_ids[0]) for r in res],
    }


def info(_job):
    import openvino as ov
    import openvino_genai as genai

    core = ov.Core()

    def prop(name):
        try:
            v = core.get_property("CPU", name)
        except Exception as exc:  # noqa: BLE001 - an older plugin lacks the property
            return f"? ({type(exc).__name__})"
        return v.to_string() if hasattr(v, "to_string") else str(v)

    names = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION",
             "VALUE_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE", "PERFORMANCE_HINT",
             "OPTIMIZATION_CAPABILITIES")  # fmt: skip
    return {"version": genai.__version__, "openvino": ov.get_version(),
            **{n: prop(n) for n in names}}  # fmt: skip


COMMANDS = {"steps": steps, "generate": generate, "info": info}


def main():
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("cmd") == "quit":
            break
        try:
            ans = COMMANDS[job["cmd"]](job)
        except Exception as exc:  # noqa: BLE001 - answered, the caller decides
            ans = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(ans) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
