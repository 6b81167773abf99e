"""Weight sync against the vLLM-faithful fake (tests/fake_vllm): vLLM's runtime LoRA lifecycle (an
LRU cache that evicts and reloads adapters from their paths, a 500 for unloading an evicted one, no
routes without VLLM_ALLOW_RUNTIME_LORA_UPDATING) and full weights through its development routes and
our worker extension (deployments/posttrain_vllm_worker.py); rl stages through it, lockstep and
asynchronous, with LoRA and with full weights."""

import importlib.util
import threading
from pathlib import Path

import pytest
from fake_vllm import FakeVllmConfig, running_fake
from test_rl import ENV, committed_policy, read_history, stage_context
from test_serve_model import NAME, local_model, trained_checkpoint
from test_vllm_rollouts import wait_for
from test_weight_sync import greedy_local, greedy_server, perturbed, rl_through

from tasks.rollout.backends import ServerRollout
from tasks.rollout.endpoint_policy import EndpointError
from tasks.rollout.server_policy import ServerPolicy
from tasks.rollout.weight_sync import WeightSync

ROOT = Path(__file__).resolve().parent.parent


def worker_extension():
    spec = importlib.util.spec_from_file_location("posttrain_vllm_worker",
                                                  ROOT / "deployments" / "posttrain_vllm_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PosttrainWorkerExtension


def fake(folder=None, name: str = NAME, **fields) -> FakeVllmConfig:
    return FakeVllmConfig(folder or trained_checkpoint(), name, logprobs_mode="processed_logprobs", **fields)


def checked_policy(url: str, tokenizer, name: str = NAME) -> ServerPolicy:
    return ServerPolicy.checked(ServerRollout(backend="server", endpoint=url, model=name), tokenizer, 512)


def lora_model():
    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora, load_model

    return add_lora(load_model(trained_checkpoint(), ModelConfig()), ModelConfig(lora=LoraConfig(r=4)))


def test_vllm_lora_sync_survives_the_cache_evicting_the_version_before(tmp_path):
    """max_loras 1 (vLLM's default): loading v2 evicts v1 from the cache, and the newest vLLM answers
    its unload with a 500: the sync goes on, and the server answers as the adapter does."""
    _, tokenizer = local_model()
    model = lora_model()
    with running_fake(fake()) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=True)
        for version in (1, 2, 3):
            perturbed(model, version, "lora_B")
            sync.publish(model, version)
            assert greedy_server(policy, tokenizer) == greedy_local(model, tokenizer)
        assert list(server.registry) == [f"{NAME}@v3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl-v3"]


def test_vllm_an_adapter_a_request_still_names_is_kept_until_it_ends(tmp_path):
    """Asynchronous rl: a request naming v1 is under way when v2 is published. v1 stays loaded and on
    disk (vLLM reloads an evicted adapter from its path for that request); it goes at the next sync
    after the request ends."""
    from models.sampling import SamplingParams

    _, tokenizer = local_model()
    model = lora_model()
    with running_fake(fake()) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=True)
        sync.publish(model, 1)
        server.gate.clear()
        answers = []
        request = threading.Thread(target=lambda: answers.append(policy.generate([1, 5, 9], 0, SamplingParams(6))))
        request.start()
        wait_for(lambda: server.in_flight == 1)
        perturbed(model, 2, "lora_B")
        sync.publish(model, 2)
        assert (tmp_path / "rl-v1").is_dir() and f"{NAME}@v1" in server.registry
        server.gate.set()
        request.join(timeout=60)
        assert answers and answers[0][0].policy_version == 1
        sync.publish(model, 3)
        assert list(server.registry) == [f"{NAME}@v3"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rl-v3"]


def test_vllm_without_runtime_lora_routes_the_error_names_the_variable(tmp_path):
    _, tokenizer = local_model()
    with running_fake(fake(runtime_lora=False)) as (url, _):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=True)
        with pytest.raises(EndpointError, match=r"the server has no load_lora_adapter route: start vLLM with "
                                                r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"):
            sync.publish(lora_model(), 1)


def test_vllm_full_weight_sync_without_dev_mode_names_what_to_set(tmp_path):
    from models.config import ModelConfig
    from models.loading import load_model

    _, tokenizer = local_model()
    with running_fake(fake()) as (url, _):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=False)
        with pytest.raises(EndpointError, match=r"the server has no pause route: full-weight sync to vLLM needs "
                                                r"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                                                r"posttrain_vllm_worker.PosttrainWorkerExtension"):
            sync.publish(load_model(trained_checkpoint(), ModelConfig()), 1)


def test_vllm_full_weight_sync_without_the_extension_names_it(tmp_path):
    from models.config import ModelConfig
    from models.loading import load_model

    _, tokenizer = local_model()
    with running_fake(fake(dev_mode=True)) as (url, server):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=False)
        with pytest.raises(EndpointError, match=r"the workers could not load the weights .*--worker-extension-cls"):
            sync.publish(load_model(trained_checkpoint(), ModelConfig()), 1)
        assert not server.paused  # resumed after the failure


def test_vllm_full_weight_sync_makes_the_server_answer_as_the_weights_do(tmp_path):
    from models.config import ModelConfig
    from models.loading import load_model

    _, tokenizer = local_model()
    model = load_model(trained_checkpoint(), ModelConfig())
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension())) as (url, server):
        policy = checked_policy(url, tokenizer)
        assert policy.server == {"kind": "vllm", "version": "0.29.0", "own_defaults": False}
        sync = WeightSync(policy, tmp_path, "rl", lora=False)
        for version in (1, 2):
            perturbed(model, version)
            sync.publish(model, version)
            assert policy.target == (NAME, version)
            assert greedy_server(policy, tokenizer) == greedy_local(model, tokenizer)
        assert server.prefix_cache_resets == 2 and not server.paused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl-v2"]


@pytest.mark.parametrize("case", ["lora-asynchronous", "full-asynchronous", "full-lockstep"])
def test_vllm_rl_through_the_fake_ends_with_its_weights_on_the_server(tmp_path, case):
    from models.config import LoraConfig, ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize
    from tasks.stages.rl.stage import run

    store, policy_ref = committed_policy(tmp_path)
    folder = tmp_path / "sync"
    folder.mkdir()
    model = ModelConfig(lora=LoraConfig(r=4)) if case.startswith("lora") else ModelConfig()
    config = fake(materialize("tiny-llama"), "policy", dev_mode=True, worker_extension=worker_extension(),
                  max_loras=2)
    with running_fake(config) as (url, _):
        stage = rl_through(url, folder, asynchronous={"max_staleness": 1} if "asynchronous" in case else None)
        outputs = run(stage, stage_context(tmp_path, "w", store, policy_ref, {"arith": ENV.config}, model))
        history = read_history(outputs)
        assert [h["step"] for h in history] == [1, 2, 3, 4]
        assert all(h["logp_mismatch"] < 1e-3 and h["stale_groups"] == 0 for h in history)
        tokenizer = load_tokenizer(outputs["checkpoint"].local_dir)
        trained = load_model(outputs["checkpoint"].local_dir, model)
        policy = checked_policy(url, tokenizer, "policy")
        policy.target = ("policy@v4", 4) if case.startswith("lora") else ("policy", 4)
        assert greedy_server(policy, tokenizer) == greedy_local(trained, tokenizer)
