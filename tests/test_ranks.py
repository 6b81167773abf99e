"""Work split across a multi-GPU stage's processes (tasks/common/ranks.py): on two CPU processes
(gloo), RL's groups, generate's rollouts and evaluate's rows are what one process makes, and no
item is made twice."""

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from tasks.common.ranks import share, split_and_gather

WORKLOAD = 7  # items: uneven over two processes


def test_round_robin_shares_cover_every_item_once():
    shares = [share(WORKLOAD, rank, 3) for rank in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
    assert split_and_gather(WORKLOAD, lambda mine: [i * i for i in mine]) == [i * i for i in range(WORKLOAD)]


def workloads(out_dir: str) -> dict:
    """RL's scored groups, a generate stage's rows and an evaluation's rows, on tiny-llama (the same
    in every process; each process writes what it made of its share and what it ended up with)."""
    from artifacts.store import Store
    from envs.arith import ArithEnv, ArithEnvConfig
    from models.config import ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize
    from tasks.common.context import StageContext
    from tasks.common.datasets import read_rows
    from tasks.rollout.episodes import LocalPolicy
    from tasks.stages.evaluate import EvaluateStage, evaluate_policy
    from tasks.stages.generate import GenerateStage
    from tasks.stages.generate import run as generate
    from tasks.stages.rl import RlStage
    from tasks.stages.rl.scoring import scored_data
    from tasks.stages.rl.stage import EpisodeSampler, step_tasks

    folder = materialize("tiny-llama")
    model, tokenizer = load_model(folder, ModelConfig()), load_tokenizer(folder)
    env_config = ArithEnvConfig(kind="arith", digits=2)
    env = ArithEnv(env_config)
    played = split_and_gather(WORKLOAD, lambda mine: [[i, os.environ.get("RANK", "0")] for i in mine])
    stage = RlStage(kind="rl", id="rl", policy="p", envs={"arith": 1.0}, steps=1, group_size=2, max_tokens=8)
    picked = step_tasks({"arith": env.tasks("train", 64, 0)}, stage.envs, 3, 0, 0)
    groups = EpisodeSampler(stage, tokenizer, {"arith": env}, {}).sample_groups(LocalPolicy(model, tokenizer), picked,
                                                                              77)
    evaluation = EvaluateStage(kind="evaluate", id="e", checkpoints=["p"], envs=["arith"], n=3, max_new_tokens=8,
                               sampled={"temperature": 1.0})
    evaluated, metrics = evaluate_policy(LocalPolicy(model, tokenizer), tokenizer, env, evaluation, "p")
    store = Store(f"file://{out_dir}/store")
    policy = store.commit("t/p", "checkpoint", folder, producer={})
    ctx = StageContext(store=store, pipeline="t", run_id="r", stage_id="g", cache_key="k", model=ModelConfig(),
                       envs={"arith": env_config}, inputs={"p": str(policy)},
                       workdir=__import__("pathlib").Path(out_dir) / f"work-{os.environ.get('RANK', '0')}")
    rollouts = generate(GenerateStage(kind="generate", id="g", policy="p", env="arith", n=3, samples=2, greedy=1,
                                      max_tokens=8), ctx)["rollouts"]
    rows = [{key: value.tolist() if hasattr(value, "tolist") else value for key, value in row.items()}
            for row in read_rows(rollouts.local_dir)]
    return {"played": played, "groups": [[scored_data(s) for s in group] for group in groups],
            "evaluated": evaluated, "metrics": metrics, "rollouts": rows}


def worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", HF_HUB_OFFLINE="1")
    result = workloads(f"{out_dir}/rank-{rank}")
    with open(f"{out_dir}/rank-{rank}.json", "w") as handle:
        json.dump(result, handle, default=str)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ranks")
    mp.start_processes(worker, args=(free_port(), str(out_dir)), nprocs=2, start_method="spawn")
    return [json.loads((out_dir / f"rank-{rank}.json").read_text()) for rank in range(2)]


def test_two_processes_make_what_one_makes_and_no_item_twice(two_processes, tmp_path):
    one = json.loads(json.dumps(workloads(str(tmp_path)), default=str))
    for result in two_processes:
        # each item was made by exactly one process: the round-robin share of its rank
        assert result["played"] == [[i, str(i % 2)] for i in range(WORKLOAD)]
        for key in ("evaluated", "metrics"):
            assert result[key] == one[key], key
        # the episodes' tokens are the same; the sampler's log-probs of rows decoded in other batches agree
        # to float rounding
        assert strip_action_logprobs(result["groups"]) == strip_action_logprobs(one["groups"])
        for theirs, ours in zip(all_action_logprobs(result["groups"]), all_action_logprobs(one["groups"])):
            assert theirs == pytest.approx(ours, abs=1e-5)
        # the same tokens; log-probs of rows decoded in other batches agree to float rounding
        assert [without_logprobs(row) for row in result["rollouts"]] == [without_logprobs(row) for row in one["rollouts"]]
        for theirs, ours in zip(result["rollouts"], one["rollouts"]):
            assert theirs["logprobs"] == pytest.approx(ours["logprobs"], abs=1e-5)
    assert len(one["groups"]) == 3 and all(len(group) == 2 for group in one["groups"])
    sampled = [row["tokens"] for row in one["rollouts"] if row["mode"] == "sampled"]
    assert len(sampled) == 6 and len({tuple(tokens) for tokens in sampled}) > 1  # seeded apart


def strip_action_logprobs(groups: list) -> list:
    return [[{**s, "trajectory": {**s["trajectory"], "turns": [{k: v for k, v in turn.items() if k != "action_logprobs"}
                                                              for turn in s["trajectory"]["turns"]]}}
             for s in group] for group in groups]


def all_action_logprobs(groups: list) -> list:
    return [turn["action_logprobs"] for group in groups for s in group for turn in s["trajectory"]["turns"]]


def without_logprobs(row: dict) -> dict:
    return {key: value for key, value in row.items() if key != "logprobs"}
