"""validate(dataset, kind, params) -> ContractResult, with GX imported only here and only when used."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from data_contracts.config import ContractParams
from data_contracts.suites import expectations, prepare

EXAMPLES = 5


@dataclass
class Failure:
    expectation: str
    column: str
    unexpected_count: int
    example_ids: list = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # positions of every failing row (what on_bad_rows: drop drops)

    def line(self) -> str:
        where = f"({self.column})" if self.column else ""
        ids = f", e.g. {', '.join(map(str, self.example_ids))}" if self.example_ids else ""
        return f"{self.expectation}{where}: {self.unexpected_count} rows{ids}"


@dataclass
class ContractResult:
    kind: str
    rows: int
    success: bool
    evaluated: int
    failures: list[Failure]
    gx_result: dict  # the GX validation result as JSON
    params: dict = field(default_factory=dict)
    gx_object: object = None  # the GX result itself, for rendering Data Docs

    def summary(self) -> dict:
        """What goes into the manifest's metrics of a committed dataset."""
        return {"suite": self.kind, "success": self.success, "rows": self.rows, "expectations": self.evaluated,
                "failed": [f.line() for f in self.failures], "params": self.params}

    def report(self) -> dict:
        """The `contract.json` written beside a quarantined dataset or its Data Docs."""
        return {"summary": self.summary(), "gx_result": self.gx_result}

    def message(self) -> str:
        head = f"data contract '{self.kind}' failed on {self.rows} rows: "
        return head + "; ".join(f.line() for f in self.failures)


_SETUP = threading.Lock()
_batch_definitions: dict = {}


def _batch_definition(kind: str):
    """The whole-dataframe batch definition of `kind`'s asset, made once per process: each
    addition to a GX context re-serialises its config (tens of ms a validation otherwise)."""
    with _SETUP:
        if kind not in _batch_definitions:
            _batch_definitions[kind] = _datasource().add_dataframe_asset(kind).add_batch_definition_whole_dataframe(
                "all")
        return _batch_definitions[kind]


@lru_cache(maxsize=1)
def _datasource():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return context.data_sources.add_pandas("posttrain")


def _row_ids(frame, indices: list) -> list:
    id_column = "id" if "id" in frame.columns else ("task_id" if "task_id" in frame.columns else None)
    if id_column is None:
        return [f"row {i}" for i in indices[:EXAMPLES]]
    return [frame[id_column].iloc[i] for i in indices[:EXAMPLES] if isinstance(i, int) and i < len(frame)]


def _checked_columns(frame, checks: list):
    """The columns the suite reads. GX hashes the batch's frame, and pickles it whole where cells
    are arrays (token ids, masks): seconds per 100k rows spent on columns no check reads."""
    named = set()
    for check in checks:
        named.update(getattr(check, field, None) for field in ("column", "column_A", "column_B"))
        named.update(getattr(check, "column_list", None) or [])
    return frame[[column for column in frame.columns if column in named]]


def validate(frame, params: ContractParams, detail: bool = False) -> ContractResult:
    """Run the suite of `params.kind` over a pandas DataFrame.

    GX is first asked only whether each expectation holds (a quarter less time on 100k rows);
    counts, examples and failing rows come from a second, complete pass, run when an expectation
    fails or `detail` asks for it (Data Docs of a passing dataset)."""
    import great_expectations as gx
    from great_expectations.validator.v1_validator import Validator

    prepared = prepare(frame, params)
    checks = expectations(prepared, params)
    batch_definition = _batch_definition(params.kind)
    batch_parameters = {"dataframe": _checked_columns(prepared, checks)}
    suite = gx.ExpectationSuite(name=f"posttrain-{params.kind}", expectations=checks)

    def run(result_format: dict):
        # what `Batch.validate` builds, without the batch it would load (and fingerprint) first
        return Validator(batch_definition, result_format, batch_parameters).validate_expectation_suite(suite)

    result = run({"result_format": "BOOLEAN_ONLY"})
    if detail or not result.success:
        result = run({"result_format": "COMPLETE", "partial_unexpected_count": EXAMPLES})
    failures = []
    for check in result.results:
        if check.success:
            continue
        config = check.expectation_config
        details = check.result or {}
        count = details.get("unexpected_count")
        if count is None:
            count = len(prepared) if config.type == "expect_column_to_exist" else 0
        indices = list(details.get("unexpected_index_list") or [])
        failures.append(Failure(config.type, config.kwargs.get("column", ""), int(count), _row_ids(prepared, indices),
                                [i for i in indices if isinstance(i, int)]))
    return ContractResult(params.kind, len(frame), bool(result.success), len(result.results), failures,
                          json.loads(json.dumps(result.to_json_dict(), default=str)), asdict(params), result)


def data_docs_html(result: ContractResult) -> str:
    """The GX Data Docs page of one validation result."""
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    return DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(result.gx_object))
