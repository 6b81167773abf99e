"""Learned rewards in a dataset env's rubric: a reward model's scores (batched, cached, its tokenizer
checked against the policy's) and a judge endpoint's (conftest's `score_judge_url`: tiny-llama taught
to answer a score; `judge_url`, taught yes/no: a judge that answers no score), errors counted, never 0."""

import functools
import math
from pathlib import Path

import pytest

from envs.arith import ArithEnv, ArithEnvConfig
from envs.base import Task
from envs.dataset import DatasetEnv, DatasetEnvConfig, JudgeScoring
from tasks.rollout.judge import JUDGE_PROMPT
from tasks.rollout.judge_client import JudgeFailure, JudgeReplyError, Question, ScoreForm, read_reply
from tasks.rollout.learned_rewards import JudgeConfigError, JudgeScorer, attach_scorers

ARITH = ArithEnv(ArithEnvConfig(kind="arith", digits=1))


def sums_env(rewards: list[dict]) -> DatasetEnv:
    env = DatasetEnv(DatasetEnvConfig(kind="dataset", data="rows", eval_fraction=0.0, rewards=rewards), "sums")
    env.use_rows([{"id": str(i), "prompt": task.prompt, "answer": task.answer}
                  for i, task in enumerate(ARITH.tasks("train", 16, 0))])
    return env


def score_of(reply: str) -> float:
    judge = JudgeScoring(endpoint="http://127.0.0.1:1/v1", model="j")
    question = Question.of(judge.prompt, ScoreForm(judge.min_score, judge.max_score), "What is 3 + 4?",
                           "The answer is 7.", "7")
    return read_reply(reply, ScoreForm(judge.min_score, judge.max_score), question)


@pytest.mark.parametrize("reply, reward", [("SCORE: 10", 1.0), ("Right, and clear.\nSCORE: 7", 0.7), ("SCORE: 0", 0.0),
                                           (" SCORE: 2.5 \n", 0.25)])
def test_a_judges_final_score_line_is_scaled_to_a_reward(reply, reward):
    assert score_of(reply) == pytest.approx(reward)


@pytest.mark.parametrize("reply, failure", [
    ("10", JudgeFailure.NO_FINAL_FORM), ("yes, it is right", JudgeFailure.NO_FINAL_FORM),
    ("Score: 7/10", JudgeFailure.NO_FINAL_FORM), ("SCORE: 7\nit is right", JudgeFailure.NO_FINAL_FORM),
    ("SCORE: 12", JudgeFailure.OUT_OF_RANGE), ("SCORE: -3", JudgeFailure.OUT_OF_RANGE),
    ("SCORE: 3\nSCORE: 10", JudgeFailure.SEVERAL_FINAL_FORMS)])
def test_a_judge_reply_without_one_final_score_line_in_range_is_no_reward(reply, failure):
    with pytest.raises(JudgeReplyError) as error:
        score_of(reply)
    assert error.value.failure is failure


def test_judge_prompts_must_hold_the_completion():
    with pytest.raises(ValueError, match="prompt: a template with {completion}"):
        JudgeScoring(endpoint="http://127.0.0.1:1/v1", model="j", prompt="Rate {prompt}")
    with pytest.raises(ValueError, match="names reference"):
        JudgeScoring(endpoint="http://127.0.0.1:1/v1", model="j", prompt="{completion} vs {reference}")


def test_two_rewards_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two rewards named rm"):
        DatasetEnvConfig(kind="dataset", data="rows", rewards=[{"reward_model": "rm"}, {"reward_model": "rm"}])


@functools.cache
def reward_model_folder() -> Path:
    """tiny-llama with a fresh score head, saved as a reward model folder (its scores are arbitrary:
    these tests check how they are asked for, not what they say)."""
    import tempfile

    import torch

    from models.config import ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize

    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp(prefix="posttrain-rm-"))
    load_model(materialize("tiny-llama"), ModelConfig(), reward_head=True).save_pretrained(str(folder))
    load_tokenizer(materialize("tiny-llama")).save_pretrained(str(folder))
    return folder


def test_a_reward_model_scores_a_batch_at_once_and_each_completion_once():
    from models.config import ModelConfig
    from models.loading import load_tokenizer
    from models.presets import materialize

    env = sums_env([{"function": "posttrain.rewards:answer_format", "weight": 0.0}, {"reward_model": "rm"}])
    attach_scorers(env, "sums", lambda stage_id: reward_model_folder(), ModelConfig(), "cpu",
                   load_tokenizer(materialize("tiny-llama")))
    scorer = env.scorers["rm"]
    calls = []
    forward = scorer.model.forward
    scorer.model.forward = lambda *args, **kwargs: calls.append(kwargs["input_ids"].shape[0]) or forward(*args, **kwargs)
    tasks = env.tasks("train", 6, 0)
    completions = [f"The answer is {i}." for i in range(6)]
    env.rubric.prefetch(list(zip(completions, tasks)))
    assert calls == [6]  # one forward for the batch
    scores = [env.rubric.score(c, t) for c, t in zip(completions, tasks)]
    again = [env.rubric.score(c, t) for c, t in zip(completions, tasks)]
    assert calls == [6]  # every score came from the cache
    assert [s.rewards["rm"] for s in scores] == [s.rewards["rm"] for s in again]
    assert all(0 < s.rewards["rm"] < 1 for s in scores)  # sigmoid of the head's score
    assert all(s.total == s.rewards["rm"] for s in scores)  # answer_format at weight 0: logged only


def test_a_reward_model_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    from transformers import AutoTokenizer

    from models.config import ModelConfig

    other = AutoTokenizer.from_pretrained(str(reward_model_folder()))
    other.add_tokens(["<extra-token>"])
    env = sums_env([{"function": "posttrain.rewards:answer_format"}, {"reward_model": "rm"}])
    with pytest.raises(ValueError) as error:
        attach_scorers(env, "sums", lambda stage_id: reward_model_folder(), ModelConfig(), "cpu", other)
    message = str(error.value)
    assert message.startswith("envs.sums.rewards[1].reward_model: the reward model's tokenizer is not the policy's "
                              "(512 vs 513 tokens; first difference: '<extra-token>')")
    assert "\n" not in message


def test_a_judge_endpoint_scores_completions_concurrently_and_once_each(score_judge_url):
    env = sums_env([{"function": "posttrain.rewards:answer_format", "weight": 0.0},
                    {"judge": {"endpoint": score_judge_url, "model": "judge", "max_workers": 4}, "weight": 1.0}])
    attach_scorers(env, "sums", None, None, "cpu")  # a first request checks the judge answers a score
    scorer = env.scorers["judge"]
    tasks = env.tasks("train", 8, 1)
    completions = [f"{t.prompt.split('is ')[-1].rstrip('?')} = {t.answer}. The answer is {t.answer}." for t in tasks]
    env.rubric.prefetch(list(zip(completions, tasks)))
    asked = len(scorer.cache)
    scores = [env.rubric.score(c, t) for c, t in zip(completions, tasks)]
    assert asked == len(set(zip((t.prompt for t in tasks), completions))) + 1  # the check's request, then each once
    assert all(s.rewards["judge"] in (0.0, 1.0) and not s.errors for s in scores)  # 10 or 0, scaled
    assert len(scorer.cache) == asked  # scoring asked nothing more


def test_a_judge_that_answers_no_score_is_a_one_line_error(judge_url):
    """A yes/no grader (the evaluation judge's prompt) asked for a reward."""
    env = sums_env([{"function": "posttrain.rewards:answer_format"},
                    {"judge": {"endpoint": judge_url, "model": "judge", "prompt": JUDGE_PROMPT}}])
    with pytest.raises(JudgeConfigError) as error:
        attach_scorers(env, "sums", None, None, "cpu")
    message = str(error.value)
    assert message.startswith(f"envs.sums.rewards[1].judge: the judge judge at {judge_url} answered no score (")
    assert message.endswith("its reply must end with the line SCORE: N, N from 0 to 10") and "\n" not in message


def test_an_unreachable_judge_scores_nan_and_counts_the_error():
    """A request that fails after its retries is an error the rubric records: the total is NaN,
    never a silent 0."""
    from conftest import free_port

    judge = JudgeScoring(endpoint=f"http://127.0.0.1:{free_port()}/v1", model="judge", retries=0, timeout_seconds=2)
    env = sums_env([{"function": "posttrain.rewards:answer_format"}, {"judge": judge.model_dump()}])
    env.use_scorers({"judge": JudgeScorer(judge, "envs.sums.rewards[1].judge")})
    task = env.tasks("train", 1, 0)[0]
    score = env.rubric.score("The answer is 3.", task)
    assert math.isnan(score.total) and math.isnan(score.rewards["judge"])
    assert "cannot reach the endpoint" in score.errors["judge"]


def test_an_unattached_learned_reward_is_an_error_not_a_zero():
    env = sums_env([{"function": "posttrain.rewards:answer_format"}, {"reward_model": "rm"}])
    score = env.rubric.score("The answer is 3.", Task(id="t", prompt="What is 1+2?", answer="3"))
    assert math.isnan(score.total) and "has no scorer" in score.errors["rm"]


def test_reward_hacking_of_a_reward_model_does_not_win_under_the_shipped_shaping():
    """pipelines/learned-rewards.yaml's rl stage, with a reward model whatever it scores (an
    untrained head): a good answer repeated, or padded to the token budget (ended there, or cut),
    earns less than the answer itself."""
    from conftest import ROOT

    from flows.spec import load_spec
    from models.config import ModelConfig
    from models.loading import load_tokenizer
    from models.presets import materialize
    from tasks.rollout.episodes import Trajectory, TurnRecord
    from tasks.stages.rl.scoring import score_trajectory

    spec, _ = load_spec(ROOT / "pipelines" / "learned-rewards.yaml")
    rl = spec.stage("rl")
    tokenizer = load_tokenizer(materialize("tiny-llama"))
    env = sums_env([{"function": "posttrain.rewards:answer_format", "weight": 0.0},
                    {"reward_model": "rm", "weight": 1.0}])
    attach_scorers(env, "sums", lambda stage_id: reward_model_folder(), ModelConfig(), "cpu", tokenizer)
    task = env.tasks("train", 1, 0)[0]
    good = f"The answer is {task.answer}."

    def shaped(text: str, tokens: int | None = None, ended: bool = True) -> float:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        ids += [ids[-1]] * ((tokens or 0) - len(ids))  # a completion exactly `tokens` long
        turn = TurnRecord(context_ids=[1], action_ids=ids, observation_ids=[], reward=0.0, truncated=not ended)
        trajectory = Trajectory(env_id="sums", task=task, prompt_ids=[1], turns=[turn], text=text, finished=ended,
                                actions=[text])
        return score_trajectory(trajectory, env, rl).reward

    filler = " ".join(f"word{i}" for i in range(80))
    honest = shaped(good)
    assert shaped(" ".join([good] * 8)) < honest  # repetition
    assert shaped(f"{good} {filler}", tokens=rl.max_tokens) < honest  # padded to the budget, ended there
    assert shaped(f"{good} {filler}", tokens=rl.max_tokens, ended=False) < honest  # cut at the budget


def test_generate_picks_preference_pairs_by_a_reward_models_score():
    """generate's rows carry the reward model's score (`reward_rm`, scored in one batch), and the
    preference pair of a prompt is its best and worst by that score."""
    from models.config import ModelConfig
    from tasks.common.pairs import preference_pairs
    from tasks.rollout.episodes import Trajectory, TurnRecord
    from tasks.stages.generate import GenerateStage, rollout_rows

    env = sums_env([{"function": "posttrain.rewards:answer_format", "weight": 0.0}, {"reward_model": "rm"}])
    attach_scorers(env, "sums", lambda stage_id: reward_model_folder(), ModelConfig(), "cpu")
    task = env.tasks("train", 1, 0)[0]
    texts = [f"The answer is {task.answer}.", "I do not know.", f"{task.answer}!"]
    group = [Trajectory(env_id="sums", task=task, prompt_ids=[1], text=text, finished=True, actions=[text],
                        turns=[TurnRecord(context_ids=[1], action_ids=[5, 2], observation_ids=[], reward=0.0,
                                          truncated=False)]) for text in texts]
    rows = rollout_rows(env, [group], GenerateStage(kind="generate", id="g", policy="p", env="sums", n=1, samples=3,
                                                    greedy=0))
    scores = [row["reward_rm"] for row in rows]
    assert [row["reward"] for row in rows] == scores and len(set(scores)) == 3
    [pair], _ = preference_pairs(rows)
    assert pair["chosen"] == texts[scores.index(max(scores))] and pair["rejected"] == texts[scores.index(min(scores))]
