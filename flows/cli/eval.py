"""`posttrain eval REF`: the evaluation flow by hand, and what it prints."""

from __future__ import annotations

import os

from artifacts.store import Store
from flows.evaluate import env_data_inputs, evaluate, evaluation_stage, plan_evaluation, with_envs
from flows.stage_requests import state_error


def run_eval(store: Store, ref: str, envs: list[str] | None, n: int | None, max_new_tokens: int | None,
             benchmarks: dict | None = None) -> int:
    """Check the inputs (EvaluationInputError: one line), run the flow, print the metrics; exit code."""
    from flows.cli.common import check_prefect_api, temporary_api, use_temporary_api
    from tasks.runtime.launch import warm_up

    plan = plan_evaluation(ref, store, envs=envs, n=n, max_new_tokens=max_new_tokens, benchmarks=benchmarks)
    warm_up()  # the stage's imports load while Prefect starts
    use_temporary_api(temporary_api(check_prefect_api()))
    running = plan.stage.envs + [name for name in ("lm_eval", "humaneval") if getattr(plan.stage, name) is not None]
    print(f"evaluating {ref} on {', '.join(running)} (n={plan.stage.n}, store {store.uri})", flush=True)
    state = evaluate(checkpoint_ref=ref, store=store.uri, storage_options=store.storage_options, envs=envs, n=n,
                     max_new_tokens=max_new_tokens, benchmarks=benchmarks, return_state=True)
    if not state.is_completed():
        print(f"evaluation of {ref} failed: {state_error(state)}")
        return 1
    result = state.result()
    print(f"\n{ref}: {result['state']}  results {result['results']}  report {result['report']}")
    print_metrics(ref, result["metrics"], plan.stage.max_new_tokens)
    return 0


def run_endpoint_eval(spec, envs: list[str] | None, n: int | None, max_new_tokens: int | None, endpoint: str,
                      model: str, api_key_env: str | None = None) -> int:
    """Evaluate a model behind an OpenAI-compatible endpoint (serve-model, vLLM, an API) on the envs
    of `spec`, exactly as a checkpoint is evaluated (same tasks, greedy, same metrics); prints them.
    Nothing is committed: the store holds checkpoints' evaluations, and this model is not one."""
    from envs.loader import make_env
    from models.loading import load_tokenizer, resolve_base
    from tasks.rollout.endpoint_policy import EndpointConfigError, EndpointPolicy
    from tasks.stages.evaluate import evaluate_policy

    spec, env_ids = with_envs(spec, envs)
    stage = evaluation_stage(spec, env_ids, model, n, max_new_tokens)
    envs_ready = {env_id: with_rows(spec, env_id, make_env(env_id, spec.envs[env_id])) for env_id in env_ids}
    tokenizer = load_tokenizer(resolve_base(spec.model.base), spec.model)  # counts tokens and builds contexts
    api_key = os.environ.get(api_key_env, "") if api_key_env else None
    if api_key_env and not api_key:
        raise EndpointConfigError(f"--api-key-env: environment variable {api_key_env} is not set")
    policy = EndpointPolicy(endpoint, model, tokenizer, api_key=api_key)
    print(f"evaluating {model} at {endpoint} on {', '.join(env_ids)} (n={stage.n})", flush=True)
    metrics = {env_id: evaluate_policy(policy, tokenizer, env, stage, model)[1] for env_id, env in envs_ready.items()}
    print_metrics(model, metrics, stage.max_new_tokens)
    return 0


def with_rows(spec, env_id: str, env):
    """A dataset env with the rows of the latest committed versions of its dataset stages in the
    spec's store, and the scorers of its learned rewards (EvaluationInputError when there are none)."""
    from tasks.common.datasets import read_rows

    if not getattr(env, "reads_data", False):
        return env
    store = spec.store_location().open()
    refs = env_data_inputs(spec, [env_id], store, {"inputs": {}})
    rows = [read_rows(store.fetch(refs[data_id])) for data_id in env.data_stages()]
    env.use_rows(rows[0], rows[1] if len(rows) > 1 else None)
    if env.learned_rewards():  # its reward models: the latest committed, as its rows
        from tasks.rollout.learned_rewards import attach_scorers

        attach_scorers(env, env_id, lambda stage_id: store.fetch(refs[stage_id]), spec.model, "cpu")
    return env


def print_metrics(label: str, metrics: dict[str, dict], max_new_tokens: int) -> None:
    """The metrics of one checkpoint (or model) per env, and a warning where most episodes were cut off."""
    from tasks.common.eval_report import unfinished_warnings

    from tasks.common.benchmarks import is_benchmark

    envs = {env_id: m for env_id, m in metrics.items() if not is_benchmark(env_id)}
    if envs:
        print(f"{'env':<12} {'accuracy':>9} {'format':>7} {'doom-loop':>10} {'tokens':>7} {'n':>5}")
    for env_id, m in envs.items():
        print(f"{env_id:<12} {m['accuracy']:>9.1%} {m['format_rate']:>7.1%} {m['doom_loop_rate']:>10.1%} "
              f"{m['mean_completion_tokens']:>7.1f} {m['n']:>5}")
    for name, m in metrics.items():
        if is_benchmark(name):
            print(f"{name}: " + ", ".join(f"{metric} {value}" for metric, value in m.items()))
    for warning in unfinished_warnings({label: metrics}, max_new_tokens):
        print(f"warning: {warning}")
