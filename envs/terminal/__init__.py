"""`terminal`: shell tasks in a sandbox. env.py: the config, the episode and the env;
catalogue.py: Harbor task folders and generated variants as tasks; families.py: the generated
task families."""

from envs.terminal.env import TerminalEnv, TerminalEnvConfig

__all__ = ["TerminalEnv", "TerminalEnvConfig"]
