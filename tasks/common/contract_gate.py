"""The data-contract gate between a stage's dataset and its commit.

A dataset that fails its contract (mode enforce) is never committed: it goes, with the GX
result and its Data Docs page, to quarantine/<run id>/<stage id>/ and the stage fails with
ContractViolation, which the runner does not retry (tasks/common/errors.py: retrying cannot fix data).
"""

from __future__ import annotations

from data_contracts.validate import ContractResult, data_docs_html, validate
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import read_frame
from tasks.common.errors import NotRetryable


class ContractViolation(NotRetryable):
    """A dataset output broke its data contract (quarantined, never committed)."""


def quarantine(ctx: StageContext, output: StageOutput, result: ContractResult) -> str:
    folder = ctx.store.path("quarantine", ctx.run_id, ctx.stage_id)
    ctx.store.put_dir(output.local_dir, folder)
    ctx.store.write_json(f"{folder}/contract.json", result.report())
    ctx.store.write_bytes(f"{folder}/contract.html", data_docs_html(result).encode())
    return folder


def check(ctx: StageContext, output: StageOutput, contract_config) -> dict:
    """Validate a dataset output; returns the summary for its manifest or raises ContractViolation."""
    params = output.contract.overridden(contract_config)
    result = validate(read_frame(output.local_dir), params)
    if result.success:
        return result.summary()
    if params.mode == "warn":
        ctx.log(f"WARNING (contract mode warn): {result.message()}")
        return result.summary()
    folder = quarantine(ctx, output, result)
    raise ContractViolation(f"{result.message()} (quarantined in {ctx.store.display(folder)})")
