"""`openclaw`: OpenClaw-style workspace tasks. env.py: the config, the task files and the env;
tools.py: the episode and its tools; graders.py: the task graders; families.py: the generated
task families."""

from envs.openclaw.env import OpenClawEnv, OpenClawEnvConfig

__all__ = ["OpenClawEnv", "OpenClawEnvConfig"]
