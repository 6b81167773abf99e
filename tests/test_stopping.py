"""A stopping run (tasks/runtime/runner.STOPPING, which post_train sets on SIGTERM or Ctrl-C)
retries no stage: a retry would start again the child it has just killed. The whole path, a
SIGTERMed `posttrain run`: tests/e2e/test_pipeline.py."""

from types import SimpleNamespace

from tasks.runtime.runner import STOPPING, NotRetryableFailure, StageFailed, retry_unless_not_retryable


def test_a_failed_stage_is_retried_unless_it_cannot_succeed_or_the_run_is_stopping():
    failed, broken = SimpleNamespace(data=StageFailed("boom")), SimpleNamespace(data=NotRetryableFailure("bad rows"))
    assert retry_unless_not_retryable(None, None, failed)
    assert not retry_unless_not_retryable(None, None, broken)
    STOPPING.set()
    try:
        assert not retry_unless_not_retryable(None, None, failed)
    finally:
        STOPPING.clear()
