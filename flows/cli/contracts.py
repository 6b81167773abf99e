"""`posttrain contracts check|docs`: run a data contract by hand, or write a dataset's Data Docs."""

from __future__ import annotations

import json
from pathlib import Path

from data_contracts.config import ContractParams


class ContractInputError(Exception):
    """Bad input to a contracts command (exit code 2)."""


def params_from_spec(kind: str, spec) -> ContractParams:
    """Parameters the spec implies: the model's context and the envs' reward ranges."""
    from envs.loader import make_env
    from models.loading import context_length, resolve_base

    if spec is None:
        return ContractParams(kind=kind)
    ranges = [make_env(name, config).rubric.reward_range for name, config in spec.envs.items()]
    reward_range = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None
    return ContractParams(kind=kind, reward_range=reward_range, context_length=context_length(
        resolve_base(spec.model.base)))


def read_parquet(path: str):
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except FileNotFoundError:
        raise ContractInputError(f"{path}: no such file") from None
    except Exception as exc:  # not Parquet, unreadable
        raise ContractInputError(f"{path}: cannot read as Parquet ({type(exc).__name__})") from None


def check(path: str, kind: str, spec=None) -> int:
    from data_contracts.validate import validate

    result = validate(read_parquet(path), params_from_spec(kind, spec))
    if result.success:
        print(f"{path}: contract '{kind}' passed ({result.evaluated} expectations, {result.rows} rows)")
        return 0
    print(result.message())
    return 1


def docs(store, ref, out_dir: str) -> Path:
    """Re-run a committed dataset's contract with the parameters it was committed under; write its Data Docs."""
    from data_contracts.validate import data_docs_html, validate

    manifest = store.manifest(ref)
    contract = manifest["metrics"].get("contract")
    if manifest["kind"] != "dataset" or contract is None:
        raise ContractInputError(f"ref: {ref} is not a dataset checked by a data contract")
    folder = store.fetch(ref, None if store.local else Path(out_dir) / "data")
    params = ContractParams(**{**contract["params"], "reward_range": _pair(contract["params"]["reward_range"])})
    result = validate(read_parquet(str(Path(folder) / "data.parquet")), params, detail=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.html").write_text(data_docs_html(result))
    (out / "contract.json").write_text(json.dumps(result.report(), indent=2))
    return out / "index.html"


def _pair(value):
    return tuple(value) if value is not None else None

