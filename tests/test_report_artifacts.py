import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.runtime import flow_run

from artifacts.store import Store
from flows.report_artifacts import artifact_key, publish_reports, report_refs, rewrite_relative_links
from tasks.common.curves import write_training_report


@pytest.fixture(scope="module", autouse=True)
def stop_prefect_temporary_server():
    yield
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    # Send the flow's logs, then stop the server now rather than at interpreter exit, where its
    # goodbye log would hit pytest's closed streams.
    APILogWorker.drain_all(timeout=5)
    SubprocessASGIServer().stop()


def test_relative_links_point_into_the_store_and_others_are_kept():
    markdown = ("![curves](curves.png) [rows](metrics.jsonl) [site](https://x.org/a.png) "
                "![abs](/tmp/a.png) [top](#table)")
    rewritten = rewrite_relative_links(markdown, "s3://bucket/p/artifacts/q/rl.report/0123")
    assert rewritten == ("![curves](s3://bucket/p/artifacts/q/rl.report/0123/curves.png) "
                         "[rows](s3://bucket/p/artifacts/q/rl.report/0123/metrics.jsonl) "
                         "[site](https://x.org/a.png) ![abs](/tmp/a.png) [top](#table)")


def test_artifact_key_is_what_prefect_accepts():
    assert artifact_key("quick_start", "rl-2") == "quick-start-rl-2-report"


def test_only_report_outputs_are_published():
    outputs = {"checkpoint": "p/rl@" + "a" * 16, "report": "p/rl.report@" + "b" * 16}
    assert [str(ref) for ref in report_refs(outputs)] == ["p/rl.report@" + "b" * 16]


def test_report_is_published_as_a_markdown_artifact_of_the_flow_run(tmp_path):
    store = Store(str(tmp_path / "store"))
    history = [{"step": s, "reward": s / 4, "loss": 1 / s} for s in range(1, 5)]
    write_training_report(history, tmp_path / "report", "rl")
    ref = store.commit("demo/rl.report", "report", tmp_path / "report", producer={"stage_id": "rl"})
    outputs = {"checkpoint": "demo/rl@" + "0" * 16, "report": str(ref)}

    @flow
    def publishing_flow():
        return flow_run.get_id(), publish_reports(store, "demo", "rl", outputs)

    run_id, keys = publishing_flow()
    assert keys == ["demo-rl-report"]
    with get_client(sync_client=True) as client:
        published = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run_id])))
    assert [(a.key, a.type) for a in published] == [("demo-rl-report", "markdown")]
    markdown = published[0].data
    assert "| reward | 0.25 | 1 | 0.25 | 1 |" in markdown
    assert f"![curves](file://{store.version_path(ref, 'curves.png')})" in markdown
    assert str(ref) in markdown
