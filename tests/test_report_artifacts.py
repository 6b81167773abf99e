import base64
import io
import json
import re
import struct
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.runtime import flow_run

from artifacts.store import Store
from flows.report_artifacts import publish_reports, report_artifact_markdown, report_refs, rewrite_relative_links
from tasks.common.context import StageContext
from tasks.common.eval_report import write_eval_report
from tasks.common.report_images import MAX_IMAGE_BYTES, inline_images, report_key, unlink_relative
from tasks.runtime.live import LiveReport
from tasks.runtime.runner import ChildMessages
from tasks.train.curves import write_training_report
from tasks.train.loop import Training

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_IMAGE = re.compile(r"!\[(\w+)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)")


def inlined(markdown: str) -> dict[str, bytes]:
    """{alt: image bytes} of the data: URI images in `markdown`."""
    return {alt: base64.b64decode(data) for alt, data in DATA_IMAGE.findall(markdown)}


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
    assert report_key("quick_start", "rl-2") == "quick-start-rl-2-report"


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
    # the picture travels in the artifact (a browser cannot load file:// from an http page) ...
    assert inlined(markdown) == {"curves": store.read_bytes(store.version_path(ref, "curves.png"))}
    # ... and the data stays a link into the store
    assert f"[metrics.jsonl](file://{store.version_path(ref, 'metrics.jsonl')})" in markdown
    assert str(ref) in markdown


def test_an_s3_report_inlines_its_chart_and_links_its_data_without_credentials(s3_endpoint, tmp_path):
    store = Store("s3://posttrain-test/report-images", {"endpoint_url": s3_endpoint})
    metrics = {"sft": {"arith": {"accuracy": 0.5, "format_rate": 0.75, "doom_loop_rate": 0.0, "n": 8}}}
    write_eval_report(metrics, {"sft": "demo/sft@" + "a" * 16}, tmp_path / "report", "evaluation demo/sft")
    ref = store.commit("demo/sft.eval.report", "report", tmp_path / "report", producer={"stage_id": "eval"})
    markdown = report_artifact_markdown(store, ref)
    chart = store.read_bytes(store.version_path(ref, "evaluation.png"))
    assert inlined(markdown) == {"rates": chart} and chart.startswith(PNG_SIGNATURE)
    assert f"[metrics.json](s3://{store.version_path(ref, 'metrics.json')})" in markdown
    assert "testing" not in markdown and "X-Amz" not in markdown  # no key, no presigned URL


def test_only_the_versions_own_images_are_inlined_and_a_huge_one_is_shrunk():
    from PIL import Image

    noise = Image.effect_noise((1600, 1200), 120).convert("RGB")  # incompressible: far over the bound
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    huge = buffer.getvalue()
    assert len(huge) > MAX_IMAGE_BYTES
    files = {"big.png": huge, "notes.txt": b"x", "chart.svg": b"<svg/>" * MAX_IMAGE_BYTES}
    asked = []

    def read(name):
        asked.append(name)
        return files[name]  # KeyError for anything else

    markdown = ("![big](big.png) ![gone](gone.png) ![up](../other/x.png) ![svg](chart.svg) "
                "[notes](notes.txt) ![web](https://x.org/a.png)")
    out = inline_images(markdown, read)
    [(alt, data)] = inlined(out).items()
    assert alt == "big" and data.startswith(PNG_SIGNATURE) and len(data) <= MAX_IMAGE_BYTES
    assert Image.open(io.BytesIO(data)).size == (400, 300)  # halved twice
    assert out.endswith("![gone](gone.png) ![up](../other/x.png) ![svg](chart.svg) [notes](notes.txt) "
                        "![web](https://x.org/a.png)")  # left for the caller to point into the store
    assert "../other/x.png" not in asked and "notes.txt" not in asked
    assert unlink_relative("![gone](gone.png) [notes](notes.txt) [w](https://x.org)") == \
        "*gone: not shown* notes [w](https://x.org)"


@pytest.mark.parametrize("planted", ["curves.png", "report.md"])
def test_a_report_file_swapped_for_a_symlink_publishes_nothing_of_its_target(tmp_path, planted):
    """A hostile local store replaces a committed report's file with a link to a secret: the
    report is read as `fetch` checks it, so the artifact is refused instead of carrying the secret."""
    from artifacts.store import StoreError

    store = Store(f"file://{tmp_path / 'store'}")
    write_training_report([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], tmp_path / "report", "demo/sft")
    ref = store.commit("demo/sft.report", "report", tmp_path / "report", producer={"stage_id": "sft"})
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOP-SECRET-VALUE")
    target = Path(store.version_path(ref, planted))
    target.unlink()
    target.symlink_to(secret)
    with pytest.raises(StoreError, match="symlink"):
        report_artifact_markdown(store, ref)


def test_a_picture_is_inlined_once_at_most_max_images_and_never_decoded_when_huge():
    from PIL import Image

    from tasks.common.report_images import MAX_IMAGES

    def png(width, height) -> bytes:
        buffer = io.BytesIO()
        Image.new("L", (width, height)).save(buffer, format="PNG")
        return buffer.getvalue()

    def claimed(width, height) -> bytes:
        """A PNG header (and no pixels) that claims width x height: a "decompression bomb"."""
        header = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + header + struct.pack(">I", zlib.crc32(header))
                + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND")))

    small = png(8, 8)
    bomb = claimed(7000, 7000)  # 49M pixels: over MAX_PIXELS, under Pillow's own bomb warning
    assert Image.open(io.BytesIO(bomb)).size == (7000, 7000)
    files = {f"p{i}.png": small for i in range(MAX_IMAGES + 2)} | {"bomb.png": bomb + b"\0" * MAX_IMAGE_BYTES}
    asked = []

    def read(name):
        asked.append(name)
        return files[name]

    out = inline_images(" ".join(["![a](p0.png)"] * 1000), read)
    assert out.count("data:image/png") == 1 and asked == ["p0.png"]  # one copy, however often it is named
    out = inline_images(" ".join(f"![a](p{i}.png)" for i in range(MAX_IMAGES + 2)), read)
    assert out.count("data:image/png") == MAX_IMAGES
    assert inline_images("![b](bomb.png)", read) == "![b](bomb.png)"  # left a link, not decoded


def test_an_in_stage_checkpoint_sends_the_curves_so_far_and_the_runner_publishes_them(tmp_path):
    """Training._checkpoint -> StageContext.show_report (a JSON line of the child) -> ChildMessages ->
    LiveReport: a markdown artifact under the stage's report key, on the task run."""
    ctx = StageContext(store=None, pipeline="demo", run_id="r", stage_id="sft", cache_key="0" * 32, model=None,
                       envs={}, inputs={}, workdir=tmp_path / "work", announce_path=tmp_path / "messages.jsonl")
    history = [{"step": s, "loss": 2 / s, "tokens_per_second": 100.0} for s in range(1, 5)]
    training = SimpleNamespace(ctx=ctx, history=history, steps=10)
    Training._show_report(training, 4, "demo/sft.step-4@" + "c" * 16)
    [message] = [json.loads(line) for line in (tmp_path / "messages.jsonl").read_text().splitlines()]
    assert message["step"] == 4
    markdown = message["report"]
    assert markdown.startswith("# demo/sft\n") and "step 4 of 10" in markdown and "4 logged steps" in markdown
    assert inlined(markdown)["curves"].startswith(PNG_SIGNATURE)
    assert "](metrics.jsonl)" not in markdown  # nothing committed yet to link to

    @flow
    def stage_flow():
        shown = []
        ChildMessages(tmp_path / "messages.jsonl", lambda ref, step: None,
                      on_report=lambda text, step: (shown.append(step), LiveReport("demo", "sft")(text, step))).drain()
        return flow_run.get_id(), shown

    run_id, shown = stage_flow()
    assert shown == [4]
    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run_id])))
    assert (artifact.key, artifact.type, artifact.data) == ("demo-sft-report", "markdown", markdown)


def test_a_report_that_cannot_be_drawn_or_published_never_fails_the_stage(tmp_path, monkeypatch):
    import prefect.artifacts

    import tasks.train.curves

    ctx = StageContext(store=None, pipeline="demo", run_id="r", stage_id="sft", cache_key="0" * 32, model=None,
                       envs={}, inputs={}, workdir=tmp_path, announce_path=tmp_path / "messages.jsonl")

    def broken(*args, **kwargs):
        raise RuntimeError("no display today")

    monkeypatch.setattr(tasks.train.curves, "report_so_far", broken)
    Training._show_report(SimpleNamespace(ctx=ctx, history=[], steps=4), 2, "demo/sft.step-2@" + "d" * 16)
    [message] = [json.loads(line) for line in (tmp_path / "messages.jsonl").read_text().splitlines()]
    assert message == {"log": "[sft] report at step 2 not shown: RuntimeError: no display today", "level": "WARNING"}

    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", broken)
    live = LiveReport("demo", "sft")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        live("# x", 2)
        live("# x", 4)
    assert [str(w.message) for w in caught] == ["sft: report at step 2 not shown: no display today"]  # once
