"""pipelines/mcp.yaml gives an action room for the tool calls its SFT traces teach: on tiny-llama-1k's
character-level vocabulary a hermes call is 65-72 tokens with its end token, and a 64-token cap cut every
one before its end, so no call ever ran and sft and rl scored 0% on the held-out tasks."""

import json
from pathlib import Path

import mcp  # noqa: E402,F401  (the dev extra installs the SDK: missing, these fail, never skip)

from envs.loader import make_env
from flows.spec import load_spec
from models.loading import load_tokenizer, resolve_base
from tasks.stages.synthesize import longest_action, multi_turn_rows

SPEC = Path(__file__).resolve().parents[1] / "pipelines" / "mcp.yaml"


def test_longest_action_counts_the_trained_run_and_its_end_token():
    rows = [{"loss_mask": [0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0]}, {"loss_mask": [0, 1, 1]}]
    assert longest_action(rows) == 4


def test_mcp_pipeline_token_caps_fit_every_oracle_tool_call_action():
    spec, _ = load_spec(SPEC)
    tokenizer = load_tokenizer(resolve_base(spec.model.base), spec.model)
    env = make_env("notes", spec.envs["notes"].model_copy(update={"teacher_shortcut_rate": 0.0}))  # every call played
    env.use_chat(tokenizer)
    lines = (SPEC.parent / spec.envs["notes"].source).read_text().splitlines()
    # the actions are a row's calls and answer; rows that differ only in their prompt's words act alike
    acting = {json.dumps([row["oracle_calls"], row["answer"]]): row for row in map(json.loads, lines)}
    env.use_rows([{"id": f"row-{i}", **row} for i, row in enumerate(acting.values())])
    tasks = env.all_tasks()
    rows, solved = multi_turn_rows(env, "notes", tasks, tokenizer)
    assert len(lines) > len(tasks) > 200 and solved == len(tasks)
    longest = longest_action(rows)
    stages = {stage.id: stage for stage in spec.stages}
    assert stages["rl"].max_tokens >= longest, f"rl max_tokens {stages['rl'].max_tokens} < {longest}"
    evaluate = stages["final-eval"]
    assert evaluate.max_new_tokens >= longest, f"final-eval max_new_tokens {evaluate.max_new_tokens} < {longest}"
