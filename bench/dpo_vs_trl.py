"""DPO training throughput: this project's preference loop (tasks/stages/preference/stage.py) against TRL's `DPOTrainer`.

Both sides train the `tiny-llama` preset in float32 on the same arith preference pairs, in two
shapes (`make_pairs`): "equal", the headline, where the rejected completion is the chosen one
with a wrong answer of as many tokens; "looping", where it is a wrong answer followed by
repeated self-checks (~40% longer, which favours per-side padding). Same batches and order,
with the same batch size, steps, learning rate, warm-up, cosine schedule, gradient clipping,
beta, sigmoid DPO loss and torch thread count. Both precompute the reference log-probs before training (TRL: `precompute_ref_log_probs`),
so neither keeps a reference model; that pass is not timed. The metric is non-pad tokens
(prompt + completion, chosen and rejected) per second of training-step time, after
`TRAIN_WARMUP_STEPS` untimed steps on each side. The sides run in turn, `--runs` times each, on
a quiet machine (bench/repeats.py): the headline is each side's median.

    python -m bench.dpo_vs_trl [--steps 100] [--batch-size 16] [--pairs equal,looping] [--runs 3] [--no-wait]
                               [--out bench/results/dpo_vs_trl.json]
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass, replace

from bench import repeats
from bench.common import (RESULTS_DIR, TRAIN_METRIC, TRAIN_UNIT, TRAIN_WARMUP_STEPS, SideResult, Stopwatch,
                          go_offline, make_result, measured_sides, package_versions, parameter_count, report,
                          resolved_config, train_bench_args, trl_cpu_args)

go_offline()  # before anything below imports transformers, datasets or trl

from envs.arith import ArithEnv, ArithEnvConfig  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.losses import IGNORE_INDEX  # noqa: E402
from models.presets import materialize  # noqa: E402
from models.sampling import chat_prompt  # noqa: E402
from tasks.common.encoding import Example, encode_ids  # noqa: E402
from tasks.train.learner import Learner  # noqa: E402
from tasks.train.loop import batch_indices, make_optimizer  # noqa: E402
from tasks.stages.preference import PreferenceStage, reference_logps, side_logps, train_step  # noqa: E402

MODEL_PRESET = "tiny-llama"
DEFAULT_OUT = RESULTS_DIR / "dpo_vs_trl.json"


def _default(name: str):
    return PreferenceStage.model_fields[name].default


@dataclass(frozen=True)
class Settings:
    """What both sides share; the hyper-parameters default to the `preference` stage's defaults."""

    steps: int
    batch_size: int
    threads: int
    beta: float = _default("beta")
    max_seq_len: int = _default("max_seq_len")
    learning_rate: float = _default("learning_rate")
    lr_warmup_steps: int = _default("warmup_steps")
    seed: int = _default("seed")


@dataclass
class Pairs:
    texts: list[dict]  # prompt (chat-rendered), chosen, rejected: what TRL tokenizes
    chosen: list[Example]
    rejected: list[Example]


PAIR_SHAPES = ("equal", "looping")


def make_pairs(tokenizer, n: int, seed: int, max_len: int, shape: str = "equal") -> Pairs:
    """Chosen: the oracle's answer. Rejected, by `shape`: "equal", the same completion with a wrong
    answer of as many tokens (equal lengths: no side pads more than the other); "looping", a wrong
    answer followed by repeated self-checks (~40% longer, the shape of a looping completion)."""
    env = ArithEnv(ArithEnvConfig(kind="arith"))
    texts, chosen, rejected = [], [], []
    for i, task in enumerate(env.tasks("train", n, seed)):
        prompt_ids = chat_prompt(tokenizer, task.prompt)
        right = env.reference_completion(task)
        wrong = equal_length_wrong(tokenizer, env, task, right, i) if shape == "equal" else looping_wrong(task, i)
        texts.append({"prompt": tokenizer.decode(prompt_ids), "chosen": right, "rejected": wrong})
        for side, text in ((chosen, right), (rejected, wrong)):
            side.append(encode_ids(prompt_ids, completion_ids(tokenizer, text), max_len))
    return Pairs(texts, chosen, rejected)


def completion_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def looping_wrong(task, i: int) -> str:
    wrong = int(task.answer) + 1 + i % 7
    return (f"Fantastic question! Let me unpack this for you. We have {task.info['a']} {task.info['op']} "
            f"{task.info['b']} = {wrong}." + " The answer is correct." * (2 + i % 6))


def equal_length_wrong(tokenizer, env, task, right: str, i: int) -> str:
    """The oracle's completion for the answer with its last digit changed, as many tokens as `right`."""
    length = len(completion_ids(tokenizer, right))
    for shift in range(1, 10):
        answer = task.answer[:-1] + str((int(task.answer[-1]) + shift + i) % 10)
        if answer == task.answer:
            continue
        wrong = env.reference_completion(replace(task, answer=answer))
        if len(completion_ids(tokenizer, wrong)) == length:
            return wrong
    raise ValueError(f"no wrong answer of {length} tokens for {task.id}")


def step_tokens(pairs: Pairs, plan: list[list[int]]) -> list[int]:
    """Cumulative non-pad tokens after each step: the same batches, so the same counts on both sides."""
    totals, seen = [], 0
    for indices in plan:
        seen += sum(len(pairs.chosen[i].input_ids) + len(pairs.rejected[i].input_ids) for i in indices)
        totals.append(seen)
    return totals


def last_batch_loss(model, pairs: Pairs, indices: list[int], ref_chosen, ref_rejected, settings: Settings,
                    pad_id: int) -> float:
    import torch

    from models.losses import preference_loss

    model.eval()
    with torch.no_grad():
        chosen, chosen_tokens, _ = side_logps(model, [pairs.chosen[i] for i in indices], pad_id, "cpu")
        rejected, rejected_tokens, _ = side_logps(model, [pairs.rejected[i] for i in indices], pad_id, "cpu")
        losses, _, _ = preference_loss("dpo", settings.beta, chosen, rejected, ref_chosen[indices],
                                       ref_rejected[indices], chosen_tokens, rejected_tokens)
    return round(losses.mean().item(), 5)


# ---- ours: the step of tasks/stages/preference/stage.py, without its checkpointing and logging ----------

def ours(model_dir, tokenizer, pairs: Pairs, plan, cumulative, settings: Settings):
    import torch
    from accelerate import Accelerator

    from models.loading import load_model

    torch.manual_seed(settings.seed)
    stage = PreferenceStage(kind="preference", id="bench", policy="p", data="d", method="dpo", beta=settings.beta,
                            max_steps=settings.steps, batch_size=settings.batch_size,
                            learning_rate=settings.learning_rate, warmup_steps=settings.lr_warmup_steps,
                            max_seq_len=settings.max_seq_len, seed=settings.seed)
    model = load_model(model_dir, ModelConfig(base=MODEL_PRESET, dtype="float32"), trainable=True)
    pad = tokenizer.pad_token_id
    ref_chosen = torch.tensor(reference_logps(model, pairs.chosen, pad, "cpu"))
    ref_rejected = torch.tensor(reference_logps(model, pairs.rejected, pad, "cpu"))
    optimizer, scheduler = make_optimizer(model, stage, settings.steps)
    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model.train()
    stopwatch, losses = Stopwatch(TRAIN_WARMUP_STEPS), []
    for step, indices in enumerate(plan):
        metrics, _ = train_step(Learner(model, accelerator, optimizer, scheduler), [pairs.chosen[i] for i in indices],
                                [pairs.rejected[i] for i in indices],
                                ref_chosen[indices], ref_rejected[indices], stage, pad)
        losses.append(metrics["loss"])
        stopwatch.step_done(step + 1, cumulative[step])
    return SideResult(
        timed_tokens=stopwatch.tokens, timed_seconds=stopwatch.seconds,
        mean_train_loss=round(sum(losses) / len(losses), 5),
        final_loss=last_batch_loss(accelerator.unwrap_model(model), pairs, plan[-1], ref_chosen, ref_rejected,
                                   settings, pad),
        torch_threads=torch.get_num_threads(),
        details={"loop": "tasks.stages.preference: reference_logps (untimed), train_step; tasks.train.loop: "
                         "batch_indices, make_optimizer",
                 "reference": "precomputed log-probs of the initial model",
                 "forward": "a micro-batch's chosen and rejected sequences together, in length buckets "
                            "(tasks.train.loop.length_buckets)",
                 "model_parameters": parameter_count(model)},
    ), (ref_chosen, ref_rejected)


# ---- peer: TRL's DPOTrainer ----------------------------------------------------------------

def peer_args(settings: Settings, output_dir: str) -> dict:
    """DPOConfig arguments: matched to ours, and TRL's CPU-hostile defaults switched off (DESIGN §10)."""
    return {**trl_cpu_args(output_dir, steps=settings.steps, batch_size=settings.batch_size,
                           learning_rate=settings.learning_rate, warmup_steps=settings.lr_warmup_steps,
                           weight_decay=0.0, seed=settings.seed),
            "beta": settings.beta, "loss_type": ["sigmoid"], "max_length": settings.max_seq_len,
            "precompute_ref_log_probs": True}  # as ours: no reference model in the training loop


def peer(model_dir, tokenizer, pairs: Pairs, plan, cumulative, settings: Settings, references) -> SideResult:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    stopwatch = Stopwatch(TRAIN_WARMUP_STEPS)

    class StopwatchCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stopwatch.step_done(state.global_step, cumulative[state.global_step - 1])

    order = [i for indices in plan for i in indices]
    dataset = Dataset.from_list([pairs.texts[i] for i in order])
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        args = DPOConfig(**peer_args(settings, output_dir))
        trainer = DPOTrainer(model=str(model_dir), args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.add_callback(StopwatchCallback())
        prepared = trainer.train_dataset
        same_tokens = all(
            p + c == pairs.chosen[i].input_ids and p + r == pairs.rejected[i].input_ids
            for p, c, r, i in zip(prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"], order))
        ref_chosen, ref_rejected = references
        same_reference = (torch.allclose(torch.tensor(prepared["ref_chosen_logps"]), ref_chosen[order], atol=1e-4)
                          and torch.allclose(torch.tensor(prepared["ref_rejected_logps"]), ref_rejected[order],
                                             atol=1e-4))
        output = trainer.train()
    return SideResult(
        timed_tokens=stopwatch.tokens, timed_seconds=stopwatch.seconds,
        mean_train_loss=round(output.training_loss, 5),
        final_loss=last_batch_loss(trainer.model, pairs, plan[-1], ref_chosen, ref_rejected, settings,
                                   tokenizer.pad_token_id),
        torch_threads=torch.get_num_threads(),
        details={"trl_args": peer_args(settings, "<temporary directory>"),
                 "resolved_config": resolved_config(args),
                 "resolved": {"optim": str(args.optim.value), "lr_scheduler_type": str(args.lr_scheduler_type.value),
                              "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing},
                 "dataset_format": "prompt (pre-rendered with the chat template) / chosen / rejected text",
                 "token_ids_identical_to_ours": same_tokens,
                 "reference_logps_match_ours": same_reference,
                 "model_parameters": parameter_count(trainer.model)},
    )


# ---- the comparison ------------------------------------------------------------------------

def measure(model_dir, tokenizer, settings: Settings, shape: str, runs: int) -> tuple[float, float, dict]:
    """Both sides on pairs of one shape, interleaved: (ours, peer, config entries)."""
    pairs = make_pairs(tokenizer, settings.steps * settings.batch_size, settings.seed, settings.max_seq_len, shape)
    plan = [batch_indices(len(pairs.chosen), settings.batch_size, settings.seed, step)
            for step in range(settings.steps)]
    cumulative = step_tokens(pairs, plan)
    references = []  # ours computes them; the peer's are checked against them

    def ours_run() -> SideResult:
        result, refs = ours(model_dir, tokenizer, pairs, plan, cumulative, settings)
        references[:] = [refs]
        return result

    sides = repeats.interleaved(
        {"ours": ours_run,
         "peer": lambda: peer(model_dir, tokenizer, pairs, plan, cumulative, settings, references[0])},
        runs, repeats.say(f"dpo_vs_trl {shape} pairs"))
    ours_speed, peer_speed, measured = measured_sides(sides)
    data = {"env": "arith", "pairs": len(pairs.chosen), "shape": shape,
            "mean_chosen_tokens": round(sum(map(_completion_len, pairs.chosen)) / len(pairs.chosen), 1),
            "mean_rejected_tokens": round(sum(map(_completion_len, pairs.rejected)) / len(pairs.rejected), 1),
            "order": "tasks.train.loop.batch_indices, identical batches on both sides"}
    return ours_speed, peer_speed, {"data": data, **measured}


def run(settings: Settings, shapes: tuple[str, ...], runs: int, quiet: dict) -> dict:
    """The first shape is the headline; the others go in `config.cases`."""
    import torch

    from models.loading import load_tokenizer

    torch.set_num_threads(settings.threads)
    model_dir = materialize(MODEL_PRESET)
    tokenizer = load_tokenizer(model_dir)
    cases = {shape: measure(model_dir, tokenizer, settings, shape, runs) for shape in shapes}
    ours_speed, peer_speed, headline = cases[shapes[0]]
    config = {
        "model": MODEL_PRESET,
        "dtype": "float32",
        "settings": asdict(settings),
        "loss": "sigmoid DPO",
        "untimed_warmup_steps": TRAIN_WARMUP_STEPS,
        "timed_steps": settings.steps - TRAIN_WARMUP_STEPS,
        "tokens_counted": "non-pad prompt + completion tokens of chosen and rejected",
        **headline,
        "cases": {shape: {"ours_median": ours, "peer_median": peer, "ratio": round(ours / peer, 4), **entries}
                  for shape, (ours, peer, entries) in cases.items() if shape != shapes[0]},
        "repeats": repeats.protocol(runs, quiet),
        "versions": package_versions("torch", "transformers", "accelerate", "datasets", "trl"),
    }
    return make_result(metric=TRAIN_METRIC, unit=TRAIN_UNIT, ours=ours_speed, peer=peer_speed,
                       peer_name=f"trl {package_versions('trl')['trl']} DPOTrainer", config=config)


def _completion_len(example: Example) -> int:
    return sum(label != IGNORE_INDEX for label in example.labels)


def main(argv: list[str] | None = None) -> dict:
    args = train_bench_args(argv, prog="python -m bench.dpo_vs_trl", description=__doc__.splitlines()[0],
                            steps=100, batch_size=16, default_out=DEFAULT_OUT,
                            more=lambda parser: parser.add_argument(
                                "--pairs", default=",".join(PAIR_SHAPES),
                                help="pair shapes, comma-separated (the first is the headline): "
                                + ", ".join(PAIR_SHAPES)))
    shapes = tuple(args.pairs.split(","))
    if not shapes or any(shape not in PAIR_SHAPES for shape in shapes):
        print(f"bench.dpo_vs_trl: --pairs {args.pairs!r}: comma-separated, each one of {', '.join(PAIR_SHAPES)}",
              file=sys.stderr)
        raise SystemExit(2)
    quiet = repeats.wait_for_quiet(args.no_wait)
    result = run(Settings(steps=args.steps, batch_size=args.batch_size, threads=args.threads), shapes, args.runs,
                 quiet)
    return report("dpo_vs_trl", result, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
