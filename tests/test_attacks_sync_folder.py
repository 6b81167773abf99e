"""Attacks on the sync folder an rl stage publishes its weights through (tasks/rollout/sync_folder.py)
and on the vLLM worker extension that loads full weights from it (deployments/posttrain_vllm_worker.py):
a planted `.partial` link, a folder others may write into or own, two runs sharing a folder and a
server, a version outside the extension's root, a linked version or file, a load that fails part way."""

import os
import stat
from types import SimpleNamespace

import pytest
from fake_vllm import running_fake
from test_serve_model import local_model
from test_vllm_weight_sync import checked_policy, fake, lora_model, worker_extension
from test_weight_sync import greedy_local, greedy_server, perturbed, versions_on_disk

from tasks.rollout.sync_folder import SyncFolderError
from tasks.rollout.weight_sync import WeightSync

NOBODY = 65534


def offline_policy():
    """A policy whose server is never called (saving a version needs none)."""
    return SimpleNamespace(server={}, base_url="http://127.0.0.1:9/v1", served_model="policy")


def test_sync_folder_a_planted_partial_link_is_never_written_through(tmp_path):
    """Before: a version was written to `<stage>-v<N>.partial` (after an rmtree that a link survives),
    so a link planted under that name sent the weights wherever it pointed."""
    folder, elsewhere = tmp_path / "sync", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    for name in ("rl-v1.partial", "rl-v1"):
        (folder / name).symlink_to(elsewhere, target_is_directory=True)
    saved = WeightSync(offline_policy(), folder, "rl", lora=True).save(lora_model(), 1)
    assert list(elsewhere.iterdir()) == []
    assert saved.parent == folder and not saved.is_symlink() and (saved / "adapter_model.safetensors").is_file()
    assert stat.S_IMODE(saved.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_sync_folder_writable_by_others_is_refused(tmp_path, mode):
    folder = tmp_path / "sync"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(SyncFolderError, match=rf"^sync_folder {folder}: writable by its group or others \(mode "
                                              rf"{mode:o}\); the server loads what is there: chmod 700"):
        WeightSync(offline_policy(), folder, "rl", lora=True)


def test_sync_folder_owned_by_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another uid needs root")
    folder = tmp_path / "sync"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(SyncFolderError, match=rf"^sync_folder {folder}: owned by uid {NOBODY}, not by this user"):
        WeightSync(offline_policy(), folder, "rl", lora=True)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "mine")
    (tmp_path / "mine").mkdir(mode=0o700)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(SyncFolderError, match=rf"^sync_folder {link}: a link owned by uid {NOBODY}"):
        WeightSync(offline_policy(), link, "rl", lora=True)


def test_sync_folder_is_created_private_or_for_its_group(tmp_path):
    private = WeightSync(offline_policy(), tmp_path / "a" / "sync", "rl", lora=True)
    assert stat.S_IMODE(private.folder.stat().st_mode) == 0o700
    shared = WeightSync(offline_policy(), tmp_path / "b" / "sync", "rl", lora=True, folder_mode="group")
    assert stat.S_IMODE(shared.folder.stat().st_mode) == 0o750
    saved = shared.save(lora_model(), 1)
    assert stat.S_IMODE(saved.stat().st_mode) == 0o750
    assert {stat.S_IMODE(f.stat().st_mode) for f in saved.iterdir()} == {0o640}


def test_sync_folder_two_runs_sharing_a_folder_and_a_server_never_touch_each_others_versions(tmp_path):
    """Before: both runs wrote `rl-v1` and loaded `policy@v1`: the second unloaded the first's adapter
    and replaced its folder, so the first run's requests decoded on the second run's weights."""
    _, tokenizer = local_model()
    folder = tmp_path / "sync"
    folder.mkdir()
    first, second = lora_model(), lora_model()
    perturbed(first, 1, "lora_B")
    perturbed(second, 2, "lora_B")
    with running_fake(fake(max_loras=1)) as (url, server):
        policies = checked_policy(url, tokenizer), checked_policy(url, tokenizer)
        runs = [WeightSync(policy, folder, "rl", lora=True) for policy in policies]
        runs[0].publish(first, 1)
        runs[1].publish(second, 1)
        perturbed(first, 3, "lora_B")
        runs[0].publish(first, 2)  # retires the first run's v1, never the second's
        assert greedy_server(policies[0], tokenizer) == greedy_local(first, tokenizer)
        assert greedy_server(policies[1], tokenizer) == greedy_local(second, tokenizer)
        assert greedy_local(first, tokenizer) != greedy_local(second, tokenizer)
        assert policies[1].target[0] in server.registry and policies[0].target[0] != policies[1].target[0]
    assert versions_on_disk(folder) == ["rl-v1", "rl-v2"]  # the second run's v1, the first run's v2


class TinyModel:
    """`model_runner.model` as a worker sees it: `load_weights` consumes the (name, tensor) iterator,
    copying each tensor into its parameter as it comes, as vLLM's models do."""

    def __init__(self):
        import torch

        self.module = torch.nn.Linear(4, 3)

    def load_weights(self, weights) -> set[str]:
        import torch

        parameters = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                parameters[name].copy_(tensor)
        return set(parameters)

    def values(self) -> dict:
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}


def extension_worker():
    worker = type("Worker", (worker_extension(),), {})()
    worker.model_runner = SimpleNamespace(model=TinyModel())
    return worker


def write_version(folder, files: dict[str, dict]) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    for name, tensors in files.items():
        save_file(tensors, str(folder / name))
    return str(folder)


def weights(seed: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(3, 4, generator=generator), "bias": torch.randn(3, generator=generator)}


def test_sync_folder_the_extension_loads_only_from_inside_its_root(tmp_path, monkeypatch):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    worker = extension_worker()
    outside = write_version(elsewhere / "v1", {"model.safetensors": weights(1)})
    with pytest.raises(ValueError, match="POSTTRAIN_SYNC_ROOT is not set on the vLLM server"):
        worker.posttrain_load_weights(outside)
    root.mkdir(mode=0o700)
    monkeypatch.setenv("POSTTRAIN_SYNC_ROOT", str(root))
    for folder in (outside, f"{root}/../elsewhere/v1", "v1", f"{root}/v1/.."):
        with pytest.raises(ValueError, match=r"not a folder directly inside POSTTRAIN_SYNC_ROOT"):
            worker.posttrain_load_weights(folder)
    (root / "linked").symlink_to(elsewhere / "v1", target_is_directory=True)
    with pytest.raises(ValueError, match=r"linked: not a folder, or a link \(links are not followed\)"):
        worker.posttrain_load_weights(str(root / "linked"))
    mixed = write_version(root / "v2", {"model-a.safetensors": {"weight": weights(2)["weight"]}})
    (root / "v2" / "model-b.safetensors").symlink_to(elsewhere / "v1" / "model.safetensors")
    before = worker.model_runner.model.values()
    with pytest.raises(ValueError, match=r"v2/model-b.safetensors: cannot be opened without following a link"):
        worker.posttrain_load_weights(mixed)
    assert all((before[k] == v).all() for k, v in worker.model_runner.model.values().items())
    good = write_version(root / "v3", {"model.safetensors": weights(3)})
    assert worker.posttrain_load_weights(good) == 2
    assert all((worker.model_runner.model.values()[k] == v).all() for k, v in weights(3).items())


def test_sync_folder_a_load_that_fails_part_way_leaves_the_last_good_weights(tmp_path, monkeypatch):
    """Before: each file's tensors went into the model as it was read, so a bad second file left the
    first file's tensors loaded (mixed weights). Now every tensor is read and checked first."""
    import torch

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("POSTTRAIN_SYNC_ROOT", str(root))
    worker = extension_worker()
    model = worker.model_runner.model
    good = weights(1)
    worker.posttrain_load_weights(write_version(root / "v1", {"a.safetensors": {"weight": good["weight"]},
                                                              "b.safetensors": {"bias": good["bias"]}}))
    new = weights(2)
    truncated = write_version(root / "v2", {"a.safetensors": {"weight": new["weight"]},
                                            "b.safetensors": {"bias": new["bias"]}})
    with open(root / "v2" / "b.safetensors", "r+b") as file:
        file.truncate(os.path.getsize(root / "v2" / "b.safetensors") - 4)
    reshaped = write_version(root / "v3", {"a.safetensors": {"weight": new["weight"]},
                                           "b.safetensors": {"bias": torch.zeros(4)}})
    integers = write_version(root / "v4", {"a.safetensors": {"weight": new["weight"]},
                                           "b.safetensors": {"bias": torch.zeros(3, dtype=torch.int32)}})
    for folder, why in ((truncated, "does not fit the file"), (reshaped, "bias is F32 \\[4\\], the last version"),
                        (integers, "bias is I32, not a floating-point weight")):
        with pytest.raises(ValueError, match=why):
            worker.posttrain_load_weights(folder)
        assert all((model.values()[k] == v).all() for k, v in good.items()), folder  # still the last good
    assert worker.posttrain_check_weights(str(root / "v1")) == 2  # a check loads nothing
    assert all((model.values()[k] == v).all() for k, v in good.items())
