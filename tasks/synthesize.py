"""`synthesize`: teacher traces for SFT from an environment's train split.

The teacher is the env's programmatic oracle; an OpenAI-compatible endpoint plugs in at
`teacher_completions` later. Each row carries its token length under the spec's model, so
the sft contract can hold it to the model's context.
"""

from __future__ import annotations

from data_contracts.config import ContractParams
from envs.base import Task
from envs.loader import make_env
from models.loading import context_length, load_tokenizer, resolve_base
from models.sampling import chat_prompt
from tasks.config import SynthesizeStage
from tasks.datasets import write_rows
from tasks.stage import StageContext, StageOutput


def teacher_completions(env, tasks: list[Task], teacher: str) -> list[str]:
    if teacher == "oracle":
        return [env.reference_completion(task) for task in tasks]
    raise ValueError(f"unknown teacher {teacher!r}")


def total_tokens(tokenizer, prompt: str, completion: str) -> int:
    """Length of the chat-formatted example as SFT will train on it (prompt + completion + end token)."""
    return len(chat_prompt(tokenizer, prompt)) + len(tokenizer(completion, add_special_tokens=False)["input_ids"]) + 1


def run(stage: SynthesizeStage, ctx: StageContext) -> dict[str, StageOutput]:
    env = make_env(stage.env, ctx.envs[stage.env])
    tasks = env.tasks("train", stage.n, stage.seed)
    completions = teacher_completions(env, tasks, stage.teacher)
    base = resolve_base(ctx.model.base)
    tokenizer = load_tokenizer(base)
    rows = [{"id": task.id, "env": stage.env, "prompt": task.prompt, "completion": completion,
             "answer": task.answer, "total_tokens": total_tokens(tokenizer, task.prompt, completion)}
            for task, completion in zip(tasks, completions)]
    out_dir = ctx.workdir / "dataset"
    write_rows(rows, out_dir)
    correct = sum(env.is_correct(c, t) for c, t in zip(completions, tasks))
    ctx.log(f"{len(rows)} examples from {stage.env} ({stage.teacher} teacher)")
    contract = ContractParams(kind="sft", context_length=context_length(base))
    return {"dataset": StageOutput("dataset", out_dir, {"rows": len(rows), "teacher_accuracy": correct / len(rows)},
                                   contract)}
