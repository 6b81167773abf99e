"""Scale check: one LoRA update of each training stage, and one generation batch, at production model size.

LFM2-350M and Qwen3-0.6B are built from their published configs (values below; random float32
weights, no download, no tokenizer) and wrapped with LoRA (r 16, alpha 32) on the attention
projections, as a spec's `model.lora` would. Each row runs in its own process, forked from a fork
server that imported the stages' modules (as the pipeline starts a stage: tasks/runtime/launch.py),
so its peak resident memory (VmHWM, tasks/runtime/peaks.py) is that row's alone:

- sft: `tasks.stages.sft.train_step` on `--rows` examples of `--seq-len` tokens (`--prompt-len`
  masked, the rest trained), micro-batch 1, gradient checkpointing
- preference: `tasks.stages.preference.train_step` on `--rows` pairs of such rows (DPO, the
  reference log-probs given: the stage computes them before training), micro-batch 1, checkpointing
- rl: `tasks.stages.rl.update.train_step` on one group of `--rows` GRPO rows (prompt + completion, DAPO
  aggregation, beta 0, temperature 1), micro-batch 1, checkpointing
- generate: models/sampling.py's engine (`generate_tokens`) completes `--rows` prompts of
  `--prompt-len` tokens with `--new-tokens` tokens each, one batch, temperature 1 (an rl stage's
  rollouts), the end token disabled so every row decodes the whole budget

Each row reports its wall seconds (the one step, or the one generation call; the model build
excluded), tokens/s (training: non-pad tokens processed; generate: tokens generated) and the
process's peak RSS. The headline is the LFM2-350M rl row's peak RSS, against the aim of staying
under 6 GB for 8 rows of 512 tokens.

    python -m bench.scale [--models lfm2-350m,qwen3-0.6b] [--rows 8] [--seq-len 512] [--prompt-len 128]
                          [--new-tokens 64] [--tiny] [--out bench/results/scale.json]
    python -m bench.scale --one lfm2-350m sft     # one row in this process: one JSON line
    python -m bench.scale --tiny --in-process ... # the test's setting: every row in this process
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from bench import repeats
from bench.common import RESULTS_DIR, go_offline, make_result, package_versions, write_result

DEFAULT_OUT = RESULTS_DIR / "scale.json"
ROWS = ("sft", "preference", "rl", "generate")
AIM_RL_PEAK_RSS_GB = 6.0  # LFM2-350M, LoRA, one rl step over 8 rows of 512 tokens
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}

# Copied from the published config.json of LiquidAI/LFM2-350M and Qwen/Qwen3-0.6B on the Hugging Face
# hub (the keys transformers' Lfm2Config / Qwen3Config read; LFM2's `block_ff_dim` is its
# `intermediate_size`, `tie_embedding` its `tie_word_embeddings`, `full_attn_idxs` [2, 5, 8, 10, 12, 14]
# its `layer_types`). LFM2 adjusts its feed-forward width: int(2/3 * 6656) rounded up to a multiple of
# 256 = 4608.
_LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                "full_attention", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"]
PUBLISHED = {
    "lfm2-350m": {
        "hub_id": "LiquidAI/LFM2-350M",
        "model_type": "lfm2",
        "config": dict(vocab_size=65536, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128000,
                       norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_multiple_of=256,
                       block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, layer_types=_LFM2_LAYERS,
                       rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=7,
                       pad_token_id=0, initializer_range=0.02),
        # q/k/v/out of the attention layers only: `out_proj` alone would also match the 10 conv blocks'
        # output projections (peft matches a name's suffix), and LFM2 has no `o_proj`
        "lora_targets": ["q_proj", "k_proj", "v_proj", "self_attn.out_proj"],
    },
    "qwen3-0.6b": {
        "hub_id": "Qwen/Qwen3-0.6B",
        "model_type": "qwen3",
        "config": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, attention_dropout=0.0,
                       hidden_act="silu", use_sliding_window=False, sliding_window=None, max_window_layers=28,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, initializer_range=0.02),
        "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
    },
}
# --tiny: the same architectures at toy size (tests)
TINY = {
    "lfm2-350m": dict(PUBLISHED["lfm2-350m"]["config"], vocab_size=1000, hidden_size=64, intermediate_size=192,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, block_multiple_of=32,
                      layer_types=["conv", "full_attention", "conv", "full_attention"], max_position_embeddings=512),
    "qwen3-0.6b": dict(PUBLISHED["qwen3-0.6b"]["config"], vocab_size=1000, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_window_layers=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2),
}
# what each row's process needs, imported once by the fork server (the stage processes' warm server
# also imports great_expectations, pyarrow and matplotlib: ~0.2 GB more resident at the fork)
PRELOAD = ["torch", "transformers", "peft", "accelerate", "models.sampling", "tasks.stages.sft",
           "tasks.stages.preference", "tasks.stages.rl", "tasks.runtime.peaks"]


def model_config(name: str, tiny: bool) -> dict:
    return dict(TINY[name] if tiny else PUBLISHED[name]["config"])


# ---- one row, in its own process -----------------------------------------------------------

class IdsOnly:
    """The sampling engine's view of a tokenizer, for token ids that need no text: no end token
    (-1: every row decodes the whole budget), no text."""

    eos_token_id = -1

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def build(name: str, tiny: bool):
    """The model with random float32 weights and its LoRA adapters (the stages' `add_lora`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora

    values = model_config(name, tiny)
    config = AutoConfig.for_model(PUBLISHED[name]["model_type"], **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(r=LORA["r"], alpha=LORA["alpha"], dropout=LORA["dropout"],
                      target_modules=PUBLISHED[name]["lora_targets"])
    model = add_lora(model, ModelConfig(base=PUBLISHED[name]["hub_id"], lora=lora, dtype="float32"))
    facts = {"parameters": parameters,
             "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
             "lora_modules": sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))}
    return model, config, facts


def random_ids(generator, vocab: int, n: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (n,), generator=generator).tolist()


def prepared(model, stage):
    """As tasks.train.loop.start_training: checkpointing, AdamW + schedule, accelerate on the CPU."""
    from tasks.train.learner import Learner
    from tasks.train.loop import make_accelerator, make_optimizer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer, scheduler = make_optimizer(model, stage, 1)
    accelerator = make_accelerator(stage, "cpu")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model.train()
    return Learner(model, accelerator, optimizer, scheduler, stage.micro_batch_size)


def run_row(name: str, row: str, settings: dict) -> dict:
    """One row: build the model (untimed), then the one timed step or generation call."""
    import torch

    from tasks.common.encoding import Example
    from tasks.runtime.peaks import peak_rss_gb

    start_rss = peak_rss_gb()  # at the fork: the imports
    torch.set_num_threads(settings["threads"])
    rows, seq_len, prompt_len = settings["rows"], settings["seq_len"], settings["prompt_len"]
    model, config, facts = build(name, settings["tiny"])
    pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    generator = torch.Generator().manual_seed(1)
    draw = lambda n: random_ids(generator, config.vocab_size, n)  # noqa: E731
    completion_len = seq_len - prompt_len
    prompts = [draw(prompt_len) for _ in range(rows)]

    def example(prompt: list[int]) -> Example:
        completion = draw(completion_len)
        return Example(prompt + completion, [-100] * prompt_len + completion, truncated=False)

    out: dict = {}
    if row == "sft":
        from tasks.stages.sft import SftStage, train_step

        learner = prepared(model, SftStage(kind="sft", id="s", data="d", micro_batch_size=1,
                                              gradient_checkpointing=True))
        batch = [example(p) for p in prompts]
        began = time.perf_counter()
        loss, tokens = train_step(learner, batch, pad_id)
        seconds = time.perf_counter() - began
        out["loss"] = loss
    elif row == "preference":
        from tasks.stages.preference import PreferenceStage, train_step

        stage = PreferenceStage(kind="preference", id="p", policy="s", data="d", micro_batch_size=1,
                                gradient_checkpointing=True)
        learner = prepared(model, stage)
        chosen, rejected = [example(p) for p in prompts], [example(p) for p in prompts]
        # reference log-probs, as the stage stores them before training: about uniform over the vocabulary
        level = -completion_len * math.log(config.vocab_size)
        ref_chosen, ref_rejected = torch.full((rows,), level), torch.full((rows,), level)
        began = time.perf_counter()
        metrics, tokens = train_step(learner, chosen, rejected, ref_chosen, ref_rejected, stage, pad_id)
        seconds = time.perf_counter() - began
        out["loss"] = metrics["loss"]
    elif row == "rl":
        from tasks.rollout.episodes import Trajectory, TurnRecord
        from tasks.stages.rl import RlStage
        from tasks.stages.rl.scoring import Scored
        from tasks.stages.rl.update import train_step
        from tasks.train.loop import Training

        stage = RlStage(kind="rl", id="r", policy="s", envs={"e": 1.0}, steps=1, prompts_per_step=1,
                        group_size=rows, max_tokens=completion_len, temperature=1.0, loss_aggregation="dapo",
                        micro_batch_size=1, gradient_checkpointing=True)
        learner = prepared(model, stage)
        training = Training(None, stage, 1, learner.model, learner.optimizer, learner.scheduler,
                            learner.accelerator, None)
        group = []
        for i, prompt in enumerate(prompts):  # one group, rewards spread so every advantage is non-zero
            turn = TurnRecord(prompt, draw(completion_len), [], 0.0, truncated=True)
            group.append(Scored(Trajectory("e", None, prompt, [turn]), [float(i)], False, False, 0.0, 0.0, True))
        began = time.perf_counter()
        metrics, trained = train_step(training, None, [group], stage, pad_id)
        seconds = time.perf_counter() - began
        tokens = rows * seq_len  # prompt + completion of every row went through the model
        out.update(loss=metrics["loss"], trained_tokens=trained)
    elif row == "generate":
        from models.sampling import SamplingParams, generate_tokens

        model.eval()
        params = SamplingParams(settings["new_tokens"], temperature=1.0)
        began = time.perf_counter()
        generations = generate_tokens(model, IdsOnly(pad_id), prompts, params, batch_size=rows, seed=0)
        seconds = time.perf_counter() - began
        tokens = sum(len(g.token_ids) for g in generations)
    else:
        raise ValueError(f"unknown row {row!r}; one of {', '.join(ROWS)}")
    return {"peak_rss_gb": peak_rss_gb(), "seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 1), "tokens": tokens, "start_rss_gb": start_rss,
            **out, **facts}


def forked_row(name: str, row: str, settings: dict, conn) -> None:
    """Entry point in the forked process: the row's result, or its error, through `conn`."""
    import traceback

    try:
        conn.send(run_row(name, row, settings))
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


def in_own_process(context, name: str, row: str, settings: dict) -> dict:
    from bench import scale  # by its importable name (not __main__), for the fork server to find it

    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=scale.forked_row, args=(name, row, settings, send))
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # it died without sending
        result = None
    process.join()
    if result is None:
        raise RuntimeError(f"{name} {row}: the process ended with exit code {process.exitcode} and no result "
                           "(killed for memory?)")
    if "error" in result:
        raise RuntimeError(f"{name} {row} failed:\n{result['error']}")
    return result


# ---- the whole bench -----------------------------------------------------------------------

def parse(argv: list[str] | None):
    import os

    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PUBLISHED), help="comma-separated: " + ", ".join(PUBLISHED))
    parser.add_argument("--rows", type=int, default=8, help="rows (examples, pairs, rl rows, prompts) per step")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training row: prompt + completion")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (masked) of each row")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same architectures (tests)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads")
    parser.add_argument("--in-process", action="store_true",
                        help="run the rows one after another in this process (quick checks, tests): each row's "
                             "peak_rss_gb is then this process's peak so far, not the row's own")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "ROW"), help="run one row in this process, print JSON")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    repeats.add_arguments(parser, runs=None)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    for name in args.models + ([args.one[0]] if args.one else []):
        if name not in PUBLISHED:
            parser.error(f"unknown model {name!r}; one of {', '.join(PUBLISHED)}")
    if args.one and args.one[1] not in ROWS:
        parser.error(f"unknown row {args.one[1]!r}; one of {', '.join(ROWS)}")
    if not 0 < args.prompt_len < args.seq_len:
        parser.error("--prompt-len must be positive and below --seq-len")
    if args.rows < 2:
        parser.error("--rows must be at least 2 (an rl group)")
    return args


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    args = parse(argv)
    settings = {"rows": args.rows, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "tiny": args.tiny, "threads": args.threads}
    if args.one:
        result = run_row(*args.one, settings)
        print(json.dumps({"model": args.one[0], "row": args.one[1], **result}))
        return result

    import multiprocessing

    quiet = repeats.wait_for_quiet(args.no_wait)  # peak memory holds on a busy machine; the seconds do not
    context = multiprocessing.get_context("forkserver")  # a clean single-threaded parent for every row
    context.set_forkserver_preload(PRELOAD)
    models, facts = {}, {}
    for name in args.models:
        models[name] = {}
        for row in ROWS:
            result = run_row(name, row, settings) if args.in_process else \
                in_own_process(context, name, row, settings)
            keep = ("peak_rss_gb", "seconds", "tokens_per_second", "tokens", "start_rss_gb", "loss",
                    "trained_tokens")
            models[name][row] = {key: result[key] for key in keep if key in result}
            facts[name] = {key: result[key] for key in ("parameters", "trainable_parameters", "lora_modules")}
            print(f"scale: {name} {row}: peak RSS {result['peak_rss_gb']:.2f} GB, {result['seconds']:.1f} s, "
                  f"{result['tokens_per_second']:,.1f} tokens/s", flush=True)
        print(f"scale: {name}: {facts[name]['parameters'] / 1e6:,.1f}M parameters, "
              f"{facts[name]['trainable_parameters'] / 1e6:,.2f}M trainable (LoRA)", flush=True)

    headline = "lfm2-350m" if "lfm2-350m" in models else args.models[0]
    rl_peak = models[headline]["rl"]["peak_rss_gb"]
    at_aim = (headline == "lfm2-350m" and not args.tiny and not args.in_process and args.rows == 8
              and args.seq_len == 512)
    result = make_result(
        metric=f"{headline} LoRA rl step peak RSS", unit="GB", ours=rl_peak, peer=None, peer_name=None,
        higher_is_better=False,
        config={"settings": {k: v for k, v in settings.items()},
                "completion_len": args.seq_len - args.prompt_len,
                "models": {name: {"hub_id": PUBLISHED[name]["hub_id"], "model_type": PUBLISHED[name]["model_type"],
                                  "config": model_config(name, args.tiny),
                                  "config_source": "tiny test config of the same architecture" if args.tiny else
                                  f"copied from the published config.json of {PUBLISHED[name]['hub_id']}",
                                  "lora": {**LORA, "target_modules": PUBLISHED[name]["lora_targets"]},
                                  **facts[name]} for name in models},
                "dtype": "float32 weights, random (from_config, seed 0), no autocast",
                "token_ids": "uniform random over the whole vocabulary",
                "training": "one optimizer step, micro_batch_size 1, gradient checkpointing (non-reentrant), "
                            "AdamW over the LoRA parameters (tasks.train.loop.make_optimizer), "
                            "accelerate on the CPU, grad clip 1.0",
                "sft": "tasks.stages.sft.train_step, rows examples of prompt (labels -100) + completion",
                "preference": "tasks.stages.preference.train_step, dpo beta 0.1, rows pairs (chosen and rejected "
                              "each seq_len tokens), reference log-probs given",
                "rl": "tasks.stages.rl.update.train_step, grpo, one group of rows, dapo aggregation, beta 0, "
                      "num_iterations 1, temperature 1",
                "generate": "models.sampling.generate_tokens, one batch of rows prompts, temperature 1, seed 0, "
                            "the LoRA-wrapped model (unmerged), no end token (the whole budget decoded)",
                "timing": "wall seconds of the one step / generation call (first call, no warm-up), model build "
                          "excluded; tokens: non-pad tokens through the model (training), generated (generate)",
                "peak_rss": "VmHWM (tasks.runtime.peaks.peak_rss_gb) of this process, the rows run one after "
                            "another in it (--in-process): a running maximum, not each row's own" if args.in_process
                else "VmHWM of the row's own process (tasks.runtime.peaks.peak_rss_gb), forked from a fork server "
                     "that imported the stages' modules; start_rss_gb is its RSS at the fork",
                "isolation": "in-process" if args.in_process else "one forked process per row (forkserver)",
                "quiet": quiet,
                "versions": package_versions("torch", "transformers", "peft", "accelerate")})
    result["models"] = models
    result["aim"] = {"rl_peak_rss_gb_below": AIM_RL_PEAK_RSS_GB, "met": rl_peak < AIM_RL_PEAK_RSS_GB,
                     "at_aim_settings": at_aim}
    path = write_result(result, args.out)
    print(f"scale: {result['metric']} {rl_peak:.2f} GB (aim: below {AIM_RL_PEAK_RSS_GB} GB: "
          f"{'met' if result['aim']['met'] else 'NOT met'}{'' if at_aim else ', not at the aim settings'}) -> {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
