"""A user's data and reward functions, wrong: one line naming the field and the file or column, exit 2,
nothing written to the store (`validate` and `run` alike)."""

import json
import subprocess

import pytest
import yaml
from conftest import POSTTRAIN, ROOT
from test_spec_errors import run_cli

from envs.base import RewardShapeError, Task
from envs.dataset import DatasetEnv, DatasetEnvConfig

PAIRS = [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}]
CHATS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
QA = [{"question": "What is 2+2?", "response": "4"}]


def spec(*stages, envs=None) -> dict:
    return {"name": "t", "store": "file://STORE", "envs": envs or {"arith": {"kind": "arith"}}, "stages": list(stages)}


def imported(stage_id, source, **options) -> dict:
    return {"id": stage_id, "kind": "dataset", "source": source, **options}


SFT = {"id": "sft", "kind": "sft", "max_steps": 2}
QA_ENV = {"kind": "dataset", "source": "qa.jsonl", "columns": {"prompt": "question", "answer": "response"}}
CASES = {
    "missing source": (spec(imported("chats", "data/nope.jsonl")), "stages[0].source: data/nope.jsonl: not found"),
    "unreadable source": (spec(imported("chats", "broken.json")),
                          "stages[0].source: broken.json: broken.json is not JSON or JSON Lines"),
    "columns fit no format": (
        spec(imported("chats", "qa.jsonl")),
        "stages[0].source: qa.jsonl: columns question, response fit no format (text needs text; prompt_completion "
        "needs prompt and completion; messages needs messages; preference needs chosen and rejected; prompts "
        "needs prompt; unpaired needs prompt and completion and label)"),
    "columns names a missing column": (
        spec(imported("chats", "qa.jsonl", columns={"prompt": "query"})),
        "stages[0].columns.prompt: column 'query' is not in qa.jsonl (found: question, response)"),
    "format whose columns are missing": (
        spec(imported("chats", "chats.jsonl", format="preference")),
        "stages[0].format: preference needs columns chosen, rejected; chats.jsonl has messages"),
    "preference data given to sft": (
        spec(imported("prefs", "prefs.jsonl"), {**SFT, "data": "prefs"}),
        "stages[1].data: stage 'prefs' produces a preference dataset, a dataset is expected here"),
    "sft data given to preference": (
        spec(imported("chats", "chats.jsonl"), {**SFT, "data": "chats"},
             {"id": "align", "kind": "preference", "policy": "sft", "data": {"chats": 1.0}}),
        "stages[2].data.chats: stage 'chats' produces a dataset, a rollouts or a preference dataset is expected here"),
    "hub id not in the local cache offline": (
        spec(imported("chats", "someorg/some-dataset")),
        "stages[0].source: someorg/some-dataset: hub dataset not in the local cache, and HF_HUB_OFFLINE is set"),
    "reward function does not import": (
        spec(imported("chats", "chats.jsonl"),
             envs={"qa": {**QA_ENV, "rewards": [{"function": "nowhere_at_all:score"}]}}),
        "envs.qa.rewards[0].function: module 'nowhere_at_all' not found in "),  # the spec's folder: below
    "reward function not callable": (
        spec(imported("chats", "chats.jsonl"),
             envs={"qa": {**QA_ENV, "rewards": [{"function": "posttrain.rewards:LENGTH_SCALE"}]}}),
        "envs.qa.rewards[0].function: posttrain.rewards:LENGTH_SCALE: envs.rewards has no function LENGTH_SCALE"),
    "env source columns name a missing column": (
        spec(imported("chats", "chats.jsonl"),
             envs={"qa": {**QA_ENV, "columns": {"prompt": "query"}, "rewards": [{"function": "posttrain.rewards:exact_match"}]}}),
        "envs.qa.columns.prompt: column 'query' is not in qa.jsonl (found: question, response)"),
}


def write_files(folder) -> None:
    for name, rows in (("prefs.jsonl", PAIRS), ("chats.jsonl", CHATS), ("qa.jsonl", QA)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "broken.json").write_text("[{not json")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_input_is_one_line_exit_2_nothing_written(case, tmp_path, capsys):
    document, message = CASES[case]
    write_files(tmp_path)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(document).replace("STORE", str(tmp_path / "store")))
    for command in ("validate", "run"):
        code, err = run_cli(capsys, command, str(path))
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "store").exists()


REWARD_MODULES = {  # function -> the message; {folder}: the spec's folder
    "nowhere_at_all:score": "module 'nowhere_at_all' not found in {folder}, nor installed",
    "lib/nope.py:score": "no file {folder}/lib/nope.py",
    "broken_rewards:score": "broken_rewards:score: cannot import broken_rewards (RuntimeError: boom)",
    "yaml:score": "module 'yaml' in {folder} has the name of a module imported from {yaml}: rename it",
}


@pytest.mark.parametrize("function", sorted(REWARD_MODULES))
def test_a_reward_module_that_does_not_import_says_where_it_looked(function, tmp_path, capsys):
    write_files(tmp_path)
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "yaml.py").write_text("def score(**kw):\n    return []\n")
    path = tmp_path / "spec.yaml"
    document = spec(imported("chats", "chats.jsonl"), envs={"qa": {**QA_ENV, "rewards": [{"function": function}]}})
    path.write_text(yaml.safe_dump(document).replace("STORE", str(tmp_path / "store")))
    message = REWARD_MODULES[function].format(folder=tmp_path.resolve(), yaml=yaml.__file__)
    for command in ("validate", "run"):
        code, err = run_cli(capsys, command, str(path))
        assert code == 2 and err == f"error: envs.qa.rewards[0].function: {message}", err
    assert not (tmp_path / "store").exists()


def test_reward_modules_resolve_against_the_specs_folder_from_any_working_folder(tmp_path):
    """The shipped specs name ../examples/my_rewards.py; a user's spec names a module beside it."""
    (tmp_path / "project").mkdir()
    write_files(tmp_path / "project")
    (tmp_path / "project" / "team_rewards.py").write_text("def score(completions, **kw):\n"
                                                          "    return [1.0] * len(completions)\n")
    user = tmp_path / "project" / "spec.yaml"
    user.write_text(yaml.safe_dump(spec(imported("chats", "chats.jsonl"),
                                        envs={"qa": {**QA_ENV, "rewards": [{"function": "team_rewards:score"}]}}))
                    .replace("STORE", str(tmp_path / "store")))
    for path in (ROOT / "pipelines" / "your-data.yaml", ROOT / "pipelines" / "learned-rewards.yaml", user):
        done = subprocess.run([POSTTRAIN, "validate", str(path)], capture_output=True, text=True, cwd=tmp_path,
                              timeout=300)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout.startswith("pipeline ")
    assert not (tmp_path / ".posttrain").exists() and not (tmp_path / "store").exists()


def test_a_reward_function_returning_the_wrong_number_of_values_names_itself(tmp_path):
    (tmp_path / "bad_rewards.py").write_text("def twice(prompts, completions, completion_ids, **kw):\n"
                                             "    return [1.0, 1.0]\n")
    config = DatasetEnvConfig(kind="dataset", data="qa", rewards=[{"function": "bad_rewards:twice"}])
    config.find_rewards_in(tmp_path)
    env = DatasetEnv(config, "qa")
    env.use_rows([{"id": "row-0", "prompt": "What is 2+2?", "answer": "4"}])
    task = env.all_tasks()[0]
    assert isinstance(task, Task)
    with pytest.raises(RewardShapeError, match=r"^reward function bad_rewards:twice returned 2 values for 1 completion$"):
        env.rubric.score("4", task)
