"""llama.cpp's speed on one GGUF through llama-cpp-python, measured the way `tandem bench-engine` measures:
single-stream greedy decode after a 16-token prompt, and prefill of a 512-token prompt (time to first token).
Prints one JSON object. Random token prompts, so no cache can help; same seed each run."""

import json
import random
import sys
import time

from llama_cpp import Llama


def main() -> None:
    path = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                n_batch=512, n_ubatch=512, verbose=False)
    rng = random.Random(0)
    vocab = llm.n_vocab()

    def prompt(n: int) -> list[int]:
        return [rng.randrange(256, vocab) for _ in range(n)]

    # Warm up once so page faults and thread start-up are not measured.
    llm.reset()
    llm.eval(prompt(32))

    prefill = []
    for _ in range(3):
        llm.reset()
        ids = prompt(512)
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill.append(512 / (time.perf_counter() - t0))

    decode = []
    for _ in range(3):
        llm.reset()
        llm.eval(prompt(16))
        t0 = time.perf_counter()
        for _ in range(128):
            logits = llm.scores[llm.n_tokens - 1]
            tok = int(logits.argmax())
            llm.eval([tok])
        decode.append(128 / (time.perf_counter() - t0))

    print(json.dumps({"engine": "llama.cpp (llama-cpp-python)", "threads": threads,
                      "single_stream_decode_tok_s": max(decode), "prefill_tok_s": max(prefill)}))


if __name__ == "__main__":
    main()
