"""GRPO throughput: this project's `rl` stage (tasks/stages/rl/stage.py) against TRL's `GRPOTrainer`.

Both sides train the `tiny-llama` preset (float32, same torch threads) on the same arith train
prompts in the same order (the stage's own draw, `tasks.stages.rl.stage.step_tasks`, handed to TRL as a
conversational dataset it does not shuffle), rendered by the same chat template to the same
prompt ids (checked), scored by the same reward (the arith rubric's total: correct 1.0 + format
0.2). Both sample `group_size` completions of `prompts_per_step` prompts per step (temperature
1, top-p 1, no top-k, the same max completion tokens) and take one optimizer step per
generation batch: DAPO token-sum aggregation, clip 0.2 / 0.28, beta 0 (no reference model),
group-std reward scaling, AdamW at a constant learning rate without warm-up, gradient clip 1.0.
Token sampling streams differ (each side its own RNG), so reward curves agree only within noise.

The headline is end to end: all sampled completion tokens (end token included) per second of
the whole call: ours `tasks.stages.rl.stage.run` (store fetch, model load, every step's generation and
update, checkpoint and report writing), TRL's `GRPOTrainer(...)` construction plus `train()`.
Per step, the JSON splits the time into rollout (sampling and scoring: ours `rollout_seconds`
in the stage's metrics.jsonl, TRL's `_generate_and_score_completions`, timed) and update (the
rest of the step). It also keeps the stepped figure, tokens per second over the steps after
`TRAIN_WARMUP_STEPS` untimed ones. The sides run in turn, `--runs` times each, on a quiet machine
(bench/repeats.py): the headline is each side's median.

Both start from the same warm start: the preset after `--sft-steps` of this project's SFT on
the env's oracle traces, so that rewards vary within groups and the curves mean something.

    python -m bench.grpo_vs_trl [--steps 80] [--max-tokens 64] [--sft-steps 600] [--runs 3] [--no-wait]
                                [--out bench/results/grpo_vs_trl.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from itertools import accumulate
from pathlib import Path

from bench import repeats
from bench.common import (RESULTS_DIR, TRAIN_WARMUP_STEPS, Stopwatch, go_offline, make_result, package_versions,
                          parameter_count, report, resolved_config)

go_offline()  # before anything below imports transformers, datasets or trl

from envs.arith import ArithEnv, ArithEnvConfig  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.presets import materialize  # noqa: E402
from models.sampling import chat_prompt  # noqa: E402
from tasks.stages.rl import RlStage  # noqa: E402
from tasks.stages.rl.stage import TASK_POOL, step_tasks  # noqa: E402

MODEL_PRESET = "tiny-llama"
DEFAULT_OUT = RESULTS_DIR / "grpo_vs_trl.json"
METRIC, UNIT = "rl completion tokens/s, end to end", "tokens/s"
ENV_CONFIG = ArithEnvConfig(kind="arith", digits=2)


def _default(name: str):
    return RlStage.model_fields[name].default


@dataclass(frozen=True)
class Settings:
    """What both sides share; the GRPO hyper-parameters default to the `rl` stage's defaults."""

    steps: int
    max_tokens: int
    threads: int
    prompts_per_step: int = _default("prompts_per_step")
    group_size: int = _default("group_size")
    learning_rate: float = _default("learning_rate")
    epsilon_low: float = _default("epsilon_low")
    epsilon_high: float = _default("epsilon_high")
    temperature: float = 1.0
    seed: int = _default("seed")
    sft_steps: int = 600  # the warm start both sides share (0: the untrained preset)

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass
class Side:
    """One side's run: per-step completion tokens and mean rewards, timed steps, end-to-end wall time."""

    step_tokens: list[int]
    rewards: list[float]
    timed_tokens: int  # after the warm-up steps
    timed_seconds: float
    seconds: float  # end to end
    rollout_seconds: list[float]  # per step: sampling and scoring the step's completions
    update_seconds: list[float]  # per step: the rest of the step (log-probs, loss, backward, optimizer)
    details: dict = field(default_factory=dict)

    @property
    def end_to_end(self) -> float:
        """Completion tokens per second of the whole call (load, every step, saving)."""
        return sum(self.step_tokens) / self.seconds

    def summary(self, completions_per_step: int) -> dict:
        steps, tokens, quarter = len(self.step_tokens), sum(self.step_tokens), max(1, len(self.rewards) // 4)
        timed = slice(TRAIN_WARMUP_STEPS, None)
        return {"completion_tokens_per_second": round(self.timed_tokens / self.timed_seconds, 1),
                "seconds_per_step": {"rollout": round(statistics.mean(self.rollout_seconds[timed]), 4),
                                     "update": round(statistics.mean(self.update_seconds[timed]), 4),
                                     "over": "the timed steps (after the untimed warm-up steps), mean"},
                "steps_per_second": round((steps - TRAIN_WARMUP_STEPS) / self.timed_seconds, 4),
                "timed_tokens": self.timed_tokens, "timed_seconds": round(self.timed_seconds, 3),
                "end_to_end": {"completion_tokens_per_second": round(self.end_to_end, 1),
                               "steps_per_second": round(steps / self.seconds, 4), "seconds": round(self.seconds, 3)},
                "steps": steps, "completion_tokens": tokens,
                "mean_completion_tokens": round(tokens / (steps * completions_per_step), 2),
                "step_tokens": self.step_tokens,
                "rollout_seconds": [round(x, 4) for x in self.rollout_seconds],
                "update_seconds": [round(x, 4) for x in self.update_seconds],
                "reward_curve": [round(r, 4) for r in self.rewards],
                "reward_first_quarter": round(sum(self.rewards[:quarter]) / quarter, 4),
                "reward_last_quarter": round(sum(self.rewards[-quarter:]) / quarter, 4),
                **self.details}


def step_prompts(settings: Settings) -> list:
    """The tasks the stage draws, step by step (`tasks.stages.rl.stage.step_tasks` over its pool), flattened."""
    pools = {"arith": ArithEnv(ENV_CONFIG).tasks("train", TASK_POOL, settings.seed)}
    return [task for step in range(settings.steps)
            for _, task in step_tasks(pools, {"arith": 1.0}, settings.prompts_per_step, settings.seed, step)]


def warm_start(settings: Settings, workdir: Path) -> Path:
    """The policy both sides start from: the preset after `sft_steps` of this project's SFT on the
    env's oracle traces. The untrained preset never earns a reward, so every advantage is 0 and
    its reward curve says nothing about learning; after SFT, rewards differ within a group."""
    if not settings.sft_steps:
        return materialize(MODEL_PRESET)
    from artifacts.store import Store
    from tasks.common.context import StageContext
    from tasks.stages import sft, synthesize
    from tasks.stages.sft import SftStage
    from tasks.stages.synthesize import SynthesizeStage

    store = Store(f"file://{workdir / 'store'}")
    model = ModelConfig(base=MODEL_PRESET, dtype="float32", threads=settings.threads)

    def context(stage_id: str, inputs: dict) -> StageContext:
        return StageContext(store=store, pipeline="bench", run_id="bench", stage_id=stage_id, cache_key=stage_id,
                            model=model, envs={"arith": ENV_CONFIG}, inputs=inputs, workdir=workdir / stage_id)

    traces = synthesize.run(SynthesizeStage(kind="synthesize", id="warmup", env="arith", n=4000),
                            context("warmup", {}))["dataset"]
    traces_ref = store.commit("bench/warmup", "dataset", traces.local_dir, producer={})
    stage = SftStage(kind="sft", id="sft", data="warmup", max_steps=settings.sft_steps, batch_size=32,
                     learning_rate=2e-3, warmup_steps=30, checkpoint_every=settings.sft_steps)
    return sft.run(stage, context("sft", {"warmup": str(traces_ref)}))["checkpoint"].local_dir


# ---- ours: the `rl` stage function over a local store ---------------------------------------

def ours(model_dir: Path, settings: Settings, workdir: Path) -> Side:
    from artifacts.store import Store
    from tasks.common.context import StageContext
    from tasks.stages.rl.stage import run as run_stage

    stage = RlStage(kind="rl", id="rl", policy="policy", envs={"arith": 1.0}, algorithm="grpo",
                    loss_aggregation="dapo", steps=settings.steps, prompts_per_step=settings.prompts_per_step,
                    group_size=settings.group_size, epsilon_low=settings.epsilon_low,
                    epsilon_high=settings.epsilon_high, beta=0.0, scale_rewards="group", num_iterations=1,
                    mask_truncated=False, temperature=settings.temperature, max_tokens=settings.max_tokens,
                    anti_doom=None, learning_rate=settings.learning_rate, weight_decay=0.0, warmup_steps=0,
                    lr_schedule="constant", checkpoint_every=settings.steps,  # no in-stage checkpoint, as TRL's
                    seed=settings.seed)
    store = Store(f"file://{workdir / 'store'}")
    policy = store.commit("bench/policy", "checkpoint", model_dir, producer={})
    ctx = StageContext(store=store, pipeline="bench", run_id="bench", stage_id="rl", cache_key="bench-rl",
                       model=ModelConfig(base=MODEL_PRESET, dtype="float32", threads=settings.threads),
                       envs={"arith": ENV_CONFIG}, inputs={"policy": str(policy)}, workdir=workdir / "work")
    began = time.perf_counter()
    outputs = run_stage(stage, ctx)
    seconds = time.perf_counter() - began
    lines = (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines if line.strip()]
    step_tokens = [h["tokens"] for h in history]
    assert [h["step"] for h in history] == list(range(1, settings.steps + 1)) == list(
        range(1, outputs["checkpoint"].metrics["steps"] + 1)), "metrics.jsonl: one row per step"
    assert sum(step_tokens) == outputs["checkpoint"].metrics["completion_tokens"]
    # the stage logs cumulative tokens / seconds since its loop began: seconds at the end of each step
    cumulative = list(accumulate(step_tokens))
    elapsed = [tokens / h["tokens_per_second"] for tokens, h in zip(cumulative, history)]
    warm = TRAIN_WARMUP_STEPS - 1
    return Side(step_tokens=step_tokens, rewards=[h["reward"] for h in history],
                timed_tokens=cumulative[-1] - cumulative[warm], timed_seconds=elapsed[-1] - elapsed[warm],
                seconds=seconds, rollout_seconds=[h["rollout_seconds"] for h in history],
                update_seconds=[h["update_seconds"] for h in history],
                details={"timed": "tasks.stages.rl.stage.run(stage, ctx); step ends from its metrics.jsonl "
                                  "(cumulative tokens / tokens_per_second); end to end: the whole call, the policy "
                                  "commit excluded",
                         "stage": stage.model_dump(mode="json"),
                         "mean_loss": round(sum(h["loss"] for h in history) / len(history), 6),
                         "sampler": "models.sampling.generate_tokens (its own KV-cache decode loop, eval mode)"})


# ---- peer: TRL's GRPOTrainer -----------------------------------------------------------------

# TRL's decoding settings tried for the peer (its `generate` path; TRL turns torch.compile off
# there, and a static cache without compile is the only other cache that needs no new package)
PEER_DECODING = {"dynamic": {}, "static": {"cache_implementation": "static"}}


def peer_args(settings: Settings, output_dir: str, decoding: str = "dynamic") -> dict:
    """GRPOConfig arguments matched to the stage, TRL's CPU-hostile defaults off (DESIGN §10)."""
    return dict(
        **PEER_DECODING[decoding],
        output_dir=output_dir, max_steps=settings.steps, seed=settings.seed,
        per_device_train_batch_size=settings.completions_per_step,  # TRL counts completions, not prompts
        gradient_accumulation_steps=1, num_generations=settings.group_size,  # one generation batch per step
        num_iterations=1, shuffle_dataset=False,  # the dataset is already in the stage's prompt order
        max_completion_length=settings.max_tokens, temperature=settings.temperature, top_p=1.0, top_k=0,
        loss_type="dapo", epsilon=settings.epsilon_low, epsilon_high=settings.epsilon_high, beta=0.0,
        scale_rewards="group", mask_truncated_completions=False,
        learning_rate=settings.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0,  # what tasks/train/loop.py clips to
        use_vllm=False, bf16=False, fp16=False,  # TRL's bf16 default is ~10x slower on this CPU
        gradient_checkpointing=False, activation_checkpointing=False,  # TRL's default True recomputes activations
        model_init_kwargs={"dtype": "float32"},
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=False, log_completions=False,
    )


def peer(model_dir: Path, tokenizer, tasks: list, settings: Settings, decoding: str = "dynamic") -> Side:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rubric = ArithEnv(ENV_CONFIG).rubric
    rewards, step_tokens, stopwatch = [], [], Stopwatch(TRAIN_WARMUP_STEPS)

    def arith_reward(completions, completion_ids, task_index, **_) -> list[float]:
        """The arith rubric's total of each completion; also notes what TRL sampled (once per step)."""
        scores = [rubric.score(c[0]["content"], tasks[i]).total for c, i in zip(completions, task_index)]
        rewards.append(sum(scores) / len(scores))
        step_tokens.append(sum(len(ids) for ids in completion_ids))
        return scores

    rollout_ends, rollout_seconds, update_seconds = [], [], []

    class StopwatchCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stopwatch.step_done(state.global_step, sum(step_tokens))
            update_seconds.append(time.perf_counter() - rollout_ends[-1])

    def timed_rollouts(generate_and_score):
        """TRL's generation + reward scoring of a step's batch, timed (one call per step here)."""
        def timed(*args, **kwargs):
            began = time.perf_counter()
            batch = generate_and_score(*args, **kwargs)
            rollout_ends.append(time.perf_counter())
            rollout_seconds.append(rollout_ends[-1] - began)
            return batch
        return timed

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": task.prompt}], "task_index": i}
                                 for i, task in enumerate(tasks)])
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        args = GRPOConfig(**peer_args(settings, output_dir, decoding))
        began = time.perf_counter()
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=arith_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StopwatchCallback()])
        trainer._generate_and_score_completions = timed_rollouts(trainer._generate_and_score_completions)
        output = trainer.train()
        seconds = time.perf_counter() - began
    unique = list(dict.fromkeys(task.prompt for task in tasks))
    prompt_ids, _, _ = trainer._tokenize_prompts([[{"role": "user", "content": p}] for p in unique])
    logged = next(h for h in reversed(trainer.state.log_history) if "reward" in h)  # means over all steps
    return Side(step_tokens=step_tokens, rewards=rewards, timed_tokens=stopwatch.tokens,
                timed_seconds=stopwatch.seconds, seconds=seconds, rollout_seconds=rollout_seconds,
                update_seconds=update_seconds,
                details={"timed": "a callback at each step's end; end to end: GRPOTrainer(...) construction "
                                  "(model load) + train(); rollout: its _generate_and_score_completions, wrapped",
                         "trl_args": peer_args(settings, "<temporary directory>", decoding),
                         "resolved_config": resolved_config(args),
                         "resolved": {"optim": str(args.optim.value), "bf16": args.bf16,
                                      "generation_batch_size": args.generation_batch_size,
                                      "steps_per_generation": args.steps_per_generation},
                         "dataset_format": "conversational prompts + task_index column (the reward's lookup)",
                         "prompt_ids_identical_to_ours": [list(ids) for ids in prompt_ids]
                         == [chat_prompt(tokenizer, p) for p in unique],
                         "reward_and_length_match_trl_log": _close(
                             [sum(rewards) / len(rewards), sum(step_tokens) / len(step_tokens)],
                             [logged["reward"], logged["completions/mean_length"] * settings.completions_per_step]),
                         "trl_mean_step_time": round(logged["step_time"], 3),
                         "mean_loss": round(output.training_loss, 6),
                         "sampler": "transformers generate (DynamicCache), model in train mode",
                         "model_parameters": parameter_count(trainer.model)})


def _close(ours: list[float], theirs: list[float]) -> bool:
    return all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(ours, theirs, strict=True))


# ---- the comparison ------------------------------------------------------------------------

def best_peer_decoding(model_dir, tokenizer, tasks: list, settings: Settings, choice: str) -> tuple[str, dict]:
    """The peer's decoding setting: `choice`, or with "auto" the fastest of PEER_DECODING on a short
    run of each (end to end), all of them recorded."""
    if choice != "auto":
        return choice, {"chosen": choice, "how": "--peer-decoding"}
    short = replace(settings, steps=min(settings.steps, TRAIN_WARMUP_STEPS + 5))
    speeds = {name: round(peer(model_dir, tokenizer, tasks, short, name).end_to_end, 1) for name in PEER_DECODING}
    best = max(speeds, key=speeds.get)
    return best, {"chosen": best, "how": f"the fastest end to end on a {short.steps}-step run of each",
                  "tried": {name: {"trl_args": PEER_DECODING[name], "completion_tokens_per_second": speed}
                            for name, speed in speeds.items()}}


def run(settings: Settings, runs: int, quiet: dict, peer_decoding: str = "auto") -> dict:
    import torch

    from models.loading import load_tokenizer

    torch.set_num_threads(settings.threads)
    tasks = step_prompts(settings)
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as workdir:
        model_dir = warm_start(settings, Path(workdir) / "warm")
        tokenizer = load_tokenizer(model_dir)
        decoding, tried = best_peer_decoding(model_dir, tokenizer, tasks, settings, peer_decoding)
        ours_dirs = (Path(workdir) / f"ours-{index}" for index in range(runs))  # each run its own store
        sides = repeats.interleaved({"ours": lambda: ours(model_dir, settings, next(ours_dirs)),
                                     "peer": lambda: peer(model_dir, tokenizer, tasks, settings, decoding)},
                                    runs, repeats.say("grpo_vs_trl"))
    ours_speed, peer_speed, summaries = repeats.measured(
        sides, lambda run: run.end_to_end, lambda run: run.summary(settings.completions_per_step), "end_to_end_runs")
    for side, results in sides.items():
        summaries[side]["stepped_runs"] = repeats.spread([r.timed_tokens / r.timed_seconds for r in results], 1)

    config = {
        "model": MODEL_PRESET, "dtype": "float32",
        "start": f"{MODEL_PRESET} after {settings.sft_steps} SFT steps on 4,000 oracle traces (tasks.stages.sft, batch 32, "
                 "lr 2e-3), the same folder for both sides" if settings.sft_steps else f"the untrained {MODEL_PRESET}",
        "data": {"env": "arith", "env_config": ENV_CONFIG.model_dump(mode="json"), "split": "train",
                 "prompts": len(tasks), "unique_prompts": len({t.prompt for t in tasks}),
                 "order": "tasks.stages.rl.stage.step_tasks (the stage's own draw); TRL the same prompts in the "
                          "same order (shuffle_dataset=False, each prompt group_size times in a row); token sampling RNGs "
                          "differ, so completions and rewards differ within sampling noise"},
        "settings": asdict(settings),
        "completions_per_step": settings.completions_per_step,
        "reward": "arith rubric total (correct 1.0 + format 0.2), no anti-doom penalty",
        "tokens_counted": "sampled completion tokens, the end token included, no padding",
        "headline": "end to end: all completion tokens / the whole call's seconds (load, generation and update of "
                    "every step, saving)",
        "untimed_warmup_steps": TRAIN_WARMUP_STEPS,
        "timed_steps": settings.steps - TRAIN_WARMUP_STEPS,
        "stepped_ratio": round(summaries["ours"]["stepped_runs"]["median"]
                               / summaries["peer"]["stepped_runs"]["median"], 4),
        "wall_seconds_ratio": round(summaries["peer"]["end_to_end"]["seconds"]
                                    / summaries["ours"]["end_to_end"]["seconds"], 4),
        "ratio_runs": summaries["ratio_runs"],
        "peer_decoding": tried,
        "ours": summaries["ours"],
        "peer": summaries["peer"],
        "repeats": repeats.protocol(runs, quiet),
        "versions": package_versions("torch", "transformers", "accelerate", "datasets", "trl"),
    }
    return make_result(metric=METRIC, unit=UNIT, ours=ours_speed, peer=peer_speed,
                       peer_name=f"trl {package_versions('trl')['trl']} GRPOTrainer", config=config)


def main(argv: list[str] | None = None) -> dict:
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog="python -m bench.grpo_vs_trl", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80,
                        help=f"optimizer steps (one generation batch each), the first {TRAIN_WARMUP_STEPS} untimed")
    parser.add_argument("--max-tokens", type=int, default=_default("max_tokens"), help="max completion tokens")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--sft-steps", type=int, default=Settings.sft_steps,
                        help="SFT steps of the shared warm start (0: the untrained preset)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--peer-decoding", choices=["auto", *PEER_DECODING], default="auto",
                        help="TRL's generation cache; auto: the fastest on a short run of each (recorded)")
    repeats.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps <= TRAIN_WARMUP_STEPS:
        parser.error(f"--steps must be more than the {TRAIN_WARMUP_STEPS} untimed warm-up steps")
    quiet = repeats.wait_for_quiet(args.no_wait)
    result = run(Settings(steps=args.steps, max_tokens=args.max_tokens, threads=args.threads,
                          sft_steps=args.sft_steps), args.runs, quiet, args.peer_decoding)
    return report("grpo_vs_trl", result, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
