"""The Python worker inside the bubblewrap sandbox (stdlib only; started by envs/sandbox/agent.py).

It keeps the episode's namespace and runs the policy's cells in it, so everything here is as
untrusted as the cells: the agent gives it nothing but its own pipes. It reads one JSON message a
line on the fd in argv[1] ({"code"} or {"values"}, with a number "n") and answers {"done": error,
"n"} on the fd in argv[2]; a cell's `llm_query(prompt)` sends {"llm_query"} there and reads
{"answer"} or {"error"}. What a cell prints goes to fd 1 and 2, which the agent reads as its output.
SIGALRM from the agent interrupts a cell that ran out of time or output.
"""

import contextlib
import json
import os
import signal
import sys


def forget_children():
    """Between cells the worker is stopped and cannot reap: with SIGCHLD ignored, the children the
    agent kills then leave no zombie (zombies would count against the process limit)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def main(in_fd, out_fd):
    requests, replies = os.fdopen(in_fd, "rb"), os.fdopen(out_fd, "wb", buffering=0)
    in_cell = []

    def on_alarm(signum, frame):
        if in_cell:
            raise TimeoutError("the cell was interrupted")

    def llm_query(prompt):
        """A model call from a cell: asked of the host, which counts and limits them."""
        replies.write((json.dumps({"llm_query": str(prompt)}) + "\n").encode())
        reply = json.loads(requests.readline())
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["answer"]

    namespace = {"__name__": "__rlm__", "llm_query": llm_query}
    signal.signal(signal.SIGALRM, on_alarm)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, errors="backslashreplace")
    for line in requests:
        message, error = json.loads(line), None
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a cell's subprocess.run needs its exit codes
        try:  # the outer try also catches an interrupt that lands in the inner finally
            try:
                in_cell.append(True)
                if "values" in message:
                    namespace.update(message["values"])
                else:
                    exec(compile(message["code"], "<cell>", "exec"), namespace)
            finally:
                in_cell.clear()
        except BaseException as exc:  # noqa: BLE001 - the cell's own errors are its output
            error = f"{type(exc).__name__}: {exc}"
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        forget_children()
        replies.write((json.dumps({"done": error, "n": message["n"]}) + "\n").encode())


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
