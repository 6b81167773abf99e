"""The RL stage's pieces on toy objects, and the stage function on the tiny preset."""

import math

import pytest

from envs.arith import ArithEnv, ArithEnvConfig
from envs.doom import repetition_excess
from tasks.config import AntiDoom
from tasks.rollout.episodes import Trajectory, TurnRecord
from tasks.stages.rl import RlStage
from tasks.stages.rl.scoring import anti_doom_rubric, score_trajectory
from tasks.stages.rl.stage import step_tasks

ENV = ArithEnv(ArithEnvConfig(kind="arith", digits=2))


def rl_stage(**overrides) -> RlStage:
    return RlStage(**{"kind": "rl", "id": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 4, **overrides})


def test_ngram_penalty_lowers_a_looping_completion_and_not_a_clean_one():
    task = ENV.tasks("train", 1, 0)[0]
    clean = ENV.reference_completion(task)
    looping = clean.replace(" The final answer", " The answer is correct." * 8 + " The final answer")
    doom = anti_doom_rubric(rl_stage(anti_doom=AntiDoom(ngram=4, threshold=0.2, penalty=0.5)))
    assert doom.score(clean, task).total == 0.0
    assert ENV.rubric.score(looping, task).total == 1.2  # correct and well formed: the rubric alone does not mind
    assert doom.score(looping, task).total < -0.2
    assert repetition_excess(clean, 4, 0.2) == 0.0 and 0 < repetition_excess(looping, 4, 0.2) <= 1
    score = anti_doom_rubric(rl_stage(anti_doom=AntiDoom(penalty=0.0))).score(looping, task)
    assert score.total == 0.0 and score.rewards["repetition"] > 0


def test_anti_doom_reads_the_policy_actions_not_the_env_observations():
    task = ENV.tasks("train", 1, 0)[0]
    observation = "<information>" + "the river runs through the city. " * 12 + "</information>"
    answer = ENV.reference_completion(task)
    trajectory = Trajectory("arith", task, [1], [TurnRecord([1], [5], [6], 0.0, False),
                                                 TurnRecord([1, 5, 6], [5], [], 0.0, False)],
                            "<search>x</search>" + observation + answer, finished=True,
                            actions=["<search>x</search>", answer])
    stage = rl_stage(anti_doom=AntiDoom(penalty=0.5))
    scored = score_trajectory(trajectory, ENV, stage)
    assert scored.repetition == 0.0 and not scored.doom_loop
    assert repetition_excess(trajectory.text, 4, 0.3) > 0  # the transcript with the passages would be penalized


def test_step_tasks_follow_the_weights_and_are_a_function_of_seed_and_step():
    pools = {"a": list(range(100)), "b": list(range(100, 200))}
    picked = [step_tasks(pools, {"a": 3.0, "b": 1.0}, 10, seed=0, step=s) for s in range(200)]
    share_a = sum(env == "a" for step in picked for env, _ in step) / 2000
    assert 0.7 < share_a < 0.8
    assert step_tasks(pools, {"a": 3.0, "b": 1.0}, 10, seed=0, step=7) == picked[7]
    assert step_tasks(pools, {"a": 3.0, "b": 1.0}, 10, seed=1, step=7) != picked[7]
    assert all((env == "a") == (task < 100) for step in picked for env, task in step)


def stage_context(tmp_path, workdir, store, policy_ref, envs, model=None):
    from models.config import ModelConfig
    from tasks.common.context import StageContext

    return StageContext(store=store, pipeline="t", run_id="r", stage_id="rl", cache_key="k",
                        model=model or ModelConfig(), envs=envs, inputs={"sft": str(policy_ref)},
                        workdir=tmp_path / workdir, producer={"stage_id": "rl"})


def committed_policy(tmp_path):
    from artifacts.store import Store
    from models.presets import materialize

    store = Store(f"file://{tmp_path / 'store'}")
    return store, store.commit("t/sft", "checkpoint", materialize("tiny-llama"), producer={})


def test_rl_stage_trains_and_resumes_from_its_in_stage_checkpoint(tmp_path, capsys):
    import json

    from models.config import ModelConfig
    from models.loading import load_model
    from tasks.stages.rl.stage import run

    store, policy_ref = committed_policy(tmp_path)
    stage = rl_stage(steps=4, prompts_per_step=2, group_size=3, max_tokens=8, checkpoint_every=2, beta=0.04,
                     anti_doom=AntiDoom())
    envs = {"arith": ENV.config}

    outputs = run(stage, stage_context(tmp_path, "w1", store, policy_ref, envs))
    first = outputs["checkpoint"]
    assert first.metrics["steps"] == 4 and first.metrics["resumed_from_step"] == 0
    assert (first.local_dir / "config.json").exists()
    assert store.listdir(stage_context(tmp_path, "w1", store, policy_ref, envs).scratch) == ["step-2"]
    [promoted] = first.metrics["promoted_checkpoints"]  # step 2 of 4 (the last is the stage's own output)
    assert promoted.startswith("t/rl.step-2@") and store.manifest(promoted)["metrics"]["promoted_at_step"] == 2
    assert store.manifest(promoted)["inputs"] == {"sft": str(policy_ref)}
    load_model(store.fetch(promoted), ModelConfig())
    history = [json.loads(line) for line in (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all(h["kl"] >= 0 and 0 <= h["entropy"] and h["tokens"] > 0 for h in history)
    assert (outputs["report"].local_dir / "curves.png").stat().st_size > 1000
    assert first.metrics["completion_tokens"] == sum(h["tokens"] for h in history)
    capsys.readouterr()

    second = run(stage, stage_context(tmp_path, "w2", store, policy_ref, envs))["checkpoint"]  # as if killed at step 2
    assert second.metrics["resumed_from_step"] == 2
    assert "resuming from in-stage checkpoint at step 2/4" in capsys.readouterr().out
    assert second.metrics["first_reward"] == pytest.approx(first.metrics["first_reward"])  # history survived
    assert second.metrics["promoted_checkpoints"] == [promoted]


def read_history(outputs) -> list[dict]:
    import json

    return [json.loads(line) for line in (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()]


def test_steppo_on_a_multi_turn_env_mix_with_lora_kl_batch_reuse_and_micro_batches(tmp_path):
    from envs.calc import CalcEnvConfig
    from models.config import LoraConfig, ModelConfig
    from tasks.stages.rl.stage import run

    store, policy_ref = committed_policy(tmp_path)
    envs = {"arith": ENV.config, "calc": CalcEnvConfig(kind="calc", max_turns=3)}
    stage = rl_stage(algorithm="steppo", envs={"arith": 1.0, "calc": 1.0}, steps=2, prompts_per_step=4,
                     group_size=2, max_tokens=8, beta=0.1, num_iterations=2, anti_doom=AntiDoom(),
                     micro_batch_size=3, gradient_checkpointing=True)  # the memory settings, wired through
    outputs = run(stage, stage_context(tmp_path, "w", store, policy_ref, envs, ModelConfig(lora=LoraConfig(r=4))))
    assert (outputs["checkpoint"].local_dir / "adapter_config.json").exists()
    history = read_history(outputs)
    logged = set().union(*history)
    assert {"arith/reward", "calc/reward", "calc/turns", "arith/accuracy", "arith/doom_loop_rate"} <= logged
    for h in history:
        assert h["rows"] >= 8 and h["kl"] >= 0  # one row per turn; KL to the adapter-disabled policy
        assert h["invalid_trace_rate"] == 1.0  # 8 tokens never reach an end


def test_dynamic_sampling_draws_again_when_no_group_has_signal(tmp_path):
    from tasks.config import DynamicSampling, Overlong
    from tasks.stages.rl.stage import run

    store, policy_ref = committed_policy(tmp_path)
    # near-greedy sampling of the untrained model: every completion is the same loop, cut at 8 tokens, with the
    # same −0.5 overlong reward
    stage = rl_stage(steps=2, prompts_per_step=2, group_size=2, max_tokens=8, temperature=0.01,
                     dynamic_sampling=DynamicSampling(max_rounds=3), overlong=Overlong(buffer=4, penalty=0.5))
    history = read_history(run(stage, stage_context(tmp_path, "w", store, policy_ref, {"arith": ENV.config})))
    for h in history:
        assert h["draws"] == 3 and h["kept_groups"] == 0 and "loss" not in h
        assert h["overlong"] == 1.0 and h["reward"] == pytest.approx(-0.5)


def test_trace_validation_keeps_penalties_and_a_raised_reward_stays_nan():
    from envs.base import RewardFunc, Rubric

    task = ENV.tasks("train", 1, 0)[0]
    answer = ENV.reference_completion(task)
    looping = answer + " The answer is correct." * 6

    def cut(text):  # an episode whose only action ran out of tokens
        return Trajectory("arith", task, [1], [TurnRecord([1], [5] * 64, [], 0.0, True)], text, finished=False,
                          actions=[text])

    stage = rl_stage(anti_doom=AntiDoom(penalty=0.5))
    shaped = ENV.rubric
    scored = score_trajectory(cut(looping), ENV, stage, shaped)
    assert not scored.valid_trace and scored.correct  # right answer, but the trace never ended
    assert scored.reward == pytest.approx(-0.5 * scored.repetition) and scored.repetition > 0
    raising = Rubric([*shaped.funcs, RewardFunc("judge", lambda c, t, o: 1 / 0, 1.0)])
    assert math.isnan(score_trajectory(cut(looping), ENV, stage, raising).reward)
    unchecked = rl_stage(anti_doom=AntiDoom(penalty=0.5, validate_trace=False))
    # unchecked, the cut trace is paid for its answer (correct 1, format 0: the trailing checks break it)
    assert score_trajectory(cut(looping), ENV, unchecked, shaped).reward == pytest.approx(
        1.0 - 0.5 * scored.repetition)
