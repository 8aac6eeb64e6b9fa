"""llama.cpp's side of `llama/examples/llama_bench.rs`, through llama-cpp-python.

Reads the exact prompt token ids our benchmark used (a JSON file), and for each prompt length
measures what ours measures: one prefill call over the prompt into an empty KV cache, then
`--decode-tokens` greedy steps (top-1 sampling, one token per llama_decode call).
Prints one JSON object per measurement and, last, the process's peak RSS.

Run by llama_bench with `--llama-cpp-python PYTHON` (an interpreter that has llama_cpp
installed); it can also be run on its own:
    python bench/llama_cpp_bench.py --model M.gguf --tokens t.json --threads 2 --decode-tokens 64
"""

import argparse
import json
import resource
import statistics
import time

import llama_cpp.llama_cpp as llama_cpp_lib
from llama_cpp import Llama

_default_model_params = llama_cpp_lib.llama_model_default_params


def _model_params_without_extra_buffers():
    # A native build on this machine enables ggml's AMX buffer type, whose matmul crashes
    # (SIGSEGV in ggml_backend_amx_mul_mat) on any batch of more than one token here; without
    # the extra buffer types ggml uses its AVX-512/VNNI dot products and llamafile's sgemm.
    # The binding has no argument for this, hence the patch of its defaults.
    p = _default_model_params()
    p.use_extra_bufts = False
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help='JSON: {"warmup": [...], "prompts": [[...], ...]}')
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--extra-buffers", action="store_true", help="keep ggml's extra buffer types (AMX, repack)")
    a = ap.parse_args()
    if not a.extra_buffers:
        llama_cpp_lib.llama_model_default_params = _model_params_without_extra_buffers
    with open(a.tokens) as f:
        spec = json.load(f)
    longest = max(len(p) for p in spec["prompts"]) + a.decode_tokens
    llm = Llama(
        model_path=a.model,
        n_ctx=longest + 16,
        # The whole prompt in one llama_decode call, as ours prefills it in one forward.
        n_batch=longest,
        n_ubatch=min(longest, 512),
        n_threads=a.threads,
        n_threads_batch=a.threads,
        verbose=False,
    )

    def run(prompt):
        # generate() evaluates the prompt in one llama_decode call (n_batch covers it), yields the
        # greedy token (top_k=1), then evaluates each yielded token in one call before the next.
        # reset() first, so that no KV prefix of the previous run is reused.
        llm.reset()
        gen = llm.generate(prompt, top_k=1, temp=0.0, reset=True)
        t = time.perf_counter()
        next(gen)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(a.decode_tokens):
            next(gen)
        decode = time.perf_counter() - t
        gen.close()
        return len(prompt) / prefill, a.decode_tokens / decode

    run(spec["warmup"])
    for prompt in spec["prompts"]:
        runs = [run(prompt) for _ in range(a.repeats)]
        pre, dec = [r[0] for r in runs], [r[1] for r in runs]
        print(json.dumps({
            "impl": "llama.cpp", "prompt_tokens": len(prompt), "decode_tokens": a.decode_tokens,
            "prefill_tokens_per_s_median": statistics.median(pre), "prefill_tokens_per_s_best": max(pre),
            "decode_tokens_per_s_median": statistics.median(dec), "decode_tokens_per_s_best": max(dec),
        }), flush=True)
    # ru_maxrss is in KiB on Linux.
    print(json.dumps({"impl": "llama.cpp", "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6}))


if __name__ == "__main__":
    main()
