"""`posttrain envs check` and `posttrain sandbox` through the CLI entry point."""

import shutil

from flows.cli.main import main

SHIPPED = "envs/data/terminal"


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def test_envs_check_prints_a_row_per_task_and_passes(capsys):
    code, out, _ = run_cli(capsys, "envs", "check", "terminal")
    assert code == 0
    assert "count-lines" in out and out.splitlines()[0].split() == ["task", "oracle", "no-op", "ok"]
    assert out.strip().endswith("terminal: 25/25 tasks hold (oracle = full reward 1, no-op = 0)")


def test_envs_check_plays_the_generated_families(capsys):
    code, out, _ = run_cli(capsys, "envs", "check", "openclaw", "--generated", "1")
    assert code == 0 and "count-lines-e0" in out and "write-file-t0" in out
    assert out.strip().endswith("openclaw: 14/14 tasks hold (oracle = full reward 1, no-op = 0)")


def test_envs_check_fails_a_task_whose_solution_is_wrong(tmp_path, capsys):
    tasks = tmp_path / "tasks"
    shutil.copytree(f"{SHIPPED}/count-lines", tasks / "count-lines")
    shutil.copytree(f"{SHIPPED}/uppercase", tasks / "uppercase")
    (tasks / "uppercase" / "solution" / "solve.sh").write_text("echo nothing useful\n")
    code, out, _ = run_cli(capsys, "envs", "check", "terminal", "--tasks", str(tasks))
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert code == 1 and rows["uppercase"][-1] == "NO" and rows["count-lines"][-1] == "yes"
    assert "1/2 tasks hold" in out


def test_envs_check_bad_input_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "envs", "check", "chess")
    assert code == 2 and err.startswith("error: unknown env kind 'chess' (kinds: arith, calc, search")
    code, _, err = run_cli(capsys, "envs", "check", "terminal", "--tasks", str(tmp_path / "none"))
    assert code == 2 and err == f"error: {tmp_path / 'none'}: no such task folder"
    code, _, err = run_cli(capsys, "envs", "check", "search", "--generated", "2")
    assert code == 2 and err == "error: --generated: 'search' has no generated families (terminal and openclaw have)"
    code, _, err = run_cli(capsys, "envs", "check", "terminal", "--generated", "0")
    assert code == 2 and err == "error: --generated: 0 variants per split; give 1 to 1000"


def test_sandbox_shows_what_the_policy_would_see(tmp_path, capsys, monkeypatch):
    (tmp_path / "data.txt").write_text("a\nb\n")
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "s3cret")
    code, out, _ = run_cli(capsys, "sandbox", "--files", str(tmp_path), "--",
                           "wc -l data.txt; env | grep -c SECRET; cat /etc/passwd")
    assert code == 1  # the last command failed: no host files in the sandbox
    assert out.splitlines()[:2] == ["2 data.txt", "0"] and "[exit code 1]" in out
    code, out, _ = run_cli(capsys, "sandbox", "--python", "--", "print(6 * 7)")
    assert code == 0 and out.startswith("42")
    code, _, err = run_cli(capsys, "sandbox", "--")
    assert code == 2 and err == "error: sandbox: no command given (posttrain sandbox -- CMD ...)"
