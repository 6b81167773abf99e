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
from test_weight_sync import adapter_of_version, greedy_local, greedy_server, perturbed, rl_through, versions_on_disk

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


@pytest.fixture
def sync_root(tmp_path, monkeypatch):
    """The server's POSTTRAIN_SYNC_ROOT: the test's sync folder (the fake's workers run in this process)."""
    monkeypatch.setenv("POSTTRAIN_SYNC_ROOT", str(tmp_path))
    return tmp_path


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
    its unload with a 500 and keeps the name registered: the sync goes on (no name is loaded twice),
    and the server answers as the adapter does."""
    _, tokenizer = local_model()
    model = lora_model()
    with running_fake(fake()) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=True)
        for version in (1, 2, 3):
            perturbed(model, version, "lora_B")
            sync.publish(model, version)
            assert greedy_server(policy, tokenizer) == greedy_local(model, tokenizer)
        assert list(server.registry) == [f"{NAME}@{sync.nonce}-v{v}" for v in (1, 2, 3)]  # evicted ones stay named
        assert list(server.cache) == [f"{NAME}@{sync.nonce}-v3"]
    assert versions_on_disk(tmp_path) == ["rl-v3"]


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
        assert versions_on_disk(tmp_path) == ["rl-v1", "rl-v2"] and f"{NAME}@{sync.nonce}-v1" in server.registry
        server.gate.set()
        request.join(timeout=60)
        assert answers and answers[0][0].policy_version == 1
        sync.publish(model, 3)
        assert policy.target == (f"{NAME}@{sync.nonce}-v3", 3) and list(server.cache) == [policy.target[0]]
        assert versions_on_disk(tmp_path) == ["rl-v3"]


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
        with pytest.raises(EndpointError, match=r"the server has no collective_rpc route: full-weight sync to "
                                                r"vLLM needs VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                                                r"posttrain_vllm_worker.PosttrainWorkerExtension"):
            sync.publish(load_model(trained_checkpoint(), ModelConfig()), 1)


def test_vllm_full_weight_sync_without_the_extension_names_it(tmp_path):
    from models.config import ModelConfig
    from models.loading import load_model

    _, tokenizer = local_model()
    with running_fake(fake(dev_mode=True)) as (url, server):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=False)
        with pytest.raises(EndpointError, match=r"the workers could not report their weight format .*"
                                                r"--worker-extension-cls"):
            sync.publish(load_model(trained_checkpoint(), ModelConfig()), 1)
        assert not server.paused  # refused before any pause


def test_vllm_full_weight_sync_makes_the_server_answer_as_the_weights_do(tmp_path, sync_root):
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
    assert versions_on_disk(tmp_path) == ["rl-v2"]


@pytest.mark.parametrize("case", ["lora-asynchronous", "full-asynchronous", "full-lockstep"])
def test_vllm_rl_through_the_fake_ends_with_its_weights_on_the_server(tmp_path, case, monkeypatch):
    from models.config import LoraConfig, ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize
    from tasks.stages.rl.stage import run

    store, policy_ref = committed_policy(tmp_path)
    folder = tmp_path / "sync"
    folder.mkdir()
    monkeypatch.setenv("POSTTRAIN_SYNC_ROOT", str(folder))
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
        policy.target = (adapter_of_version(url, 4), 4) if case.startswith("lora") else ("policy", 4)
        assert greedy_server(policy, tokenizer) == greedy_local(trained, tokenizer)


def full_model():
    from models.config import ModelConfig
    from models.loading import load_model

    return load_model(trained_checkpoint(), ModelConfig())


def served_weights(server) -> dict:
    return {name: p.detach().clone() for name, p in server.model.named_parameters()}


def same_weights(server, model) -> bool:
    import torch

    theirs = dict(model.named_parameters())
    return all(torch.equal(p.to(theirs[name].dtype), theirs[name].detach())
               for name, p in served_weights(server).items())


def in_thread(call) -> tuple[threading.Thread, list]:
    """`call()` in a daemon thread; the list gets its result, or the EndpointError it raised."""
    outcome: list = []

    def run():
        try:
            outcome.append(call())
        except EndpointError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_vllm_load_inplace_a_rerun_on_a_long_lived_server_loads_its_versions(tmp_path):
    """A rerun (a resume a few versions back) against a server whose cache of 1 evicted the first
    run's adapters: their unloads answered 500 and left the names registered. Before, the rerun's
    `policy@v1` was a 400 ("has already been loaded") and the stage died; its names are its own now."""
    _, tokenizer = local_model()
    model = lora_model()
    with running_fake(fake(max_loras=1)) as (url, server):
        first = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=True)
        for version in (1, 2, 3):
            perturbed(model, version, "lora_B")
            first.publish(model, version)
        assert len(server.registry) == 3  # two evicted names the server keeps
        policy = checked_policy(url, tokenizer)
        rerun = WeightSync(policy, tmp_path, "rl", lora=True)
        for version in (1, 2):
            perturbed(model, 10 + version, "lora_B")
            rerun.publish(model, version)
            assert greedy_server(policy, tokenizer) == greedy_local(model, tokenizer)


@pytest.mark.parametrize("version", ["0.29.0", "0.14.0"])
def test_vllm_load_inplace_replaces_a_name_the_server_still_holds(tmp_path, version):
    """Should a name meet one the server holds (here: two syncs forced onto one nonce), it is loaded
    again in place; a build before 0.15 ignores load_inplace, and the error says what to upgrade."""
    _, tokenizer = local_model()
    first, second = lora_model(), lora_model()
    perturbed(first, 1, "lora_B")
    perturbed(second, 2, "lora_B")
    with running_fake(fake(max_loras=1, version=version)) as (url, server):
        WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=True, nonce="0123abcd").publish(first, 1)
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=True, nonce="0123abcd")
        if version == "0.14.0":
            with pytest.raises(EndpointError, match=rf"^{url}: the server already holds an adapter named "
                                                    rf"{NAME}@0123abcd-v1 and ignores load_inplace \(vLLM 0.14.0; it "
                                                    r"needs vLLM >= 0.15.0\): upgrade vLLM, or restart it to free "
                                                    r"the name$"):
                sync.publish(second, 1)
            return
        sync.publish(second, 1)
        assert greedy_server(policy, tokenizer) == greedy_local(second, tokenizer) != greedy_local(first, tokenizer)


def test_vllm_an_engine_that_lost_an_evicted_adapters_folder_drops_connections(tmp_path):
    """vLLM reloads an evicted adapter from its path when a request names it; with the folder gone
    the engine core dies and the API server shuts down: that request gets a bare 500, the next ones
    (the client's retry of it too) a refused connection. The fake answered 500s and stayed up."""
    import shutil

    from models.sampling import SamplingParams

    _, tokenizer = local_model()
    model = lora_model()
    with running_fake(fake(max_loras=1)) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=True)
        sync.publish(model, 1)
        first_name, first_folder = sync.published[0]
        server.load_adapter({"lora_name": "other", "lora_path": str(first_folder)})  # evicts v1
        shutil.rmtree(first_folder)
        first = raised(lambda: policy.generate([1, 5, 9], 0, SamplingParams(4)))
        assert "HTTP 500" in first or "cannot reach the endpoint" in first, first  # the client retries a 500
        assert server.dead
        wait_for(lambda: "cannot reach the endpoint" in raised(lambda: policy.generate([1, 5, 9], 0,
                                                                                      SamplingParams(4))))


def raised(call) -> str:
    try:
        call()
    except EndpointError as exc:
        return str(exc)
    return "no error"


def test_vllm_quantized_model_refuses_full_weight_sync(tmp_path, sync_root):
    """`--quantization fp8` (or an AWQ/GPTQ checkpoint): the model's load_weights would write
    checkpoint tensors into kernel-format parameters; refused before anything is saved."""
    _, tokenizer = local_model()
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension(), quantization="fp8")) as (url, server):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=False)
        with pytest.raises(EndpointError, match=rf"^{url}: the server's model is quantized \(fp8\): full weights "
                                                r"cannot be loaded into its kernel-format parameters; serve the "
                                                r"unquantized model \(no --quantization\), or train with model.lora$"):
            sync.publish(full_model(), 1)
        assert not server.paused and list(tmp_path.iterdir()) == []


def test_vllm_full_weights_are_saved_in_the_dtype_the_server_serves(tmp_path, sync_root):
    import json

    _, tokenizer = local_model()
    model = full_model()
    perturbed(model, 5)
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension(), dtype="bfloat16")) as (url, server):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=False)
        sync.publish(model, 1)
        [saved] = list(tmp_path.iterdir())
        header = (saved / "model.safetensors").read_bytes()
        entries = json.loads(header[8:8 + int.from_bytes(header[:8], "little")])
        dtypes = {entry["dtype"] for name, entry in entries.items() if name != "__metadata__"}
        assert dtypes == {"BF16"}
        assert same_weights(server, model.to(dtype=__import__("torch").bfloat16))


def test_vllm_full_weight_sync_needs_the_sync_folder_as_the_servers_root(tmp_path, monkeypatch):
    _, tokenizer = local_model()
    monkeypatch.setenv("POSTTRAIN_SYNC_ROOT", str(tmp_path / "elsewhere"))
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension())) as (url, server):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path / "sync", "rl", lora=False)
        with pytest.raises(EndpointError, match=rf"^{url}: the server's workers load only from POSTTRAIN_SYNC_ROOT "
                                                rf"\({tmp_path}/elsewhere\), not from this stage's sync_folder: start "
                                                rf"vLLM with POSTTRAIN_SYNC_ROOT={tmp_path}/sync$"):
            sync.publish(full_model(), 1)
        assert not server.paused


def test_vllm_pause_full_weight_sync_is_refused_before_the_first_build_with_pause(tmp_path, sync_root):
    _, tokenizer = local_model()
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension(), version="0.11.2")) as (url, _):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=False)
        with pytest.raises(EndpointError, match=rf"^{url}: vLLM 0.11.2 has no /pause route; full-weight sync needs "
                                                r"vLLM >= 0.12.0 \(or train with model.lora\)$"):
            sync.publish(full_model(), 1)


def test_vllm_pause_waits_for_requests_under_way_on_a_build_before_the_mode_parameter(tmp_path, sync_root):
    """vLLM 0.14 ignores `mode=wait` and aborts the requests under way unless
    `wait_for_inflight_requests=true`: an asynchronous stage's rollouts came back `abort`."""
    from models.sampling import SamplingParams

    _, tokenizer = local_model()
    model = full_model()
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension(), version="0.14.0")) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=False)
        sync.publish(model, 1)
        server.gate.clear()
        request, answer = in_thread(lambda: policy.generate([1, 5, 9], 0, SamplingParams(6)))
        wait_for(lambda: server.in_flight == 1)
        perturbed(model, 2)
        publish, published = in_thread(lambda: sync.publish(model, 2))
        wait_for(lambda: server.paused)
        server.gate.set()
        request.join(timeout=60)
        publish.join(timeout=60)
    assert published == [None], published
    assert len(answer) == 1 and not isinstance(answer[0], EndpointError), answer
    assert answer[0][0].policy_version == 1 and answer[0][0].finish_reason in ("stop", "length")


def test_vllm_pause_that_times_out_is_followed_by_resume(tmp_path, sync_root):
    """A /pause that did not answer in time (requests under way ran long) was never followed by
    /resume: the server stayed paused and the next start check hung for 600 s."""
    from models.sampling import SamplingParams

    _, tokenizer = local_model()
    model = full_model()
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension())) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=False)
        sync.publish(model, 1)
        sync.pause_timeout = 1.0
        server.gate.clear()
        request, answer = in_thread(lambda: policy.generate([1, 5, 9], 0, SamplingParams(6)))
        wait_for(lambda: server.in_flight == 1)
        publish, published = in_thread(lambda: sync.publish(model, 2))
        publish.join(timeout=30)
        finished, paused = not publish.is_alive(), server.paused
        server.gate.set()
        request.join(timeout=60)
        publish.join(timeout=60)
        assert finished and not paused
        assert len(published) == 1 and "pause: cannot reach the endpoint" in str(published[0])
        assert policy.target == (NAME, 1) and policy.accepting.is_set()
        assert not isinstance(answer[0], EndpointError)
        checked_policy(url, tokenizer)  # the next start check answers at once


def test_vllm_pause_a_paused_server_is_refused_at_start(tmp_path):
    import httpx

    _, tokenizer = local_model()
    with running_fake(fake(dev_mode=True)) as (url, server):
        httpx.post(url.removesuffix("/v1") + "/pause", params={"mode": "keep"}, timeout=30)
        check, outcome = in_thread(lambda: checked_policy(url, tokenizer))
        check.join(timeout=30)
        done = not check.is_alive()
        httpx.post(url.removesuffix("/v1") + "/resume", timeout=30)
        check.join(timeout=60)
    assert done and isinstance(outcome[0], EndpointError), outcome
    assert str(outcome[0]) == (f"{url}: the server is paused (GET /is_paused): a weight sync that failed part way "
                               "leaves it so, its weights possibly mixed; restart it (or POST /resume if its weights "
                               "are whole)")


def test_vllm_pause_a_load_that_fails_once_is_tried_again(tmp_path, sync_root):
    _, tokenizer = local_model()
    model = full_model()
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension())) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=False)
        sync.publish(model, 1)
        perturbed(model, 2)
        server.failing_loads = 1
        sync.publish(model, 2)
        assert policy.target == (NAME, 2) and not server.paused and same_weights(server, model)


def test_vllm_pause_a_load_that_fails_twice_gives_the_last_good_version_back(tmp_path, sync_root):
    """Before: a load that failed part way was followed by /resume, the server decoding on mixed weights."""
    import copy

    _, tokenizer = local_model()
    model = full_model()
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension())) as (url, server):
        policy = checked_policy(url, tokenizer)
        sync = WeightSync(policy, tmp_path, "rl", lora=False)
        sync.publish(model, 1)
        good = copy.deepcopy(model)
        perturbed(model, 2)
        server.failing_loads = 2
        with pytest.raises(EndpointError, match=rf"^{url}: the workers could not load version 2, twice \(HTTP 500: "
                                                r".*the model may hold mixed weights\); the server has version 1 back "
                                                r"and was resumed$"):
            sync.publish(model, 2)
        assert not server.paused and policy.target == (NAME, 1) and same_weights(server, good)
        assert policy.accepting.is_set()


def test_vllm_pause_a_server_whose_weights_may_be_mixed_stays_paused(tmp_path, sync_root):
    _, tokenizer = local_model()
    with running_fake(fake(dev_mode=True, worker_extension=worker_extension())) as (url, server):
        sync = WeightSync(checked_policy(url, tokenizer), tmp_path, "rl", lora=False)
        server.failing_loads = 2
        with pytest.raises(EndpointError, match=rf"^{url}: the workers could not load version 0 \(HTTP 500: .*\) and "
                                                r"there is no earlier version of this run to load back: the server "
                                                r"stays paused, its weights possibly mixed; restart it$"):
            sync.publish(full_model(), 0)
        assert server.paused
        with pytest.raises(EndpointError, match="the server is paused"):
            checked_policy(url, tokenizer)
