"""The MCP servers of an `mcp` env: how a connection is opened for an episode and what happens to it
after (envs/mcp/config.py says which lifetime does what).

- a stdio server, `lifetime: episode`: started for the episode, ended at its finish (fresh state);
- a stdio server, `lifetime: shared`: kept after a clean episode and handed to the next one (after
  `reset_tool`), one episode at a time each, as many as episodes run at once; ended at exit;
- a URL: a session of its own per episode (after `reset_tool`), closed at the finish.
A connection whose server failed is never kept.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
from pathlib import Path

from envs.mcp.client import McpToolset, ToolsetFailed
from envs.mcp.config import HttpServer, McpEnvConfig, StdioServer
from envs.tools import ToolFailed

PYTHONS = ("python", "python3")  # a command's program named so runs on posttrain's own interpreter (its venv)
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # where `envs` imports from, for the sandbox launcher


def program_path(program: str) -> str:
    if program in PYTHONS:
        return sys.executable
    found = shutil.which(program)
    if found is None:
        raise ToolsetFailed(f"the MCP server's program {program!r} is not found on PATH")
    return found


def sandboxed_command(server: StdioServer) -> tuple[str, list[str], dict[str, str]]:
    """The launcher's command line (envs/mcp/sandboxed.py) for a server run in the sandbox: its
    program absolute, the interpreter's prefixes bound read-only, the command's files copied in."""
    program = program_path(server.command[0])
    arguments = [str(Path(arg).resolve()) if Path(arg).is_file() else arg for arg in server.command[1:]]
    folders = sorted({sys.prefix, sys.base_prefix} - {"/usr"})
    files = sorted({arg for arg in arguments if Path(arg).is_absolute() and Path(arg).is_file()}
                   | ({program} if not program.startswith(("/usr/", "/bin/", *folders)) else set()))
    read_only = json.dumps({"folders": folders, "files": files})
    return (sys.executable, ["-m", "envs.mcp.sandboxed", server.sandbox_limits.model_dump_json(), read_only, "--",
                             program, *arguments], {"PYTHONPATH": str(PROJECT_ROOT)})


def connect_target(server: StdioServer | HttpServer):
    """What the SDK's client is given: the URL, or the stdio command's parameters."""
    if isinstance(server, HttpServer):
        return server.url
    from mcp.client.stdio import StdioServerParameters

    if server.sandbox:
        command, args, env = sandboxed_command(server)
        return StdioServerParameters(command=command, args=args, env=env)
    return StdioServerParameters(command=program_path(server.command[0]), args=server.command[1:], cwd=os.getcwd())


class Servers:
    def __init__(self, config: McpEnvConfig):
        self.config = config
        self.kept = isinstance(config.server, StdioServer) and config.server.lifetime == "shared"
        self.idle: list[McpToolset] = []
        self.lock = threading.Lock()
        self.opened = 0  # servers started or sessions opened (the tests count them)
        if self.kept:
            atexit.register(self.close_all)

    def open(self) -> McpToolset:
        config = self.config
        with self.lock:
            self.opened += 1
        return McpToolset(connect_target(config.server), connect_seconds=config.connect_seconds,
                          call_seconds=config.call_seconds, hidden=config.hidden_tools, shown=config.tools)

    def take(self) -> McpToolset:
        """A connection for an episode: a kept server reset (one that cannot be is replaced by a fresh
        one), a URL's session reset, a fresh stdio server as it started."""
        with self.lock:
            kept = self.idle.pop() if self.idle else None
        if kept is not None:
            try:
                return self.reset(kept)
            except ToolsetFailed:
                pass  # closed by reset: a fresh server instead
        toolset = self.open()
        return self.reset(toolset) if isinstance(self.config.server, HttpServer) else toolset

    def reset(self, toolset: McpToolset) -> McpToolset:
        if self.config.reset_tool is not None:
            try:
                toolset.call_any(self.config.reset_tool, {})
            except (ToolFailed, ToolsetFailed) as exc:
                toolset.close()
                raise ToolsetFailed(f"reset_tool {self.config.reset_tool}: {exc}") from None
        return toolset

    def give_back(self, toolset: McpToolset, failed: bool) -> None:
        if self.kept and not failed:
            with self.lock:
                self.idle.append(toolset)
            return
        toolset.close()

    def close_all(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for toolset in idle:
            toolset.close()
