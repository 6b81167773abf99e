"""The dataset env: prompt rows as tasks, a held-out split, and reward functions with TRL's exact
`reward_funcs` signature, from a user's module, receiving the dataset's extra columns."""

import json
import math

from envs import rewards
from envs.dataset import DatasetEnv, DatasetEnvConfig

USER_MODULE = '''
CALLS = []


def graded(prompts, completions, completion_ids, **kwargs):
    """Written for TRL's GRPOTrainer: one score per completion, None where it does not apply."""
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [None if answer is None else float(answer in completion[-1]["content"]) * difficulty
            for completion, answer, difficulty in zip(completions, kwargs["answer"], kwargs["difficulty"])]
'''
PROMPT = json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}])


def stored_rows(n: int) -> list[dict]:
    """Rows as the dataset stage stores prompt-only data (conversational prompts as JSON text)."""
    return [{"id": f"row-{i}", "row": i, "prompt": PROMPT, "answer": str(i) if i % 5 else None, "difficulty": 0.5,
             "conversational": True, "tools": None, "malformed": None, "total_tokens": 12} for i in range(n)]


def env_with_user_rewards(tmp_path, monkeypatch) -> DatasetEnv:
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    config = DatasetEnvConfig(kind="dataset", data="qa", eval_fraction=0.25, rewards=[
        {"function": "user_rewards:graded", "weight": 1.0}, {"function": "posttrain.rewards:answer_format",
                                                             "weight": 0.5}])
    config.find_rewards_in(tmp_path)  # the spec's folder
    env = DatasetEnv(config, "qa")
    env.use_rows(stored_rows(40))
    return env


def test_a_trl_reward_function_receives_the_extra_columns(tmp_path, monkeypatch):
    env = env_with_user_rewards(tmp_path, monkeypatch)
    import user_rewards  # imported by the env, from the spec's folder

    task = next(t for t in env.all_tasks() if t.answer == "3")
    score = env.rubric.score("It is 3. The answer is 3.", task, completion_ids=[7, 8, 9])
    call = user_rewards.CALLS[-1]
    assert call["prompts"] == [json.loads(PROMPT)]  # conversational data: message lists, as TRL passes them
    assert call["completions"] == [[{"role": "assistant", "content": "It is 3. The answer is 3."}]]
    assert call["completion_ids"] == [[7, 8, 9]]
    assert call["answer"] == ["3"] and call["difficulty"] == [0.5] and "row" not in call
    assert score.rewards == {"graded": 0.5, "answer_format": 1.0} and score.total == 1.0
    assert env.is_correct("The answer is 3.", task) is False  # the first function scores 0.5 here, not 1


def test_none_means_does_not_apply_and_is_left_out_of_the_total(tmp_path, monkeypatch):
    env = env_with_user_rewards(tmp_path, monkeypatch)
    unanswered = next(t for t in env.all_tasks() if t.answer == "")
    score = env.rubric.score("The answer is 4.", unanswered)
    assert score.rewards["graded"] is None and score.not_applied == 1
    assert score.total == 0.5 and not math.isnan(score.total)


def test_splits_are_disjoint_and_held_out_by_fraction(tmp_path, monkeypatch):
    env = env_with_user_rewards(tmp_path, monkeypatch)
    train, held_out = env.rows["train"], env.rows["eval"]
    assert not {t.id for t in train} & {t.id for t in held_out}
    assert len(train) + len(held_out) == 40 and 3 <= len(held_out) <= 18
    assert env.tasks("eval", 5, seed=0) == env.tasks("eval", 5, seed=0)
    env.use_rows(stored_rows(10), eval_rows=stored_rows(3))  # eval_data / eval_source: a second dataset
    assert len(env.rows["train"]) == 10 and len(env.rows["eval"]) == 3


def test_an_env_held_out_as_another_holds_out_the_same_rows():
    """Two envs over the same rows (one scores generation with a check, one rewards RL with a learned
    reward): by name alone each holds out other rows; `held_out_as` makes the splits one."""
    def split(name: str, held_out_as: str | None = None) -> set[str]:
        config = DatasetEnvConfig(kind="dataset", data="qa", eval_fraction=0.3, held_out_as=held_out_as,
                                  rewards=[{"function": "posttrain.rewards:answer_format", "weight": 1.0}])
        env = DatasetEnv(config, name)
        env.use_rows(stored_rows(200))
        return {task.id.removeprefix(f"{name}-") for task in env.rows["eval"]}

    sums = split("sums")
    assert split("checked") != sums  # the env's name is in the hash
    assert split("checked", held_out_as="sums") == sums


def test_synthesize_draws_a_repeated_row_under_an_id_of_its_own(tmp_path, monkeypatch):
    """More teacher traces than train rows (pipelines/mcp.yaml: 600 over ~70): the repeats get ids of
    their own, as the sft contract wants them unique, and the first pass keeps the rows' ids."""
    from tasks.stages.synthesize import SynthesizeStage, drawn_tasks

    env = env_with_user_rewards(tmp_path, monkeypatch)
    stage = SynthesizeStage(id="traces", kind="synthesize", env="qa", n=100, teacher="oracle")
    tasks = drawn_tasks(env, stage)
    ids = [task.id for task in tasks]
    assert len(set(ids)) == 100 and {task.prompt for task in tasks} == {PROMPT}
    train = len(env.rows["train"])
    assert set(ids[:train]) == {task.id for task in env.rows["train"]}
    assert ids[train].endswith("-r1") and ids[train].removesuffix("-r1") in ids[:train]


def test_built_in_rewards():
    completions = ["So 2+2 = 4. The answer is 4.", "\\boxed{1,000}", "#### 7", "no idea"]
    assert rewards.exact_match(None, completions, answer=["4", "1000", "7", None]) == [1.0, 1.0, 1.0, None]
    assert rewards.math_answer(None, completions, answer=["4.0", "1000", "8", "x"]) == [1.0, 1.0, 0.0, 0.0]
    assert rewards.answer_format(None, completions) == [1.0, 1.0, 1.0, 0.0]
    assert rewards.think_format(None, ["<think>add them</think> 4", "4", "<think>a</think><think>b</think> 4"]) == \
        [1.0, 0.0, 0.0]
    assert rewards.length_penalty(None, ["x", "y"], [[1] * 512, [1] * 4096]) == [0.5, 1.0]
    conversational = [[{"role": "assistant", "content": "The answer is 4."}]]
    assert rewards.exact_match(None, conversational, answer=["4"]) == [1.0]


def test_trls_own_reward_functions_work_unchanged():
    config = DatasetEnvConfig(kind="dataset", data="qa", rewards=[{"function": "trl.rewards:think_format_reward"}])
    env = DatasetEnv(config, "qa")
    env.use_rows(stored_rows(5))
    task = env.all_tasks()[0]
    assert env.rubric.score("<think>\n2 and 2 make 4\n</think>\nThe answer is 4.", task).rewards == \
        {"think_format_reward": 1.0}
    assert env.rubric.score("The answer is 4.", task).rewards == {"think_format_reward": 0.0}


def test_an_endpoint_evaluation_reads_the_envs_rows_from_the_store(tmp_path):
    import pandas as pd
    import pytest

    from artifacts.store import Store
    from envs.loader import make_env
    from flows.cli.eval import with_rows
    from flows.evaluate import EvaluationInputError
    from flows.spec import parse_spec

    spec = parse_spec({"name": "t", "store": f"file://{tmp_path / 'store'}",
                       "envs": {"qa": {"kind": "dataset", "data": "qa-rows",
                                       "rewards": [{"function": "posttrain.rewards:exact_match"}]}},
                       "stages": [{"id": "qa-rows", "kind": "dataset", "source": "rows.jsonl", "format": "prompts"}]},
                      read_sources=False)
    with pytest.raises(EvaluationInputError, match="^env: qa reads its rows from stage 'qa-rows', which has no "
                                                   "committed dataset: no alias t/qa-rows@latest"):
        with_rows(spec, "qa", make_env("qa", spec.envs["qa"]))
    (tmp_path / "rows").mkdir()
    pd.DataFrame(stored_rows(20)).to_parquet(tmp_path / "rows" / "data.parquet")
    Store(f"file://{tmp_path / 'store'}").commit("t/qa-rows", "dataset", tmp_path / "rows", producer={})
    env = with_rows(spec, "qa", make_env("qa", spec.envs["qa"]))
    assert len(env.all_tasks()) == 20 and env.rows["train"]
