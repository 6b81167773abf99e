"""One connection to an MCP server as a synchronous `Toolset` (envs/tools/executor.py), on the
official SDK's `Client`.

The SDK is async (anyio) and an episode is synchronous, started and stepped on the rollout loop's
threads (tasks/rollout/episodes.py). Each connection therefore runs its client on an event loop of
its own, in a thread of its own: one coroutine holds the `async with Client(...)` (anyio's task
groups must be left by the task that entered them) until `close()`, and each call is a coroutine
handed to that loop and waited for with a deadline.

What goes wrong is told apart: a tool's own error, an unknown tool or bad arguments answer the model
(`ToolFailed`, an error `tool` turn; the episode goes on); a server that cannot be reached, crashed,
hangs past its deadline or breaks the protocol ends the episode (`ToolsetFailed`, counted as a tool
server error, never a crash of the rollout).
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from envs.tools import ToolCall, ToolFailed, ToolSpec
from envs.tools.executor import check_arguments
from envs.tools.schema import ToolSchemaError, tool_from_schema

CLOSE_SECONDS = 10.0  # the SDK ends a stdio server within ~4 s (terminate, then kill)


class ToolsetFailed(Exception):
    """The tool server failed (cannot start, crashed, hangs, broke the protocol): one line; the
    episode ends as an error."""


def first_line(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # anyio's task groups wrap what failed
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class McpToolset:
    """A connected MCP server: its tools (less the `hidden` ones: a reset or grader tool) and calls.
    `connect` is the SDK client's server argument: a URL (streamable HTTP) or `StdioServerParameters`."""

    def __init__(self, connect, *, connect_seconds: float, call_seconds: float, hidden: tuple[str, ...] = (),
                 shown: list[str] | None = None):
        self.connect_seconds, self.call_seconds = connect_seconds, call_seconds
        self.closed = False
        self.errlog = tempfile.TemporaryFile("w+")  # a stdio server's stderr: its last line names a crash
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self.thread.start()
        self.stop = asyncio.Event()  # set on the loop: the holding coroutine leaves the client
        ready: Future = Future()
        self.held = asyncio.run_coroutine_threadsafe(self._hold(connect, ready), self.loop)
        try:
            self.client = ready.result(connect_seconds)
            self.all_specs = self._list_tools()
        except FutureTimeout:
            self.close()
            raise ToolsetFailed(f"the MCP server did not answer within {connect_seconds:g} s of its start") from None
        except ToolsetFailed:
            self.close()
            raise
        except Exception as exc:  # whatever the SDK or the server raised on the way up: one line
            message = f"cannot connect to the MCP server: {first_line(exc)}{self.server_said()}"
            self.close()
            raise ToolsetFailed(message) from None
        names = [spec.name for spec in self.all_specs]
        missing = sorted(set(hidden) - set(names)) + sorted(set(shown or []) - set(names))
        if missing:
            self.close()
            raise ToolsetFailed(f"the MCP server has no tool {', '.join(missing)}; it has {', '.join(names)}")
        keep = set(shown) if shown is not None else set(names) - set(hidden)
        self.shown = [spec for spec in self.all_specs if spec.name in keep]

    async def _hold(self, connect, ready: Future) -> None:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        server = stdio_client(connect, errlog=self.errlog) if isinstance(connect, StdioServerParameters) else connect
        try:
            async with Client(server, read_timeout_seconds=self.connect_seconds, mode="legacy") as client:
                ready.set_result(client)
                await self.stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits, once
            if not ready.done():
                ready.set_exception(exc)
            raise

    def server_said(self) -> str:
        """`; the server's stderr: <its last line>`, when a stdio server wrote one."""
        try:
            self.errlog.seek(0)
            lines = [line.strip() for line in self.errlog.read()[-4000:].splitlines() if line.strip()]
        except (OSError, ValueError):
            return ""
        return f"; the server's stderr: {lines[-1][:200]}" if lines else ""

    def _run(self, coroutine, seconds: float, what: str):
        """A coroutine on the client's loop, waited for `seconds`; ToolsetFailed when the server
        fails or does not answer in time."""
        if self.closed:
            coroutine.close()
            raise ToolsetFailed("the MCP connection is closed")
        if self.held.done():  # the client's holder ended: the server is gone
            coroutine.close()
            raise ToolsetFailed(f"the MCP server is gone ({self._holder_error()}){self.server_said()}")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(seconds)
        except FutureTimeout:
            future.cancel()
            raise ToolsetFailed(f"the MCP server did not answer {what} within {seconds:g} s") from None

    def _holder_error(self) -> str:
        error = self.held.exception() if not self.held.cancelled() else None
        return first_line(error) if error is not None else "its connection closed"

    def _list_tools(self) -> list[ToolSpec]:
        listed = self._run(self.client.list_tools(), self.call_seconds, "tools/list")
        specs = []
        for tool in listed.tools:
            try:
                specs.append(tool_from_schema({"name": tool.name, "description": tool.description or "",
                                               "parameters": tool.input_schema}))
            except ToolSchemaError as exc:
                raise ToolsetFailed(f"the MCP server's tool {tool.name!r} has a schema the model cannot take: {exc}")
        return specs

    def specs(self) -> list[ToolSpec]:
        return list(self.shown)

    def call(self, call: ToolCall) -> str:
        """A shown tool's call; ToolFailed for an unknown tool, bad arguments or the tool's error."""
        spec = next((spec for spec in self.shown if spec.name == call.name), None)
        if spec is None:
            raise ToolFailed(f"unknown tool {call.name!r}; tools: {', '.join(s.name for s in self.shown)}")
        check_arguments(spec, call.arguments)
        return self.call_any(call.name, call.arguments)

    def call_any(self, name: str, arguments: dict) -> str:
        """Any tool of the server, hidden ones included (reset, grader): its text, or ToolFailed."""
        from mcp import MCPError
        from mcp_types.jsonrpc import CONNECTION_CLOSED, REQUEST_TIMEOUT

        try:
            result = self._run(self._call(name, arguments), self.call_seconds, f"{name}")
        except MCPError as exc:
            if exc.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):  # the server is gone, or hangs
                raise ToolsetFailed(f"the MCP server failed during {name}: {exc.error.message}"
                                    f"{self.server_said()}") from None
            raise ToolFailed(f"{name}: {exc.error.message}".splitlines()[0]) from None  # it answered: the call failed
        except (ToolsetFailed, ToolFailed):
            raise
        except Exception as exc:  # the connection broke under the call (a crashed server)
            raise ToolsetFailed(f"the MCP server failed during {name}: {first_line(exc)}{self.server_said()}") from None
        text = "\n".join(block.text for block in result.content if getattr(block, "type", "") == "text")
        if result.is_error:
            raise ToolFailed((text or f"{name} failed").splitlines()[0])
        return text

    async def _call(self, name: str, arguments: dict):
        return await self.client.call_tool(name, arguments)  # its deadline is _run's: a hang is the server's failure

    def close(self) -> None:
        """Leave the client (a stdio server is ended) and stop the loop; bounded by CLOSE_SECONDS."""
        if self.closed:
            return
        self.closed = True
        self.loop.call_soon_threadsafe(self.stop.set)
        try:
            self.held.result(CLOSE_SECONDS)
        except BaseException:  # noqa: BLE001 - a failed server's error was reported where it failed
            self.held.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_SECONDS)
        if not self.thread.is_alive():
            self.loop.close()
        self.errlog.close()

