"""Generation throughput: this project's engine (models/sampling.py) against `model.generate`.

Same model (the tiny-llama preset), same 256 arith chat prompts, same batches (64, left
padded), same greedy decoding and token budget, fp32, same threads; both sides in one process
after an untimed warm-up batch each, then in turn, `--runs` times each, on a quiet machine
(bench/repeats.py): the headline is each side's median. The metric is completion tokens per
second (tokens each side emitted, the end token included). Greedy outputs must be identical.

    python -m bench.generate [--prompts 256] [--batch-size 64] [--max-new-tokens 64] [--runs 9] [--no-wait]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench import repeats
from bench.common import RESULTS_DIR, go_offline, make_result, package_versions, write_result

RUNS = 9  # a run is about a second: three a side left the ratio to this VM's second-to-second noise


def peer_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int):
    import torch

    from models.sampling import left_padded

    outputs = []
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_padded(prompts[start:start + batch_size], tokenizer.pad_token_id, model.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for row in out[:, ids.shape[1]:].tolist():
            outputs.append(row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return outputs


def timed(fn):
    began = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - began


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    parser = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS_DIR / "generate.json"))
    repeats.add_arguments(parser, runs=RUNS)
    args = parser.parse_args(argv)
    quiet = repeats.wait_for_quiet(args.no_wait)

    import torch
    from transformers import AutoModelForCausalLM

    from envs.arith import ArithEnv, ArithEnvConfig
    from models.loading import load_tokenizer
    from models.presets import materialize
    from models.sampling import SamplingParams, chat_prompt, generate_tokens

    folder = materialize("tiny-llama")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(str(folder)).eval(), load_tokenizer(folder)
    tasks = ArithEnv(ArithEnvConfig(kind="arith")).tasks("eval", args.prompts, 0)
    prompts = [chat_prompt(tokenizer, t.prompt) for t in tasks]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    warm = prompts[:args.batch_size]
    generate_tokens(model, tokenizer, warm, params, batch_size=args.batch_size)
    peer_generate(model, tokenizer, warm, args.max_new_tokens, args.batch_size)
    sides = repeats.interleaved(
        {"ours": lambda: timed(lambda: [g.token_ids for g in generate_tokens(model, tokenizer, prompts, params,
                                                                           batch_size=args.batch_size)]),
         "peer": lambda: timed(lambda: peer_generate(model, tokenizer, prompts, args.max_new_tokens, args.batch_size))},
        args.runs, repeats.say("generate"))
    outputs = {side: runs[0][0] for side, runs in sides.items()}
    identical = outputs["ours"] == outputs["peer"] and all(
        output == outputs[side] for side, runs in sides.items() for output, _ in runs)  # greedy: every run the same
    tokens = sum(len(ids) for ids in outputs["ours"])
    speeds = {side: [sum(len(ids) for ids in output) / seconds for output, seconds in runs]
              for side, runs in sides.items()}
    ours, peer = (repeats.spread(speeds[side], 1) for side in ("ours", "peer"))
    result = make_result(
        metric="completion tokens/s (greedy)", unit="tokens/s", ours=ours["median"], peer=peer["median"],
        peer_name=f"transformers {package_versions('transformers')['transformers']} model.generate",
        config={"model": "tiny-llama", "prompts": args.prompts, "batch_size": args.batch_size,
                "max_new_tokens": args.max_new_tokens, "dtype": "float32", "torch_threads": torch.get_num_threads(),
                "greedy_outputs_identical": identical, "completion_tokens": tokens,
                "ours_runs": ours, "peer_runs": peer,
                "ratio_runs": repeats.paired_ratios(speeds["ours"], speeds["peer"]),
                "warm_up": "one untimed batch each side first",
                "repeats": repeats.protocol(args.runs, quiet),
                "versions": package_versions("torch", "transformers")})
    path = write_result(result, args.out)
    print(f"generate: ours {result['ours']:,.0f} vs model.generate {result['peer']:,.0f} tokens/s "
          f"(ratio {result['ratio']:.2f}, identical greedy outputs: {identical}) -> {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
