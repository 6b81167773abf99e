"""The cores shared among a box's stage children (tasks/runtime/core_share.py): each live child's
share file follows how many run, and a child follows its file (StageContext.follow_core_share)."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from tasks.common.context import StageContext
from tasks.runtime.core_share import CoreShare, cores, threads_each


def test_each_child_gets_the_cores_divided_by_the_children_never_below_one():
    assert threads_each(1, 2) == 2
    assert threads_each(2, 2) == 1
    assert threads_each(3, 16) == 5
    assert threads_each(4, 2) == 1
    assert threads_each(0, 2) == 2


def test_a_child_takes_the_cores_back_when_the_other_ends(tmp_path):
    """Decided once at the start, a stage started beside another (or beside a stage that turned out
    cached) kept half the cores for its whole life."""
    share = CoreShare()
    first, second = tmp_path / "first", tmp_path / "second"
    with share.child(first):
        assert first.read_text() == str(threads_each(1, cores()))
        with share.child(second):
            assert first.read_text() == second.read_text() == str(threads_each(2, cores()))
        assert first.read_text() == str(threads_each(1, cores()))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["first", "second"]  # no staged file left


def _context(tmp_path, model: ModelConfig) -> StageContext:
    return StageContext(store=None, pipeline="p", run_id="r", stage_id="sft", cache_key="0" * 32, model=model,
                        envs={}, inputs={}, workdir=tmp_path, core_share_path=tmp_path / "core-share")


def test_a_child_follows_its_share_unless_the_spec_sets_threads(tmp_path):
    before = torch.get_num_threads()
    try:
        (tmp_path / "core-share").write_text("1")
        torch.set_num_threads(2)
        _context(tmp_path, ModelConfig()).follow_core_share()
        assert torch.get_num_threads() == 1

        torch.set_num_threads(2)
        _context(tmp_path, ModelConfig(threads=2)).follow_core_share()  # the spec's number stands
        assert torch.get_num_threads() == 2

        (tmp_path / "core-share").unlink()  # the runner cleaned up first: keep what it has
        _context(tmp_path, ModelConfig()).follow_core_share()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
