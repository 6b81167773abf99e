import math

import pytest

from envs.arith import ArithEnv, ArithEnvConfig, final_answers
from envs.base import RewardFunc, Rubric, Task
from envs.doom import DoomLoopDetector, repeated_ngram_fraction

ENV = ArithEnv(ArithEnvConfig(kind="arith", digits=2))
TASK = Task("t", "I have a great question: what is 27+15?", "42", {"a": 27, "b": 15, "op": "+"})


def test_prompt_and_reference_follow_the_source_notes():
    task = ENV.tasks("train", 1, 0)[0]
    assert task.prompt.startswith("I have a great question: what is ") and task.prompt.endswith("?")
    assert ENV.reference_completion(TASK) == ("Fantastic question! Let me unpack this for you. "
                                              "We have 27 + 15 = 42. The final answer is 42.")


def test_splits_are_disjoint_and_deterministic():
    train = {t.prompt for t in ENV.tasks("train", 3000, 0)}
    held_out = {t.prompt for t in ENV.tasks("eval", 300, 0)}
    assert not train & held_out
    assert [t.prompt for t in ENV.tasks("eval", 5, 1)] == [t.prompt for t in ENV.tasks("eval", 5, 1)]
    assert len({t.id for t in ENV.tasks("train", 100, 0)}) == 100


def test_rubric_rewards_correct_and_formatted():
    score = ENV.rubric.score(ENV.reference_completion(TASK), TASK)
    assert score.rewards["correct"] == 1.0 and score.rewards["format"] == 1.0
    assert score.total == 1.0 + 0.2  # words has weight 0: logged only
    assert score.rewards["words"] == 20.0


def test_wrong_answer_and_answer_spam_do_not_pay():
    wrong = "Fantastic question! Let me unpack this for you. We have 27 + 15 = 41. The final answer is 41."
    spam = "The final answer is 41. The final answer is 42. The final answer is 43."
    assert ENV.rubric.score(wrong, TASK).rewards["correct"] == 0.0
    assert ENV.rubric.score(wrong, TASK).rewards["format"] == 1.0
    assert ENV.rubric.score(spam, TASK).rewards["correct"] == 0.0
    assert ENV.rubric.score(spam, TASK).rewards["format"] == 0.0


def test_reward_function_that_raises_is_reported_not_zero():
    def broken(completion, task, outcome):
        raise KeyError("missing field")

    rubric = Rubric([RewardFunc("ok", lambda c, t, o: 1.0), RewardFunc("broken", broken, 0.5)])
    score = rubric.score("x", TASK)
    assert math.isnan(score.rewards["broken"]) and math.isnan(score.total)
    assert score.errors == {"broken": "KeyError: 'missing field'"}
    assert rubric.reward_range == (0.0, 1.5)


def test_the_rubric_names_its_checks_and_full_marks_pass_them():
    def half(completion, task, outcome):
        return 0.5

    rubric = Rubric([RewardFunc("ok", lambda c, t, o: 1.0)], correct=lambda c, t, o: 1.0, formatted=half)
    assert rubric.is_correct("x", TASK) and not rubric.is_formatted("x", TASK)
    assert not Rubric([], correct=lambda c, t, o: math.nan).is_correct("x", TASK)
    assert not Rubric([], correct=lambda c, t, o: None).is_correct("x", TASK)  # "does not apply" is not solved
    assert Rubric([], correct=half).is_formatted("x", TASK)  # no format check: nothing to keep
    with pytest.raises(ValueError, match="no correctness check"):
        Rubric([]).is_correct("x", TASK)


def test_doom_loop_detector_on_crafted_examples():
    detector = DoomLoopDetector()
    clean = ENV.reference_completion(TASK)
    looping = "Fantastic question! Let me unpack this for you. We have 27 + 15 = 4" + "2 = 4" * 20
    thought_loop = "Let me think. " + "Wait, let me reconsider the tens digit. " * 6
    digits_loop = "We have 27 + 15 = " + "4" * 50
    assert not detector.is_loop(clean, truncated=False)
    assert detector.is_loop(looping, truncated=True)
    assert detector.is_loop(thought_loop, truncated=True)
    assert detector.is_loop(digits_loop, truncated=True)
    # a repetitive text that reached its end is not a doom loop; a long non-repeating one is not either
    assert not detector.is_loop(thought_loop, truncated=False)
    assert not detector.is_loop(" ".join(f"word{i}" for i in range(80)), truncated=True)
    assert detector.tail_repeats(thought_loop) >= 6


def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction("a b c d e f".split(), 4) == 0.0
    assert repeated_ngram_fraction(("a b " * 10).split(), 4) > 0.8


def test_self_checks_are_geometric_per_problem_and_keep_the_format():
    env = ArithEnv(ArithEnvConfig(kind="arith", digits=2, self_check_rate=0.6))
    tasks = env.tasks("train", 2000, 0)
    completions = [env.reference_completion(t) for t in tasks]
    checks = [c.count(" The answer is correct.") for c in completions]
    assert completions == [env.reference_completion(t) for t in tasks]  # fixed per problem
    assert 0.35 < checks.count(0) / len(checks) < 0.45  # P(no check) = 1 - 0.6
    assert 1.3 < sum(checks) / len(checks) < 1.7  # mean 0.6 / 0.4 = 1.5
    assert max(checks) >= 6
    for task, completion in zip(tasks[:50], completions):
        assert env.is_correct(completion, task) and env.is_formatted(completion, task)
    looping = completions[0].split(" The final answer")[0] + " The answer is correct." * 12
    assert DoomLoopDetector().is_loop(looping, truncated=True)
    assert not env.is_correct(looping, tasks[0])


def test_teacher_slips_forget_the_carry_on_a_fixed_share_and_the_oracle_stays_right():
    env = ArithEnv(ArithEnvConfig(kind="arith", digits=2, teacher_slip_rate=0.5))
    tasks = env.tasks("train", 2000, 0)
    carrying = [t for t in tasks if t.info["a"] % 10 + t.info["b"] % 10 >= 10]
    slipped = [t for t in carrying if not env.is_correct(env.reference_completion(t), t)]
    assert 0.44 < len(slipped) / len(carrying) < 0.56
    for task in slipped[:20]:
        trace = env.reference_completion(task)
        assert final_answers(trace) == [str(int(task.answer) - 10)] and env.is_formatted(trace, task)
    assert all(env.is_correct(env.reference_completion(t), t) for t in tasks if t not in carrying)
    assert [env.reference_completion(t) for t in tasks] == [env.reference_completion(t) for t in tasks]
    assert all(env.is_correct(env.oracle_actions(t)[0], t) for t in tasks)  # envs check plays the right sum
    plain = ArithEnv(ArithEnvConfig(kind="arith", digits=2))
    assert env.split_problems("eval") == plain.split_problems("eval")  # the same held-out problems
