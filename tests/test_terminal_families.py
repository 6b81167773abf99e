"""The generated terminal families: every family's oracle passes its hidden check and a no-op
fails it (through the real sandbox), held-out variants share nothing with the train ones, and a
bad `generated:` config fails with one line."""

import re

import pytest

from envs.terminal import TerminalEnv, TerminalEnvConfig
from envs.families import word_pool
from envs.terminal_families import FAMILIES, HELD_OUT_PIPES, GeneratedTerminalTasks, variant

ENV = TerminalEnv(TerminalEnvConfig(kind="terminal", max_turns=5, generated=GeneratedTerminalTasks()))
TASKS = ENV.all_tasks()
WORD = re.compile(r"[a-z]+")


def _split(split):
    return [task for task in TASKS if task.info["split"] == split]


def _text(task) -> str:
    """Everything a task shows or holds: its prompt, its files' names and contents, its check, its oracle."""
    files = task.info["setup"]
    return "\n".join([task.prompt, *files, *files.values(), task.info["tests"]["test.sh"], *task.info["solution"]])


def test_every_family_has_hundreds_of_train_variants_and_held_out_ones():
    assert {task.info["family"] for task in TASKS} == set(FAMILIES)
    for family in FAMILIES:
        mine = [task for task in TASKS if task.info["family"] == family]
        assert sum(task.info["split"] == "train" for task in mine) == 200
        assert sum(task.info["split"] == "eval" for task in mine) == 10
        assert len({task.prompt for task in mine}) >= 150  # variants, not copies
    assert len(_split("eval")) >= 100 and len({task.id for task in TASKS}) == len(TASKS)


def test_no_held_out_variant_appears_in_training():
    train, held_out = _split("train"), _split("eval")
    train_words = {word for task in train for word in WORD.findall(_text(task))}
    held_out_names = set(word_pool("eval"))
    assert not held_out_names & set(word_pool("train"))
    assert not held_out_names & train_words  # no held-out name or content word in any train task
    for task in held_out:
        assert {word for word in WORD.findall(task.prompt) if word in held_out_names}, task.prompt
        assert len({word for word in WORD.findall(_text(task)) if word in held_out_names}) >= 2
    assert not {task.prompt for task in held_out} & {task.prompt for task in train}
    assert not {task.info["tests"]["test.sh"] for task in held_out} & {task.info["tests"]["test.sh"] for task in train}


def test_held_out_pipes_are_chains_no_train_variant_uses():
    def chain(task):
        command = task.info["solution"][0]
        return command.split(" ")[0] + ("-u" if " -u " in command else ""), command.split("| ")[1].split(" ")[0]

    train = {chain(task) for task in _split("train") if task.info["family"] == "pipe"}
    held_out = {chain(task) for task in _split("eval") if task.info["family"] == "pipe"}
    assert len(train) == 9 - len(HELD_OUT_PIPES) and len(held_out) == len(HELD_OUT_PIPES)
    assert not train & held_out
    assert {step for pair in held_out for step in pair} <= {step for pair in train for step in pair}


def test_variants_are_the_same_on_every_call():
    assert variant("pipe", "eval", 3, 0) == variant("pipe", "eval", 3, 0)
    assert variant("pipe", "eval", 3, 0) != variant("pipe", "eval", 3, 1)


def test_every_family_passes_with_its_oracle_and_fails_with_a_no_op(tokenizer):
    from tasks.common.env_check import check_env

    sample = [task for family in FAMILIES for split in ("train", "eval")
              for task in [t for t in _split(split) if t.info["family"] == family][:3]]
    rows = check_env(ENV, tokenizer, sample)
    assert len(rows) == len(FAMILIES) * 6
    assert [row for row in rows if not row.ok] == []


@pytest.mark.parametrize("config, message", [
    ({"tasks": "envs/data/terminal", "generated": {}}, "tasks and generated: give one"),
    ({"generated": {"families": ["count-files", "juggle"]}}, "generated.families.1: Input should be"),
    ({"generated": {"eval": 0}}, "generated.eval: Input should be greater than or equal to 1"),
])
def test_a_bad_generated_config_is_one_line(config, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        TerminalEnvConfig(kind="terminal", **config)
    error = caught.value.errors()[0]
    assert message in f"{'.'.join(map(str, error['loc']))}: {error['msg']}" or message in error["msg"]


def test_a_family_whose_oracle_needs_more_turns_than_allowed_is_refused():
    with pytest.raises(ValueError, match=r"^generated family fix-script: the oracle needs more than max_turns=3"):
        TerminalEnv(TerminalEnvConfig(kind="terminal", max_turns=3, generated=GeneratedTerminalTasks(train=2, eval=1)))


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))
