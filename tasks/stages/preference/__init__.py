"""`preference`: alignment on preference pairs (Liquid's phase 2), offline on the pairs of its
datasets or online on pairs sampled and judged every step. config.py holds the config, step.py the
pair encoding, log-probs and the loss step, stage.py the run (offline), online.py the online run, kto.py
`method: kto` on unpaired rows."""

from tasks.common.pairs import preference_pairs  # noqa: F401 (the kind's API: config, run and the pieces tests use)
from tasks.stages.preference.config import PreferenceStage  # noqa: F401
from tasks.stages.preference.stage import run  # noqa: F401
from tasks.stages.preference.step import (  # noqa: F401
    bucketed_logps,
    encode_pairs,
    pair_logps,
    reference_logps,
    shared_length,
    shared_prompt_logps,
    side_logps,
    train_step,
)
