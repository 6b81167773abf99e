"""Failures a stage's retry cannot fix: the same inputs and settings fail the same way again.

A stage raising one of these fails at once, in one line, without Prefect's retries (the child
reports `retryable: false`; tasks/runtime/runner.py). Anything else a stage raises is retried up to
the spec's `retries`: a lost GPU, a server that was briefly down, a killed process.
"""


class NotRetryable(Exception):
    """The stage cannot succeed as specified; retrying only repeats the failure."""


class NoTrainingData(NotRetryable):
    """A training stage found nothing to train on in its inputs (no preference pairs, no examples)."""


class ConfigMismatch(NotRetryable, ValueError):
    """Two inputs that cannot work together as configured (a reward model whose tokenizer is not the
    policy's, a judge that answers no score)."""
