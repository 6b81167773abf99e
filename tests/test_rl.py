"""The RL stage's pieces on toy objects, and the stage function on the tiny preset."""

import pytest

from envs.arith import ArithEnv, ArithEnvConfig
from envs.doom import repetition_excess
from tasks.config import AntiDoom, RlStage
from tasks.rl import shaped_rubric, step_tasks

ENV = ArithEnv(ArithEnvConfig(kind="arith", digits=2))


def rl_stage(**overrides) -> RlStage:
    return RlStage(**{"kind": "rl", "id": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 4, **overrides})


def test_ngram_penalty_lowers_a_looping_completion_and_not_a_clean_one():
    task = ENV.tasks("train", 1, 0)[0]
    clean = ENV.reference_completion(task)
    looping = clean.replace(" The final answer", " The answer is correct." * 8 + " The final answer")
    plain = ENV.rubric
    shaped = shaped_rubric(plain, rl_stage(anti_doom=AntiDoom(ngram=4, threshold=0.2, penalty=0.5)))
    assert shaped.score(clean, task).total == plain.score(clean, task).total == 1.2
    assert plain.score(looping, task).total == 1.2  # correct and well formed: the rubric alone does not mind
    assert shaped.score(looping, task).total < 1.2 - 0.2
    assert repetition_excess(clean, 4, 0.2) == 0.0 and 0 < repetition_excess(looping, 4, 0.2) <= 1
    logged_only = shaped_rubric(plain, rl_stage(anti_doom=AntiDoom(penalty=0.0)))
    score = logged_only.score(looping, task)
    assert score.total == 1.2 and score.rewards["repetition"] > 0


def test_step_tasks_follow_the_weights_and_are_a_function_of_seed_and_step():
    pools = {"a": list(range(100)), "b": list(range(100, 200))}
    picked = [step_tasks(pools, {"a": 3.0, "b": 1.0}, 10, seed=0, step=s) for s in range(200)]
    share_a = sum(env == "a" for step in picked for env, _ in step) / 2000
    assert 0.7 < share_a < 0.8
    assert step_tasks(pools, {"a": 3.0, "b": 1.0}, 10, seed=0, step=7) == picked[7]
    assert step_tasks(pools, {"a": 3.0, "b": 1.0}, 10, seed=1, step=7) != picked[7]
    assert all((env == "a") == (task < 100) for step in picked for env, task in step)


def test_rl_stage_trains_and_resumes_from_its_in_stage_checkpoint(tmp_path, capsys):
    from artifacts.store import Store
    from models.config import ModelConfig
    from models.presets import materialize
    from tasks.rl import run
    from tasks.stage import StageContext

    store = Store(f"file://{tmp_path / 'store'}")
    policy_ref = store.commit("t/sft", "checkpoint", materialize("tiny-llama"), producer={})
    stage = rl_stage(steps=4, prompts_per_step=2, group_size=3, max_tokens=8, checkpoint_every=2, beta=0.04,
                     anti_doom=AntiDoom())

    def context(workdir):
        return StageContext(store=store, pipeline="t", run_id="r", stage_id="rl", cache_key="k",
                            model=ModelConfig(), envs={"arith": ENV.config}, inputs={"sft": str(policy_ref)},
                            workdir=tmp_path / workdir)

    first = run(stage, context("w1"))["checkpoint"]
    assert first.metrics["steps"] == 4 and first.metrics["resumed_from_step"] == 0
    assert (first.local_dir / "config.json").exists()
    assert store.listdir(context("w1").scratch) == ["step-2"]
    capsys.readouterr()

    second = run(stage, context("w2"))["checkpoint"]  # as if the first had been killed after step 2
    assert second.metrics["resumed_from_step"] == 2
    assert "resuming from in-stage checkpoint at step 2/4" in capsys.readouterr().out
    assert second.metrics["first_reward"] == pytest.approx(first.metrics["first_reward"])  # history survived
