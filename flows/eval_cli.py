"""`posttrain eval REF`: the evaluation flow by hand, and what it prints."""

from __future__ import annotations

from artifacts.store import Store
from flows.evaluate import EvaluationInputError, evaluate, plan_evaluation


def run_eval(store: Store, ref: str, envs: list[str] | None, n: int | None, max_new_tokens: int | None) -> int:
    """Check the inputs (EvaluationInputError: one line), run the flow, print the metrics; exit code."""
    plan = plan_evaluation(ref, store, envs=envs, n=n, max_new_tokens=max_new_tokens)
    print(f"evaluating {ref} on {', '.join(plan.stage.envs)} (n={plan.stage.n}, store {store.uri})", flush=True)
    state = evaluate(checkpoint_ref=ref, store=store.uri, storage_options=store.storage_options, envs=envs, n=n,
                     max_new_tokens=max_new_tokens, return_state=True)
    if not state.is_completed():
        try:
            state.result()
        except Exception as exc:
            print(f"evaluation of {ref} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        return 1
    result = state.result()
    print(f"\n{ref}: {result['state']}  results {result['results']}  report {result['report']}")
    print(f"{'env':<12} {'accuracy':>9} {'format':>7} {'doom-loop':>10} {'tokens':>7} {'n':>5}")
    for env_id, m in result["metrics"].items():
        print(f"{env_id:<12} {m['accuracy']:>9.1%} {m['format_rate']:>7.1%} {m['doom_loop_rate']:>10.1%} "
              f"{m['mean_completion_tokens']:>7.1f} {m['n']:>5}")
    return 0


__all__ = ["EvaluationInputError", "run_eval"]
