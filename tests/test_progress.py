import io

from tasks.common.progress import Progress, format_duration, format_metric


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_format_duration():
    assert [format_duration(s) for s in (0, 44.6, 60, 130, 3599, 3600, 3725)] == \
        ["0s", "45s", "1m00s", "2m10s", "59m59s", "1h00m", "1h02m"]


def test_format_metric():
    assert [format_metric(v) for v in (0.93149, 12345.6, 3, "x")] == ["0.931", "12,346", "3", "x"]


def test_line_shows_bar_metrics_speed_and_eta():
    clock = Clock()
    progress = Progress(200, 0, "rl", stream=io.StringIO(), clock=clock)
    clock.now += 40 * 0.65
    line = progress.line(40, {"reward": 0.9314, "accuracy": 0.8125})
    assert line.startswith("[rl] step 40/200 [####................]  20% reward 0.931 accuracy 0.812 | ")
    assert line.endswith("1.5 it/s ETA 1m44s")  # 160 steps left at 0.65 s each


def test_slow_steps_show_seconds_per_step_and_no_eta_before_the_first_step():
    clock = Clock()
    progress = Progress(10, 0, "sft", stream=io.StringIO(), clock=clock)
    assert progress.line(0, {}).endswith("| ETA ?")
    clock.now += 12.3
    assert progress.line(1, {}).endswith("12.3 s/it ETA 1m51s")


def test_resumed_stage_times_only_the_steps_done_in_this_process():
    clock = Clock()
    progress = Progress(200, 150, "rl", stream=io.StringIO(), clock=clock)
    clock.now += 10.0  # 10 steps (151..160) in 10 s
    assert progress.line(160, {}).endswith("1.0 s/it ETA 40s")


def test_non_tty_prints_a_line_every_log_every_steps_and_on_the_last():
    stream = io.StringIO()
    progress = Progress(60, 0, "sft", stream=stream, log_every=25, clock=Clock())
    for step in range(1, 61):
        progress.update(step, loss=1 / step)
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["25/60", "50/60", "60/60"]
    assert "\r" not in stream.getvalue()


def test_tty_redraws_one_line_every_step_and_ends_it_on_the_last():
    stream = Terminal()
    progress = Progress(3, 0, "dpo", stream=stream, clock=Clock())
    progress.update(1, loss=10000.0)
    progress.update(2, loss=0.5)
    text = stream.getvalue()
    assert text.count("\r") == 2 and "\n" not in text
    first, second = text.split("\r")[1:]
    assert len(second) == len(first)  # padded over the longer previous line
    progress.update(3, loss=0.25)
    assert stream.getvalue().endswith("loss 0.250 | ETA ?\n")  # the clock stood still: no speed yet


def test_close_ends_a_line_left_open():
    stream = Terminal()
    progress = Progress(10, 0, "rl", stream=stream, clock=Clock())
    progress.update(4, reward=0.5)
    progress.close()
    progress.close()
    assert stream.getvalue().endswith("\n") and stream.getvalue().count("\n") == 1


def test_every_update_reaches_the_orchestrator_with_its_eta_and_the_logged_lines(tmp_path):
    """Progress -> StageContext.report_progress -> the child's message file the runner reads: the
    full lines a log keeps, and {step, total, eta_seconds, metrics} at most every PROGRESS_SECONDS."""
    import json

    from tasks.common.context import StageContext

    clock = Clock()
    ctx = StageContext(store=None, pipeline="p", run_id="r", stage_id="sft", cache_key="0" * 32, model=None,
                       envs={}, inputs={}, workdir=tmp_path, announce_path=tmp_path / "messages.jsonl")
    progress = Progress(4, 0, "sft", stream=io.StringIO(), log_every=2, clock=clock, on_update=ctx.report_progress)
    for step in range(1, 5):
        clock.now += 3.0
        progress.update(step, loss=0.5, note="x")
    ctx.log("done", level="WARNING")
    messages = [json.loads(line) for line in (tmp_path / "messages.jsonl").read_text().splitlines()]
    reports = [m["progress"] for m in messages if "progress" in m]
    logs = [(m["level"], m["log"]) for m in messages if "log" in m]
    assert [r["step"] for r in reports] == [1, 4]  # PROGRESS_SECONDS apart in real time, and the last
    assert reports[0] == {"step": 1, "total": 4, "eta_seconds": 9.0, "metrics": {"loss": 0.5}}
    assert reports[-1]["eta_seconds"] == 0.0
    assert [line.split(" [")[0] for _, line in logs[:2]] == ["[sft] step 2/4", "[sft] step 4/4"]
    assert logs[-1] == ("WARNING", "[sft] done")


def test_progress_reports_are_throttled_but_the_last_step_always_goes(tmp_path):
    import json

    from tasks.common.context import StageContext

    ctx = StageContext(store=None, pipeline="p", run_id="r", stage_id="s", cache_key="0" * 32, model=None,
                       envs={}, inputs={}, workdir=tmp_path, announce_path=tmp_path / "m.jsonl")
    for step in range(1, 101):  # far faster than PROGRESS_SECONDS
        ctx.report_progress({"step": step, "total": 100, "eta_seconds": None, "metrics": {}, "line": None})
    steps = [json.loads(line)["progress"]["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps == [1, 100]


def test_status_shows_a_running_stage_with_its_step_and_eta(capsys):
    from flows.cli.report import print_stage_table

    print_stage_table({"stages": [], "running": {"sft": {"step": 40, "total": 120, "eta_seconds": 65.0}},
                       "not_run": []})
    assert capsys.readouterr().out.splitlines()[-1].split() == ["sft", "running", "step", "40/120", "(33%),",
                                                                "ETA", "1m05s"]
