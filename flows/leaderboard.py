"""Every evaluated checkpoint of a pipeline side by side, read from the store's evaluation results.

The rows come from the manifests of the committed evaluation results (the primary dataset of
every kind that `produces` an evaluation: the pipeline's own evaluate stages and the evaluation
flow's `<checkpoint>.eval` datasets; their metrics are `{checkpoint: {env: {..., n}}}`, a benchmark's
beside the envs as `lm_eval.<task>` or `humaneval`), so the
leaderboard is the same whichever process or machine evaluated what.
"""

from __future__ import annotations

from artifacts.store import Store
from tasks.common.benchmarks import headline, headline_name, is_benchmark
from tasks.common.report_images import prefect_key
from tasks.kinds import produces

COLUMNS = ("accuracy", "format_rate", "doom_loop_rate", "n")


def evaluations(store: Store, pipeline: str) -> list[dict]:
    """One row per (checkpoint ref, env, n): its metrics, the evaluation's ref, and the checkpoint's
    run, creation time, stage, cache key, step and inputs; the newest evaluation wins when
    settings repeat."""
    manifests = store.manifests(pipeline)
    evaluated = [m for m in manifests.values()
                 if m["kind"] == "dataset" and produces(m["producer"].get("stage_kind")) == "evaluation"]
    rows: dict[tuple, dict] = {}
    for manifest in sorted(evaluated, key=lambda m: m["created"]):
        for key, checkpoint in manifest["inputs"].items():
            by_env = manifest["metrics"].get(key)
            if not isinstance(by_env, dict):
                continue  # an input the evaluation did not score
            for env_id, metrics in by_env.items():
                rows[(checkpoint, env_id, metrics["n"])] = {"checkpoint": checkpoint, "env": env_id, **metrics,
                                                            "headline": headline(env_id, metrics),
                                                            "evaluation": manifest["ref"]}
    checkpoints = {row["checkpoint"]: manifests.get(row["checkpoint"]) or store.manifest(row["checkpoint"])
                   for row in rows.values()}
    for row in rows.values():
        manifest = checkpoints[row["checkpoint"]]
        producer = manifest["producer"]
        row.update(run_id=producer.get("run_id"), created=manifest["created"], stage=producer.get("stage_id"),
                   cache_key=producer.get("cache_key"), step=checkpoint_step(manifest),
                   inputs=list(manifest["inputs"].values()))
    return sorted(rows.values(), key=lambda row: (row["created"], row["checkpoint"], row["env"]))


def checkpoint_step(manifest: dict) -> int | None:
    """The training step a checkpoint holds: an in-stage one's, or the stage's last (None: no step)."""
    metrics = manifest["metrics"]
    step = metrics.get("promoted_at_step", metrics.get("steps"))
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def leaderboard_table(rows: list[dict]) -> list[dict]:
    """One row per checkpoint, a column per (env, metric): the checkpoints side by side."""
    table: dict[str, dict] = {}
    for row in rows:
        entry = table.setdefault(row["checkpoint"], {"checkpoint": row["checkpoint"], "run": row["run_id"]})
        if is_benchmark(row["env"]):  # an lm-eval task's or HumanEval's: its headline metric and n
            entry[f"{row['env']} {headline_name(row['env'], row_metrics(row))}"] = row["headline"]
            entry[f"{row['env']} n"] = row["n"]
            continue
        for column in COLUMNS:
            entry[f"{row['env']} {column}"] = row.get(column)
    return list(table.values())


def row_metrics(row: dict) -> dict:
    """A row's metrics alone, in their order (what `evaluations` put between `env` and `headline`)."""
    names = list(row)
    return {name: row[name] for name in names[names.index("env") + 1:names.index("headline")]}


def publish_leaderboard(store: Store, pipeline: str, attempts: int = 3) -> str | None:
    """Publish the pipeline's leaderboard as a Prefect table artifact (inside a flow or task run).

    Evaluations finishing at the same time could publish out of order, the latest artifact
    missing a row; each publisher reads the store again after publishing and republishes if it
    changed, so the last one published holds every evaluation committed before it. Like a
    report, a leaderboard that cannot be published is logged, not raised: the evaluation is
    committed, and a display problem must not fail its run.
    """
    from prefect import get_run_logger
    from prefect.artifacts import create_table_artifact

    key = prefect_key(pipeline, "leaderboard")
    try:
        table = leaderboard_table(evaluations(store, pipeline))
        for _ in range(attempts):
            if not table:
                return None
            create_table_artifact(table=table, key=key,
                                  description=f"every evaluated checkpoint of pipeline {pipeline} ({store.uri})")
            latest = leaderboard_table(evaluations(store, pipeline))
            if latest == table:
                break
            table = latest
    except Exception as exc:
        get_run_logger().warning(f"leaderboard {key} not published: {type(exc).__name__}: {exc}")
        return None
    return key
