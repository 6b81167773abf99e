"""A vLLM-faithful fake OpenAI-compatible server for tests (not product code): app.py (routes,
running it), server.py (its state: adapters, pause, the worker), engine.py (decoding, log-prob
modes), protocol.py (vLLM's fields, defaults, checks and error shapes, with their sources)."""

from fake_vllm.app import make_app, running_fake
from fake_vllm.server import FakeVllm, FakeVllmConfig

__all__ = ["FakeVllm", "FakeVllmConfig", "make_app", "running_fake"]
