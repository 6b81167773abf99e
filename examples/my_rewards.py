"""Reward functions for pipelines/your-data.yaml, written for TRL's GRPOTrainer: the same signature
works in posttrain's dataset env unchanged (`function: my_rewards:correct_sum`)."""

import re

_ANSWER = re.compile(r"The answer is (-?\d+)\.")


def correct_sum(prompts, completions, completion_ids, answer, **kwargs):
    """1.0 when the completion's one stated answer is the row's `answer`; None for a row without one."""
    scores = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = _ANSWER.findall(text)
        scores.append(None if expected is None else float(found == [str(expected)]))
    return scores
