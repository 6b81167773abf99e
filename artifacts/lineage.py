"""Lineage: the tree of an artifact's inputs, back to the spec and base model it came from."""

from __future__ import annotations

from artifacts.refs import Ref
from artifacts.store import Store


def _describe(manifest: dict) -> str:
    producer = manifest.get("producer", {})
    return (f"{manifest['ref']}  {manifest['kind']}  stage {producer.get('stage_id')} ({producer.get('stage_kind')})"
            f"  run {producer.get('run_id')}")


def lineage_lines(store: Store, ref: Ref) -> list[str]:
    lines: list[str] = []

    def visit(manifest: dict, prefix: str, child_prefix: str) -> None:
        lines.append(prefix + _describe(manifest))
        producer = manifest.get("producer", {})
        leaves = [f"base model {producer['base_model']}"] if producer.get("base_model") else []
        if producer.get("spec"):
            leaves.append(f"spec {producer.get('pipeline')} (specs/{producer['spec']}.yaml)")
        entries = [("ref", text) for text in manifest["inputs"].values()] + [("leaf", text) for text in leaves]
        for i, (what, text) in enumerate(entries):
            last = i == len(entries) - 1
            branch, extend = ("└── ", "    ") if last else ("├── ", "│   ")
            if what == "ref":
                visit(store.manifest(text), child_prefix + branch, child_prefix + extend)
            else:
                lines.append(child_prefix + branch + text)

    visit(store.manifest(ref), "", "")
    return lines
