"""The `rl` stage kind: config.py (RlStage), stage.py (`run`: the step top to bottom, in lockstep),
ahead.py (the producer of asynchronous rollouts), scoring.py (an episode's step rewards), batch.py
(rows, advantages, padding, log-probs), update.py (the policy update) and metrics.py. Where rollouts
decode and how weights reach a server: tasks/rollout/backends/, tasks/rollout/weight_sync.py."""

from tasks.stages.rl.config import Asynchronous, RlStage
from tasks.stages.rl.stage import run

__all__ = ["Asynchronous", "RlStage", "run"]
