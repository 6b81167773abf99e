"""Great Expectations suites, one per dataset kind, written as code.

Checks that need more than one row or column (group sizes, chosen == rejected, masks) are
computed into derived columns first (`prepare`), so every check is a plain GX expectation
and shows up in the GX result and its Data Docs.
"""

from __future__ import annotations

from data_contracts.config import ContractParams
from data_contracts.formats import conversation_problems, decoded

REQUIRED = {
    "sft": ["id", "prompt", "completion"],
    "rollouts": ["id", "prompt_id", "completion", "finish_reason", "reward"],
    "preference": ["id", "prompt", "chosen", "rejected"],
    "eval": ["checkpoint", "env", "mode", "task_id", "completion", "finish_reason", "completion_tokens"],
    # a user's data, imported by the dataset stage (data_contracts/formats.py)
    "text": ["id", "text"],
    "prompt_completion": ["id", "prompt", "completion"],
    "messages": ["id", "messages"],
    "prompts": ["id", "prompt"],
    "unpaired": ["id", "prompt", "completion", "label"],
}
TEXT_COLUMNS = {"sft": ["prompt", "completion"], "rollouts": ["completion"], "preference": ["chosen", "rejected"],
                "eval": [], "text": ["text"], "prompt_completion": ["prompt", "completion"], "messages": [],
                "prompts": ["prompt"], "unpaired": ["prompt", "completion"]}
# Blank text: nothing but the whitespace Python's `\s` matches, spelled out, and `\Z` for the end,
# so pandas runs it with Arrow's regex engine over the whole column. `\s` and `$` send pandas to a
# Python loop (Arrow's RE2 disagrees with Python on both), a tenth of a second per 100k rows.
WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
BLANK = "^[" + WHITESPACE + "]*\\Z"
# the conversations of each kind of imported data: the columns joined into one conversation, and
# whether it is trained on (so must hold an assistant turn and end on one)
CONVERSATIONS = {"messages": [(("messages",), True)], "prompt_completion": [(("prompt", "completion"), True)],
                 "preference": [(("prompt", "chosen"), True), (("prompt", "rejected"), True)],
                 "prompts": [(("prompt",), False)], "unpaired": [(("prompt", "completion"), True)]}
PROBLEMS = ("unknown_roles", "empty_turns", "turns_out_of_order", "no_assistant_turn", "not_ending_on_assistant")


def _joined(row, columns: tuple[str, ...]) -> list | None:
    """The row's conversation over `columns` (None where any part is plain text)."""
    turns = []
    for column in columns:
        value = decoded(row[column]) if row.get(column) is not None else []
        if not isinstance(value, list):
            return None
        turns += value
    return turns


def _conversation_columns(frame, kind: str) -> None:
    """Per-row counts of what is wrong with each conversation (0 for plain-text rows)."""
    records = frame.to_dict("records")
    totals = {name: [0] * len(records) for name in PROBLEMS}
    for columns, trained in CONVERSATIONS[kind]:
        for i, row in enumerate(records):
            turns = _joined(row, columns) if row.get("conversational") in (True,) else None
            for name, count in (conversation_problems(turns, trained) if turns is not None else {}).items():
                totals[name][i] += count
    for name in PROBLEMS:
        frame[name] = totals[name]


def _flat_masks(masks):
    """Every row's mask in one flat int64 array, and each row's bounds in it (a null mask is empty)."""
    import itertools

    import numpy as np
    import pyarrow as pa

    first = next((mask for mask in masks if mask is not None), None)
    if isinstance(first, np.ndarray):  # as read from parquet: Arrow flattens these without a Python loop
        lists = pa.array(masks, from_pandas=True)
        offsets = lists.offsets.to_numpy()
        return np.asarray(lists.flatten().to_numpy(zero_copy_only=False), dtype=np.int64), offsets - offsets[0]
    cells = [mask if mask is not None else () for mask in masks]
    lengths = np.fromiter(map(len, cells), dtype=np.int64, count=len(cells))
    values = np.fromiter(itertools.chain.from_iterable(cells), dtype=np.int64, count=int(lengths.sum()))
    return values, np.concatenate([[0], np.cumsum(lengths)])


def _row_sum(mask, other=None, paired: bool = False) -> int:
    """One row the slow way; -1 where a mask is not a list of numbers (so its row fails the suite)."""
    try:
        mask = list(mask) if mask is not None else []
        if not paired:
            return int(sum(mask))
        return sum(int(bool(a) and bool(b)) for a, b in zip(mask, list(other) if other is not None else []))
    except (TypeError, ValueError):
        return -1


def _segment_sums(values, offsets):
    """The sum of each row's segment `values[offsets[i]:offsets[i + 1]]`."""
    import numpy as np

    starts, lengths = offsets[:-1], np.diff(offsets)
    if len(starts) == 0:
        return np.zeros(0, dtype=np.int64)
    if starts[-1] >= len(values):  # empty rows at the end: reduceat needs every start inside the array
        values = np.append(values, 0)
    # reduceat sums from each start to the next; an empty segment gets its start's value, zeroed here
    sums = np.add.reduceat(values, starts, dtype=np.int64)
    sums[lengths == 0] = 0
    return sums


def mask_totals(loss_masks, env_masks=None):
    """Per row, as int64 arrays: the tokens trained on (sum of the loss mask) and, given env masks, the env-written
    tokens among them (positions set in both, over the shorter mask).

    Vectorised over one flat array (a 100k-row rollouts frame in tens of ms, not a second of Python);
    ragged pairs and masks that are not numbers go row by row.
    """
    import numpy as np

    paired = env_masks is not None
    try:
        values, offsets = _flat_masks(loss_masks)
        trained = _segment_sums(values, offsets)
        if not paired:
            return trained, None
        env_values, env_offsets = _flat_masks(env_masks)
        if np.array_equal(offsets, env_offsets):
            return trained, _segment_sums((values != 0) & (env_values != 0), offsets)
    except (TypeError, ValueError, OverflowError):  # Arrow's errors subclass these
        trained = np.array([_row_sum(mask) for mask in loss_masks], dtype=np.int64)
    if not paired:
        return trained, None
    return trained, np.array([_row_sum(loss, env, paired=True) for loss, env in zip(loss_masks, env_masks)],
                             dtype=np.int64)


def prepare(frame, params: ContractParams):
    """Add the derived columns the suite of `params.kind` checks."""
    frame = frame.copy()
    if params.kind == "rollouts":
        frame["group_size"] = frame.groupby("prompt_id")["id"].transform("size")
        if "loss_mask" in frame:
            trained, env_trained = mask_totals(frame["loss_mask"], frame["env_mask"] if "env_mask" in frame else None)
            frame["trained_tokens"] = trained
            if env_trained is not None:
                frame["env_tokens_trained"] = env_trained
    if params.kind == "preference":
        frame["chosen_equals_rejected"] = frame["chosen"] == frame["rejected"]
    if params.kind in CONVERSATIONS and "conversational" in frame:
        _conversation_columns(frame, params.kind)
    return frame


def expectations(frame, params: ContractParams) -> list:
    import great_expectations.expectations as gxe

    kind = params.kind
    checks = [gxe.ExpectTableRowCountToBeBetween(min_value=1)]  # an empty dataset passes no contract
    checks += [gxe.ExpectColumnToExist(column=column) for column in REQUIRED[kind]]
    if "malformed" in frame.columns:  # an imported row that could not be read
        checks.append(gxe.ExpectColumnValuesToBeNull(column="malformed"))
    checks += [gxe.ExpectColumnValuesToBeInSet(column=name, value_set=[0]) for name in PROBLEMS
               if name in frame.columns]
    present = [c for c in REQUIRED[kind] if c in frame.columns]
    checks += [gxe.ExpectColumnValuesToNotBeNull(column=column) for column in present]
    blank_allowed = {"mostly": 1.0 - params.max_blank_fraction} if params.max_blank_fraction else {}
    checks += [gxe.ExpectColumnValuesToNotMatchRegex(column=column, regex=BLANK, **blank_allowed)
               for column in TEXT_COLUMNS[kind] if column in frame.columns]
    if kind == "eval":
        checks.append(gxe.ExpectCompoundColumnsToBeUnique(column_list=["checkpoint", "env", "mode", "task_id"]))
    elif "id" in frame.columns:
        checks.append(gxe.ExpectColumnValuesToBeUnique(column="id"))
    if "finish_reason" in frame.columns:
        checks.append(gxe.ExpectColumnValuesToBeInSet(column="finish_reason", value_set=["stop"],
                                                      mostly=1.0 - params.max_truncated_fraction)
                      if kind == "rollouts" else
                      gxe.ExpectColumnValuesToBeInSet(column="finish_reason", value_set=["stop", "length"]))
    if params.reward_range is not None:
        low, high = params.reward_range
        for column in ("reward", "chosen_score", "rejected_score"):
            if column in frame.columns:
                checks.append(gxe.ExpectColumnValuesToBeBetween(column=column, min_value=low, max_value=high))
    if params.context_length is not None and "total_tokens" in frame.columns:
        checks.append(gxe.ExpectColumnValuesToBeBetween(column="total_tokens", max_value=params.context_length))
    if kind == "rollouts":
        if params.group_size is not None:
            checks.append(gxe.ExpectColumnValuesToBeInSet(column="group_size", value_set=[params.group_size]))
        if "trained_tokens" in frame.columns:
            checks.append(gxe.ExpectColumnValuesToBeBetween(column="trained_tokens", min_value=1))
        if "env_tokens_trained" in frame.columns:
            checks.append(gxe.ExpectColumnValuesToBeInSet(column="env_tokens_trained", value_set=[0]))
    if kind == "unpaired":
        checks.append(gxe.ExpectColumnValuesToBeInSet(column="label", value_set=[True, False]))
    if kind == "preference":
        checks.append(gxe.ExpectColumnValuesToBeInSet(column="chosen_equals_rejected", value_set=[False]))
        if "chosen_score" in frame.columns and "rejected_score" in frame.columns:  # pairs from scored rollouts
            checks.append(gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="chosen_score",
                                                                      column_B="rejected_score", or_equal=True))
    return checks
