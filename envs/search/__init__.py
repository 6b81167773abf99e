"""`search` (Search-R1): question answering with a search tool. env.py: the config, the index,
the rewards and the env; corpus.py: the seeded synthetic world it searches."""

from envs.search.env import SearchEnv, SearchEnvConfig

__all__ = ["SearchEnv", "SearchEnvConfig"]
