"""SFT training throughput: this project's SFT loop (tasks/stages/sft.py) against TRL's `SFTTrainer`.

Both sides train the `tiny-llama` preset in float32 on the same arith prompt/completion pairs,
in the same batches and order, with the same batch size, steps, max sequence length, learning
rate, warm-up, weight decay, gradient clipping and torch thread count, completion-only loss.
The metric is non-pad (prompt + completion) tokens per second of training-step time, after
`TRAIN_WARMUP_STEPS` untimed steps on each side. Setup (loading, tokenizing) is not timed.
The sides run in turn, `--runs` times each, on a quiet machine (bench/repeats.py): the headline
is each side's median.

    python -m bench.sft_vs_trl [--steps 200] [--batch-size 32] [--runs 3] [--no-wait]
                               [--out bench/results/sft_vs_trl.json]
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import repeats
from bench.common import (GRAD_CLIP, RESULTS_DIR, TRAIN_METRIC, TRAIN_UNIT, TRAIN_WARMUP_STEPS, SideResult,
                          Stopwatch, go_offline, make_result, measured_sides, package_versions, parameter_count,
                          report, resolved_config, train_bench_args, trl_cpu_args)

go_offline()  # before anything below imports transformers, datasets or trl

from envs.arith import ArithEnv, ArithEnvConfig  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.losses import completion_nll  # noqa: E402
from models.presets import materialize  # noqa: E402
from tasks.common.encoding import Example, collate, encode_example  # noqa: E402
from tasks.train.learner import Learner  # noqa: E402
from tasks.train.loop import batch_indices, make_optimizer  # noqa: E402
from tasks.stages.sft import SftStage, train_step  # noqa: E402

MODEL_PRESET = "tiny-llama"
DEFAULT_OUT = RESULTS_DIR / "sft_vs_trl.json"


def _sft_default(name: str):
    return SftStage.model_fields[name].default


@dataclass(frozen=True)
class Settings:
    """What both sides share; the SFT hyper-parameters default to the `sft` stage's defaults."""

    steps: int
    batch_size: int
    threads: int
    max_seq_len: int = _sft_default("max_seq_len")
    learning_rate: float = _sft_default("learning_rate")
    lr_warmup_steps: int = _sft_default("warmup_steps")
    weight_decay: float = _sft_default("weight_decay")
    seed: int = _sft_default("seed")


# ---- data ----------------------------------------------------------------------------------

def arith_rows(n: int, seed: int) -> list[dict]:
    env = ArithEnv(ArithEnvConfig(kind="arith"))
    return [{"prompt": task.prompt, "completion": env.reference_completion(task)}
            for task in env.tasks("train", n, seed)]


def batch_plan(n_examples: int, settings: Settings) -> list[list[int]]:
    """The example indices of every step, exactly as tasks/stages/sft.py draws them."""
    return [batch_indices(n_examples, settings.batch_size, settings.seed, step) for step in range(settings.steps)]


def last_batch_loss(model, examples: list[Example], indices: list[int], pad_id: int) -> float:
    import torch

    device = next(model.parameters()).device
    ids, mask, labels = collate([examples[i] for i in indices], pad_id, device)
    model.eval()
    with torch.no_grad():
        loss, _ = completion_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
    return round(loss.item(), 5)


# ---- ours: the step of tasks/stages/sft.py, without its checkpointing and logging -----------------

def ours(model_dir: Path, tokenizer, examples: list[Example], settings: Settings) -> SideResult:
    import torch
    from accelerate import Accelerator

    from models.loading import load_model

    torch.manual_seed(settings.seed)
    steps, batch_size, seed = settings.steps, settings.batch_size, settings.seed
    stage = SftStage(kind="sft", id="bench", data="bench", max_steps=steps, batch_size=batch_size,
                     learning_rate=settings.learning_rate, weight_decay=settings.weight_decay,
                     warmup_steps=settings.lr_warmup_steps, max_seq_len=settings.max_seq_len, seed=seed)
    model = load_model(model_dir, ModelConfig(base=MODEL_PRESET, dtype="float32"), trainable=True)
    optimizer, scheduler = make_optimizer(model, stage, steps)
    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    model.train()
    stopwatch, losses, tokens_seen = Stopwatch(TRAIN_WARMUP_STEPS), [], 0
    for step in range(steps):
        batch = [examples[i] for i in batch_indices(len(examples), batch_size, seed, step)]
        loss, tokens = train_step(Learner(model, accelerator, optimizer, scheduler), batch, tokenizer.pad_token_id)
        tokens_seen += tokens
        losses.append(loss)
        stopwatch.step_done(step + 1, tokens_seen)

    final_indices = batch_indices(len(examples), batch_size, seed, steps - 1)
    return SideResult(
        timed_tokens=stopwatch.tokens, timed_seconds=stopwatch.seconds,
        mean_train_loss=round(sum(losses) / len(losses), 5),
        final_loss=last_batch_loss(accelerator.unwrap_model(model), examples, final_indices, tokenizer.pad_token_id),
        torch_threads=torch.get_num_threads(),
        details={"loop": "tasks.common.encoding: encode_example; tasks.stages.sft: train_step; "
                           "tasks.train.loop: batch_indices, make_optimizer",
                 "optimizer": f"torch.optim.AdamW(lr={settings.learning_rate}, "
                              f"weight_decay={settings.weight_decay}), torch's default implementation",
                 "scheduler": "LambdaLR(tasks.train.loop.lr_factor): linear warm-up, cosine to 10% of peak",
                 "grad_clip": GRAD_CLIP, "accelerate": True, "last_step_loss": round(losses[-1], 5),
                 "model_parameters": parameter_count(model)},
    )


# ---- peer: TRL's SFTTrainer ----------------------------------------------------------------

def peer_args(settings: Settings, output_dir: str) -> dict:
    """SFTConfig arguments: matched to ours, and TRL's CPU-hostile defaults switched off (DESIGN §10)."""
    return {**trl_cpu_args(output_dir, steps=settings.steps, batch_size=settings.batch_size,
                           learning_rate=settings.learning_rate, warmup_steps=settings.lr_warmup_steps,
                           weight_decay=settings.weight_decay, seed=settings.seed),
            "max_length": settings.max_seq_len, "packing": False, "completion_only_loss": True,
            "loss_type": "nll",  # the plain per-token NLL ours computes (pinned: a newer default may differ)
            "include_num_input_tokens_seen": "non_padding"}  # TRL's own count of the tokens we measure


def _stopwatch_callback(stopwatch: Stopwatch):
    from transformers import TrainerCallback

    class StopwatchCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stopwatch.step_done(state.global_step, state.num_input_tokens_seen)

    return StopwatchCallback()


def chat_prompt(tokenizer, prompt: str) -> str:
    """The prompt exactly as encode_example renders it (chat template plus generation prompt)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def peer(model_dir: Path, tokenizer, rows: list[dict], plan: list[list[int]], examples: list[Example],
         settings: Settings) -> SideResult:
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    # Prompt/completion format with the prompt pre-rendered: TRL tokenizes it to exactly our
    # token ids (checked below). The conversational format would add the template's trailing
    # newline after the end token, one more trained token per example than ours.
    ordered = [rows[i] for indices in plan for i in indices]
    dataset = Dataset.from_list([{"prompt": chat_prompt(tokenizer, r["prompt"]), "completion": r["completion"]}
                                 for r in ordered])
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        args = SFTConfig(**peer_args(settings, output_dir))
        trainer = SFTTrainer(model=str(model_dir), args=args, train_dataset=dataset, processing_class=tokenizer)
        stopwatch = Stopwatch(TRAIN_WARMUP_STEPS)
        trainer.add_callback(_stopwatch_callback(stopwatch))
        same_tokens = _same_tokens(trainer.train_dataset, [examples[i] for indices in plan for i in indices])
        output = trainer.train()

    model = trainer.model
    return SideResult(
        timed_tokens=stopwatch.tokens, timed_seconds=stopwatch.seconds,
        mean_train_loss=round(output.training_loss, 5),
        final_loss=last_batch_loss(model, examples, plan[-1], tokenizer.pad_token_id),
        torch_threads=torch.get_num_threads(),
        details={"trl_args": peer_args(settings, "<temporary directory>"),
                 "resolved_config": resolved_config(args),
                 "resolved": {"optim": str(args.optim.value), "lr_scheduler_type": str(args.lr_scheduler_type.value),
                              "completion_only_loss": trainer.completion_only_loss,
                              "loss_type": args.loss_type,
                              "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
                              "activation_checkpointing": args.activation_checkpointing},
                 "dataset_format": "prompt/completion, prompt pre-rendered with the chat template",
                 "token_ids_identical_to_ours": same_tokens,
                 "model_parameters": parameter_count(model)},
    )


def _same_tokens(prepared, expected: list[Example]) -> bool:
    """Whether TRL's tokenized dataset holds our input ids and our completion-only labels."""
    return (len(prepared) == len(expected)
            and list(prepared["input_ids"]) == [e.input_ids for e in expected]
            and list(prepared["labels"]) == [e.labels for e in expected])


# ---- the comparison ------------------------------------------------------------------------

def run(settings: Settings, runs: int, quiet: dict) -> dict:
    import torch

    from models.loading import load_tokenizer

    torch.set_num_threads(settings.threads)
    model_dir = materialize(MODEL_PRESET)
    tokenizer = load_tokenizer(model_dir)
    rows = arith_rows(settings.steps * settings.batch_size, settings.seed)  # one epoch, no example repeats
    examples = [encode_example(tokenizer, r["prompt"], r["completion"], settings.max_seq_len) for r in rows]
    plan = batch_plan(len(examples), settings)

    sides = repeats.interleaved({"ours": lambda: ours(model_dir, tokenizer, examples, settings),
                                 "peer": lambda: peer(model_dir, tokenizer, rows, plan, examples, settings)},
                                runs, repeats.say("sft_vs_trl"))
    ours_speed, peer_speed, measured = measured_sides(sides)
    config = {
        "model": MODEL_PRESET,
        "dtype": "float32",
        "data": {"env": "arith", "split": "train", "examples": len(examples),
                 "truncated_examples": sum(e.truncated for e in examples),
                 "order": "tasks.train.loop.batch_indices, identical batches on both sides"},
        "settings": asdict(settings),
        "untimed_warmup_steps": TRAIN_WARMUP_STEPS,
        "timed_steps": settings.steps - TRAIN_WARMUP_STEPS,
        "tokens_counted": "non-pad prompt + completion tokens (attention mask sum)",
        **measured,
        "repeats": repeats.protocol(runs, quiet),
        "versions": package_versions("torch", "transformers", "accelerate", "datasets", "trl"),
    }
    return make_result(metric=TRAIN_METRIC, unit=TRAIN_UNIT, ours=ours_speed, peer=peer_speed,
                       peer_name=_peer_name(), config=config)


def _peer_name() -> str:
    return f"trl {package_versions('trl')['trl']} SFTTrainer"


def main(argv: list[str] | None = None) -> dict:
    args = train_bench_args(argv, prog="python -m bench.sft_vs_trl", description=__doc__.splitlines()[0],
                            steps=200, batch_size=32, default_out=DEFAULT_OUT)
    quiet = repeats.wait_for_quiet(args.no_wait)
    result = run(Settings(steps=args.steps, batch_size=args.batch_size, threads=args.threads), args.runs, quiet)
    return report("sft_vs_trl", result, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
