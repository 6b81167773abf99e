"""HumanEval as an evaluation backend (tasks/rollout/humaneval.py): the package's own data file, the
unbiased pass@k estimator, completions run in the sandbox (a hostile one fails harmlessly), pass@k of a
real tiny model through the local policy."""

import math
import socket
import threading

import pytest

from tasks.common.benchmarks import HumanEvalSettings
from tasks.rollout.humaneval import check_program, evaluate_humaneval, humaneval_problems, pass_at_k, passes


def exact_pass_at_k(n, c, k):
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_humaneval_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in [(1, 0, 1), (1, 1, 1), (5, 1, 1), (10, 3, 5), (10, 8, 5), (20, 0, 10), (200, 37, 100)]:
        assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the share that passed
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)  # the product form: no overflow, no cancellation
    with pytest.raises(ValueError, match="n=3, c=4, k=1"):
        pass_at_k(3, 4, 1)


def test_humaneval_settings_refuse_k_above_n_samples():
    with pytest.raises(ValueError, match=r"k: 10 is not between 1 and n_samples \(1\)"):
        HumanEvalSettings(k=[1, 10])
    with pytest.raises(ValueError, match=r"temperature: 0 \(greedy\) draws 10 identical samples"):
        HumanEvalSettings(n_samples=10, k=[1, 10])
    assert HumanEvalSettings(n_samples=10, k=[1, 10], temperature=0.8).k == [1, 10]


def test_humaneval_problems_come_from_the_package_data_file():
    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    assert [p["task_id"] for p in humaneval_problems(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_humaneval_canonical_solution_passes_and_a_wrong_one_fails_in_the_sandbox():
    problem = humaneval_problems(1)[0]
    assert passes(check_program(problem, problem["canonical_solution"]), 5.0) == (True, "")
    passed, why = passes(check_program(problem, "    return True\n"), 5.0)
    assert not passed and "AssertionError" in why


def test_humaneval_hostile_completion_fails_harmlessly(tmp_path):
    """A completion that reaches for the network, the host's files and a runaway loop: each fails inside
    the sandbox; the host's listener sees no connection, its secret is not read, nothing is written."""
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-61")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    connections = []

    def accept():
        while not stop.is_set():
            try:
                connections.append(listener.accept())
            except OSError:
                pass

    stop = threading.Event()
    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    problem = humaneval_problems(1)[0]
    attempts = {
        "network": f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                   "    return True\n",
        "host file": f"    print(open({str(secret)!r}).read())\n    return open('/etc/hostname').read() != ''\n",
        "write outside": f"    open({str(tmp_path / 'planted.py')!r}, 'w').write('x')\n    return True\n",
        "runaway": "    while True:\n        pass\n",
        "subprocess": "    import subprocess\n    subprocess.run(['cat', '/proc/1/environ'], check=True)\n"
                      "    return open('/root/.bashrc').read() != ''\n",
    }
    try:
        for name, completion in attempts.items():
            passed, why = passes(check_program(problem, completion), 2.0)
            assert not passed, name
            assert "host-secret-61" not in why, name
    finally:
        stop.set()
        listener.close()
    assert connections == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]


def test_humaneval_of_a_tiny_model_counts_every_sample():
    """pass@k of a real (untrained) model through the local policy: every sample run, pass@1 the
    mean of the problems' pass shares (an untrained model passes none)."""
    from test_serve_model import local_model

    from tasks.rollout.episodes import LocalPolicy

    model, tokenizer = local_model()
    policy = LocalPolicy(model, tokenizer, 8)
    settings = HumanEvalSettings(n_samples=2, k=[1, 2], temperature=0.8, limit=2, max_new_tokens=16)
    rows, metrics = evaluate_humaneval(policy, tokenizer, settings, "tiny", seed=3)
    assert sorted(r["task_id"] for r in rows) == ["HumanEval/0#0", "HumanEval/0#1", "HumanEval/1#0", "HumanEval/1#1"]
    assert {r["env"] for r in rows} == {"humaneval"} and {r["correct"] for r in rows} == {False}
    assert metrics == {"pass@1": 0.0, "pass@2": 0.0, "n": 2, "samples": 2}
