"""The documented vLLM commands (README, docs, shipped specs, the worker extension's docstring) bind
loopback or a private address and set --api-key: vLLM's key guards only /v1, and its development
routes (/pause, /collective_rpc) answer whoever reaches the port, so `--host 0.0.0.0` (or no
--host: vLLM listens on every interface by default) would hand them to the network."""

from __future__ import annotations

import ipaddress
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipelines").glob("*.yaml")),
             "deployments/posttrain_vllm_worker.py"]


# a command line: environment assignments, then a `vllm` executable (a path too), then `serve`
COMMAND = re.compile(r"^\s*(?:[A-Z_]+=\S*\s+)*\S*\bvllm serve\b")


def vllm_commands(text: str) -> list[str]:
    """Each `vllm serve` command of a text, its continuation lines (`\\`) joined, comment marks dropped."""
    lines = [re.sub(r"^\s*#\s?", "", line) for line in text.splitlines()]
    commands, index = [], 0
    while index < len(lines):
        if COMMAND.match(lines[index]):
            command = lines[index]
            while command.rstrip().endswith("\\") and index + 1 < len(lines):
                index += 1
                command = command.rstrip()[:-1] + " " + lines[index]
            commands.append(command)
        index += 1
    return commands


def private_or_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return address.is_loopback or (address.is_private and not address.is_unspecified)


def test_vllm_recipe_every_documented_command_binds_a_private_address_with_a_key():
    found = 0
    for name in DOCUMENTS:
        for command in vllm_commands((ROOT / name).read_text()):
            words = shlex.split(command, comments=True)
            assert "--host" in words, f"{name}: a vllm serve without --host listens on every interface: {command}"
            host = words[words.index("--host") + 1]
            assert private_or_loopback(host), f"{name}: vllm serve --host {host} is not private: {command}"
            assert "--api-key" in words, f"{name}: a vllm serve without --api-key: {command}"
            found += 1
    assert found >= 5  # README's two, GPU.md's three, the node spec's, the extension's


def test_vllm_recipe_check_knows_a_public_bind():
    command = vllm_commands("# vllm serve m \\\n#   --host 0.0.0.0 --port 8000\n")[0]
    words = shlex.split(command)
    assert not private_or_loopback(words[words.index("--host") + 1])
    assert "--api-key" not in words
