"""The `search` env: the seeded corpus, the FTS5 bm25 index, every task's oracle through the real
rollout loop, exact-match grading and the observation masking."""

import sqlite3
import time

import pytest
from pydantic import ValidationError

from envs.search.env import (
    Fts5Unavailable,
    SearchEnv,
    SearchEnvConfig,
    exact_match,
    format_ok,
    normalize_answer,
    require_fts5,
    search_index,
)
from envs.search.corpus import build_world, corpus

ENV = SearchEnv(SearchEnvConfig(kind="search"))
TASK = next(t for t in ENV.all_tasks() if t.info["hops"] == 2)


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))


def play(env, task, actions):
    episode, transcript = env.start(task), ""
    for action in actions:
        turn = episode.step(action)
        transcript += action + (turn.observation if not turn.done else "")
        if turn.done:
            break
    return transcript


def test_the_corpus_is_seeded_short_and_large_enough():
    world = build_world(2000, 0)
    assert world.digest == build_world(2000, 0).digest == corpus(2000, 0).digest
    assert world.digest != build_world(2000, 1).digest
    assert len(world.passages) >= 2000 and len(build_world(3000, 0).passages) >= 3000
    assert all(len(str(p)) <= 200 for p in world.passages)
    assert len(set(world.passages)) == len(world.passages)


def test_the_index_is_fast_and_finds_every_gold_passage_with_the_oracle_queries():
    started = time.perf_counter()
    index = search_index(2000, 7)  # a world no other test built: a cold build
    assert time.perf_counter() - started < 2.0
    assert len(index.passages) == 2000
    tasks = ENV.all_tasks()
    assert len(tasks) >= 200 and sum(t.info["hops"] == 2 for t in tasks) >= 100
    for task in tasks:
        assert normalize_answer(task.answer) not in normalize_answer(task.prompt)
        for query, gold in zip(task.info["queries"], task.info["gold"]):
            assert gold in [str(ENV.index.passages[i]) for i in ENV.index.search(query, 2)]


def test_every_task_oracle_scores_full_reward_and_a_no_op_scores_zero(tokenizer):
    from tasks.rollout.env_check import check_env

    tasks = ENV.all_tasks()
    checks = check_env(ENV, tokenizer, tasks)
    assert len(checks) == len(tasks) >= 200
    assert [c.task_id for c in checks if not c.ok] == []
    for task in tasks:
        completion = ENV.reference_completion(task)
        assert len(task.prompt) + len(completion) <= 900
        assert ENV.is_correct(completion, task) and ENV.is_formatted(completion, task)
        score = ENV.rubric.score(completion, task)
        assert score.rewards["searches"] == task.info["hops"] and score.rewards["gold_retrieved"] == 1.0


def test_rollout_chains_tokens_and_masks_the_retrieved_passages(tokenizer):
    from models.sampling import SamplingParams
    from tasks.rollout.episodes import ScriptedPolicy, roll_out

    [trajectory] = roll_out(ScriptedPolicy(tokenizer, [ENV.oracle_actions(TASK)]), tokenizer, ENV, [TASK],
                            SamplingParams(64))
    assert trajectory.finished and len(trajectory.turns) == 3 and trajectory.text == ENV.reference_completion(TASK)
    ids, mask = trajectory.completion()
    masked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert masked.count("<information>") == 2 and all(g in masked for g in TASK.info["gold"])
    assert "<answer>" not in masked and "<search>" in tokenizer.decode([t for t, m in zip(ids, mask) if m])
    [cut] = roll_out(ScriptedPolicy(tokenizer, [["<search>x</search>"] * 9]), tokenizer, ENV, [TASK], SamplingParams(64))
    assert len(cut.turns) == ENV.max_turns and cut.truncated and ENV.rubric.score(cut.text, TASK).total == 0


def test_exact_match_normalizes_and_answer_spam_does_not_pay():
    assert normalize_answer("  The  Tamsel-River! ") == "tamselriver"
    assert normalize_answer("an Architect.") == "architect" and normalize_answer("A") == ""
    assert normalize_answer("Theodor's Anvil") == "theodors anvil"  # articles only as whole words
    answer = TASK.answer
    for good in (f"<answer>{answer}</answer>", f"<answer> the {answer.upper()}. </answer>",
                 f"<think>easy</think><answer>{answer}</answer>"):
        assert exact_match(good, TASK) == 1.0
    for bad in ("", f"<answer>{answer} x</answer>", f"<answer>{answer}", f"{answer}", "<answer></answer>",
                f"<answer>{answer}</answer><answer>{answer}</answer>", f"<answer>no</answer><answer>{answer}</answer>"):
        assert exact_match(bad, TASK) == 0.0
    spam = play(ENV, TASK, [f"<answer>x</answer><search>{TASK.info['queries'][0]}</search>",
                            f"<answer>{answer}</answer>"])
    assert ENV.rubric.score(spam, TASK).total == 0 and not ENV.is_correct(spam, TASK)


def test_format_needs_one_search_per_call_and_one_final_answer():
    reference = ENV.reference_completion(TASK)
    assert format_ok(reference, TASK) == 1.0
    thinking = play(ENV, TASK, [f"<think>hop one</think>\n{a}" for a in ENV.oracle_actions(TASK)])
    assert format_ok(thinking, TASK) == 1.0 and exact_match(thinking, TASK) == 1.0
    assert format_ok(f"<answer>{TASK.answer}</answer>", TASK) == 1.0  # a lucky guess is well formed
    for bad in (reference + "trailing <answer>x</answer>", "no tags",
                play(ENV, TASK, ["why <search>a</search>", "<answer>b</answer>"]),
                play(ENV, TASK, ["<search>a</search>", "<search>b</search>"])):
        assert format_ok(bad, TASK) == 0.0


def test_steps_answer_searches_and_end_on_answers_or_no_call():
    episode = ENV.start(TASK)
    first = episode.step(ENV.oracle_actions(TASK)[0])
    assert not first.done and first.observation.startswith("\n<information>")
    assert first.observation.endswith("</information>\n")
    assert first.observation.count("\n") == 3  # top_k=2 passages, one a line
    for hostile in ('" OR *', "NEAR(a b)", "title:x", "'; DROP TABLE passages; --", "\x00\u2603", "a " * 500):
        assert not episode.step(f"<search>{hostile}</search>").done
    assert episode.step("<search>?!</search>").observation == "\n<information>no results</information>\n"
    assert episode.step("<search>zzzqqq</search>").observation == "\n<information>no results</information>\n"
    assert episode.step("I give up").done and ENV.start(TASK).step("<answer>x</answer>").done
    assert episode.finish() == {}


def test_splits_are_disjoint_seeded_and_cycle():
    train, held_out = ENV.split_tasks("train"), ENV.split_tasks("eval")
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    assert 0.05 < len(held_out) / len(ENV.all_tasks()) < 0.15
    assert [t.id for t in ENV.tasks("eval", 5, 3)] == [t.id for t in ENV.tasks("eval", 5, 3)]
    assert [t.id for t in ENV.tasks("eval", 5, 3)] != [t.id for t in ENV.tasks("eval", 5, 4)]
    cycled = ENV.tasks("eval", 2 * len(held_out) + 1, 0)
    assert len({t.id for t in cycled}) == len(cycled) and len({t.prompt for t in cycled}) == len(held_out)
    with pytest.raises(ValueError, match="unknown split"):
        ENV.tasks("test", 1, 0)


def test_config_errors_read_well_and_missing_fts5_is_explained():
    with pytest.raises(ValidationError, match="passages"):
        SearchEnvConfig(kind="search", passages=100)
    with pytest.raises(ValidationError, match="extra"):
        SearchEnvConfig(kind="search", topk=2)

    class NoFts5:
        def execute(self, sql):
            raise sqlite3.OperationalError("no such module: fts5")

    with pytest.raises(Fts5Unavailable, match="needs SQLite's FTS5 .* no such module: fts5"):
        require_fts5(NoFts5())
