"""`preference`: alignment on preference pairs (Liquid's phase 2), offline on the pairs of its
datasets or online on pairs sampled and judged every step; stage.py holds the config, the pair
encoding, the loss step and the offline run; online.py the online run."""

from tasks.stages.preference.stage import (  # noqa: F401 (the kind's API: config, run and the pieces tests use)
    PreferenceStage,
    bucketed_logps,
    encode_pairs,
    pair_logps,
    preference_pairs,
    reference_logps,
    run,
    shared_length,
    shared_prompt_logps,
    side_logps,
    train_step,
)
