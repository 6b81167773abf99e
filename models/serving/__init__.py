"""`posttrain serve-model`: one checkpoint behind an OpenAI-compatible API (FastAPI + uvicorn).

A served checkpoint is a policy like any other (docs/DESIGN §7): a teacher for `synthesize`, a
model for an OpenAI client, the server an RL stage's rollouts decode on (tasks/rollout/server_policy.py;
the stage publishes its new weights to it, tasks/rollout/weight_sync.py), or the endpoint a rollout
plays through by chat (tasks/rollout/endpoint_policy.py). It decodes with the project's own engine: a one-user-message
chat request gives exactly what in-process evaluation gives for that prompt, and a token-id
completion what the local engine gives for those ids. Concurrent requests decode together
(models/serving/batch.py). The served model: models/serving/model.py; the request fields:
models/serving/requests.py; the answers' shapes: models/serving/responses.py (streamed:
models/serving/stream.py); the routes: models/serving/app.py; what it refuses (sizes, bounds,
deadlines) and how it says so: models/serving/limits.py; runtime adapters and weights:
models/serving/weights.py.
"""

from models.serving.model import (SENTINEL, ServedModel, copies_of, model_config, render_prompt, response_text,
                                  serving_device)

__all__ = ["SENTINEL", "ServedModel", "copies_of", "model_config", "render_prompt", "response_text", "serving_device"]
