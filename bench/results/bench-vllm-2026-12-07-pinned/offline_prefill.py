"""Times vLLM's prefill of fresh prompts of the given lengths, in one process, no server,
no connector, no prefix cache (the baseline of README.md):

    [OMP_NUM_THREADS=1] .venv-vllm/bin/python offline_prefill.py 1024,1024,1024,1920,1920

Model: the bench's seeded Llama, as `kvferry bench --engine vllm` creates it under
/tmp/kvferry-bench-vllm-models/.
"""
import os, time, random, sys
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
def main():
    llm = LLM(model="/tmp/kvferry-bench-vllm-models/tiny-llama-h512-f32", dtype="float32", enforce_eager=True,
              block_size=128, max_model_len=2048, kv_cache_memory_bytes=64<<20, skip_tokenizer_init=True,
              enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(1)
    seq = [int(x) for x in sys.argv[1].split(",")]
    for n in seq:
        p = {"prompt_token_ids": [rng.randrange(1, 1000) for _ in range(n)]}
        t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); dt = time.perf_counter() - t
        print(f"{n} {dt:.4f}", flush=True)
if __name__ == "__main__":
    main()
