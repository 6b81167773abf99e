"""`posttrain validate --check-endpoints SPEC`: every server a stage talks to answers, before anything runs.

A rollout server must serve its model, return token ids and log-probs, and report log-probs after
temperature (the rollout backend's own start check, tasks/rollout/server_checks.py); a teacher or
judge endpoint (a dataset env's judge reward too) must list its model.
The first problem is one line naming the stage's field and the endpoint (exit 2).
"""

from __future__ import annotations

from flows.cli.common import UserError


def check_endpoints(spec) -> int:
    """Check each endpoint of the spec's stages; how many were checked."""
    from tasks.rollout.backends import RolloutBackend
    from tasks.rollout.endpoint_policy import EndpointConfigError, EndpointError, EndpointPolicy

    checked = 0
    for stage in spec.stages:
        for field, config in stage.endpoints():
            where = f"stages.{stage.id}.{field}"
            found = ""
            try:
                if isinstance(config, RolloutBackend):  # the backend's own start check
                    found = config.check_endpoint(where)
                    found = f" ({found})" if found else ""
                else:
                    EndpointPolicy.of(config, None, where).check_model()
            except (EndpointError, EndpointConfigError) as exc:
                raise UserError(f"{where}: {exc}") from None
            print(f"{where}: {config.describe()} answers{found}", flush=True)
            checked += 1
    return checked + check_judges(spec)


def check_judges(spec) -> int:
    """Each judge of a dataset env's rewards lists its model; how many were checked (whether it
    answers a score is checked by the stage that attaches it, on a train task)."""
    from envs.dataset import DatasetEnvConfig, JudgeReward
    from tasks.rollout.endpoint_policy import EndpointConfigError, EndpointError, EndpointPolicy

    checked = 0
    for env_id, config in spec.envs.items():
        rewards = config.rewards if isinstance(config, DatasetEnvConfig) else []
        for i, reward in enumerate(rewards):
            if not isinstance(reward, JudgeReward):
                continue
            where = f"envs.{env_id}.rewards[{i}].judge"
            try:
                EndpointPolicy.of(reward.judge, None, where).check_model()
            except (EndpointError, EndpointConfigError) as exc:
                raise UserError(f"{where}: {exc}") from None
            print(f"{where}: {reward.judge.describe()} answers", flush=True)
            checked += 1
    return checked
