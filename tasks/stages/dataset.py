"""`dataset`: a user's dataset imported into the store as a versioned dataset artifact.

The source (a file, a folder of files, a save_to_disk folder, an fsspec URL or a hub id,
data_contracts/sources.py) is kept in the store by the orchestrator; this stage reads that copy,
renames columns (`columns: {ours: theirs}`), picks the TRL format (`auto`: from the columns),
shuffles and cuts, and writes one row per example with its token length under the model's chat
template. The format's data contract runs before the commit: bad rows stop the stage and go to
quarantine with their row numbers, or (`on_bad_rows: drop`) are dropped, counted, and capped by
`max_bad_fraction`.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, PrivateAttr

from data_contracts import formats
from data_contracts.config import ContractParams
from data_contracts.sources import (
    Source,
    SourceError,
    check_hub,
    columns_of,
    locate,
    options_for,
    source_files,
)
from tasks.common import contract_gate
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.progress import Progress
from tasks.config import FieldError, StageBase

TOKENIZE_CHUNK = 256  # rows between progress reports while counting tokens


class DatasetStage(StageBase):
    """A user's dataset (TRL formats) imported into the store."""

    outputs = ("dataset",)
    primary = "dataset"
    produces = "dataset"  # the instance decides: output_kind()
    preload = ("pyarrow.parquet",)
    uses_accelerator = False  # reads, renames and counts tokens

    kind: Literal["dataset"]
    source: str  # a file, a folder, a save_to_disk folder, an fsspec URL or a hub dataset id
    split: str | None = None  # hub ids and saved DatasetDicts ('train' when unset)
    format: Literal["auto", "text", "prompt_completion", "messages", "preference", "prompts", "unpaired"] = "auto"
    columns: dict[str, str] = {}  # our column <- their column
    limit: int | None = Field(None, gt=0)
    shuffle_seed: int | None = None
    on_bad_rows: Literal["stop", "drop"] = "stop"
    max_bad_fraction: float = Field(0.1, ge=0, le=1)  # with drop: more bad rows than this fails the stage
    tools: list[dict] | None = None  # OpenAI-style tool schemas for rows without their own `tools`

    _source: Source | None = PrivateAttr(None)
    _format: str | None = PrivateAttr(None)

    def read_sources(self, spec_dir, store) -> None:
        """Resolve the source; for a local or URL one, read its columns: they decide `auto` and must
        hold every `columns` mapping. A hub dataset is checked at stage start (offline: it must
        be in the local cache)."""
        self._source = locate(self.source, spec_dir)
        try:
            if self._source.kind == "hub":
                check_hub(self._source)
                self._format = None if self.format == "auto" else self.format
                return
            files = source_files(self._source, options_for(self._source, store.uri, store.options))
            found = columns_of(files, self.split, self.source)
        except SourceError as exc:
            raise FieldError("source", str(exc)) from None
        self._format = resolve_format(self, found, self.source)

    def sources(self) -> dict:
        return {"source": self._source} if self._source is not None else {}

    def output_kind(self) -> str | None:
        return formats.PRODUCES[self._format] if self._format else None


def resolve_format(stage: DatasetStage, found: list[str], where: str) -> str:
    """The format of a source with columns `found` (FieldError naming the field if none fits)."""
    for ours, theirs in stage.columns.items():
        if theirs not in found:
            raise FieldError(f"columns.{ours}", f"column {theirs!r} is not in {where} (found: {', '.join(found)})")
    columns = formats.renamed(found, stage.columns)
    if stage.format != "auto":
        if not formats.fits(stage.format, columns):
            raise FieldError("format", f"{stage.format} needs columns {', '.join(formats.NEEDS[stage.format])}; "
                                       f"{where} has {', '.join(columns)}")
        return stage.format
    detected = formats.detect(columns)
    if detected is None:
        raise FieldError("source", f"{where}: {formats.no_format(columns)}")
    return detected


def source_rows(stage: DatasetStage, ctx: StageContext) -> list[dict]:
    """The source's rows, from the copy the orchestrator kept (a hub dataset: datasets.load_dataset)."""
    from data_contracts.snapshots import kept_files
    from data_contracts.sources import hub_rows, rows_of

    if "source" not in ctx.sources:
        raise SourceError(f"{stage.source}: the orchestrator kept no copy of this source (a request built "
                          "without reading the spec's sources)")
    kept = ctx.sources["source"]
    if "hub" in kept:
        return hub_rows(Source("hub", kept["hub"], stage.source), stage.split)
    return rows_of(kept_files(ctx.store, kept["digest"]), stage.split, stage.source)


def picked(stage: DatasetStage, rows: list[dict]) -> list[tuple[int, dict]]:
    """(source row number, row) after the seeded shuffle and the limit."""
    numbered = list(enumerate(rows))
    if stage.shuffle_seed is not None:
        random.Random(stage.shuffle_seed).shuffle(numbered)
    return numbered[:stage.limit] if stage.limit else numbered


def imported_rows(stage: DatasetStage, name: str, numbered: list[tuple[int, dict]]) -> list[dict]:
    """Each source row renamed and normalised; a row that cannot be read keeps its number and an
    error in `malformed`, which its contract refuses."""
    theirs = {their: our for our, their in stage.columns.items()}
    out = []
    for number, row in numbered:
        renamed = {theirs.get(column, column): formats.plain(value) for column, value in row.items()}
        try:
            out.append({**formats.normalize(name, renamed, number, stage.tools), "malformed": None})
        except (formats.FormatError, ValueError) as exc:
            out.append({"id": f"row-{number}", "row": number, "malformed": str(exc)[:200]})
    return out


def token_lengths(rows: list[dict], name: str, tokenizer, report=lambda done: None) -> None:
    """Each row's `total_tokens` under the model's chat template, as the training stage encodes it;
    `report(done)` every TOKENIZE_CHUNK rows and at the end."""
    for done, row in enumerate(rows, 1):
        if row["malformed"] is None:
            _count_tokens(row, name, tokenizer)
        if done % TOKENIZE_CHUNK == 0 or done == len(rows):
            report(done)


def _count_tokens(row: dict, name: str, tokenizer) -> None:
    from tasks.common.encoding import (
        TemplateError,
        encode_row,
        preference_examples,
        prompt_ids,
    )

    try:
        if name == "preference":
            chosen, rejected = preference_examples(tokenizer, row, 10 ** 9)
            row["total_tokens"] = max(len(chosen.input_ids), len(rejected.input_ids))
        elif name == "prompts":
            row["total_tokens"] = len(prompt_ids(tokenizer, row))
        else:
            row["total_tokens"] = len(encode_row(tokenizer, row, 10 ** 9).input_ids)
    except TemplateError:
        raise
    except Exception as exc:  # the template refused the row (a role it does not know, ...)
        row["malformed"] = f"the chat template cannot render it: {type(exc).__name__}: {exc}"[:200]


def run(stage: DatasetStage, ctx: StageContext) -> dict[str, StageOutput]:
    from models.loading import context_length, load_tokenizer, resolve_base

    rows = source_rows(stage, ctx)
    found = list(rows[0]) if rows else []
    name = resolve_format(stage, found, stage.source)  # a worker's stage has no parse-time state
    if stage.format == "auto":
        ctx.log(f"format auto: {name} (columns {', '.join(formats.renamed(found, stage.columns))})")
    base = resolve_base(ctx.model.base)
    imported = imported_rows(stage, name, picked(stage, rows))
    progress = Progress(len(imported), 0, ctx.stage_id, log_every=10 * TOKENIZE_CHUNK,
                        on_update=ctx.report_progress)  # a step: one row tokenized
    token_lengths(imported, name, load_tokenizer(base, ctx.model), progress.update)
    folder = ctx.workdir / "dataset"
    write_rows(imported, folder)
    metrics = {"format": name, "source_rows": len(rows), "rows": len(imported)}
    output = StageOutput("dataset", folder, metrics, ContractParams(kind=name, context_length=context_length(base)))
    if stage.on_bad_rows == "drop":
        output.contract_summary = drop_bad_rows(stage, ctx, output, imported)
    return {"dataset": output}


def drop_bad_rows(stage: DatasetStage, ctx: StageContext, output: StageOutput, imported: list[dict]) -> dict:
    """Validate; drop the rows that fail (at most `max_bad_fraction` of them) and validate again."""
    from data_contracts.validate import validate
    from tasks.common.datasets import read_frame

    params = output.contract.overridden(stage.contract)
    result = validate(read_frame(output.local_dir), params)
    bad = sorted({row for failure in result.failures for row in failure.rows})
    if bad and len(bad) <= stage.max_bad_fraction * len(imported) and len(bad) < len(imported):
        keep = [row for i, row in enumerate(imported) if i not in set(bad)]
        write_rows(keep, output.local_dir)
        output.metrics.update(rows=len(keep), dropped_rows=len(bad),
                              dropped=[imported[i]["id"] for i in bad[:20]])
        ctx.log(f"dropped {len(bad)} bad rows of {len(imported)} (on_bad_rows: drop)")
    elif bad:
        ctx.log(f"{len(bad)} bad rows of {len(imported)}: more than max_bad_fraction {stage.max_bad_fraction}")
    return contract_gate.check(ctx, output, stage.contract)
