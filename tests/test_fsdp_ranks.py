"""Sharded training on two CPU processes (gloo), the tiny preset under torch's FSDP2 (`fully_shard`;
accelerate does not run FSDP without CUDA). Every forward and backward is then a collective: the
steps of sft, preference and rl, given deliberately uneven data per process (3 rows against 2, in
micro-batches of 2), must run as many of them on both, and rl's decoding (a different number of
prompts, so of decode steps, on each) must not be collectives at all. A hang would end at gloo's
timeout as a failure. Each step must update the weights as one process does over the whole batch."""

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port
from test_micro_batches import ragged_examples

from models.presets import materialize

MICRO = 2
GLOO_TIMEOUT = datetime.timedelta(seconds=60)


def learner(model, micro_batch_size=MICRO):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from tasks.train.learner import Learner

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=GLOO_TIMEOUT)])
    return Learner(model, accelerator, optimizer, scheduler, micro_batch_size)


def fresh_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(materialize("tiny-llama"))).train()


def sharded(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def rl_groups():
    """One scored group of 5 ragged rows: 3 and 2 per process."""
    from tasks.rollout.episodes import Trajectory, TurnRecord
    from tasks.stages.rl.scoring import Scored

    group = []
    for i, example in enumerate(ragged_examples(4, 5)):
        prompt, completion = example.input_ids[:2], example.input_ids[2:] or [7]
        turn = TurnRecord(prompt, completion, [], 0.0, False)
        group.append(Scored(Trajectory("e", None, prompt, [turn]), [float(i)], False, False, 0.0, 0.0, True))
    return [group]


def rl_step(model, rank: int | None):
    """rl's update over rl_groups(), each process on its share (Training.shard), as the stage runs it."""
    from types import SimpleNamespace

    from tasks.stages.rl import RlStage
    from tasks.stages.rl.update import train_step

    stage = RlStage(kind="rl", id="rl", policy="p", envs={"e": 1.0}, steps=1, group_size=5, max_tokens=8,
                    scale_rewards="none", micro_batch_size=MICRO)
    step_learner = learner(model)
    processes = step_learner.accelerator.num_processes
    training = SimpleNamespace(learner=step_learner, accelerator=step_learner.accelerator, model=model,
                               shard=lambda rows: rows if processes == 1 else rows[rank::processes])
    metrics, _ = train_step(training, None, rl_groups(), stage, 0)
    return metrics


def steps(model, rank: int | None, processes: int) -> dict:
    """sft, preference, rl steps on `model`, each process on its share of the batch."""
    from tasks.stages.preference import PreferenceStage
    from tasks.stages.preference import train_step as preference_step
    from tasks.stages.sft import train_step as sft_step

    def share(items):
        return items if rank is None else items[rank::processes]

    examples = ragged_examples(1, 5)
    step_tokens = sum(e.scored_tokens for e in examples)
    sft_loss, _ = sft_step(learner(model), share(examples), 0, step_tokens, shards=processes)
    chosen, rejected = ragged_examples(2, 5), ragged_examples(3, 5)
    ref_chosen, ref_rejected = -torch.arange(5.0) * 3, -torch.arange(5.0) * 4
    indices = share(list(range(5)))
    stage = PreferenceStage(kind="preference", id="p", policy="s", data="g", method="dpo")
    preference_step(learner(model), [chosen[i] for i in indices], [rejected[i] for i in indices],
                    ref_chosen[indices], ref_rejected[indices], stage, 0, step_pairs=5, shards=processes)
    rl_step(model, rank)
    return {"sft_loss": sft_loss}


def decode_uneven(model, rank: int) -> list[list[int]]:
    """Greedy completions of 1 + 2 * rank prompts inside full_weights: no collective per step."""
    from models.loading import load_tokenizer
    from models.sampling import SamplingParams, chat_prompt
    from tasks.rollout.episodes import LocalPolicy
    from tasks.train.sharding import full_weights

    tokenizer = load_tokenizer(materialize("tiny-llama"))
    prompts = [chat_prompt(tokenizer, f"What is {a} + 2?") for a in range(1 + 2 * rank)]
    with full_weights(model), torch.no_grad():
        generations = LocalPolicy(model, tokenizer).generate_many(prompts, SamplingParams(6), list(range(len(prompts))))
    return [g.token_ids for g in generations]


def full_state(model) -> dict:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def ranked_model(rank: int, port: int):
    """This rank's fresh model in a group of 2 processes, sharded as the stage shards it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    model = fresh_model()
    learner(model)  # the process group, as the stage's accelerator makes it
    sharded(model)
    return model


def save_whole_weights(model, rank: int, out_dir: str) -> None:
    """The gathered weights, written once (rank 0) as weights.safetensors."""
    from safetensors.torch import save_file

    weights = full_state(model)
    if rank == 0:
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, f"{out_dir}/weights.safetensors")


def worker(rank: int, port: int, out_dir: str) -> None:
    model = ranked_model(rank, port)
    decoded = decode_uneven(model, rank)
    steps(model, rank, 2)
    save_whole_weights(model, rank, out_dir)
    with open(f"{out_dir}/decoded-{rank}.json", "w") as handle:
        json.dump(decoded, handle)


def assert_two_processes_train_as_one(two_ranks, one_process_steps, tmp_path) -> None:
    """`two_ranks` (rank, port, out_dir) on 2 spawned processes saves weights.safetensors; a fresh
    model after `one_process_steps(model, None, 1)` in this process must hold the same weights."""
    from safetensors.torch import load_file

    mp.start_processes(two_ranks, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    torch.manual_seed(0)
    alone = fresh_model()
    one_process_steps(alone, None, 1)
    expected = full_state(alone)
    got = load_file(str(tmp_path / "weights.safetensors"))
    worst = max((got[name] - expected[name]).abs().max().item() for name in expected)
    assert worst < 1e-5, worst


@pytest.mark.timeout(600)
def test_fsdp_steps_with_uneven_data_finish_and_train_as_one_process(tmp_path):
    assert_two_processes_train_as_one(worker, steps, tmp_path)
    decoded = [json.loads((tmp_path / f"decoded-{rank}.json").read_text()) for rank in range(2)]
    assert [len(d) for d in decoded] == [1, 3] and decoded[0][0] == decoded[1][0]  # rank 1 decoded 3, whole weights


def adam_learner(model):
    from tasks.train.learner import Learner

    step_learner = learner(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Learner(model, step_learner.accelerator, optimizer, scheduler, MICRO)


def sft_steps(step_learner, rank: int, batches: list) -> None:
    from tasks.stages.sft import train_step

    for batch in batches:
        train_step(step_learner, batch[rank::2], 0, sum(e.scored_tokens for e in batch), shards=2)


def resume_worker(rank: int, port: int, out_dir: str) -> None:
    """Three sft steps under AdamW uninterrupted; then two, each process keeping its own state
    (`rank_state`, through bytes loaded with weights_only as from the store), a fresh model and
    optimizer given the gathered weights and that state, and the third step."""
    import io

    from safetensors.torch import save_file

    from tasks.train.checkpointing import load_state, placed, rank_state, set_rng_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", HF_HUB_OFFLINE="1")
    batches = [ragged_examples(seed, 5) for seed in (5, 6, 7)]
    torch.manual_seed(0)
    learner(fresh_model())  # the process group
    straight = adam_learner(sharded(fresh_model()))
    sft_steps(straight, rank, batches)
    first = adam_learner(sharded(fresh_model()))
    sft_steps(first, rank, batches[:2])
    buffer = io.BytesIO()
    torch.save(rank_state(first.optimizer, with_optimizer=True), buffer)
    (Path(out_dir) / f"rank-{rank}.pt").write_bytes(buffer.getvalue())
    own = load_state(Path(out_dir) / f"rank-{rank}.pt")
    resumed_model = fresh_model()
    resumed_model.load_state_dict(full_state(first.model), strict=False)  # lm_head is tied to the embeddings
    resumed = adam_learner(sharded(resumed_model))
    resumed.optimizer.load_state_dict(placed(own["optimizer"], resumed.optimizer))
    set_rng_state(own["rng"])
    sft_steps(resumed, rank, batches[2:])
    weights = {"straight": full_state(straight.model), "resumed": full_state(resumed.model)}
    if rank == 0:
        for name, state in weights.items():
            save_file({key: tensor.contiguous() for key, tensor in state.items()}, f"{out_dir}/{name}.safetensors")


@pytest.mark.timeout(600)
def test_fsdp_resume_keeps_each_processs_optimizer_shard_and_trains_as_uninterrupted(tmp_path):
    from safetensors.torch import load_file

    mp.start_processes(resume_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    straight, resumed = (load_file(str(tmp_path / f"{name}.safetensors")) for name in ("straight", "resumed"))
    worst = max((straight[name] - resumed[name]).abs().max().item() for name in straight)
    assert worst < 1e-6, worst
    assert torch.load(tmp_path / "rank-1.pt", weights_only=True)["optimizer"]["state"]  # rank 1 kept its own shard
