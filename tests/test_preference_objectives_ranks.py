"""orpo, cpo and kto steps split over two CPU processes (gloo, FSDP2, as tests/test_fsdp_ranks.py):
their batch-wide terms (orpo and cpo's NLL token count, kto's KL baseline) are summed over the
processes before the loss, so each step updates the weights as one process does over the whole
batch, with uneven shares (3 rows against 2) in micro-batches of 2."""


import pytest
import torch
from test_fsdp_ranks import assert_two_processes_train_as_one, learner, ranked_model, save_whole_weights
from test_micro_batches import ragged_examples

ROWS = 5


def steps(model, rank: int | None, processes: int) -> None:
    from tasks.stages.preference import PreferenceStage, train_step
    from tasks.stages.preference.kto import kto_step, mismatched

    def share(items):
        return items if rank is None else items[rank::processes]

    chosen, rejected = ragged_examples(2, ROWS), ragged_examples(3, ROWS)
    indices = share(list(range(ROWS)))
    for method in ("orpo", "cpo"):
        stage = PreferenceStage(kind="preference", id="p", policy="s", data="g", method=method)
        train_step(learner(model), [chosen[i] for i in indices], [rejected[i] for i in indices], None, None, stage,
                   0, step_pairs=ROWS, shards=processes)
    rows = ragged_examples(5, ROWS)
    kl_rows = mismatched(rows, list(range(ROWS)), 64)
    desirable = torch.tensor([True, False, True, True, False])
    # near the policy's log-probs, a little below on the mismatched pairs: a KL baseline of a few nats, not
    # clamped to 0, and losses off their sigmoid's flat tails
    ref_logps, ref_kl = -25.0 + torch.arange(1.0, ROWS + 1), -28.0 - torch.arange(1.0, ROWS + 1)
    stage = PreferenceStage(kind="preference", id="p", policy="s", data="g", method="kto", batch_size=ROWS)
    kto_step(learner(model), [rows[i] for i in indices], [kl_rows[i] for i in indices], desirable[indices],
             ref_logps[indices], ref_kl[indices], stage, 0, step_rows=ROWS, shards=processes)


def worker(rank: int, port: int, out_dir: str) -> None:
    model = ranked_model(rank, port)
    steps(model, rank, 2)
    save_whole_weights(model, rank, out_dir)


@pytest.mark.timeout(600)
def test_orpo_cpo_kto_steps_on_two_processes_train_as_one(tmp_path):
    assert_two_processes_train_as_one(worker, steps, tmp_path)
