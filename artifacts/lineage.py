"""Lineage: the DAG of an artifact's inputs back to the spec and base model it came from, printed
as a tree in which each artifact appears once (a later mention refers back to it)."""

from __future__ import annotations

from artifacts.refs import Ref
from artifacts.store import Store


def _describe(manifest: dict) -> str:
    producer = manifest.get("producer", {})
    return (f"{manifest['ref']}  {manifest['kind']}  stage {producer.get('stage_id')} ({producer.get('stage_kind')})"
            f"  run {producer.get('run_id')}")


def _leaves(manifest: dict) -> list[str]:
    """What an artifact came from besides artifacts: its base model, its spec, the outputs made with it."""
    producer = manifest.get("producer", {})
    leaves = [f"base model {producer['base_model']}"] if producer.get("base_model") else []
    if manifest.get("siblings"):
        leaves.append(f"made with {', '.join(sorted(manifest['siblings'].values()))}")
    if producer.get("spec"):
        leaves.append(f"spec {producer.get('pipeline')} (specs/{producer['spec']}.yaml)")
    return leaves


def lineage_lines(store: Store, ref: Ref) -> list[str]:
    lines: list[str] = []
    printed: set[str] = set()

    def visit(manifest: dict, prefix: str, child_prefix: str, chosen: str = "") -> None:
        lines.append(prefix + _describe(manifest) + chosen)
        printed.add(manifest["ref"])
        entries = [("ref", key, text) for key, text in manifest["inputs"].items()] + \
            [("leaf", "", text) for text in _leaves(manifest)]
        for i, (what, key, text) in enumerate(entries):
            last = i == len(entries) - 1
            branch, extend = ("└── ", "    ") if last else ("├── ", "│   ")
            # an input named by a selector (`rl@best:arith.accuracy`, flows/stage_inputs.py) says so
            chosen = f"  (chosen as {key})" if "@" in key else ""
            if what == "leaf":
                lines.append(child_prefix + branch + text)
            elif text in printed:
                lines.append(child_prefix + branch + f"{text}  (shown above)" + chosen)
            else:
                visit(store.manifest(text), child_prefix + branch, child_prefix + extend, chosen)

    visit(store.manifest(ref), "", "")
    return lines
