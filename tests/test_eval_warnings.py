"""An evaluation warns where most of an env's episodes were cut off: their accuracy measures the
caps (max_new_tokens, max_turns) as much as the model."""

from flows.cli.eval import print_metrics
from tasks.common.eval_report import report_markdown, unfinished_warnings


def _metrics(truncated_rate, doom_loop_rate=0.0):
    return {"accuracy": 0.16, "format_rate": 1.0, "doom_loop_rate": doom_loop_rate, "truncated_rate": truncated_rate,
            "mean_completion_tokens": 90.0, "mean_turns": 2.0, "n": 100}


METRICS = {"align": {"rlm": _metrics(0.65), "term": _metrics(0.0), "packs": _metrics(0.2)},
           "base": {"arith": _metrics(0.9, doom_loop_rate=0.9)}}  # looping: no cap mends it
RLM_WARNING = ("align on rlm: 65% of the episodes ended unfinished without a doom loop (an action reached "
               "max_new_tokens=96, or the episode the env's max_turns) and count as failed: raise the cap that binds")


def test_only_an_env_with_most_episodes_cut_off_and_not_looping_is_warned_about():
    assert unfinished_warnings(METRICS, 96) == [RLM_WARNING]  # 20 % (packs) is at the threshold, not over it


def test_the_report_lists_the_warnings_above_its_table_and_shows_the_truncated_rate():
    markdown = report_markdown(METRICS, {"align": "agentic/align@" + "a" * 16, "base": "base"}, "evaluation",
                               unfinished_warnings(METRICS, 96))
    assert f"**Warnings**\n\n- {RLM_WARNING}\n\n| checkpoint | env |" in markdown
    assert "| `agentic/align@" + "a" * 16 + "` | rlm | 0.160 | - | - | - | - | - | - | 1.000 | 0.000 | 0.650 |" in markdown
    assert "Warnings" not in report_markdown({"align": {"term": _metrics(0.0)}}, {"align": "a"}, "evaluation")


def test_posttrain_eval_prints_the_warning_under_its_table(capsys):
    print_metrics("agentic/align@latest", {"rlm": _metrics(0.65), "term": _metrics(0.0)}, 96)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "warning: " + RLM_WARNING.replace("align on", "agentic/align@latest on")
    assert printed[1].startswith("rlm ") and printed[2].startswith("term ") and len(printed) == 4
