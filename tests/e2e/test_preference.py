"""End-to-end: generate -> preference -> rl through the real CLI, killed mid-DPO, resumed, then cached."""


import pandas as pd

from artifacts.store import Store
from tests.e2e.helpers import by_id, concurrently, kill_once, posttrain, start, summary, tiny_spec, write

DPO_STEPS = 40


def preference_spec(store) -> dict:
    """A short SFT on one-digit sums, from a tiny-llama already SFT'd on them (test_serve_model's,
    shared with the serving tests), that gets some answers right, so rollouts differ in reward."""
    from test_serve_model import trained_checkpoint

    pipeline = tiny_spec(f"file://{store}", sft={"max_steps": 20, "batch_size": 32, "learning_rate": 0.002,
                                                 "warmup_steps": 5, "checkpoint_every": 200})
    pipeline["model"]["base"] = str(trained_checkpoint())
    pipeline["envs"]["arith"]["digits"] = 1
    pipeline["stages"][0]["n"] = 512
    pipeline["stages"][2] = {"id": "final-eval", "kind": "evaluate", "checkpoints": ["sft", "align", "rl"],
                             "envs": ["arith"], "n": 16, "max_new_tokens": 64, "sampled": None}
    pipeline["stages"][2:2] = [
        {"id": "onpolicy", "kind": "generate", "policy": "sft", "env": "arith", "n": 24, "samples": 4, "greedy": 1,
         "max_tokens": 64, "contract": {"max_truncated_fraction": 1.0}},
        {"id": "align", "kind": "preference", "policy": "sft", "data": "onpolicy", "method": "ln_dpo",
         "beta": 0.5, "max_steps": DPO_STEPS, "batch_size": 4, "checkpoint_every": 5},
        {"id": "rl", "kind": "rl", "policy": "align", "envs": {"arith": 1.0}, "steps": 4, "prompts_per_step": 2,
         "group_size": 3, "max_tokens": 16, "anti_doom": {"penalty": 0.5}},
    ]
    return pipeline


def test_preference_killed_mid_stage_resumes_then_reruns_cached(tmp_path):
    store = tmp_path / "store"
    spec = write(tmp_path, preference_spec(store))
    kill_once(start("run", spec),
              lambda: list(store.glob("scratch/*/step-*/DONE")) and list(store.glob("artifacts/tiny/onpolicy/*")),
              420, "no in-stage checkpoint of the preference stage appeared")
    assert not list(store.glob("artifacts/tiny/align/*/MANIFEST.json"))  # the stage's own output is not there
    assert not list(store.glob("artifacts/tiny/align.pairs/*/MANIFEST.json"))

    rerun = posttrain("run", spec, "--summary-json", tmp_path / "rerun.json")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    stages = by_id(summary(tmp_path / "rerun.json"))
    assert [stages[s]["state"] for s in ("warmup", "sft", "onpolicy")] == ["cached"] * 3
    align = stages["align"]
    assert align["state"] == "completed"
    resumed_from = align["metrics"]["resumed_from_step"]
    assert resumed_from >= 5 and resumed_from % 5 == 0
    assert f"resuming from in-stage checkpoint at step {resumed_from}/{DPO_STEPS}" in rerun.stdout
    assert not list(store.glob("scratch/*"))

    # the pairs are committed beside the checkpoint, contract-checked, and in its lineage
    checkpoint_ref, pairs_ref = align["outputs"]["checkpoint"], align["outputs"]["pairs"]
    assert checkpoint_ref.startswith("tiny/align@") and pairs_ref.startswith("tiny/align.pairs@")
    promoted = align["metrics"]["promoted_checkpoints"]  # every 5 steps but the last, across the kill
    assert [ref.split("@")[0] for ref in promoted] == [f"tiny/align.step-{n}" for n in range(5, DPO_STEPS, 5)]
    manifests = Store(f"file://{store}")
    assert manifests.manifest(checkpoint_ref)["siblings"]["align.pairs"] == pairs_ref
    assert manifests.manifest(pairs_ref)["metrics"]["contract"]["success"] is True
    pairs = pd.read_parquet(manifests.fetch(pairs_ref) / "data.parquet")
    assert len(pairs) == align["metrics"]["pairs"] > 0
    assert (pairs["chosen_score"] > pairs["rejected_score"]).all()
    assert pairs["ref_chosen_logp"].lt(0).all() and pairs["ref_rejected_logp"].lt(0).all()
    metrics = align["metrics"]
    assert metrics["prompts"] == 24 == metrics["pairs"] + metrics["dropped_tied"] + metrics["dropped_unscored"]
    assert set(stages["final-eval"]["metrics"]) == {"sft", "align", "rl"}
    assert stages["rl"]["state"] == "completed" and stages["rl"]["metrics"]["steps"] == 4

    # the cached rerun and the two lineage commands only read the store: all three at once
    again, lineage, rl_lineage = concurrently(
        lambda: posttrain("run", spec, "--summary-json", tmp_path / "again.json"),
        lambda: posttrain("lineage", checkpoint_ref, "--store", f"file://{store}"),
        lambda: posttrain("lineage", "tiny/rl@latest", "--store", f"file://{store}"))
    assert pairs_ref in lineage.stdout and stages["onpolicy"]["outputs"]["rollouts"] in lineage.stdout
    assert_lineage_is_a_dag(manifests, stages, rl_lineage)

    assert again.returncode == 0
    run = summary(tmp_path / "again.json")
    assert [s["state"] for s in run["stages"]] == ["cached"] * 6
    assert by_id(run)["align"]["outputs"] == align["outputs"]


def assert_lineage_is_a_dag(manifests: Store, stages: dict, lineage) -> None:
    """The quickstart's shape (warmup -> sft -> onpolicy -> align -> rl): `lineage rl@latest` (its
    finished command) prints each artifact once (sft is reached through align and onpolicy), and no
    manifest lists an artifact of its own stage run among its inputs (those are its `siblings`)."""
    rl_ref = stages["rl"]["outputs"]["checkpoint"]
    assert lineage.returncode == 0 and lineage.stderr == f"tiny/rl@latest = {rl_ref}\n"
    printed = [line.split("── ")[-1].split()[0] for line in lineage.stdout.splitlines() if "  stage " in line]
    assert len(printed) == len(set(printed))
    assert {stages[s]["outputs"][key] for s, key in (("warmup", "dataset"), ("sft", "checkpoint"),
                                                      ("onpolicy", "rollouts"), ("align", "checkpoint"))} < set(printed)
    assert f"{stages['sft']['outputs']['checkpoint']}  (shown above)" in lineage.stdout
    for manifest in manifests.manifests("tiny").values():
        own_run = manifest["producer"]["cache_key"]
        assert all(manifests.manifest(ref)["producer"]["cache_key"] != own_run for ref in manifest["inputs"].values())
