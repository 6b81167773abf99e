"""`rollout: {backend: server}`: episodes decoded by an inference server (a real serve-model on
127.0.0.1) through /v1/completions with token-id prompts, token ids and log-probs back. Greedy
rollouts through the server are the local ones token for token, single- and multi-turn."""

import json
import threading

import pytest
from conftest import free_port
from test_serve_model import ARITH, CALC, NAME, local_model, running_app

from models.sampling import SamplingParams
from tasks.rollout.endpoint_policy import EndpointError
from tasks.rollout.episodes import LocalPolicy, roll_out
from tasks.rollout.server_policy import ServerPolicy


def turns_of(trajectories):
    return [[(turn.context_ids, turn.action_ids, turn.observation_ids) for turn in t.turns] for t in trajectories]


def assert_same_rollouts(remote, local):
    assert turns_of(remote) == turns_of(local)
    assert [t.text for t in remote] == [t.text for t in local]
    assert [(t.finished, t.outcome) for t in remote] == [(t.finished, t.outcome) for t in local]
    for mine, theirs in zip(remote, local):  # the behaviour log-probs are the engine's, to float32 noise
        for a, b in zip(mine.turns, theirs.turns):
            assert a.action_logprobs == pytest.approx(b.action_logprobs, abs=1e-4)


@pytest.mark.parametrize("env, n", [(ARITH, 16), (CALC, 12)], ids=["single-turn", "multi-turn"])
def test_greedy_rollouts_through_the_server_are_the_local_ones(base_url, env, n):
    model, tokenizer = local_model()
    tasks, params = env.tasks("eval", n, 0), SamplingParams(48)
    local = roll_out(LocalPolicy(model, tokenizer), tokenizer, env, tasks, params)
    remote = roll_out(ServerPolicy(base_url, NAME, tokenizer), tokenizer, env, tasks, params)
    if env is CALC:
        assert sum(len(t.turns) > 1 for t in local) >= n // 2  # contexts continue from ids, env tokens included
    assert_same_rollouts(remote, local)
    assert all(turn.policy_version == 0 for t in remote for turn in t.turns)


def test_sampled_rollouts_through_the_server_follow_the_episode_seeds(base_url):
    model, tokenizer = local_model()
    tasks, params = ARITH.tasks("eval", 2, 0) * 4, SamplingParams(24, temperature=1.0)
    policy = ServerPolicy(base_url, NAME, tokenizer)
    first = roll_out(policy, tokenizer, ARITH, tasks, params, seed=5)
    assert turns_of(first) == turns_of(roll_out(policy, tokenizer, ARITH, tasks, params, seed=5))
    assert len({t.text for t in first}) > 2  # a task's repeats are different samples
    # the same seeds in-process sample the same tokens: the server's batch does not change a row's draws
    assert turns_of(first) == turns_of(roll_out(LocalPolicy(model, tokenizer), tokenizer, ARITH, tasks, params, seed=5))


def test_an_episode_model_call_goes_through_the_server(base_url):
    model, tokenizer = local_model()
    prompt, params = ARITH.tasks("eval", 1, 3)[0].prompt, SamplingParams(40)
    assert ServerPolicy(base_url, NAME, tokenizer).complete(prompt, params) == \
        LocalPolicy(model, tokenizer).complete(prompt, params)


def test_server_errors_are_one_line_naming_the_endpoint(base_url):
    _, tokenizer = local_model()
    with pytest.raises(EndpointError, match=r"unknown model 'nope' \(the endpoint serves: t/sft@0123456789abcdef\)"):
        ServerPolicy(base_url, "nope", tokenizer).check()
    port = free_port()
    with pytest.raises(EndpointError, match=rf"^http://127.0.0.1:{port}/v1: cannot reach the endpoint"):
        ServerPolicy(f"http://127.0.0.1:{port}/v1", NAME, tokenizer).check()


def plain_openai_app():
    """A real OpenAI-compatible server that answers completions without token ids or log-probs (as
    a plain OpenAI API or a vLLM older than 0.10.2 does)."""
    from fastapi import FastAPI

    from models.serving.limits import Limits

    app = FastAPI()
    app.state.limits = Limits()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "text": "4", "finish_reason": "stop", "logprobs": None}]}

    return app


def test_a_server_without_token_ids_is_refused_with_what_is_missing():
    _, tokenizer = local_model()
    with running_app(plain_openai_app()) as url:
        with pytest.raises(EndpointError, match=rf"^{url}: the answer has no generated token ids; rollouts need "
                                                r"token ids and log-probs \(vLLM >= 0.10.2"):
            ServerPolicy(url, NAME, tokenizer).check()


def test_concurrent_requests_decode_as_one_batch(tight_server):
    """Eight clients' requests that wait together (here: while the engine is busy) decode as one batch,
    and each gets what it gets alone."""
    import httpx

    url, app = tight_server
    served = app.state.served
    prompts = [[1, 5 + k, 9] for k in range(8)]
    alone = [complete(url, p) for p in prompts]
    answers: dict[int, dict] = {}
    with served.batcher.engine:
        threads = [threading.Thread(target=lambda k=k: answers.__setitem__(k, complete(url, prompts[k])))
                   for k in range(8)]
        for thread in threads:
            thread.start()
        wait_for(lambda: served.batcher.queued() == 8)
    for thread in threads:
        thread.join(timeout=60)
    assert list(served.batcher.batches)[-1] == (8, 8)  # eight requests, eight rows, one batch
    assert [answers[k]["choices"][0]["token_ids"] for k in range(8)] == [a["choices"][0]["token_ids"] for a in alone]
    assert httpx.get(f"{url}/models").status_code == 200


def complete(url: str, prompt: list[int], **fields) -> dict:
    import httpx

    body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True, **fields}
    response = httpx.post(f"{url}/completions", content=json.dumps(body), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(condition, seconds: float = 30) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def tight_server():
    from test_serve_model import trained_checkpoint

    from models.serving.app import make_app

    app = make_app(trained_checkpoint(), NAME)
    with running_app(app) as url:
        yield url, app


def test_validate_check_endpoints_reports_a_server_that_cannot_serve_rollouts(base_url, tmp_path, capsys):
    import yaml

    from flows.cli.main import main

    def spec_with(endpoint: str, model: str = NAME) -> str:
        rollout = {"backend": "server", "endpoint": endpoint, "model": model, "sync_folder": str(tmp_path)}
        spec = {"name": "t", "store": f"file://{tmp_path / 'store'}", "envs": {"arith": {"kind": "arith"}},
                "stages": [{"id": "warmup", "kind": "synthesize", "env": "arith", "n": 4},
                           {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2},
                           {"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 2,
                            "rollout": rollout}]}
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump(spec))
        return str(path)

    assert main(["validate", "--check-endpoints", spec_with(base_url)]) == 0
    assert f"stages.rl.rollout: {NAME} at {base_url} answers" in capsys.readouterr().out
    port = free_port()
    for endpoint, model, words in ((f"http://127.0.0.1:{port}/v1", NAME, "cannot reach the endpoint"),
                                   (base_url, "other", "unknown model 'other'")):
        assert main(["validate", "--check-endpoints", spec_with(endpoint, model)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: stages.rl.rollout: {endpoint}: {words}") and "\n" not in err, err
    assert not (tmp_path / "store").exists()  # nothing written


@pytest.mark.parametrize("env_id", ["arith", "calc"])
def test_generate_and_evaluate_through_the_server_write_what_local_decoding_writes(base_url, tmp_path, env_id):
    from test_serve_model import trained_checkpoint

    from artifacts.store import Store
    from models.config import ModelConfig
    from tasks.common.context import StageContext
    from tasks.common.datasets import read_rows
    from tasks.stages.evaluate import EvaluateStage
    from tasks.stages.evaluate import run as evaluate
    from tasks.stages.generate import GenerateStage
    from tasks.stages.generate import run as generate

    store = Store(f"file://{tmp_path / 'store'}")
    policy_ref = store.commit("t/sft", "checkpoint", trained_checkpoint(), producer={})
    server = {"backend": "server", "endpoint": base_url, "model": NAME}

    def context(stage_id: str, workdir: str) -> StageContext:
        return StageContext(store=store, pipeline="t", run_id="r", stage_id=stage_id, cache_key="k",
                            model=ModelConfig(), envs={"arith": ARITH.config, "calc": CALC.config},
                            inputs={"sft": str(policy_ref)}, workdir=tmp_path / workdir)

    def rows(outputs, name):
        return [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items() if k != "logprobs"}
                for row in read_rows(outputs[name].local_dir)]

    fields = {"kind": "generate", "id": "g", "policy": "sft", "env": env_id, "n": 4, "samples": 2, "greedy": 1,
              "max_tokens": 32}
    local = generate(GenerateStage(**fields), context("g", "local"))
    remote = generate(GenerateStage(**fields, rollout=server), context("g", "remote"))
    assert rows(remote, "rollouts") == rows(local, "rollouts")
    fields = {"kind": "evaluate", "id": "e", "checkpoints": ["sft"], "envs": [env_id], "n": 6, "max_new_tokens": 32}
    local = evaluate(EvaluateStage(**fields), context("e", "local-e"))
    remote = evaluate(EvaluateStage(**fields, rollout=server), context("e", "remote-e"))
    assert remote["results"].metrics == local["results"].metrics


def test_a_groups_samples_go_as_one_request_with_n_and_sample_what_local_rows_sample(base_url):
    from tasks.rollout.server_policy import seed_runs

    assert seed_runs([[1], [1], [1], [2], [2], [1]], [5, 6, 7, 8, 10, 11]) == [(0, 3), (3, 1), (4, 1), (5, 1)]
    model, tokenizer = local_model()
    tasks, params = [t for t in ARITH.tasks("eval", 2, 0) for _ in range(4)], SamplingParams(24, temperature=1.0)
    remote = roll_out(ServerPolicy(base_url, NAME, tokenizer), tokenizer, ARITH, tasks, params, seed=11)
    assert turns_of(remote) == turns_of(roll_out(LocalPolicy(model, tokenizer), tokenizer, ARITH, tasks, params,
                                                 seed=11))
    assert len({t.text for t in remote[:4]}) > 1


def hostile_app(token_ids: list[int]):
    """A real server that answers every completion with these token ids (log-probs 0)."""
    from fastapi import FastAPI

    from models.serving.limits import Limits

    app = FastAPI()
    app.state.limits = Limits()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "text": "", "finish_reason": "length", "token_ids": token_ids,
                             "logprobs": {"tokens": [], "token_logprobs": [0.0] * len(token_ids),
                                          "top_logprobs": None, "text_offset": []}}]}

    return app


@pytest.mark.parametrize("token_ids", [[10**9], list(range(40))], ids=["outside the vocabulary", "over max_tokens"])
def test_token_ids_a_model_cannot_have_written_are_refused(token_ids):
    _, tokenizer = local_model()
    with running_app(hostile_app(token_ids)) as url:
        policy = ServerPolicy(url, NAME, tokenizer)
        policy.vocab = 512
        with pytest.raises(EndpointError, match="the answer's token ids are not a completion of this model"):
            policy.generate([1, 2], 0, SamplingParams(8))
