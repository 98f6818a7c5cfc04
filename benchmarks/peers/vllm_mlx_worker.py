"""vllm-mlx's side of a peer run, executed by the interpreter of its own venv (no batchmlx import:
only the standard library and vllm_mlx with what it pulls in: mlx, mlx-lm).

    <vllm-mlx venv>/bin/python vllm_mlx_worker.py IN.json OUT.json

IN: {"model" (an MLX folder), "messages": [[...], ...], "max_tokens"}. Builds the engine
`vllm-mlx serve MODEL --continuous-batching` runs: `BatchedEngine(model,
scheduler_config=SchedulerConfig())` with the scheduler's defaults (the same as the serve
flags': max_num_seqs 256, prefill_batch_size 8, completion_batch_size 32, memory-aware prefix
cache on), i.e. AsyncEngineCore stepping mlx-lm's BatchGenerator on one worker thread. Templates
every chat with the engine's own tokenizer (add_generation_prompt=True, as its chat endpoint)
and submits every request at once, greedy (temperature 0), then awaits them all. OUT: the texts
as its server returns them (`clean_output_text`: special tokens removed, then stripped) and as
its tokens decode, the generated token ids, the token counts without the eos token (as batchmlx
counts them) and with it (vllm-mlx's own completion_tokens), the BLAS this process has mapped,
and the moments (seconds since this script started) the engine was ready and the last request
done.
"""

import asyncio
import json
import sys
import time

T0 = time.perf_counter()
TAG = "[vllm_mlx_worker]"


def _blas() -> str:
    """The BLAS libraries this process has mapped (the preloaded one shows up here)."""
    try:
        with open("/proc/self/maps") as fh:
            libs = {line.split()[-1] for line in fh if "blas" in line.lower() and "/" in line}
    except OSError:
        return "?"
    return ", ".join(sorted(libs))


async def run(job: dict) -> dict:
    import mlx.core as mx
    import mlx_lm
    import vllm_mlx
    from vllm_mlx.engine.runner.batched import BatchedEngine
    from vllm_mlx.scheduler import SchedulerConfig

    t_import = time.perf_counter() - T0
    engine = BatchedEngine(job["model"], scheduler_config=SchedulerConfig())
    await engine.start()  # loads the model on the engine's generation thread, starts its loop
    t_loaded = time.perf_counter() - T0
    print(f"{TAG} loaded", flush=True)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
               for m in job["messages"]]  # fmt: skip
    try:
        outs = await asyncio.gather(*(
            engine.generate(p, max_tokens=job["max_tokens"], temperature=0.0, top_p=1.0)
            for p in prompts
        ))  # fmt: skip
        t_done = time.perf_counter() - T0
        print(f"{TAG} generated", flush=True)
    finally:
        await engine.stop()
    eos = set(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    # its token ids (and completion_tokens) end with the eos token on a "stop": not text
    ids = [list(o.tokens)[:-1] if o.finish_reason == "stop" and o.tokens and o.tokens[-1] in eos
           else list(o.tokens) for o in outs]  # fmt: skip
    counts = [len(i) for i in ids]
    return {
        "texts": [o.text for o in outs],
        "raw_texts": [tok.decode(i) for i in ids],
        "token_ids": ids,
        "token_counts": counts,
        "completion_tokens": [int(o.completion_tokens) for o in outs],
        "prompt_tokens": [int(o.prompt_tokens) for o in outs],
        "finish_reasons": [o.finish_reason for o in outs],
        "generated_tokens": sum(counts),
        "version": f"vllm-mlx {vllm_mlx.__version__}, mlx-lm {mlx_lm.__version__}, "
                   f"mlx {mx.__version__}",
        "device": str(mx.default_device()),
        "blas": _blas(),
        "t_import": t_import, "t_loaded": t_loaded, "t_done": t_done,
    }  # fmt: skip


def main(inp: str, out: str) -> None:
    with open(inp) as fh:
        job = json.load(fh)
    result = asyncio.run(run(job))
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
