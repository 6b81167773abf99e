"""An evaluation's benchmarks beside its envs (tasks/common/benchmarks.py): lm-eval's tasks and HumanEval,
run for one checkpoint on the evaluation's own policy, in this process or on the server serving it."""

from __future__ import annotations

import os
from pathlib import Path

from tasks.common.benchmarks import HUMANEVAL, LM_EVAL
from tasks.common.context import StageContext
from tasks.config import Endpoint, python_files
from tasks.rollout.harness import LmEvalError


def benchmark_metrics(stage, policy, folder, tokenizer, ctx: StageContext, label: str) -> tuple[list[dict], dict]:
    """(rows of the evaluation's results dataset: a row per lm-eval document and per HumanEval sample,
    {`lm_eval.<task>` | `humaneval`: metrics}) of one checkpoint in `folder`."""
    from tasks.rollout.harness import run_lm_eval
    from tasks.rollout.humaneval import evaluate_humaneval

    metrics, rows = {}, []
    if stage.lm_eval is not None:
        documents, scores = run_lm_eval(lm_eval_model(stage, policy, folder, tokenizer), stage.lm_eval,
                                        task_folder(ctx), label, stage.seed)
        rows += documents
        metrics.update(scores)
    if stage.humaneval is not None:
        samples, metrics[HUMANEVAL] = evaluate_humaneval(policy, tokenizer, stage.humaneval, label, stage.seed)
        rows += samples
    return rows, metrics


def lm_eval_model(stage, policy, folder, tokenizer):
    """lm-eval's model of the checkpoint: the endpoint the stage's rollout backend decodes on, or else
    the policy's loaded model."""
    from tasks.rollout.harness import endpoint_model, hf_model

    rollout = stage.rollout
    if isinstance(rollout, Endpoint):
        api_key = os.environ.get(rollout.api_key_env) if rollout.api_key_env else None
        return endpoint_model(rollout.endpoint, rollout.model, folder, stage.lm_eval, api_key,
                              getattr(rollout, "max_model_len", None))
    return hf_model(policy.model, tokenizer, stage.lm_eval)


def task_folder(ctx: StageContext) -> Path | None:
    """The include_path's files, as the orchestrator kept them in the store, in the stage's work folder."""
    from data_contracts.snapshots import kept_files

    if LM_EVAL not in ctx.sources:
        return None
    folder = ctx.workdir / "lm_eval_tasks"
    if not folder.exists():
        files = kept_files(ctx.store, ctx.sources[LM_EVAL]["digest"])
        if python_files(files):  # the spec check refuses them: a store written by someone else could hold them
            raise LmEvalError(f"lm_eval.include_path: {python_files(files)[0]}: task folders hold no Python")
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    return folder
