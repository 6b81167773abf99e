"""serve-model's vLLM-shaped API beyond chat: /v1/completions with token-id prompts, log-probs and
returned token ids, streaming, and the limits of the new fields (each a 400 naming the field)."""

import json

import httpx
import openai
import pytest
from test_serve_model import NAME, local_model

from models.sampling import SamplingParams, chat_prompt, generate_tokens


def post(base_url: str, route: str, **fields) -> httpx.Response:
    return httpx.post(f"{base_url}/{route}", content=json.dumps({"model": NAME, **fields}), timeout=60,
                      headers={"content-type": "application/json"})


def refused(response: httpx.Response, param: str | None, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)


def test_a_token_id_completion_is_the_local_engines(client):
    model, tokenizer = local_model()
    prompt = chat_prompt(tokenizer, "what is 3+4?")
    local = generate_tokens(model, tokenizer, [prompt], SamplingParams(24, top_logprobs=3))[0]
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=3,
                                       extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert choice.model_extra["token_ids"] == local.token_ids and choice.model_extra["prompt_token_ids"] == prompt
    assert choice.text == local.text and choice.finish_reason == local.finish_reason
    assert choice.logprobs.token_logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert [len(top) for top in choice.logprobs.top_logprobs] == [3] * len(local.token_ids)
    first = max(choice.logprobs.top_logprobs[0].values())  # greedy: the token taken is the likeliest
    assert first == pytest.approx(local.logprobs[0], abs=1e-5)
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == len(local.token_ids)


def test_text_prompts_several_prompts_and_tokens_as_ids(client):
    _, tokenizer = local_model()
    prompts = [chat_prompt(tokenizer, "what is 1+1?"), chat_prompt(tokenizer, "what is 2+2?")]
    texts = [tokenizer.decode(p) for p in prompts]
    by_ids = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, n=2)
    by_text = client.completions.create(model=NAME, prompt=texts, max_tokens=8, temperature=0, n=2,
                                        logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert len(by_ids.choices) == 4 and by_ids.choices[0].text == by_ids.choices[1].text  # prompt by prompt, n each
    assert all(token.startswith("token_id:") for token in by_text.choices[0].logprobs.tokens)


def test_chat_log_probs_and_token_ids(client):
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "what is 2+5?"}],
                                            max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                                            extra_body={"return_token_ids": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == len(answer.choices[0].model_extra["token_ids"]) and all(len(t.top_logprobs) == 2
                                                                                   for t in content)
    assert answer.model_extra["prompt_token_ids"]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_streamed_answer_is_the_non_streamed_one(client, route):
    _, tokenizer = local_model()
    fields = {"max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 2, "stop": ["\n\n"]}
    if route == "chat":
        messages = [{"role": "user", "content": "what is 12+34?"}]
        whole = client.chat.completions.create(model=NAME, messages=messages, **fields)
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **fields))
        texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(2)]
        assert texts == [choice.message.content for choice in whole.choices]
    else:
        prompt = chat_prompt(tokenizer, "what is 12+34?")
        whole = client.completions.create(model=NAME, prompt=prompt, **fields)
        chunks = list(client.completions.create(model=NAME, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, **fields))
        texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(2)]
        assert texts == [choice.text for choice in whole.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason for choice in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len(chunks) > 6  # one event per token, not one per answer


def test_the_completions_limits_are_400s_naming_the_field(base_url):
    _, tokenizer = local_model()
    refused(post(base_url, "completions", prompt=[1, 2], logprobs=21), "logprobs", "less than or equal to 20")
    refused(post(base_url, "completions", prompt=[]), "prompt", "between 1 and 64 prompts")
    refused(post(base_url, "completions", prompt=[[1]] * 65), "prompt", "between 1 and 64 prompts")
    refused(post(base_url, "completions", prompt=[1, -3]), "prompt", "token ids are not negative")
    refused(post(base_url, "completions", prompt=[1, 10**9]), "prompt", "outside the vocabulary")
    refused(post(base_url, "completions", prompt=[1] * 5000), "prompt", "the model's context is")
    refused(post(base_url, "completions", prompt=[[1]] * 5, n=64), "n", "more than 256 choices")
    refused(post(base_url, "completions", prompt=[1], n=65), "n", "less than or equal to 64")
    refused(post(base_url, "completions", prompt="hi", echo=True, stream=True), None, "echo is not supported with stream")
    refused(post(base_url, "completions", prompt="hi", max_tokens=0), None, "max_tokens 0 needs echo true")
    refused(post(base_url, "completions", prompt="hi", temperature=2.5), "temperature", "less than or equal to 2")
    refused(post(base_url, "completions", prompt="hi", seed=-1), "seed", "greater than or equal to 0")
    refused(post(base_url, "completions", prompt="hi", stop=["x"] * 17), "stop", "at most 16 stop strings")
    refused(post(base_url, "completions", prompt=[1.5]), "prompt", "a text, a list of token ids (integers)")
    refused(post(base_url, "chat/completions", messages=[{"role": "user", "content": "hi"}], top_logprobs=2),
            None, "top_logprobs needs logprobs true")
    refused(post(base_url, "chat/completions", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                 top_logprobs=21), "top_logprobs", "less than or equal to 20")


def test_a_stream_sends_tokens_while_the_engine_still_decodes():
    """The first events arrive while the batch is still decoding (the engine holds its lock), not
    once the answer is done; a client that leaves mid-stream stops its rows."""
    from test_serve_model import running_app

    from models.presets import materialize
    from models.serving.app import make_app

    app = make_app(materialize("tiny-llama"), "raw")  # untrained: it writes its whole budget
    batcher = app.state.served.batcher
    engine = batcher.engine
    with running_app(app) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        stream = client.completions.create(model="raw", prompt=[1, 2, 3], max_tokens=2000, temperature=1.0,
                                           stream=True)
        decoding_at_first_text = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                decoding_at_first_text = engine.locked()
                break
        stream.close()  # the client leaves after its first words
        assert decoding_at_first_text is True
        import time

        deadline = time.monotonic() + 30
        while batcher.cut == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert batcher.cut == 1  # its row left the batch before its budget was spent
