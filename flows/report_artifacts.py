"""Stage reports as Prefect markdown artifacts, so a run's curves show in the Prefect UI.

A stage's `report` output (`<pipeline>/<stage>.report`: metrics.jsonl, curves.png, report.md)
is published with its relative links pointing into the store.
"""

from __future__ import annotations

import posixpath
import re

from artifacts.refs import Ref
from artifacts.store import Store

REPORT_SUFFIX = ".report"
REPORT_MARKDOWN = "report.md"
# ![alt](target) or [text](target) whose target has no scheme and is not absolute or an anchor
_RELATIVE_LINK = re.compile(r"(!?\[[^\]]*\]\()(?![a-zA-Z][a-zA-Z0-9+.-]*:|/|#)([^)\s]+)\)")


def report_refs(outputs: dict[str, str]) -> list[Ref]:
    """The refs among a stage's outputs {key: ref} that are reports."""
    refs = [Ref.parse(ref) for ref in outputs.values()]
    return [ref for ref in refs if ref.name.endswith(REPORT_SUFFIX)]


def prefect_key(*parts: str) -> str:
    """An artifact key of `parts`: Prefect wants lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def artifact_key(pipeline: str, stage_id: str) -> str:
    return prefect_key(pipeline, stage_id, "report")


def version_uri(store: Store, ref: Ref) -> str:
    """Where a version's files are, as a URI (file:///... for a local store)."""
    return f"{store.protocol}://{store.version_path(ref)}"


def rewrite_relative_links(markdown: str, base_uri: str) -> str:
    """Point relative links and images (`![curves](curves.png)`) at `base_uri`/target."""
    return _RELATIVE_LINK.sub(lambda m: f"{m.group(1)}{posixpath.join(base_uri, m.group(2))})", markdown)


def report_artifact_markdown(store: Store, ref: Ref) -> str:
    report = store.read_bytes(store.version_path(ref, REPORT_MARKDOWN)).decode()
    return rewrite_relative_links(report, version_uri(store, ref)) + f"\nArtifact: `{ref}` in `{store.uri}`\n"


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
        key = artifact_key(pipeline, stage_id)
        try:
            create_markdown_artifact(markdown=report_artifact_markdown(store, ref), key=key,
                                     description=f"training report of stage {stage_id} ({ref})")
        except Exception as exc:
            get_run_logger().warning(f"{stage_id}: report {ref} not published as a Prefect artifact: "
                                     f"{type(exc).__name__}: {exc}")
            continue
        keys.append(key)
    return keys
