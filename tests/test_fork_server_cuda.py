"""The warm fork server (tasks/runtime/launch.py) imports every stage kind's modules before it forks
a single-GPU stage, and the child sets CUDA_VISIBLE_DEVICES after the fork. A preload that
initialised CUDA would make every such stage fail ("Cannot re-initialize CUDA in forked
subprocess"). Here, in a fresh interpreter that believes CUDA is there (so code guarded by
`torch.cuda.is_available()` runs), importing the preloads must never reach CUDA's initialisation."""

import json
import subprocess
import sys

from conftest import ROOT

PROBE = """
import importlib, json
import torch
touched = []
def recorded(name):
    def call(*args, **kwargs):
        touched.append(name)
    return call
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda._lazy_init = recorded("torch.cuda._lazy_init")
torch.cuda.init = recorded("torch.cuda.init")
from tasks.kinds import warm_modules
modules = warm_modules(lora=True)
for module in modules:
    importlib.import_module(module)
print(json.dumps({"modules": modules, "touched": touched}))
"""


def test_fork_server_preloads_never_initialise_cuda():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"torch", "transformers", "peft", "tasks.stages.rl"} <= set(found["modules"])
    assert found["touched"] == []
