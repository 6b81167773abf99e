"""`posttrain ls | lineage | verify`: what the store holds, where an artifact came from, and
whether its files are still what its manifest says."""

from __future__ import annotations

import re

from flows.cli.common import DEFAULT_STORE, UserError, open_named_store, open_store, resolve_ref

PIPELINE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")  # a spec's `name`


def human_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def listing_row(manifest: dict) -> tuple[str, ...]:
    producer = manifest.get("producer", {})
    size = sum(entry.get("size", 0) for entry in manifest.get("files", []))
    made_by = f"{producer.get('stage_id', '?')} ({producer.get('stage_kind', '?')})"
    return (manifest["ref"], manifest.get("kind", "?"), manifest.get("created", "?"), human_size(size), made_by,
            str(producer.get("run_id", "?")))


def cmd_ls(args) -> int:
    if args.pipeline is not None and not PIPELINE_NAME.fullmatch(args.pipeline):
        raise UserError(f"pipeline: not a pipeline name: {args.pipeline!r}")
    store = open_named_store(args.store, args.spec)
    manifests = store.manifests(args.pipeline)
    if not manifests:
        print(f"no artifacts{f' of pipeline {args.pipeline}' if args.pipeline else ''} in {store.uri}")
        return 0
    rows = sorted((listing_row(m) for m in manifests.values()), key=lambda row: (row[0].split("@")[0], row[2]))
    header = ("artifact", "kind", "created", "size", "stage", "run")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) if i != 3 else cell.rjust(width)
                        for i, (cell, width) in enumerate(zip(row, widths))).rstrip())
    return 0


def cmd_lineage(args) -> int:
    from artifacts.lineage import lineage_lines
    from artifacts.store import StoreError

    store = open_store(args.store)
    ref = resolve_ref(store, args.ref)
    try:
        print("\n".join(lineage_lines(store, ref)))
    except StoreError as exc:
        raise UserError(f"ref: {exc}") from None
    return 0


def cmd_verify(args) -> int:
    from artifacts.store import StoreError

    store = open_store(args.store)
    ref = resolve_ref(store, args.ref)
    try:
        problems = store.verify(ref)
    except StoreError as exc:
        raise UserError(f"ref: {exc}") from None
    if problems:
        print(f"{ref}: TAMPERED")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"{ref}: ok ({len(store.manifest(ref)['files'])} files match their manifest)")
    return 0


def add_artifact_commands(commands) -> None:
    listing = commands.add_parser("ls", help="the store's committed artifacts (by name, oldest version first): kind, created, "
                                    "size, producing stage")
    listing.add_argument("pipeline", nargs="?", help="only this pipeline's artifacts")
    listing.add_argument("--store", help=f"store URI (default: the spec's `store`, else {DEFAULT_STORE})")
    listing.add_argument("--spec", help="read the store this spec names")
    listing.set_defaults(func=cmd_ls)
    for name, func, text in (("lineage", cmd_lineage, "print the inputs of an artifact back to the spec"),
                             ("verify", cmd_verify, "re-hash an artifact's files against its manifest")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("ref", help="name@version, or name@latest")
        sub.add_argument("--store", default=DEFAULT_STORE)
        sub.set_defaults(func=func)
