"""What the CLI prints: the stage DAG, run reports, run lists."""

from __future__ import annotations

from flows.learning_curves import LearningCurve, learning_curves
from flows.spec import PipelineSpec, topological_order
from tasks.common.progress import step_and_eta
from tasks.kinds import produces


def print_dag(spec: PipelineSpec) -> None:
    print(f"pipeline {spec.name}")
    print(f"  store  {spec.store}")
    print(f"  model  {spec.model.base}" + (f" + LoRA r={spec.model.lora.r}" if spec.model.lora else ""))
    print(f"  envs   {', '.join(f'{k} ({v.kind})' for k, v in spec.envs.items())}")
    at_once = f", up to {spec.max_parallel_stages} at once" if spec.max_parallel_stages > 1 else ""
    print(f"stages (run order{at_once}):")
    for stage in topological_order(spec):
        deps = [target for _, target, _ in spec.inputs_of(stage)]
        r = spec.resolved(stage)
        trains = "report_to" in type(stage).model_fields  # the defaults' trackers apply to training stages only
        trackers = f" report_to={','.join(r.report_to)}" if r.report_to and trains else ""
        print(f"  {stage.id:<14} {stage.kind:<11} <- {', '.join(deps) or '-':<16} retries={r.retries} "
              f"retry_delay={r.retry_delay_seconds:g}s timeout={r.timeout_seconds:g}s gpus={r.gpus}{trackers}")
        params = ", ".join(f"{k}={v}" for k, v in stage.params().items() if k != "kind")
        print(f"  {'':<14} {params}")


def eval_rows(summary: dict) -> list[tuple[str, str, dict]]:
    """(checkpoint, env, metrics) of every evaluation stage, checkpoints in the order the run made them."""
    made = [stage["id"] for stage in summary["stages"]]
    rows = []
    for stage in summary["stages"]:
        if produces(stage["kind"]) == "evaluation":
            for checkpoint in sorted(stage["metrics"], key=lambda c: made.index(c) if c in made else len(made)):
                rows += [(checkpoint, env, metrics) for env, metrics in stage["metrics"][checkpoint].items()]
    return rows


def print_stage_table(summary: dict) -> None:
    print(f"{'stage':<14} {'kind':<11} {'state':<10} {'seconds':>8}  {'device':<7} {'RAM GB':>6} {'GPU GB':>6}  outputs")
    for stage in summary["stages"]:
        outputs = ", ".join(stage["outputs"].values())
        print(f"{stage['id']:<14} {stage['kind']:<11} {stage['state']:<10} {stage['seconds']:>8.1f}  "
              f"{resources(stage)}  {outputs}")
        if stage.get("error"):
            print(f"{'':<14} error: {stage['error']}")
    for stage_id, progress in summary.get("running", {}).items():
        print(f"{stage_id:<14} {'':<11} {'running':<10} {'':>8}  {step_and_eta(progress)}")
    for stage_id in summary.get("not_run", []):
        print(f"{stage_id:<14} {'':<11} {'not run':<10}  (an input stage failed)")


def resources(stage: dict) -> str:
    """Where the stage ran and its peak memory (resident, GPU), as the table's columns; `-` where its
    record does not say (a failed stage, a summary from before these fields, no CUDA)."""
    def gigabytes(key: str) -> str:
        return f"{stage[key]:.1f}" if stage.get(key) is not None else "-"

    return f"{stage.get('device') or '-':<7} {gigabytes('peak_rss_gb'):>6} {gigabytes('peak_gpu_gb'):>6}"


def print_run_report(summary: dict) -> None:
    print()
    print(f"run {summary['run_id']}: {summary['state']} in {summary.get('seconds', 0):.1f}s")
    print_stage_table(summary)
    rows = eval_rows(summary)
    if rows:
        print()
        print(f"{'checkpoint':<14} {'env':<10} {'accuracy':>9} {'sampled':>8} {'format':>7} {'doom-loop':>10} "
              f"{'tokens':>7}")
        for checkpoint, env, m in rows:
            sampled = f"{m['sampled_accuracy']:.1%}" if "sampled_accuracy" in m else "-"
            print(f"{checkpoint:<14} {env:<10} {m['accuracy']:>9.1%} {sampled:>8} {m['format_rate']:>7.1%} "
                  f"{m['doom_loop_rate']:>10.1%} {m['mean_completion_tokens']:>7.1f}")
    if summary.get("evaluations"):
        print()
        print("evaluated inline (evaluation.on_new_checkpoint, ephemeral mode):")
        for evaluation in summary["evaluations"]:
            if evaluation["state"] == "failed":
                print(f"  {evaluation['checkpoint']}: failed: {evaluation['error']}")
                continue
            scores = ", ".join(f"{env} {m['accuracy']:.1%}" for env, m in evaluation["metrics"].items())
            print(f"  {evaluation['checkpoint']}: {evaluation['state']}, accuracy {scores} -> {evaluation['results']}")
    print_curves([LearningCurve.from_dict(curve) for curve in summary.get("learning_curves", [])])
    print()
    print(f"artifacts: {summary['store']}/artifacts/  summary: {summary['store']}/runs/{summary['run_id']}.json")


def print_run_status(summary: dict, evaluated: list[dict]) -> None:
    print(f"run {summary['run_id']} ({summary['pipeline']}): {summary['state']}, started {summary['started']}")
    print_stage_table(summary)
    print_evaluations([row for row in evaluated if row["run_id"] == summary["run_id"]], indent="")
    print_curves(learning_curves(evaluated, {stage["cache_key"] for stage in summary["stages"]}))


def print_curves(curves: list[LearningCurve]) -> None:
    """Held-out accuracy checkpoint by checkpoint (flows/learning_curves.py)."""
    if curves:
        print()
        print("learning curves (held-out accuracy; step 0: the checkpoint the stage started from):")
        for curve in curves:
            print(f"  {curve.line()}")


def print_evaluations(rows: list[dict], indent: str = "    ") -> None:
    """The evaluations of a run's checkpoints (by the pipeline's evaluate stages or the evaluation flow)."""
    if not rows:
        return
    print(f"{indent}{'evaluated checkpoint':<44} {'env':<10} {'accuracy':>9} {'format':>7} {'doom-loop':>10} {'n':>5}")
    for row in rows:
        print(f"{indent}{row['checkpoint']:<44} {row['env']:<10} {row['accuracy']:>9.1%} {row['format_rate']:>7.1%} "
              f"{row['doom_loop_rate']:>10.1%} {row['n']:>5}")


def print_run_list(store, evaluations_of) -> None:
    """The 20 most recent runs, each with the evaluations of the checkpoints it made;
    `evaluations_of(pipeline)` gives a pipeline's evaluation rows."""
    summaries = [store.read_json(store.path("runs", name)) for name in store.listdir(store.path("runs"))
                 if name.endswith(".json")]
    if not summaries:
        print(f"no runs in {store.uri}")
        return
    recent = sorted(summaries, key=lambda s: s["started"], reverse=True)[:20]
    evaluated = {pipeline: evaluations_of(pipeline) for pipeline in {s["pipeline"] for s in recent}}
    print(f"{'run id':<40} {'state':<10} {'started':<26} stages")
    for summary in recent:
        states = " ".join([*(f"{s['id']}={s['state']}" for s in summary["stages"]),
                           *(f"{stage_id}=running({step_and_eta(p)})" for stage_id, p in summary.get("running", {}).items())])
        print(f"{summary['run_id']:<40} {summary['state']:<10} {summary['started']:<26} {states}")
        print_evaluations([row for row in evaluated[summary["pipeline"]] if row["run_id"] == summary["run_id"]])
