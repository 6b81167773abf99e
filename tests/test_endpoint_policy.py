"""EndpointPolicy: the rollout loop's policy over an OpenAI-compatible endpoint (a real serve-model
server on 127.0.0.1, the official client). A multi-turn episode continues its context through
`continue_final_message` and plays exactly as the local model does."""

import pytest
from conftest import free_port
from test_serve_model import ARITH, CALC, NAME, local_model

from models.sampling import SamplingParams
from tasks.rollout.endpoint_policy import EndpointError, EndpointPolicy
from tasks.rollout.episodes import Context, LocalPolicy, roll_out


def test_multi_turn_episodes_through_the_endpoint_equal_the_local_ones(base_url):
    model, tokenizer = local_model()
    tasks, params = CALC.tasks("eval", 12, 0), SamplingParams(48)
    local = roll_out(LocalPolicy(model, tokenizer), tokenizer, CALC, tasks, params)
    remote = roll_out(EndpointPolicy(base_url, NAME, tokenizer), tokenizer, CALC, tasks, params)
    assert sum(len(t.turns) > 1 for t in local) >= len(tasks) // 2  # the continuation path is exercised
    assert [t.text for t in remote] == [t.text for t in local]
    for mine, theirs in zip(remote, local):  # token in / token out, the same ids turn by turn
        assert [(turn.context_ids, turn.action_ids, turn.observation_ids) for turn in mine.turns] == \
            [(turn.context_ids, turn.action_ids, turn.observation_ids) for turn in theirs.turns]
        assert (mine.finished, mine.outcome) == (theirs.finished, theirs.outcome)
    assert [CALC.is_correct(t.text, t.task) for t in remote] == [CALC.is_correct(t.text, t.task) for t in local]


def test_an_episode_model_call_is_answered_like_the_local_model(base_url):
    model, tokenizer = local_model()
    prompt, params = ARITH.tasks("eval", 1, 3)[0].prompt, SamplingParams(40)
    assert EndpointPolicy(base_url, NAME, tokenizer).complete(prompt, params) == \
        LocalPolicy(model, tokenizer).complete(prompt, params)


def test_a_group_of_samples_is_seeded_per_episode(base_url):
    _, tokenizer = local_model()
    policy = EndpointPolicy(base_url, NAME, tokenizer)
    tasks, params = ARITH.tasks("eval", 1, 0) * 4, SamplingParams(24, temperature=1.0)
    first = [t.text for t in roll_out(policy, tokenizer, ARITH, tasks, params, seed=5)]
    assert first == [t.text for t in roll_out(policy, tokenizer, ARITH, tasks, params, seed=5)]
    assert len(set(first)) > 1  # the repeats of one task are different samples


def test_an_unknown_model_names_the_models_the_endpoint_serves(base_url):
    _, tokenizer = local_model()
    with pytest.raises(EndpointError) as error:
        roll_out(EndpointPolicy(base_url, "gpt-nothing", tokenizer), tokenizer, ARITH, ARITH.tasks("eval", 2, 0),
                 SamplingParams(8))
    assert str(error.value) == f"{base_url}: unknown model 'gpt-nothing' (the endpoint serves: {NAME})"


def test_an_unreachable_endpoint_is_a_one_line_error():
    _, tokenizer = local_model()
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with pytest.raises(EndpointError) as error:
        EndpointPolicy(url, NAME, tokenizer).complete("what is 2+2?", SamplingParams(8))
    message = str(error.value)
    assert message.startswith(f"{url}: cannot reach the endpoint (") and "\n" not in message, message


def test_without_extensions_a_continued_context_is_refused_before_anything_is_sent():
    _, tokenizer = local_model()
    policy = EndpointPolicy(f"http://127.0.0.1:{free_port()}/v1", NAME, tokenizer, extensions=False)
    context = Context.start(tokenizer, "what is 2+2?")
    with pytest.raises(EndpointError, match="needs the continue_final_message extension"):
        policy.act([0], [context.extended([5, 6])], 1, SamplingParams(8, stop=("</calc>",)), [0])
