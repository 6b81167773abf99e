"""serve-model's throughput with eight concurrent clients against the same requests one at a time.

A `posttrain serve-model` of the quickstart's rl-stage input (its store's `@latest`; the tiny-llama
preset when the store has none) runs in a subprocess with one torch thread (the clients share the
machine). Each run sends the same 64 sampled
`/v1/completions` requests (token-id prompts, 64 new tokens, seeds 0..63): one after another
(`sequential`), or from 8 client threads at once (`concurrent`), whose requests the server decodes
together. Completion tokens per second, sides in turn, medians; `ratio` = concurrent / sequential.

    python -m bench.serve_batching [--runs 3] [--requests 64] [--clients 8] [--no-wait]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import RESULTS_DIR, go_offline, make_result, package_versions, write_result
from bench.repeats import paired_ratios, protocol, spread, wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 64


def served_folder() -> tuple[Path, str]:
    """The checkpoint to serve: the quickstart store's align@latest, else the tiny-llama preset."""
    from artifacts.store import Store, StoreError
    from models.presets import materialize

    store = Store(f"file://{ROOT}/.posttrain/store")
    try:
        ref = store.resolve("quickstart/align@latest")
        return store.fetch(ref), str(ref)
    except (StoreError, OSError, ValueError):
        return materialize("tiny-llama"), "tiny-llama"


def start_server(folder: Path) -> tuple[object, str]:
    import subprocess

    code = ("import sys; from models.serving.app import serve; "
            "serve(sys.argv[1], 'policy', port=0)")
    # one torch thread: the clients run on this machine too, and two decode threads spinning on its
    # two cores would starve them and the server's own event loop
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    line = process.stdout.readline()
    if not line.startswith("serving "):
        process.kill()
        raise RuntimeError(f"serve-model did not start: {line!r}")
    return process, line.split(" on ")[1].strip()


LOCAL = threading.local()


def request(url: str, prompt: list[int], seed: int) -> int:
    """One completion; each client thread keeps its connection open, as the `openai` client does."""
    import httpx

    if not hasattr(LOCAL, "client"):
        LOCAL.client = httpx.Client(timeout=600)
    body = {"model": "policy", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed,
            "return_token_ids": True}
    answer = LOCAL.client.post(f"{url}/completions", content=json.dumps(body),
                               headers={"content-type": "application/json"}).json()
    return len(answer["choices"][0]["token_ids"])


def one_run(url: str, prompts: list[list[int]], clients: int) -> dict:
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        tokens = list(pool.map(lambda item: request(url, item[1], item[0]), enumerate(prompts)))
    seconds = time.perf_counter() - began
    return {"tokens": sum(tokens), "seconds": round(seconds, 4), "tokens_per_second": sum(tokens) / seconds}


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    parser = argparse.ArgumentParser(prog="python -m bench.serve_batching", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--out", default=str(RESULTS_DIR / "serve_batching.json"))
    args = parser.parse_args(argv)
    from envs.arith import ArithEnv, ArithEnvConfig
    from models.loading import load_tokenizer
    from models.sampling import chat_prompt

    folder, served = served_folder()
    tokenizer = load_tokenizer(folder)
    env = ArithEnv(ArithEnvConfig(kind="arith", digits=2))
    prompts = [chat_prompt(tokenizer, t.prompt) for t in env.tasks("eval", args.requests, 0)]
    process, url = start_server(folder)
    try:
        one_run(url, prompts[:4], 1)  # warm-up: first requests load kernels
        quiet = wait_for_quiet(args.no_wait)
        runs: dict[str, list[dict]] = {"sequential": [], "concurrent": []}
        for index in range(args.runs):
            for side, clients in (("sequential", 1), ("concurrent", args.clients)):
                print(f"[serve_batching] {side} run {index + 1}", file=sys.stderr, flush=True)
                runs[side].append(one_run(url, prompts, clients))
    finally:
        process.kill()
        process.wait()
    speeds = {side: spread([r["tokens_per_second"] for r in results], 1) for side, results in runs.items()}
    ours, peer = speeds["concurrent"]["median"], speeds["sequential"]["median"]
    result = make_result(
        metric=f"serve-model completion tokens per second: {args.clients} concurrent clients / one request at a time",
        unit="tokens/s", ours=ours, peer=peer, peer_name="the same requests one at a time", higher_is_better=True,
        config={"served": served, "requests": args.requests, "clients": args.clients, "max_tokens": MAX_TOKENS,
                "sampling": "temperature 1.0, seeds 0..N-1, token-id prompts", "tokens_per_second": speeds,
                "runs": runs, "repeats": protocol(args.runs, quiet),
                "ratio_runs": paired_ratios([r["tokens_per_second"] for r in runs["concurrent"]],
                                            [r["tokens_per_second"] for r in runs["sequential"]]),
                "versions": package_versions("torch", "transformers", "fastapi", "uvicorn"),
                "command": "python -m bench.serve_batching"})
    path = write_result(result, args.out)
    print(f"serve-model: {ours:.0f} tokens/s with {args.clients} clients, {peer:.0f} one at a time "
          f"-> {result['ratio']:.2f}x -> {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
