"""`posttrain export REF --out DIR`: a committed checkpoint as a plain folder (flows/export.py),
from any store, and pushed to a hub repository on request."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from flows.cli.common import DEFAULT_STORE, UserError, open_named_store, resolve_ref


def cmd_export(args) -> int:
    from artifacts.store import StoreError, first_line
    from flows.cli.serve_model import ServeModelInputError, fetch_checkpoint
    from flows.export import ExportError, export_checkpoint, push_to_hub

    out = Path(args.out).absolute()
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise UserError(f"--out: {out} already exists and is not an empty folder; export writes a new one")
    if not out.parent.is_dir():
        raise UserError(f"--out: {out.parent} is not a folder")
    if args.push_to_hub and not os.environ.get("HF_TOKEN"):
        raise UserError("--push-to-hub: set HF_TOKEN in the environment (a token with write access)")
    store = open_named_store(args.store, args.spec)
    ref = resolve_ref(store, args.ref)
    with tempfile.TemporaryDirectory(prefix="posttrain-export-") as scratch:
        try:
            folder, model = fetch_checkpoint(ref, store, None if store.local else Path(scratch))
            if model is None:
                from models.serving.model import model_config

                model = model_config(folder)
            weights = export_checkpoint(store, ref, folder, model, out, args.merge_lora, args.dtype)
        except (ServeModelInputError, ExportError) as exc:
            raise UserError(str(exc)) from None
        except StoreError as exc:  # an input of its lineage gone from the store
            raise UserError(f"ref: {exc}") from None
    print(f"{ref} -> {out} ({weights})", flush=True)
    if args.push_to_hub:
        try:
            url = push_to_hub(out, args.push_to_hub, f"posttrain export of {ref}")
        except ExportError as exc:
            raise UserError(str(exc)) from None
        except Exception as exc:  # the hub refused (a bad token, no write access) or could not be reached
            print(f"error: --push-to-hub {args.push_to_hub}: {type(exc).__name__}: {first_line(exc)} "
                  f"(the folder is written: {out})", file=sys.stderr)
            return 1
        print(f"pushed to {url}", flush=True)
    return 0


def add_export_command(commands) -> None:
    from flows.export import DTYPES

    export = commands.add_parser("export", help="write a checkpoint as a plain save_pretrained folder with a model "
                                 "card; push it to a hub repository on request")
    export.add_argument("ref", help="a checkpoint, name@version or name@latest")
    export.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    export.add_argument("--store", help=f"store URI, file:// or s3:// (default: the spec's `store`, else "
                        f"{DEFAULT_STORE})")
    export.add_argument("--spec", help="read the store this spec names (with its storage_options)")
    export.add_argument("--merge-lora", action="store_true", help="merge a LoRA adapter into its base: full weights")
    export.add_argument("--dtype", choices=list(DTYPES), help="the weights' dtype (default: the spec's model.dtype)")
    export.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this model repository "
                        "(huggingface_hub; the token from HF_TOKEN, the endpoint from HF_ENDPOINT)")
    export.set_defaults(func=cmd_export)
