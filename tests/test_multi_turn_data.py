"""Multi-turn data for SFT and preference: the policy's tokens are trained on, the env's never."""

from envs.calc import CalcEnv, CalcEnvConfig
from models.loading import load_tokenizer
from models.losses import IGNORE_INDEX
from models.presets import materialize
from models.sampling import SamplingParams
from tasks.common.encoding import encode_row
from tasks.rollout.episodes import ScriptedPolicy, roll_out
from tasks.stages.preference import encode_pairs, preference_pairs
from tasks.stages.synthesize import multi_turn_rows, segments

ENV = CalcEnv(CalcEnvConfig(kind="calc", operands=3, digits=2))
TOKENIZER = load_tokenizer(materialize("tiny-llama"))


def trained_text(example) -> str:
    return TOKENIZER.decode([t for t in example.labels if t != IGNORE_INDEX])


def test_oracle_rows_train_on_actions_only():
    tasks = ENV.tasks("train", 4, 0)
    rows, solved = multi_turn_rows(ENV, "calc", tasks, TOKENIZER)
    assert solved == 4 and len(rows) == 4  # one context stretch per episode
    for row, task in zip(rows, tasks):
        example = encode_row(TOKENIZER, row, 512)
        actions = "".join(ENV.oracle_actions(task))
        assert trained_text(example) == actions + TOKENIZER.eos_token  # tool results never trained on
        assert "<result>" in TOKENIZER.decode(example.input_ids)  # ... but they are in the context
        assert row["completion"] == ENV.reference_completion(task)


def test_a_restarted_context_starts_a_new_stretch():
    task = ENV.tasks("train", 1, 0)[0]
    trajectory = roll_out(ScriptedPolicy(TOKENIZER, [ENV.oracle_actions(task)]), TOKENIZER, ENV, [task],
                          SamplingParams(64))[0]
    assert len(segments(trajectory)) == 1
    first, second, third = trajectory.turns  # as if the env had restarted the context after the first action
    second.context_ids = trajectory.prompt_ids
    third.context_ids = second.context_ids + second.action_ids + second.observation_ids
    stretches = segments(trajectory)
    assert len(stretches) == 2 and stretches[1][0][:len(trajectory.prompt_ids)] == trajectory.prompt_ids


def test_preference_pairs_of_episodes_score_the_policy_tokens_only():
    task = ENV.tasks("train", 1, 0)[0]
    good, bad = ENV.oracle_actions(task), ["<calc>1+1</calc>", "The final answer is 2."]
    trajectories = roll_out(ScriptedPolicy(TOKENIZER, [good, bad]), TOKENIZER, ENV, [task, task], SamplingParams(64))
    rows = []
    for index, trajectory in enumerate(trajectories):
        ids, mask = trajectory.completion()
        rows.append({"id": f"r{index}", "prompt_id": task.id, "prompt": task.prompt, "mode": "sampled",
                     "completion": trajectory.text, "tokens": ids, "loss_mask": mask, "doom_loop": False,
                     "reward": ENV.rubric.score(trajectory.text, task).total})
    pairs, stats = preference_pairs(rows)
    assert stats.pairs == 1 and pairs[0]["chosen"] == trajectories[0].text
    chosen, rejected = encode_pairs(TOKENIZER, pairs, 256)
    assert trained_text(chosen[0]) == "".join(good) + TOKENIZER.eos_token
    assert trained_text(rejected[0]) == "".join(bad) + TOKENIZER.eos_token


def test_generate_writes_whole_episodes_with_complementary_masks():
    from models.config import ModelConfig
    from models.loading import load_model
    from tasks.rollout.episodes import LocalPolicy
    from tasks.stages.generate import GenerateStage, episode_groups, rollout_rows

    model = LocalPolicy(load_model(materialize("tiny-llama"), ModelConfig()), TOKENIZER)
    stage = GenerateStage(kind="generate", id="g", policy="sft", env="calc", n=2, samples=2, greedy=1, max_tokens=8)
    tasks = ENV.tasks("train", 2, 0)
    rows = rollout_rows(ENV, episode_groups(ENV, tasks, model, TOKENIZER, stage), stage)
    assert [row["mode"] for row in rows] == ["sampled", "sampled", "greedy"] * 2
    assert [row["prompt_id"] for row in rows] == [tasks[0].id] * 3 + [tasks[1].id] * 3
    for row in rows:
        assert len(row["tokens"]) == len(row["loss_mask"]) == len(row["env_mask"]) == len(row["logprobs"]) > 0
        assert all(a + b == 1 for a, b in zip(row["loss_mask"], row["env_mask"]))
        assert row["turns"] >= 1 and row["finish_reason"] in ("stop", "length")


def test_episodes_out_of_turns_are_reported_over():
    """Progress (synthesize, generate) counts an episode that ran out of turns as done."""
    tasks = ENV.tasks("train", 3, 0)
    scripts = [[ENV.oracle_actions(task)[0]] * (ENV.max_turns + 1) for task in tasks]  # tool calls only
    over = []
    trajectories = roll_out(ScriptedPolicy(TOKENIZER, scripts), TOKENIZER, ENV, tasks, SamplingParams(64),
                            on_finished=over.append)
    assert not any(t.finished for t in trajectories)
    assert over == [0] * ENV.max_turns + [3]


def test_stages_that_split_one_draw_play_distinct_tasks_in_the_same_order():
    from envs.terminal import TerminalEnv, TerminalEnvConfig
    from tasks.stages.synthesize import SynthesizeStage, drawn_tasks

    env = TerminalEnv(TerminalEnvConfig(kind="terminal", generated={"train": 20, "eval": 2}))

    def ids(**fields) -> list[str]:
        stage = SynthesizeStage(id="warm", kind="synthesize", env="term", **fields)
        return [task.id for task in drawn_tasks(env, stage)]

    whole, first, second = ids(n=120), ids(n=60), ids(n=60, skip=60)
    assert first + second == whole
    assert len(set(whole)) == 120
    assert ids(n=60, seed=1) != first
