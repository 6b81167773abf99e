"""`synthesize`: teacher traces for SFT from an environment's train split.

The teacher is the env's programmatic oracle; an OpenAI-compatible endpoint plugs in at
`teacher_completions` later.
"""

from __future__ import annotations

from envs.base import Task
from envs.loader import make_env
from tasks.config import SynthesizeStage
from tasks.datasets import write_rows
from tasks.stage import StageContext, StageOutput


def teacher_completions(env, tasks: list[Task], teacher: str) -> list[str]:
    if teacher == "oracle":
        return [env.reference_completion(task) for task in tasks]
    raise ValueError(f"unknown teacher {teacher!r}")


def run(stage: SynthesizeStage, ctx: StageContext) -> dict[str, StageOutput]:
    env = make_env(stage.env, ctx.envs[stage.env])
    tasks = env.tasks("train", stage.n, stage.seed)
    completions = teacher_completions(env, tasks, stage.teacher)
    rows = [{"id": task.id, "env": stage.env, "prompt": task.prompt, "completion": completion,
             "answer": task.answer} for task, completion in zip(tasks, completions)]
    out_dir = ctx.workdir / "dataset"
    write_rows(rows, out_dir)
    correct = sum(env.is_correct(c, t) for c, t in zip(completions, tasks))
    ctx.log(f"{len(rows)} examples from {stage.env} ({stage.teacher} teacher)")
    return {"dataset": StageOutput("dataset", out_dir, {"rows": len(rows), "teacher_accuracy": correct / len(rows)})}
