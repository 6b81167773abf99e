"""An rl stage publishing its policy's weights to the inference server its rollouts decode on.

Version v is the policy after v optimizer steps. With LoRA the adapter is saved (safetensors) to
`rollout.sync_folder/<stage>-v<v>` and loaded through vLLM's runtime LoRA endpoint under the name
`<model>@v<v>`; requests then name it, and the adapter of the version before is unloaded. vLLM
needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora for those endpoints; serve-model
needs --lora-folder set to the sync folder. Full weights go only to serve-model: saved to
`<stage>-v<v>` and copied in by its `/v1/reload_weights` (vLLM documents no such call, so full-weight
sync to vLLM is not offered; LoRA sync is).

A version is published before the stage's first step too (version `start`), so the server decodes
exactly the weights the stage starts from, whatever it was started with: a resumed stage publishes
its checkpoint's weights again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.common.endpoint_policy import EndpointError, connection_reason
from tasks.common.server_policy import ServerPolicy


class WeightSync:
    """Publishes versions of `model` (the trainer's, unwrapped) to `policy`'s server."""

    def __init__(self, policy: ServerPolicy, folder: str | Path, stage_id: str, lora: bool):
        self.policy, self.folder, self.stage_id, self.lora = policy, Path(folder), stage_id, lora
        self.published: list[tuple[str, Path]] = []  # (adapter name or served name, folder) still on disk

    def publish(self, model, version: int) -> None:
        self.announce(version, self.save(model, version))

    def save(self, model, version: int) -> Path:
        """Version `version` of `model` on disk, for the server (written whole, then renamed into place)."""
        saved = self.folder / f"{safe(self.stage_id)}-v{version}"
        partial = saved.with_name(saved.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(str(partial))  # safetensors: transformers' only format, peft's default
        shutil.rmtree(saved, ignore_errors=True)
        partial.rename(saved)  # the server never sees half a save
        return saved

    def announce(self, version: int, saved: Path) -> None:
        """The server loads the saved version; requests name it from then on; the version before goes."""
        if self.lora:
            name = f"{self.policy.served_model}@v{version}"
            self._post("unload_lora_adapter", {"lora_name": name}, missing_ok=True)  # a crashed run's
            self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(saved.resolve())})
        else:
            name = self.policy.served_model
            self._post("reload_weights", {"weights_path": str(saved.resolve()), "version": version})
        self.policy.target = (name, version)
        for old_name, old_folder in self.published:
            if self.lora and old_name != name:
                self._post("unload_lora_adapter", {"lora_name": old_name}, missing_ok=True)
            shutil.rmtree(old_folder, ignore_errors=True)
        self.published = [(name, saved)]

    def _post(self, route: str, body: dict, missing_ok: bool = False) -> None:
        """One call of the server's weight API; an error is one line naming the endpoint."""
        import httpx

        headers = {"Authorization": f"Bearer {self.policy.api_key}"} if self.policy.api_key else {}
        url = f"{self.policy.base_url.rstrip('/')}/{route}"
        try:
            response = httpx.post(url, json=body, headers=headers, timeout=600)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{self.policy.base_url}: cannot reach the endpoint ({connection_reason(exc)})") \
                from None
        if response.status_code < 300 or (missing_ok and response.status_code in (400, 404)):
            return
        raise EndpointError(f"{self.policy.base_url}: {route} failed: HTTP {response.status_code}: "
                            f"{response_message(response)}")


def response_message(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:300] if response.text.strip() else "no body"
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
