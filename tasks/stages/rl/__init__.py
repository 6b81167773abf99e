"""The `rl` stage kind: config.py (RlStage, its rollout backends), stage.py (`run`, the step top to
bottom), sources.py (where a step's rollouts come from), scoring.py (an episode's step rewards),
batch.py (rows, advantages, padding, log-probs), update.py (the policy update), metrics.py, and
weight_sync.py (publishing the weights to a rollout server)."""

from tasks.stages.rl.config import Asynchronous, RlStage
from tasks.stages.rl.stage import run

__all__ = ["Asynchronous", "RlStage", "run"]
