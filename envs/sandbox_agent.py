"""Runs inside the bubblewrap sandbox (stdlib only, started by envs/sandbox.py).

Reads one JSON request per line on stdin and answers one JSON line on stdout:
- {"op": "sh", "command"}: runs `bash -c command` in /work under the limits;
- {"op": "py", "code"}: runs a Python cell in one namespace kept for the episode; the cell
  may call `llm_query(prompt)`, which asks the host ({"llm_query": prompt} out, {"answer"} in);
- {"op": "put", "path", "data"}: writes a file (base64) under /work or /tmp;
- {"op": "set", "values"}: sets variables of the Python namespace (RLM's `context`);
- {"op": "snapshot"}: the files under /work (base64, small files only), for graders.
Every answer is {"output", "exit_code", "timed_out", "error"} or the op's own fields.
"""

import base64
import contextlib
import io
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time

LIMITS = json.loads(sys.argv[1])
PROTOCOL_OUT = os.fdopen(os.dup(1), "w")
NAMESPACE = {"__name__": "__rlm__"}
SNAPSHOT_FILE_BYTES = 65536


def set_limits(cpu_seconds):
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (LIMITS["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (LIMITS["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMITS["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def kill_everything_else():
    """In the sandbox's own pid namespace, kill(-1) reaches every process but this one and init."""
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)


def shell(command):
    cap, hard_cap = LIMITS["output_bytes"], 64 * LIMITS["output_bytes"]
    process = subprocess.Popen(["/bin/bash", "-c", command], cwd="/work", stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: set_limits(LIMITS["cpu_seconds"]))
    deadline, kept, seen, error = time.monotonic() + LIMITS["wall_seconds"], b"", 0, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            error = f"timed out after {LIMITS['wall_seconds']}s"
            break
        ready, _, _ = select.select([process.stdout], [], [], left)
        if not ready:
            continue
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        seen += len(chunk)
        kept += chunk[:max(0, cap - len(kept))]
        if seen > hard_cap:
            error = f"output limit: more than {hard_cap} bytes"
            break
    if error is not None:
        kill_everything_else()
    process.stdout.close()
    code = process.wait()
    kill_everything_else()  # nothing a command started outlives it
    return answer(kept, seen, code if error is None else None, error)


def answer(kept, seen, code, error):
    text = kept.decode("utf-8", "replace")
    if seen > len(kept):
        text += f"\n[output truncated: {seen} bytes, {len(kept)} shown]"
    return {"output": text, "exit_code": code, "error": error}


def llm_query(prompt):
    """A model call from a cell: asked of the host, which counts and limits them."""
    PROTOCOL_OUT.write(json.dumps({"llm_query": str(prompt)}) + "\n")
    PROTOCOL_OUT.flush()
    reply = json.loads(sys.stdin.readline())
    if reply.get("error"):
        raise RuntimeError(reply["error"])
    return reply["answer"]


def on_alarm(signum, frame):
    raise TimeoutError(f"cell timed out after {LIMITS['wall_seconds']}s")


def python_cell(code):
    buffer = io.StringIO()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMITS["wall_seconds"])
    error = None
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            exec(compile(code, "<cell>", "exec"), NAMESPACE)
    except BaseException as exc:  # the cell's own errors are its output
        error = f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    data = buffer.getvalue().encode("utf-8", "replace")
    return answer(data[:LIMITS["output_bytes"]], len(data), 0 if error is None else 1, error)


def put(path, data):
    if not os.path.realpath(path).startswith(("/work/", "/tmp/")):
        return {"error": f"not writable: {path}"}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(base64.b64decode(data))
    return {"error": None}


def snapshot():
    files = {}
    for root, dirs, names in os.walk("/work"):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) <= SNAPSHOT_FILE_BYTES:
                with open(path, "rb") as handle:
                    files[os.path.relpath(path, "/work")] = base64.b64encode(handle.read()).decode()
    return {"files": files, "error": None}


def main():
    NAMESPACE["llm_query"] = llm_query
    set_limits(LIMITS["episode_cpu_seconds"])
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "sh":
            reply = shell(request["command"])
        elif request["op"] == "py":
            reply = python_cell(request["code"])
        elif request["op"] == "put":
            reply = put(request["path"], request["data"])
        elif request["op"] == "set":
            NAMESPACE.update(request["values"])
            reply = {"error": None}
        else:
            reply = snapshot()
        PROTOCOL_OUT.write(json.dumps(reply) + "\n")
        PROTOCOL_OUT.flush()


if __name__ == "__main__":
    main()
