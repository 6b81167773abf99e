"""Rollouts against a vLLM-faithful fake server (tests/fake_vllm): what real vLLM does differently
from serve-model. Every sampling field goes out explicitly, max_tokens fits the context the server
has left, the server's log-prob mode is checked at start, and an aborted completion is an error.
Greedy rollouts through the fake are the local ones, token for token."""

import threading

import httpx
import pytest
from fake_vllm import FakeVllmConfig, running_fake
from test_serve_model import ARITH, CALC, NAME, local_model, trained_checkpoint
from test_server_policy import assert_same_rollouts

from models.sampling import SamplingParams, chat_prompt
from tasks.rollout.endpoint_policy import EndpointError
from tasks.rollout.episodes import LocalPolicy, roll_out
from tasks.rollout.server_policy import ServerPolicy

QWEN3_GENERATION_CONFIG = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 32768}


def fake(**fields) -> FakeVllmConfig:
    return FakeVllmConfig(trained_checkpoint(), NAME, **{"logprobs_mode": "processed_logprobs", **fields})


@pytest.fixture(scope="module")
def vllm_url():
    with running_fake(fake(generation_config=QWEN3_GENERATION_CONFIG)) as (url, server):
        yield url, server


@pytest.mark.parametrize("env, n", [(ARITH, 12), (CALC, 8)], ids=["single-turn", "multi-turn"])
def test_vllm_greedy_rollouts_through_the_fake_are_the_local_ones(vllm_url, env, n):
    url, _ = vllm_url
    model, tokenizer = local_model()
    tasks, params = env.tasks("eval", n, 0), SamplingParams(48)
    local = roll_out(LocalPolicy(model, tokenizer), tokenizer, env, tasks, params)
    assert_same_rollouts(roll_out(ServerPolicy.checked(fake_rollout(url), tokenizer, 512), tokenizer, env, tasks,
                                  params), local)


def fake_rollout(url: str, **fields):
    from tasks.rollout.backends import ServerRollout

    return ServerRollout(backend="server", endpoint=url, model=NAME, **fields)


def test_vllm_requests_leave_no_sampling_field_to_the_server_defaults(vllm_url):
    """The fake fills what a request leaves out from the model's generation_config (Qwen3's top_k 20,
    top_p 0.95, temperature 0.6), as vLLM does: every request says all of it."""
    url, server = vllm_url
    model, tokenizer = local_model()
    tasks, params = ARITH.tasks("eval", 4, 1), SamplingParams(24, temperature=1.0)
    before = len(server.requests)
    remote = roll_out(ServerPolicy.checked(fake_rollout(url), tokenizer, 512), tokenizer, ARITH, tasks, params, seed=3)
    decoded = [request["sampling"] for request in server.requests[before:]]
    assert decoded and all((s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.presence_penalty,
                            s.frequency_penalty) == (1.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0) for s in decoded[-len(tasks):])
    local = roll_out(LocalPolicy(model, tokenizer), tokenizer, ARITH, tasks, params, seed=3)
    assert [t.turns[0].action_ids for t in remote] == [t.turns[0].action_ids for t in local]


def test_vllm_a_growing_multi_turn_episode_ends_truncated_where_the_context_is_full():
    """vLLM answers 400 when max_tokens exceeds what the context has left: the client asks for what
    fits, and an episode with no room left ends cut (truncated), never failed."""
    _, tokenizer = local_model()
    tasks = CALC.tasks("eval", 6, 2)
    longest = max(len(chat_prompt(tokenizer, task.prompt)) for task in tasks)
    with running_fake(fake(max_model_len=longest + 40)) as (url, server):
        policy = ServerPolicy.checked(fake_rollout(url), tokenizer, 512)
        assert policy.max_model_len == longest + 40  # read from the server's /v1/models card
        trajectories = roll_out(policy, tokenizer, CALC, tasks, SamplingParams(32))
        ends = [len(t.prompt_ids) + t.completion_tokens + sum(len(turn.observation_ids) for turn in t.turns)
                for t in trajectories]
    assert all(length <= longest + 40 for length in ends)
    assert any(not t.finished for t in trajectories)  # some episodes ran out of room
    for trajectory in trajectories:
        for turn in trajectory.turns:
            assert len(turn.context_ids) + len(turn.action_ids) <= longest + 40


def test_vllm_max_model_len_from_the_spec_wins_over_the_server():
    _, tokenizer = local_model()
    with running_fake(fake(max_model_len=4096)) as (url, _):
        policy = ServerPolicy.checked(fake_rollout(url, max_model_len=100), tokenizer, 512)
        assert policy.max_model_len == 100
        [generation] = policy.generate(list(range(1, 98)), 0, SamplingParams(16))
        assert len(generation.token_ids) <= 3 and generation.finish_reason == "length"


def test_vllm_raw_logprobs_are_refused_naming_the_flag():
    _, tokenizer = local_model()
    with running_fake(fake(logprobs_mode="raw_logprobs")) as (url, _):
        with pytest.raises(EndpointError, match=rf"^{url}: the server's log-probs are raw \(before temperature\); "
                                                r"the trainer's are after it: start vLLM with --logprobs-mode "
                                                r"processed_logprobs$"):
            ServerPolicy.checked(fake_rollout(url), tokenizer, 512)


def test_vllm_an_aborted_completion_is_an_error_not_a_stop():
    _, tokenizer = local_model()
    with running_fake(fake(dev_mode=True)) as (url, server):
        policy = ServerPolicy.checked(fake_rollout(url), tokenizer, 512)
        server.gate.clear()  # the next request waits in flight
        failures = []
        request = threading.Thread(target=lambda: failures.append(raises(lambda: policy.generate([1, 5, 9], 0,
                                                                                                 SamplingParams(8)))))
        request.start()
        wait_for(lambda: server.in_flight == 1)
        assert httpx.post(url.removesuffix("/v1") + "/pause", params={"mode": "abort"}, timeout=60).status_code == 200
        request.join(timeout=60)
        httpx.post(url.removesuffix("/v1") + "/resume", timeout=60)
        server.gate.set()
    assert failures and "finish_reason 'abort'" in failures[0], failures


def raises(call) -> str:
    try:
        call()
    except EndpointError as exc:
        return str(exc)
    return "no error"


def wait_for(condition, seconds: float = 30) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_vllm_a_greedy_group_is_one_request_per_completion(vllm_url):
    """A group's samples share a prompt and count their seeds up: one request with `n`, except when
    greedy, which vLLM refuses with `n` > 1 (400 "n must be 1 when using greedy sampling")."""
    url, server = vllm_url
    model, tokenizer = local_model()
    policy = ServerPolicy.checked(fake_rollout(url), tokenizer, 512)
    prompt = chat_prompt(tokenizer, ARITH.tasks("eval", 1, 4)[0].prompt)
    before = len(server.requests)
    generations = policy.generate_many([prompt] * 3, SamplingParams(12), [7, 8, 9])
    assert [request["sampling"].n for request in server.requests[before:]] == [1, 1, 1]
    local = LocalPolicy(model, tokenizer).generate_many([prompt] * 3, SamplingParams(12), [7, 8, 9])
    assert [g.token_ids for g in generations] == [g.token_ids for g in local]
    sampled = policy.generate_many([prompt] * 3, SamplingParams(12, temperature=1.0), [7, 8, 9])
    assert len(sampled) == 3 and server.requests[-1]["sampling"].n == 3


def test_vllm_the_local_engine_ends_on_the_generation_configs_end_ids_as_vllm_does():
    """vLLM stops on the tokenizer's end token and on every eos_token_id of the model's
    generation_config (Qwen3: <|im_end|> and <|endoftext|>); the local engine stopped on the first only."""
    from models.sampling import generate_tokens

    model, tokenizer = local_model()
    prompt = chat_prompt(tokenizer, ARITH.tasks("eval", 1, 4)[0].prompt)
    [free] = generate_tokens(model, tokenizer, [prompt], SamplingParams(12, stop=()))
    third = free.token_ids[2]
    assert third != tokenizer.eos_token_id and len(free.token_ids) > 3
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, third]
    try:
        [ended] = generate_tokens(model, tokenizer, [prompt], SamplingParams(12, stop=()))
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    first = free.token_ids.index(third)
    assert ended.token_ids == free.token_ids[:first + 1] and ended.finish_reason == "stop"
