"""A stage kind as a third-party package would ship it: a module with its config class and its
`run`, declared through the `posttrain.stages` entry-point group, in a folder of its own.

`write_toy_stage(folder)` writes it the way pip installs a package (the module plus a
`*.dist-info` with `entry_points.txt`), so putting `folder` on PYTHONPATH is all it takes.
"""

from __future__ import annotations

from pathlib import Path

TOY_MODULE = '''"""`sums`: SFT examples of one-digit sums, written by a package's own stage kind."""

from typing import Literal

from pydantic import Field

from data_contracts.config import ContractParams
from tasks.common.context import StageOutput
from tasks.common.datasets import write_rows
from tasks.config import StageBase


class SumsStage(StageBase):
    """`n` prompts `what is a+b?` with their answers as completions."""

    outputs = ("dataset",)
    primary = "dataset"
    produces = "dataset"

    kind: Literal["sums"]
    n: int = Field(gt=0)


def run(stage: SumsStage, ctx) -> dict[str, StageOutput]:
    rows = [{"id": f"sum-{i}", "prompt": f"what is {i % 10}+{i // 10 % 10}?",
             "completion": f"{i % 10 + i // 10 % 10}"} for i in range(stage.n)]
    folder = ctx.workdir / "dataset"
    write_rows(rows, folder)
    ctx.log(f"{len(rows)} sums written by a package's stage kind")
    return {"dataset": StageOutput("dataset", folder, {"rows": len(rows)}, ContractParams(kind="sft"))}
'''


def write_package(folder: Path, module: str, source: str, entry_points: str) -> Path:
    """`module` with `source`, installed in `folder` as distribution `<module>` 0.1 with `entry_points`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / module).mkdir(exist_ok=True)
    (folder / module / "__init__.py").write_text(source)
    info = folder / f"{module}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    return folder


def write_toy_stage(folder: Path) -> Path:
    return write_package(folder, "toy_sums", TOY_MODULE, "[posttrain.stages]\nsums = toy_sums:SumsStage\n")


FLAKY_MODULE = '''"""`flaky`: SFT examples of one-digit sums, after failing its first attempt as a lost GPU or a killed
process would (the file `marker` records that the first attempt happened)."""

from pathlib import Path
from typing import Literal

from data_contracts.config import ContractParams
from tasks.common.context import StageOutput
from tasks.common.datasets import write_rows
from tasks.config import StageBase


class FlakyStage(StageBase):
    outputs = ("dataset",)
    primary = "dataset"
    produces = "dataset"

    kind: Literal["flaky"]
    marker: str


def run(stage: FlakyStage, ctx) -> dict[str, StageOutput]:
    marker = Path(stage.marker)
    if not marker.exists():
        marker.write_text("attempted")
        raise RuntimeError("flaky: the first attempt fails (a retriable error)")
    rows = [{"id": f"sum-{i}", "prompt": f"what is {i % 10}+{i // 10 % 10}?",
             "completion": f"{i % 10 + i // 10 % 10}"} for i in range(32)]
    folder = ctx.workdir / "dataset"
    write_rows(rows, folder)
    return {"dataset": StageOutput("dataset", folder, {"rows": len(rows)}, ContractParams(kind="sft"))}
'''


def write_flaky_stage(folder: Path) -> Path:
    return write_package(folder, "toy_flaky", FLAKY_MODULE, "[posttrain.stages]\nflaky = toy_flaky:FlakyStage\n")
