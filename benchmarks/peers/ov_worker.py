"""OpenVINO GenAI's side of a peer run, executed by the interpreter of its own venv (no batchmlx
import: only the standard library and openvino_genai).

    <openvino venv>/bin/python ov_worker.py IN.json OUT.json

IN: {"gguf", "messages": [[...], ...], "max_tokens", "ignore_eos", "max_num_seqs",
"threads", "props"}. Builds `LLMPipeline(gguf, "CPU", scheduler_config=...)` (continuous
batching, paged KV, prefix caching on; "props": CPU plugin properties such as
DYNAMIC_QUANTIZATION_GROUP_SIZE), applies the GGUF's chat template with the pipeline's own
tokenizer and runs one `generate` over every prompt, greedy. OUT: texts, generated token counts, the
inference precision the CPU plugin picked, and the moments (seconds since this script started)
the pipeline was built and the generation done.
"""

import json
import sys
import time

T0 = time.perf_counter()


def main(inp: str, out: str) -> None:
    import openvino as ov
    import openvino_genai as genai

    job = json.loads(open(inp).read())
    t_import = time.perf_counter() - T0
    sched = genai.SchedulerConfig()
    sched.max_num_seqs = job["max_num_seqs"]
    sched.enable_prefix_caching = True
    sched.cache_size = job.get("cache_gb", 2)
    props = dict(job.get("props") or {})
    if job.get("threads"):
        props["INFERENCE_NUM_THREADS"] = job["threads"]
    pipe = genai.LLMPipeline(job["gguf"], "CPU", scheduler_config=sched, **props)
    t_loaded = time.perf_counter() - T0
    print("[ov_worker] loaded", flush=True)
    tok = pipe.get_tokenizer()
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in job["messages"]]
    cfg = genai.GenerationConfig()
    cfg.max_new_tokens = job["max_tokens"]
    cfg.do_sample = False
    cfg.ignore_eos = bool(job.get("ignore_eos"))
    if hasattr(cfg, "apply_chat_template"):
        cfg.apply_chat_template = False  # the prompts are templated already
    res = pipe.generate(prompts, cfg)
    t_done = time.perf_counter() - T0
    print("[ov_worker] generated", flush=True)
    texts = list(res.texts)
    counts = [len(tok.encode(t, add_special_tokens=False).input_ids.data[0]) for t in texts]
    try:
        generated = int(res.perf_metrics.get_num_generated_tokens())
    except Exception:  # older wheels: per-text counts only
        generated = sum(counts)
    # the pipeline's compiled model is not exposed: the hint it was given, else the plugin's default
    hint = props.get("INFERENCE_PRECISION_HINT") or ov.Core().get_property(
        "CPU", "INFERENCE_PRECISION_HINT"
    )
    precision = hint.to_string() if hasattr(hint, "to_string") else str(hint)
    result = {"texts": texts, "token_counts": counts, "generated_tokens": generated,
              "precision": precision, "version": genai.__version__, "t_import": t_import,
              "t_loaded": t_loaded, "t_done": t_done}  # fmt: skip
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
