"""Data-contract throughput: validating 100,000 rollout rows with the rollouts suite (GX).

Times `data_contracts.validate.validate` on a synthetic rollouts dataset shaped like the
generate stage's (group ids, token masks, rewards), written to parquet and read back as the
contract gate reads a dataset (masks come back as numpy arrays, not lists), after one untimed
call on a small frame so GX's import and first-use costs are not counted. No peer: `--runs`
runs in a row on a quiet machine, the median reported.

    python -m bench.contracts [--rows 100000] [--runs 3] [--no-wait] [--out bench/results/contracts.json]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench import repeats
from bench.common import RESULTS_DIR, go_offline, make_result, write_result

GROUP_SIZE = 8


def rollouts(rows: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    return pd.DataFrame({
        "id": [f"r{i}" for i in range(rows)],
        "prompt_id": [f"p{i // GROUP_SIZE}" for i in range(rows)],
        "completion": ["We have 27 + 15 = 42. The final answer is 42."] * rows,
        "finish_reason": rng.choice(["stop", "length"], size=rows, p=[0.95, 0.05]),
        "reward": rng.random(rows),
        "total_tokens": rng.integers(40, 120, size=rows),
        "loss_mask": [[0] * 20 + [1] * 30] * rows,
        "env_mask": [[0] * 50] * rows,
    })


def as_the_gate_reads_it(frame):
    """`frame` after a round trip through the store's parquet file (tasks.common.datasets)."""
    import tempfile
    from pathlib import Path

    from tasks.common.datasets import DATA_FILE, read_frame

    with tempfile.TemporaryDirectory() as folder:
        frame.to_parquet(Path(folder) / DATA_FILE, index=False)
        return read_frame(Path(folder))


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    parser = argparse.ArgumentParser(prog="python -m bench.contracts", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--out", default=str(RESULTS_DIR / "contracts.json"))
    repeats.add_arguments(parser)
    args = parser.parse_args(argv)
    quiet = repeats.wait_for_quiet(args.no_wait)

    from data_contracts.config import ContractParams
    from data_contracts.validate import validate

    params = ContractParams(kind="rollouts", reward_range=(0.0, 1.0), group_size=GROUP_SIZE, context_length=512,
                            max_truncated_fraction=0.1)
    frame = as_the_gate_reads_it(rollouts(args.rows))
    validate(frame.head(GROUP_SIZE * 4), params)  # untimed: GX import and first use
    timings = []
    for _ in range(args.runs):
        began = time.perf_counter()
        result = validate(frame, params)
        timings.append(time.perf_counter() - began)
        assert result.success, result.message()
    speeds = repeats.spread([args.rows / seconds for seconds in timings], 1)
    seconds = args.rows / speeds["median"]
    output = make_result(metric="contract validation throughput", unit="rows/s", ours=speeds["median"],
                         peer=None, peer_name=None,
                         config={"rows": args.rows, "seconds": round(seconds, 3), "suite": "rollouts",
                                 "frame": "read back from parquet, as the contract gate reads it",
                                 "expectations": result.evaluated, "aim": "100,000 rows in under 2 s",
                                 "rows_per_second_runs": speeds,
                                 "repeats": repeats.protocol(args.runs, quiet, one_side=True)})
    path = write_result(output, args.out)
    print(f"contracts: {args.rows:,} rollout rows in {seconds:.2f}s ({output['ours']:,.0f} rows/s) -> {path}")
    return output


if __name__ == "__main__":
    main(sys.argv[1:])
