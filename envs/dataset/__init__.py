"""`dataset`: single-turn tasks from the rows of a prompt-only dataset, scored by reward functions with
TRL's signature, a reward model or a judge. config.py holds the config, reward_modules.py how a user's
reward module is found and called, env.py the env."""

from envs.dataset.config import (  # noqa: F401 (the kind's API)
    BUILTIN_REWARDS,
    DatasetEnvConfig,
    JudgeReward,
    JudgeScoring,
    RewardConfig,
    RewardModelReward,
    reward_source,
)
from envs.dataset.env import DatasetEnv  # noqa: F401
from envs.dataset.reward_modules import load_function, module_files  # noqa: F401
