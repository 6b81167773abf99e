"""Stage reports as Prefect markdown artifacts, so a run's curves show in the Prefect UI.

A stage's `report` output (`<pipeline>/<stage>.report`: metrics.jsonl, curves.png, report.md;
an evaluation's report.md, evaluation.png, metrics.json) is published with its images inline
(data: URIs, tasks/common/report_images.py: a browser can load neither a file:// path nor an
s3:// object) and its other relative links pointing into the store. A training stage's report so
far goes out under the same key at each in-stage checkpoint (tasks/runtime/live.py).
"""

from __future__ import annotations

import posixpath
import tempfile
from pathlib import Path

from artifacts.refs import Ref
from artifacts.store import Store, StoreError
from tasks.common.report_images import MAX_SOURCE_BYTES, RELATIVE_LINK, inline_images, report_key

REPORT_SUFFIX = ".report"
REPORT_MARKDOWN = "report.md"
MAX_MARKDOWN_BYTES = 1024 * 1024  # a report's own text; a bigger one is not published


def report_refs(outputs: dict[str, str]) -> list[Ref]:
    """The refs among a stage's outputs {key: ref} that are reports."""
    refs = [Ref.parse(ref) for ref in outputs.values()]
    return [ref for ref in refs if ref.name.endswith(REPORT_SUFFIX)]


def version_uri(store: Store, ref: Ref) -> str:
    """Where a version's files are, as a URI (file:///... for a local store)."""
    return f"{store.protocol}://{store.version_path(ref)}"


def rewrite_relative_links(markdown: str, base_uri: str) -> str:
    """Point relative links and images (`![curves](curves.png)`) at `base_uri`/target."""
    return RELATIVE_LINK.sub(lambda m: f"{m.group(1)}{m.group(2)}{posixpath.join(base_uri, m.group(3))})", markdown)


def report_artifact_markdown(store: Store, ref: Ref) -> str:
    """The committed report as the UI shows it: its images (files of the version's manifest) inline,
    its other relative links into the store. The files are read as `Store.fetch` checks them
    (no symlink, the manifest's size and sha256), so a tampered store cannot put another file's
    bytes into an artifact."""
    with tempfile.TemporaryDirectory(prefix="posttrain-report-") as scratch:
        folder = store.fetch(ref, None if store.local else Path(scratch), hashes=True)
        files = {entry["path"] for entry in store.manifest(ref)["files"]}  # each checked by fetch

        def size(name: str) -> int:
            return (folder / name).stat().st_size if name in files else -1

        if not 0 <= size(REPORT_MARKDOWN) <= MAX_MARKDOWN_BYTES:
            raise StoreError(f"{ref}: no {REPORT_MARKDOWN} of at most {MAX_MARKDOWN_BYTES} bytes")
        report = (folder / REPORT_MARKDOWN).read_text(errors="replace")

        def read(name: str) -> bytes:
            if not 0 <= size(name) <= MAX_SOURCE_BYTES:
                raise FileNotFoundError(name)  # not the version's, or too big to show: stays a link
            return (folder / name).read_bytes()

        inlined = inline_images(report, read)
    return rewrite_relative_links(inlined, version_uri(store, ref)) + f"\nArtifact: `{ref}` in `{store.uri}`\n"


def publish_reports(store: Store, pipeline: str, stage_id: str, outputs: dict[str, str]) -> list[str]:
    """Publish each report among a stage's outputs as a Prefect markdown artifact; returns their keys.

    Must run inside a flow or task run, which the artifact is attached to. A report that cannot
    be published is logged and skipped: the stage's outputs are committed, and a display
    problem must not fail the run.
    """
    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    keys = []
    for ref in report_refs(outputs):
        key = report_key(pipeline, stage_id)
        try:
            create_markdown_artifact(markdown=report_artifact_markdown(store, ref), key=key,
                                     description=f"report of stage {stage_id} ({ref})")
        except Exception as exc:
            get_run_logger().warning(f"{stage_id}: report {ref} not published as a Prefect artifact: "
                                     f"{type(exc).__name__}: {exc}")
            continue
        keys.append(key)
    return keys
