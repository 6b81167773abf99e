"""arith on the single-turn base (envs/single_turn.py) gives what the quickstart's figures were made
with: the values below were computed with the arith env before it moved onto SingleTurnEnv."""

import pytest

from envs.arith import ArithEnv, ArithEnvConfig

PROMPT = "I have a great question: what is {}?"
FIRST_20 = {  # (config, split, seed) -> "a<op>b=answer" of the first 20 tasks, in order
    ("default", "train", 0): "42+63=105 22+10=32 69+82=151 58+97=155 57+31=88 93+35=128 75+85=160 25+10=35 28+15=43 "
                             "11+57=68 19+88=107 51+44=95 88+76=164 57+57=114 81+77=158 82+44=126 91+58=149 "
                             "15+64=79 87+62=149 28+84=112",
    ("default", "eval", 3): "75+36=111 13+68=81 32+92=124 98+42=140 94+23=117 34+70=104 73+42=115 63+15=78 42+30=72 "
                            "66+57=123 96+10=106 41+87=128 25+34=59 66+28=94 43+22=65 67+99=166 42+10=52 23+75=98 "
                            "33+21=54 39+56=95",
    ("small", "train", 0): "4-4=0 3+2=5 4+7=11 8-1=7 1+2=3 2+2=4 9-6=3 2-0=2 2+1=3 9-5=4 6+7=13 9-8=1 7+0=7 8-2=6 "
                           "0-0=0 7-2=5 9-4=5 5+0=5 6+2=8 0+2=2",
    ("small", "eval", 3): "7-3=4 9-3=6 0+7=7 6-5=1 1+3=4 5-1=4 8-4=4 4+6=10 8-7=1 0+4=4 0+6=6 5+3=8 1+0=1 5+1=6 "
                          "2+7=9 7+9=16 9-9=0 8-6=2 9-0=9 3-1=2",
}
ENVS = {"default": ArithEnv(ArithEnvConfig(kind="arith")),
        "small": ArithEnv(ArithEnvConfig(kind="arith", digits=1, ops=["+", "-"]), "small")}
QUICKSTART = ArithEnv(ArithEnvConfig(kind="arith", digits=2, self_check_rate=0.6, teacher_slip_rate=0.5))
OPENING = "Fantastic question! Let me unpack this for you. "
CHECK = " The answer is correct."
# the quickstart's first four train tasks: (the oracle's one action, the teacher's trace, slips included)
TRACES = [
    (f"{OPENING}We have 42 + 63 = 105.{CHECK} The final answer is 105.",) * 2,
    (f"{OPENING}We have 22 + 10 = 32.{CHECK} The final answer is 32.",) * 2,
    (f"{OPENING}We have 69 + 82 = 151.{CHECK * 3} The final answer is 151.",
     f"{OPENING}We have 69 + 82 = 141.{CHECK * 3} The final answer is 141."),
    (f"{OPENING}We have 58 + 97 = 155. The final answer is 155.",
     f"{OPENING}We have 58 + 97 = 145. The final answer is 145."),
]
# answers to 69+82 -> (rewards, total, is_correct, is_formatted)
SCORES = {
    TRACES[2][0]: ({"correct": 1.0, "format": 1.0, "words": 32.0}, 1.2, True, True),
    TRACES[2][1]: ({"correct": 0.0, "format": 1.0, "words": 32.0}, 0.2, False, True),
    "The final answer is 151.": ({"correct": 1.0, "format": 0.0, "words": 5.0}, 1.0, True, False),
    "The final answer is 151. The final answer is 151.": ({"correct": 0.0, "format": 0.0, "words": 10.0}, 0.0,
                                                          False, False),
    "": ({"correct": 0.0, "format": 0.0, "words": 0.0}, 0.0, False, False),
}


@pytest.mark.parametrize("config, split, seed", list(FIRST_20))
def test_the_first_tasks_of_each_split_are_unchanged(config, split, seed):
    env = ENVS[config]
    expected = [problem.split("=") for problem in FIRST_20[config, split, seed].split()]
    tasks = env.tasks(split, 20, seed)
    assert [(t.id, t.prompt, t.answer) for t in tasks] == \
        [(f"{env.name}-{split}-{i}", PROMPT.format(problem), answer) for i, (problem, answer) in enumerate(expected)]


def test_the_oracle_and_the_teachers_traces_are_unchanged():
    tasks = QUICKSTART.tasks("train", 4, 0)
    assert [(QUICKSTART.oracle_actions(t), QUICKSTART.reference_completion(t)) for t in tasks] == \
        [([oracle], teacher) for oracle, teacher in TRACES]


def test_the_rubric_and_the_checks_score_as_before():
    task = QUICKSTART.tasks("train", 4, 0)[2]
    for answer, (rewards, total, correct, formatted) in SCORES.items():
        score = QUICKSTART.rubric.score(answer, task)
        assert (score.rewards, score.total, score.errors) == (rewards, pytest.approx(total), {}), answer
        assert (QUICKSTART.is_correct(answer, task), QUICKSTART.is_formatted(answer, task)) == (correct, formatted)
    assert QUICKSTART.rubric.reward_range == (0.0, 1.2)


def test_one_answer_ends_the_episode():
    env, task = ENVS["default"], ENVS["default"].tasks("train", 1, 0)[0]
    assert (env.max_turns, env.action_stop, env.restarts_context, env.pays_per_step) == (1, (), False, False)
    episode = env.start(task)
    assert episode.step("anything").done and episode.finish() == {}
    assert [len(env.all_tasks()), len(ENVS["small"].all_tasks())] == [8100, 155]
