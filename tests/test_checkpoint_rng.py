"""The RNG states an in-stage checkpoint keeps: the GPUs' too once a process uses CUDA, restored
where there is a GPU with the same index, and states from before they were kept (or from a
machine with other GPUs) still load."""

import io
import random

import pytest
import torch

from tasks.train import checkpointing

CUDA = torch.cuda.is_available()


def through_weights_only(state: dict) -> dict:
    """The state as a resumed stage reads it back (checkpointing.load_state)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def draws() -> tuple:
    return random.random(), torch.rand(3).tolist()


def test_a_state_saved_before_cuda_states_were_kept_still_restores():
    state = checkpointing.rng_state()
    state.pop("cuda", None)  # an older checkpoint's
    expected = draws()
    checkpointing.set_rng_state(through_weights_only(state))
    assert draws() == expected


def test_cuda_states_from_a_machine_with_other_gpus_restore_what_matches():
    eight_gpus = [torch.cuda.get_rng_state(0) if CUDA else torch.zeros(16, dtype=torch.uint8)] * 8
    state = through_weights_only({**checkpointing.rng_state(), "cuda": eight_gpus})
    expected = draws()
    checkpointing.set_rng_state(state)  # no crash with fewer GPUs here, or none
    assert draws() == expected
    assert checkpointing.set_cuda_rng_states(eight_gpus) == (min(8, torch.cuda.device_count()) if CUDA else 0)
    assert checkpointing.set_cuda_rng_states([]) == 0


@pytest.mark.skipif(CUDA, reason="a process that used CUDA keeps its GPUs' states")
def test_a_process_without_cuda_keeps_no_cuda_state():
    assert "cuda" not in checkpointing.rng_state()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_gpus_rng_states_round_trip():
    torch.rand(1, device="cuda")  # the process uses CUDA
    state = through_weights_only(checkpointing.rng_state())
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda").tolist()
    checkpointing.set_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == expected
