"""The generated task families (terminal, openclaw): every family's oracle passes its check and a
no-op fails it (through the real sandbox), held-out variants share nothing with the train ones,
and a bad `generated:` config fails with one line."""

import json
import re

import pytest

from envs.families import word_pool
from envs.openclaw import OpenClawEnv, OpenClawEnvConfig
from envs.openclaw.families import FAMILIES as CLAW_FAMILIES
from envs.openclaw.families import GeneratedClawTasks
from envs.terminal import TerminalEnv, TerminalEnvConfig
from envs.terminal.families import FAMILIES, HELD_OUT_PIPES, GeneratedTerminalTasks, variant

ENV = TerminalEnv(TerminalEnvConfig(kind="terminal", max_turns=5, generated=GeneratedTerminalTasks()))
CLAW = OpenClawEnv(OpenClawEnvConfig(kind="openclaw", max_turns=5, generated=GeneratedClawTasks()))
ENVS = {"terminal": (ENV, FAMILIES), "openclaw": (CLAW, CLAW_FAMILIES)}
WORD = re.compile(r"[a-z]+")


def _split(split, tasks):
    return [task for task in tasks if task.info["split"] == split]


def _text(task) -> str:
    """Everything a task shows or holds: its prompt, and its info (files, check, oracle)."""
    return task.prompt + "\n" + json.dumps(task.info)


@pytest.mark.parametrize("kind", ENVS)
def test_every_family_has_hundreds_of_train_variants_and_held_out_ones(kind):
    env, families = ENVS[kind]
    tasks = env.all_tasks()
    assert {task.info["family"] for task in tasks} == set(families)
    for family in families:
        mine = [task for task in tasks if task.info["family"] == family]
        assert sum(task.info["split"] == "train" for task in mine) == 200
        assert sum(task.info["split"] == "eval" for task in mine) == 10
        assert len({task.prompt for task in mine}) >= 150  # variants, not copies
    assert len({task.id for task in tasks}) == len(tasks)
    assert len({task.id for task in env.tasks("eval", 70, 0)}) == 70  # >= 70 held-out episodes, none repeated


@pytest.mark.parametrize("kind", ENVS)
def test_no_held_out_variant_appears_in_training(kind):
    tasks = ENVS[kind][0].all_tasks()
    train, held_out = _split("train", tasks), _split("eval", tasks)
    train_words = {word for task in train for word in WORD.findall(_text(task))}
    held_out_names = set(word_pool("eval"))
    assert not held_out_names & set(word_pool("train"))
    assert not held_out_names & train_words  # no held-out name or content word in any train task
    for task in held_out:
        assert {word for word in WORD.findall(task.prompt) if word in held_out_names}, task.prompt
        assert len({word for word in WORD.findall(_text(task)) if word in held_out_names}) >= 2
    assert not {task.prompt for task in held_out} & {task.prompt for task in train}


def test_held_out_pipes_are_chains_no_train_variant_uses():
    def chain(task):
        command = task.info["solution"][0]
        return command.split(" ")[0] + ("-u" if " -u " in command else ""), command.split("| ")[1].split(" ")[0]

    train = {chain(task) for task in _split("train", ENV.all_tasks()) if task.info["family"] == "pipe"}
    held_out = {chain(task) for task in _split("eval", ENV.all_tasks()) if task.info["family"] == "pipe"}
    assert len(train) == 9 - len(HELD_OUT_PIPES) and len(held_out) == len(HELD_OUT_PIPES)
    assert not train & held_out
    assert {step for pair in held_out for step in pair} <= {step for pair in train for step in pair}


def test_variants_are_the_same_on_every_call():
    assert variant("pipe", "eval", 3, 0) == variant("pipe", "eval", 3, 0)
    assert variant("pipe", "eval", 3, 0) != variant("pipe", "eval", 3, 1)


@pytest.mark.parametrize("kind", ENVS)
def test_every_family_passes_with_its_oracle_and_fails_with_a_no_op(kind, tokenizer):
    from tasks.rollout.env_check import check_env

    env, families = ENVS[kind]
    sample = [task for family in families for split in ("train", "eval")
              for task in [t for t in _split(split, env.all_tasks()) if t.info["family"] == family][:3]]
    rows = check_env(env, tokenizer, sample)
    assert len(rows) == len(families) * 6
    assert [row for row in rows if not row.ok] == []


def test_a_family_whose_oracle_needs_more_turns_than_allowed_is_refused():
    with pytest.raises(ValueError, match=r"^3 is fewer than the fix-script family's oracle needs \(4 actions\)"):
        TerminalEnv(TerminalEnvConfig(kind="terminal", max_turns=3, generated=GeneratedTerminalTasks(train=2, eval=1)))


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))
