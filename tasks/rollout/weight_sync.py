"""A training stage (rl) publishing its policy's weights to the inference server its rollouts decode on
(`rollout: {backend: server}`'s publisher).

Version v is the policy after v optimizer steps, saved (safetensors) to `rollout.sync_folder/<stage>-v<v>`.
- **LoRA** (vLLM and serve-model alike): loaded through the runtime LoRA endpoint under the name
  `<model>@v<v>`; requests then name it. vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and
  --enable-lora; serve-model needs --lora-folder set to the sync folder. An older version is unloaded
  and its folder deleted only once no request in flight names it: vLLM reloads an adapter its LRU
  cache evicted from the adapter's path, so an asynchronous stage keeps up to max_staleness + 1
  versions. An unload the server refuses is not fatal (the newest vLLM answers 500 for an adapter
  its cache already evicted).
- **Full weights to serve-model**: its `/v1/reload_weights` copies them in between two batches, and
  its answers then carry `weights_version`.
- **Full weights to vLLM**: its development routes (VLLM_SERVER_DEV_MODE=1) and a worker extension
  of ours (deployments/posttrain_vllm_worker.py, `--worker-extension-cls`): /pause?mode=wait (the
  requests under way finish on the old weights), /collective_rpc `posttrain_load_weights` (every
  worker reads the saved folder), /reset_prefix_cache (cached prefixes hold the old weights' keys),
  /resume. New requests wait meanwhile, so each decodes wholly on one version. vLLM's NCCL weight
  transfer is faster but needs vLLM in the trainer's environment and a process group across both
  sides; a shared folder deploys anywhere (docs/ARCHITECTURE.md).

A version is published before the stage's first step too (version `start`), so the server decodes
exactly the weights the stage starts from, whatever it was started with: a resumed stage publishes
its checkpoint's weights again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.rollout.endpoint_policy import EndpointError, connection_reason
from tasks.rollout.server_policy import ServerPolicy

RPC_METHOD = "posttrain_load_weights"
EXTENSION = "posttrain_vllm_worker.PosttrainWorkerExtension"
LORA_ROUTES = ("start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (serve-model: "
               "--lora-folder)")
DEV_ROUTES = (f"full-weight sync to vLLM needs VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} "
              "(deployments/posttrain_vllm_worker.py on the server's PYTHONPATH)")


class WeightSync:
    """Publishes versions of `model` (the trainer's, unwrapped) to `policy`'s server, one every `every`
    optimizer steps."""

    def __init__(self, policy: ServerPolicy, folder: str | Path, stage_id: str, lora: bool, every: int = 1):
        self.policy, self.folder, self.stage_id, self.lora = policy, Path(folder), stage_id, lora
        self.every = every
        self.published: list[tuple[str, Path]] = []  # (the name requests use, folder): the current version
        self.retiring: list[tuple[str, Path]] = []  # older versions, kept while a request names them

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
        """The server loads the saved version; requests name it from then on; older versions go
        once no request names them."""
        if self.lora:
            name = f"{self.policy.served_model}@v{version}"
            self._post("unload_lora_adapter", {"lora_name": name}, tolerated=True)  # a crashed run's
            self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(saved.resolve())},
                       missing_route=LORA_ROUTES)
            self._retarget(name, version)
        elif self.policy.server.get("kind") == "vllm":
            self._reload_vllm(saved, version)
        else:
            self._post("reload_weights", {"weights_path": str(saved.resolve()), "version": version})
            self._retarget(self.policy.served_model, version)
        current = self.policy.target[0]
        self.retiring += [(old_name, folder) for old_name, folder in self.published if folder != saved]
        self.published = [(current, saved)]
        self.retire()

    def retire(self) -> None:
        """Unload and delete the older versions no request in flight names (full weights were copied
        into the server: their folders go at once)."""
        kept = []
        for name, folder in self.retiring:
            with self.policy.lock:
                busy = self.lora and self.policy.in_flight[name] > 0
            if busy:
                kept.append((name, folder))
                continue
            if self.lora:
                self._post("unload_lora_adapter", {"lora_name": name}, tolerated=True)
            shutil.rmtree(folder, ignore_errors=True)
        self.retiring = kept

    def _retarget(self, name: str, version: int) -> None:
        with self.policy.lock:
            self.policy.target = (name, version)

    def _reload_vllm(self, saved: Path, version: int) -> None:
        """Full weights into vLLM: pause (after the requests under way), every worker loads the folder,
        the prefix cache is dropped, resume; no request starts meanwhile."""
        self.policy.accepting.clear()
        try:
            self._post_root("pause", params={"mode": "wait"})
            try:
                self._post_root("collective_rpc", {"method": RPC_METHOD, "args": [str(saved.resolve())]})
                self._post_root("reset_prefix_cache")
            finally:
                self._post_root("resume")
            self._retarget(self.policy.served_model, version)
        finally:
            self.policy.accepting.set()

    def _post(self, route: str, body: dict, tolerated: bool = False, missing_route: str | None = None) -> None:
        """One call of the server's /v1 weight API; an error is one line naming the endpoint."""
        self._call(f"{self.policy.base_url.rstrip('/')}/{route}", route, body, None, tolerated, missing_route)

    def _post_root(self, route: str, body: dict | None = None, params: dict | None = None) -> None:
        """One call of vLLM's development routes, beside /v1."""
        self._call(f"{self.policy.root_url}/{route}", route, body, params, False, DEV_ROUTES)

    def _call(self, url: str, route: str, body, params, tolerated: bool, missing_route: str | None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.policy.api_key}"} if self.policy.api_key else {}
        try:
            response = httpx.post(url, json=body, params=params, headers=headers, timeout=600)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{self.policy.base_url}: cannot reach the endpoint ({connection_reason(exc)})") \
                from None
        if response.status_code < 300 or (tolerated and response.status_code in (400, 404, 500)):
            return
        if response.status_code == 404 and route_missing(response) and missing_route is not None:
            raise EndpointError(f"{self.policy.base_url}: the server has no {route} route: {missing_route}")
        if route == "collective_rpc":
            raise EndpointError(f"{self.policy.base_url}: the workers could not load the weights (HTTP "
                                f"{response.status_code}: {response_message(response)}): {DEV_ROUTES}")
        raise EndpointError(f"{self.policy.base_url}: {route} failed: HTTP {response.status_code}: "
                            f"{response_message(response)}")


def route_missing(response) -> bool:
    """FastAPI's answer for a route the server did not register (vLLM registers its runtime LoRA and
    development routes only when their environment variables are set)."""
    try:
        return response.json() == {"detail": "Not Found"}
    except ValueError:
        return False


def response_message(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:300] if response.text.strip() else "no body"
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
