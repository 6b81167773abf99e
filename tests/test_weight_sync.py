"""Weight sync to a real serve-model on 127.0.0.1: a LoRA adapter through vLLM's runtime LoRA
endpoints, full weights through serve-model's reload; an rl stage whose rollouts decode on the
server, in lockstep and asynchronously. The server then answers as the trainer's weights do."""

import json
import os
from pathlib import Path

import httpx
import pytest
from test_rl import ENV, committed_policy, read_history, rl_stage, stage_context
from test_serve_model import ARITH, NAME, local_model, running_app, trained_checkpoint

from models.sampling import SamplingParams, chat_prompt, generate_tokens
from tasks.rollout.server_policy import ServerPolicy
from tasks.rollout.weight_sync import WeightSync

PROMPTS = [t.prompt for t in ARITH.tasks("eval", 4, 1)]


@pytest.fixture(scope="module")
def sync_server(tmp_path_factory):
    """serve-model on the SFT'd checkpoint with a LoRA folder and an API key; yields (url, app, folder)."""
    from models.serving.app import make_app

    folder = tmp_path_factory.mktemp("sync")
    app = make_app(trained_checkpoint(), NAME, lora_folder=folder, api_key="k3y")
    with running_app(app) as url:
        yield url, app, folder


def greedy_local(model, tokenizer) -> list[list[int]]:
    prompts = [chat_prompt(tokenizer, p) for p in PROMPTS]
    return [g.token_ids for g in generate_tokens(model.eval(), tokenizer, prompts, SamplingParams(24))]


def greedy_server(policy: ServerPolicy, tokenizer) -> list[list[int]]:
    generations = [policy.generate(chat_prompt(tokenizer, p), 0, SamplingParams(24))[0] for p in PROMPTS]
    assert {g.policy_version for g in generations} == {policy.target[1]}
    return [g.token_ids for g in generations]


def versions_on_disk(folder) -> list[str]:
    """The versions in a sync folder as `<stage>-v<N>`: each is `<stage>-<nonce>-v<N>-<random>`."""
    import re

    found = [re.fullmatch(r"(.+)-[0-9a-f]{8}-v(\d+)-[^-]+", p.name) for p in Path(folder).iterdir()]
    assert all(found), sorted(p.name for p in Path(folder).iterdir())
    return sorted(f"{m[1]}-v{m[2]}" for m in found)


def adapter_of_version(url: str, version: int) -> str:
    """The loaded adapter of weights version `version` (`<model>@<nonce>-v<N>`), from /v1/models."""
    cards = httpx.get(f"{url}/models", timeout=60).json()["data"]
    [name] = [card["id"] for card in cards if card["id"].endswith(f"-v{version}") and "@" in card["id"]]
    return name


def perturbed(model, seed: int, names: str = "") -> None:
    """Weights moved as training would move them (the adapter's B, or every weight)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if names in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def test_a_lora_sync_makes_the_server_answer_as_the_adapter_does(sync_server, tmp_path):
    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora, load_model

    url, app, folder = sync_server
    _, tokenizer = local_model()
    model = add_lora(load_model(trained_checkpoint(), ModelConfig()), ModelConfig(lora=LoraConfig(r=4)))
    policy = ServerPolicy(url, NAME, tokenizer, api_key="k3y")
    sync = WeightSync(policy, folder, "rl", lora=True)
    base = greedy_server(policy, tokenizer)
    for version in (1, 2):
        perturbed(model, version, "lora_B")
        sync.publish(model, version)
        assert policy.target == (f"{NAME}@{sync.nonce}-v{version}", version)
        assert greedy_server(policy, tokenizer) == greedy_local(model, tokenizer)
    assert greedy_local(model, tokenizer) != base  # the adapter changes what is decoded
    listed = httpx.get(f"{url}/models", headers={"Authorization": "Bearer k3y"}).json()["data"]
    assert [card["id"] for card in listed] == [NAME, f"{NAME}@{sync.nonce}-v2"]  # the version before was unloaded
    assert versions_on_disk(folder) == ["rl-v2"]
    policy.target = (NAME, 0)
    assert greedy_server(policy, tokenizer) == base  # the served weights alone, as before


def test_a_full_weight_sync_reloads_the_served_model(tmp_path):
    from models.config import ModelConfig
    from models.loading import load_model
    from models.serving.app import make_app

    _, tokenizer = local_model()
    model = load_model(trained_checkpoint(), ModelConfig())
    with running_app(make_app(trained_checkpoint(), NAME, lora_folder=tmp_path)) as url:
        policy = ServerPolicy(url, NAME, tokenizer)
        perturbed(model, 7)
        WeightSync(policy, tmp_path, "rl", lora=False).publish(model, 3)
        assert policy.target == (NAME, 3)
        assert greedy_server(policy, tokenizer) == greedy_local(model, tokenizer)  # weights_version 3 reported


def post(url: str, route: str, body: dict, key: str | None = "k3y") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/{route}", json=body, headers=headers, timeout=60)


def refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"], response.json()


def test_runtime_weights_load_only_safetensors_from_inside_the_folder(sync_server, tmp_path):
    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora, load_model

    url, app, folder = sync_server
    refused(post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}), 400, "not inside the LoRA folder")
    refused(post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": "a/../../etc"}), 400, "`..` is not allowed")
    outside = tmp_path / "elsewhere"
    add_lora(load_model(trained_checkpoint(), ModelConfig()), ModelConfig(lora=LoraConfig(r=4))).save_pretrained(
        str(outside))
    (folder / "link").symlink_to(outside)
    refused(post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": "link"}), 400, "symlinks are not followed")
    pickled = folder / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((outside / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    refused(post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": "pickled"}), 400,
            "no adapter_model.safetensors in pickled")
    alien = folder / "alien"
    alien.mkdir()
    (alien / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["nowhere"]}))
    (outside / "adapter_model.safetensors").rename(alien / "adapter_model.safetensors")
    refused(post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": "alien"}), 400, "not an adapter for this model")
    refused(post(url, "load_lora_adapter", {"lora_name": "../x", "lora_path": "alien"}), 400, "lora_name")
    refused(post(url, "unload_lora_adapter", {"lora_name": "never"}), 404, "is not loaded")
    refused(post(url, "reload_weights", {"weights_path": "alien", "version": 1}), 400, "no model.safetensors")
    refused(post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": "alien"}, key="wrong"), 401,
            "a valid API key is needed")
    refused(post(url, "completions", {"model": NAME, "prompt": "hi"}, key=None), 401, "a valid API key is needed")
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
    os.unlink(folder / "link")


def test_full_weights_must_be_the_served_models_tensors(sync_server, tmp_path):
    import torch
    from safetensors.torch import save_file

    url, app, folder = sync_server
    for name in app.state.served.adapters.served():  # a test before may have left one
        post(url, "unload_lora_adapter", {"lora_name": name})
    wrong = folder / "wrong"
    wrong.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(wrong / "model.safetensors"))
    refused(post(url, "reload_weights", {"weights_path": "wrong", "version": 1}), 400,
            "model.embed_tokens.weight is [3, 3], the served model's is")
    save_file({"evil.weight": torch.zeros(1)}, str(wrong / "model.safetensors"))
    refused(post(url, "reload_weights", {"weights_path": "wrong", "version": 1}), 400,
            "evil.weight is not a tensor of the served model")


def test_runtime_loading_is_off_without_a_folder(base_url):
    refused(post(base_url, "load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}, key=None), 404,
            "runtime LoRA loading is off")


def rl_through(url: str, folder, **fields):
    return rl_stage(steps=4, prompts_per_step=2, group_size=3, max_tokens=8, checkpoint_every=2,
                    rollout={"backend": "server", "endpoint": url, "model": "policy", "sync_folder": str(folder)},
                    **fields)


@pytest.mark.parametrize("case", ["lockstep", "asynchronous", "lora"])
def test_an_rl_stage_decodes_on_the_server_and_the_server_ends_with_its_weights(tmp_path, case, capsys):
    """Each step's rollouts decode on the server with the weights of the step before (lockstep) or of
    at most one step before that (asynchronous), and the server's last version is the stage's output:
    it answers as the trained checkpoint (full weights, or the trained LoRA adapter) does in-process.
    A rerun resumes from the in-stage checkpoint and publishes its weights again first."""
    from models.config import LoraConfig, ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize
    from models.serving.app import make_app
    from tasks.stages.rl.stage import run

    store, policy_ref = committed_policy(tmp_path)
    folder = tmp_path / "sync"
    folder.mkdir()
    model = ModelConfig(lora=LoraConfig(r=4)) if case == "lora" else ModelConfig()
    with running_app(make_app(materialize("tiny-llama"), "policy", lora_folder=folder)) as url:
        stage = rl_through(url, folder, asynchronous={"max_staleness": 1} if case == "asynchronous" else None)
        outputs = run(stage, stage_context(tmp_path, "w", store, policy_ref, {"arith": ENV.config}, model))
        history = read_history(outputs)
        assert [h["step"] for h in history] == [1, 2, 3, 4]
        for h in history:
            assert h["logp_mismatch"] < 1e-3 and abs(h["importance_weight"] - 1) < 1e-3  # the same engine's numbers
            assert h["stale_groups"] == 0
        staleness = [h["staleness"] for h in history]
        if case == "asynchronous":  # step 1 waits for v0; step 2's rollouts start while step 1 trains
            # later groups may start after the next version was published: fresher, never staler than 1
            assert staleness[:2] == [0, 1] and all(0 <= lag <= 1 for lag in staleness)
        else:
            assert staleness == [0, 0, 0, 0]
        tokenizer = load_tokenizer(outputs["checkpoint"].local_dir)
        trained = load_model(outputs["checkpoint"].local_dir, model)
        policy = ServerPolicy(url, "policy", tokenizer)
        policy.target = (adapter_of_version(url, 4), 4) if case == "lora" else ("policy", 4)
        assert greedy_server(policy, tokenizer) == greedy_local(trained, tokenizer)
        if case == "asynchronous":
            capsys.readouterr()
            again = run(stage, stage_context(tmp_path, "w2", store, policy_ref, {"arith": ENV.config}, model))
            assert again["checkpoint"].metrics["resumed_from_step"] == 2
            assert [h["staleness"] for h in read_history(again)][2:] == [0, 1]  # republished v2, then ahead again
