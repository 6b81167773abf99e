"""Parquet datasets inside artifacts: one `data.parquet` per dataset version."""

from __future__ import annotations

from pathlib import Path

DATA_FILE = "data.parquet"


def write_rows(rows: list[dict], out_dir: Path) -> Path:
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / DATA_FILE
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def read_rows(folder: Path) -> list[dict]:
    return read_frame(folder).to_dict("records")


def read_frame(folder: Path):
    import pandas as pd

    return pd.read_parquet(Path(folder) / DATA_FILE)
