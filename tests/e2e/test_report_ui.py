"""The training curves and the evaluation chart as the Prefect UI shows them, in a real browser.

The tiny pipeline on an s3:// store (moto; the session's `s3_run`, tests/e2e/conftest.py) ran
against the shared Prefect server (its UI on); headless Chromium opens the report artifacts'
pages and the images must have loaded. The screenshots go to tests/output/test_report_ui/
(git-ignored).
"""

import os

from conftest import ROOT
from tests.e2e.browser import browser_paths, chromium, loaded_data_images, screenshot
from tests.e2e.helpers import by_id
from tests.e2e.prefect_server import flow_run_named, rest

OUTPUT = ROOT / "tests" / "output" / "test_report_ui"


def report_artifacts(api: str, run_id: str, key: str) -> list[dict]:
    """The versions of report artifact `key` made in pipeline run `run_id`, oldest first."""
    body = {"artifacts": {"key": {"any_": [key]}, "flow_run_id": {"any_": [flow_run_named(api, run_id)["id"]]}}}
    response = rest("POST", f"{api}/artifacts/filter", json=body)
    response.raise_for_status()
    return sorted(response.json(), key=lambda artifact: artifact["created"])


def test_curves_and_evaluation_chart_render_in_the_prefect_ui_refreshed_at_each_checkpoint(s3_run):
    browser_paths()  # skip (or fail, where they could be installed) before running anything
    api, ui = os.environ["PREFECT_API_URL"], os.environ["PREFECT_UI_URL"]
    run_summary = s3_run.summary  # sft: 12 steps, an in-stage checkpoint every 5
    assert [s["state"] for s in run_summary["stages"]] == ["completed"] * 3

    # the report so far at each in-stage checkpoint (steps 5 and 10, on the task run), then the committed one
    at_5, at_10, final = report_artifacts(api, run_summary["run_id"], "tiny-sft-report")
    assert at_5["task_run_id"] and at_10["task_run_id"] and not final["task_run_id"]
    assert "step 5 of 12" in at_5["data"] and "5 logged steps" in at_5["data"] and "step 10 of 12" in at_10["data"]
    assert "12 logged steps" in final["data"] and by_id(run_summary)["sft"]["outputs"]["report"] in final["data"]
    for artifact in (at_5, at_10, final):
        assert "![curves](data:image/png;base64," in artifact["data"]
    assert "[metrics.jsonl](s3://posttrain-test/" in final["data"]  # the data stays in the store
    [evaluation] = report_artifacts(api, run_summary["run_id"], "tiny-final-eval-report")
    assert "![rates](data:image/png;base64," in evaluation["data"]

    OUTPUT.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        for name, artifact, alt in (("curves-at-step-5", at_5, "curves"), ("curves", final, "curves"),
                                    ("evaluation", evaluation, "rates")):
            images = loaded_data_images(browser, f"{ui}/artifacts/artifact/{artifact['id']}")
            assert [(a, complete) for a, complete, _, _ in images] == [(alt, True)], images
            assert images[0][2] > 0 and images[0][3] > 0  # natural width and height: the PNG decoded
            path = OUTPUT / f"{name}.png"
            screenshot(browser, path)
            assert path.stat().st_size > 0
            print(f"screenshot of the {name} artifact page: {path}")
