"""lm-eval (EleutherAI's lm-evaluation-harness) as an evaluation backend: a checkpoint's results on lm-eval
tasks, run in this process through lm-eval's HF model on the loaded checkpoint (a LoRA adapter included), or
against the endpoint serving it (serve-model, vLLM) through lm-eval's `local-completions` model, whose
loglikelihood requests need the server's `echo` with prompt log-probs.

Results come back per task, `{"lm_eval.<task>": {"<metric>": value, ..., "n": documents}}` (`<metric>.<filter>`
where a task has several filters): the evaluation keeps each task beside its envs."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

from tasks.common.benchmarks import LM_EVAL, LmEvalSettings
from tasks.common.errors import NotRetryable


class LmEvalError(NotRetryable):
    """A task lm-eval does not know, or a task folder it cannot read; str() is one line."""


def hf_model(model, tokenizer, settings: LmEvalSettings):
    """lm-eval's HF model over an already loaded checkpoint (a PeftModel too), on the model's device."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size,
                max_length=getattr(model.config, "max_position_embeddings", None))


def endpoint_model(base_url: str, model: str, tokenizer_folder: str | Path, settings: LmEvalSettings,
                   api_key: str | None = None, max_length: int | None = None):
    """lm-eval's `local-completions` model at `base_url` (…/v1), token ids in (the checkpoint's tokenizer,
    read here), log-probs by `echo`."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(base_url=f"{base_url.rstrip('/')}/completions", model=model,
                               tokenizer=str(tokenizer_folder), tokenizer_backend="huggingface",
                               tokenized_requests=True, batch_size=settings.batch_size, max_length=max_length or 2048,
                               header={"Authorization": f"Bearer {api_key or 'none'}"})


def run_lm_eval(lm, settings: LmEvalSettings, task_folder: Path | None, label: str,
                seed: int = 0) -> tuple[list[dict], dict[str, dict]]:
    """(a row per task document, the tasks' metrics) of `lm`, with `task_folder` (the include_path's files) as
    lm-eval's include path and the working folder while it runs (task YAMLs name their data files relative
    to it)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = TaskManager(include_path=str(task_folder) if task_folder is not None else None)
    unknown = [task for task in settings.tasks if task not in manager.all_tasks]
    if unknown:
        where = f"lm-eval's tasks or {task_folder.name}/" if task_folder is not None else "lm-eval's tasks"
        raise LmEvalError(f"lm_eval.tasks: {', '.join(unknown)} not found in {where}")
    with working_folder(task_folder):
        results = simple_evaluate(model=lm, tasks=list(settings.tasks), num_fewshot=settings.num_fewshot,
                                  limit=settings.limit, task_manager=manager, log_samples=True,
                                  apply_chat_template=settings.apply_chat_template, bootstrap_iters=1000,
                                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed, verbosity="WARNING")
    return document_rows(results, label), flat_results(results)


def document_rows(results: dict, label: str) -> list[dict]:
    """A row of the evaluation's results dataset per task document (its first filter's): the answer lm-eval
    took (a generation, or the likeliest choice's continuation), `score` its task's first metric for it,
    `correct` whether that is 1 (a right choice, an exact match)."""
    rows = []
    for task, samples in results["samples"].items():
        seen = set()
        for sample in samples:
            if sample["doc_id"] in seen:
                continue  # the same document under the task's next filter
            seen.add(sample["doc_id"])
            metric = sample["metrics"][0]
            rows.append({"checkpoint": label, "env": f"{LM_EVAL}.{task}", "mode": "greedy",
                         "task_id": str(sample["doc_id"]), "prompt": str(sample["arguments"][0][0]),
                         "answer": str(sample["target"]), "completion": answer_of(sample),
                         "score": float(sample[metric]), "correct": bool(sample[metric] == 1),
                         "finish_reason": "stop", "completion_tokens": 0})
    return rows


def answer_of(sample: dict) -> str:
    """A generation's text (before the task's filters); for loglikelihood choices, the continuation with the
    highest log-prob."""
    responses = sample["filtered_resps"]
    if responses and isinstance(responses[0], (tuple, list)):
        best = max(range(len(responses)), key=lambda i: responses[i][0])
        return str(sample["arguments"][best][1])
    return str(sample["resps"][0][0]) if sample["resps"] and sample["resps"][0] else ""


def flat_results(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's `results` (`{"arith_mc": {"acc,none": 0.8, ...}}`) as `{"lm_eval.arith_mc": {"acc": 0.8,
    "acc_stderr": 0.06, "n": 40}}`, metrics in lm-eval's order; the filter's name joins the metric's only
    where a task reports several filters."""
    flat = {}
    for task, values in results["results"].items():
        keys = [key for key in values if "," in key]
        several_filters = len({key.split(",", 1)[1] for key in keys}) > 1
        metrics = {}
        for key in keys:
            metric, filter_name = key.split(",", 1)
            value = values[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                continue  # lm-eval's "N/A" stderr
            metrics[f"{metric}.{filter_name}" if several_filters else metric] = round(float(value), 4)
        metrics["n"] = results["n-samples"][task]["effective"]
        flat[f"{LM_EVAL}.{task}"] = metrics
    return flat


@contextlib.contextmanager
def working_folder(folder: Path | None):
    if folder is None:
        yield
        return
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)
