"""roll_out starts and finishes episodes a few at once (tasks/rollout/episodes.py): the episodes
are the same as one at a time, and when a start or a finish fails, every other episode is still
finished (a sandbox is never left behind) and the failure reaches the caller."""

import threading
import time

import pytest

from envs.calc import CalcEnv, CalcEnvConfig
from models.loading import load_tokenizer
from models.presets import materialize
from models.sampling import SamplingParams
from tasks.rollout.episodes import EPISODE_THREADS, ScriptedPolicy, roll_out


class SlowCalc(CalcEnv):
    """calc whose episodes take a while to start and to finish (as a sandbox does), recording how
    many start at once and which finished; `fail_start` / `fail_finish`: task indexes that raise."""

    def __init__(self, fail_start=(), fail_finish=()):
        super().__init__(CalcEnvConfig(kind="calc", operands=3, digits=2))
        self.fail_start, self.fail_finish = set(fail_start), set(fail_finish)
        self.lock, self.starting, self.most_at_once, self.finished = threading.Lock(), 0, 0, []

    def start(self, task, llm=None):
        with self.lock:
            self.starting += 1
            self.most_at_once = max(self.most_at_once, self.starting)
        time.sleep(0.05)
        with self.lock:
            self.starting -= 1
        if task.id in self.fail_start:
            raise RuntimeError(f"no sandbox for {task.id}")
        return Recorded(super().start(task, llm), self, task.id)


class Recorded:
    def __init__(self, episode, env: SlowCalc, task_id: str):
        self.episode, self.env, self.task_id = episode, env, task_id

    def step(self, action):
        return self.episode.step(action)

    def finish(self):
        time.sleep(0.02)
        with self.env.lock:
            self.env.finished.append(self.task_id)
        if self.task_id in self.env.fail_finish:
            raise RuntimeError(f"grading {self.task_id} failed")
        return self.episode.finish()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(materialize("tiny-llama"))


def play(env, tokenizer, tasks):
    oracle = ScriptedPolicy(tokenizer, [env.oracle_actions(task) for task in tasks])
    return roll_out(oracle, tokenizer, env, tasks, SamplingParams(32))


def test_episodes_start_a_few_at_once_and_play_as_one_at_a_time(tokenizer):
    env = SlowCalc()
    tasks = env.tasks("train", 12, 0)
    trajectories = play(env, tokenizer, tasks)
    assert 1 < env.most_at_once <= EPISODE_THREADS
    assert sorted(env.finished) == sorted(task.id for task in tasks)
    one_by_one = [play(env, tokenizer, [task])[0] for task in tasks]
    assert [t.text for t in trajectories] == [t.text for t in one_by_one] == \
        [env.reference_completion(task) for task in tasks]
    assert [t.outcome for t in trajectories] == [t.outcome for t in one_by_one]


def test_a_start_that_fails_finishes_every_started_episode_and_raises(tokenizer):
    tasks = SlowCalc().tasks("train", 9, 0)
    env = SlowCalc(fail_start={tasks[4].id})
    with pytest.raises(RuntimeError, match=f"no sandbox for {tasks[4].id}"):
        play(env, tokenizer, tasks)
    assert sorted(env.finished) == sorted(task.id for task in tasks if task.id != tasks[4].id)


def test_a_finish_that_fails_still_finishes_the_others_and_raises(tokenizer):
    tasks = SlowCalc().tasks("train", 9, 0)
    env = SlowCalc(fail_finish={tasks[0].id, tasks[7].id})
    with pytest.raises(RuntimeError, match=f"grading {tasks[0].id} failed"):
        play(env, tokenizer, tasks)
    assert sorted(env.finished) == sorted(task.id for task in tasks)


def test_sandboxes_started_from_several_threads_all_start():
    """Terminal episodes (a bwrap sandbox each) started and finished on the rollout loop's threads:
    before envs/sandbox/ (its __init__) serialized the launch, about one start in 200 failed."""
    from concurrent.futures import ThreadPoolExecutor

    from envs.terminal import TerminalEnv, TerminalEnvConfig
    from tasks.rollout.episodes import finish_episodes, start_episodes

    env = TerminalEnv(TerminalEnvConfig(kind="terminal", generated={"train": 20, "eval": 1}))
    tasks = env.tasks("train", 200, 0)
    with ThreadPoolExecutor(EPISODE_THREADS) as pool:
        outcomes = finish_episodes(pool, start_episodes(pool, env, tasks, None))
    assert len(outcomes) == len(tasks)
    assert all(outcome["tests_passed"] == 0.0 for outcome in outcomes)  # nothing done: every task's tests fail
