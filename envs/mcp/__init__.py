"""`mcp`: an MCP server's tools as an env (the official `mcp` SDK, the `mcp` extra). config.py holds
the config, client.py one connection as a Toolset, servers.py their lifetimes, sandboxed.py the
sandbox launcher of a stdio server, env.py the env and its episode."""

from envs.mcp.config import McpEnvConfig  # noqa: F401 (the kind's API)
from envs.mcp.env import McpEnv  # noqa: F401
