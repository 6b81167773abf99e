"""The oracle check of an environment: every task, played through the real episode loop, must
score full reward with its reference solution and zero with a policy that does nothing.

This is how tasks, graders and the sandbox are tested without a trained model
(`posttrain envs check KIND`, and the env tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from envs.tools.chat import use_policy_chat
from models.sampling import SamplingParams
from tasks.rollout.episodes import ScriptedPolicy, roll_out

SCRIPT_TOKENS = 4096  # a scripted action is never cut
CHUNK = 32  # episodes played at once (each sandboxed one holds a sandbox)


@dataclass(frozen=True)
class TaskCheck:
    task_id: str
    oracle_reward: float
    no_op_reward: float
    oracle_correct: bool
    full_reward: float
    errors: str  # reward functions that raised, if any

    @property
    def ok(self) -> bool:
        return (math.isclose(self.oracle_reward, self.full_reward, abs_tol=1e-9) and self.oracle_correct
                and math.isclose(self.no_op_reward, 0.0, abs_tol=1e-9) and not self.errors)


def scripted_policy(env, tokenizer, scripts: list[list[str]]) -> ScriptedPolicy:
    """Replays `scripts`; an env whose oracle makes model calls of its own (rlm's `llm_query`)
    says what those calls answer (`oracle_llm`)."""
    respond = getattr(env, "oracle_llm", None)  # only envs with episode-level model calls define it
    if respond is None:
        return ScriptedPolicy(tokenizer, scripts)
    return ScriptedPolicy(tokenizer, scripts, respond=respond)


def scripted_rollouts(env, tokenizer, tasks, scripts: list[list[str]], report=None):
    """The trajectories of `scripts` played on `tasks`, CHUNK episodes (sandboxes) at a time;
    `report(done)` as episodes end."""
    trajectories = []
    for start in range(0, len(tasks), CHUNK):
        policy = scripted_policy(env, tokenizer, scripts[start:start + CHUNK])
        trajectories += roll_out(policy, tokenizer, env, tasks[start:start + CHUNK], SamplingParams(SCRIPT_TOKENS),
                                 on_finished=report and (lambda done, before=start: report(before + done)))
    return trajectories


def _scores(env, tokenizer, tasks, scripts):
    return [(env.rubric.score(t.text, t.task, t.outcome), env.is_correct(t.text, t.task, t.outcome))
            for t in scripted_rollouts(env, tokenizer, tasks, scripts)]


def check_env(env, tokenizer, tasks=None) -> list[TaskCheck]:
    """One row per task (every shipped task unless `tasks` is given)."""
    use_policy_chat(env, tokenizer)  # its oracle's calls in the tokenizer's own format
    tasks = env.all_tasks() if tasks is None else tasks
    oracle = _scores(env, tokenizer, tasks, [env.oracle_actions(task) for task in tasks])
    no_op = _scores(env, tokenizer, tasks, [[""] for _ in tasks])
    full = env.rubric.reward_range[1]
    return [TaskCheck(task.id, o.total, n.total, correct, full,
                      "; ".join(f"{k}: {v}" for k, v in {**o.errors, **n.errors}.items()))
            for task, (o, correct), (n, _) in zip(tasks, oracle, no_op)]
