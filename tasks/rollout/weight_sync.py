"""A training stage (rl) publishing its policy's weights to the inference server its rollouts decode on
(`rollout: {backend: server}`'s publisher).

Version v is the policy after v optimizer steps, saved (safetensors) into a fresh directory of
`rollout.sync_folder` (tasks/rollout/sync_folder.py: a private folder, refused when others could write
into it; one `mkdtemp` directory per version, `<stage>-<nonce>-v<v>-<random>`, the nonce the run's own).
- **LoRA** (vLLM and serve-model alike): loaded through the runtime LoRA endpoint under the name
  `<model>@<nonce>-v<v>`; requests then name it. vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and
  --enable-lora; serve-model needs --lora-folder set to the sync folder. An older version is unloaded
  and its folder deleted only once no request in flight names it: vLLM reloads an adapter its LRU
  cache evicted from the adapter's path, so an asynchronous stage keeps up to max_staleness + 1
  versions. An unload the server refuses is not fatal: vLLM answers 500 for an adapter its cache
  already evicted and keeps the name registered, which is why no name is ever loaded twice (the
  nonce: a rerun, or another run on the same server, has names of its own). Should a load still meet
  a name the server holds, it is loaded again with `load_inplace` (vLLM >= 0.15); only then, since
  vLLM keeps the flag on the adapter and rereads it from disk at every step while it is set.
- **Full weights to serve-model**: its `/v1/reload_weights` copies them in between two batches, and
  its answers then carry `weights_version`.
- **Full weights to vLLM** (>= 0.12, the first with /pause): its development routes
  (VLLM_SERVER_DEV_MODE=1) and a worker extension of ours (deployments/posttrain_vllm_worker.py,
  `--worker-extension-cls`, loading only from POSTTRAIN_SYNC_ROOT). Once, before the first save: the
  workers' weight format (a quantized model is refused: its parameters are in kernel format; versions
  are saved in the dtype served) and their root (the sync folder). Each version: every worker reads
  and checks it whole while the server still decodes (`posttrain_check_weights`), then /pause once the
  requests under way end (`mode=wait`, and `wait_for_inflight_requests=true` for builds before 0.15,
  which ignore `mode` and abort them), `posttrain_load_weights` (retried once; failing twice, the last
  good version is loaded back), /reset_prefix_cache (cached prefixes hold the old weights' keys),
  /resume. Every /pause is followed by /resume, unless no version could be loaded whole: a server
  whose weights may be mixed stays paused, and the stage fails saying so. New requests wait
  meanwhile, so each decodes wholly on one version. vLLM's NCCL weight transfer is faster but needs
  vLLM in the trainer's environment and a process group across both sides; a shared folder deploys
  anywhere (docs/ARCHITECTURE.md).

A version is published before the stage's first step too (version `start`), so the server decodes
exactly the weights the stage starts from, whatever it was started with: a resumed stage publishes
its checkpoint's weights again.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tasks.rollout.endpoint_policy import EndpointError, connection_reason
from tasks.rollout.server_checks import vllm_at_least
from tasks.rollout.server_policy import ServerPolicy
from tasks.rollout.sync_folder import prepared_folder, run_nonce, share_files, version_folder

RPC_METHOD = "posttrain_load_weights"
CHECK_METHOD = "posttrain_check_weights"
FORMAT_METHOD = "posttrain_weight_format"
EXTENSION = "posttrain_vllm_worker.PosttrainWorkerExtension"
LORA_ROUTES = ("start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (serve-model: "
               "--lora-folder)")
DEV_ROUTES = (f"full-weight sync to vLLM needs VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} "
              "(deployments/posttrain_vllm_worker.py on the server's PYTHONPATH)")
PAUSE_SINCE = (0, 12, 0)  # /pause and /resume (vllm-project/vllm#28037, Nov 2025)
LOAD_INPLACE_SINCE = "0.15.0"  # `load_inplace` on /v1/load_lora_adapter (#31326)
# /pause after the requests under way end: `mode=wait` from vLLM 0.15 (#32351); the builds before it
# know only `wait_for_inflight_requests` (default: abort them) and ignore `mode`; newer ones still
# take the flag, as mode=wait
PAUSE_WAIT = {"mode": "wait", "wait_for_inflight_requests": "true"}
SERVED_DTYPES = ("float32", "bfloat16", "float16")
TIMEOUT = 600.0


class MixedWeights(EndpointError):
    """No version could be loaded whole after a load failed part way: the server stays paused."""


class WorkerCallFailed(EndpointError):
    """A /collective_rpc call the workers failed; `reason` is its short cause."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class WeightSync:
    """Publishes versions of `model` (the trainer's, unwrapped) to `policy`'s server, one every `every`
    optimizer steps, through `folder` (created private, or group-readable with `folder_mode` "group")."""

    def __init__(self, policy: ServerPolicy, folder: str | Path, stage_id: str, lora: bool, every: int = 1,
                 folder_mode: str = "private", nonce: str | None = None):
        self.policy, self.stage_id, self.lora = policy, stage_id, lora
        self.folder_mode = folder_mode
        self.folder = prepared_folder(folder, folder_mode)
        self.nonce = nonce or run_nonce()  # this run's versions and adapters, apart from any other run's
        self.every = every
        self.published: list[tuple[str, Path]] = []  # (the name requests use, folder): the current version
        self.published_version: int | None = None  # the last version the server loaded whole
        self.retiring: list[tuple[str, Path]] = []  # older versions, kept while a request names them
        self.served_dtype: str | None = None  # vLLM full weights: versions are saved in the served dtype
        self.server_checked = False
        self.pause_timeout = TIMEOUT  # /pause waits for the requests under way

    def publish(self, model, version: int) -> None:
        self.announce(version, self.save(model, version))

    def save(self, model, version: int) -> Path:
        """Version `version` of `model` written whole into a fresh directory of the sync folder (the
        server is told of it only then, so it never sees half a save)."""
        self.check_server()
        saved = version_folder(self.folder, self.stage_id, self.nonce, version, self.folder_mode)
        state = None if self.served_dtype is None else in_dtype(model, self.served_dtype)
        model.save_pretrained(str(saved), **({} if state is None else {"state_dict": state}))
        share_files(saved, self.folder_mode)
        return saved

    def check_server(self) -> None:
        """Once, before full weights first go to vLLM: a build with /pause, a worker extension that
        loads from this sync folder, an unquantized model; the dtype versions are saved in."""
        if self.server_checked or self.lora or self.policy.server.get("kind") != "vllm":
            return
        version = self.policy.server.get("version")
        if not vllm_at_least(version, PAUSE_SINCE):
            raise EndpointError(f"{self.policy.base_url}: vLLM {version} has no /pause route; full-weight sync "
                                f"needs vLLM >= {'.'.join(map(str, PAUSE_SINCE))} (or train with model.lora)")
        formats = self._worker_formats()
        self._refuse_quantized(formats)
        self._refuse_other_root(formats)
        dtype = formats[0].get("dtype")
        self.served_dtype = dtype if dtype in SERVED_DTYPES else None
        self.server_checked = True

    def _worker_formats(self) -> list[dict]:
        results = self._rpc(FORMAT_METHOD, what="report their weight format", hint=DEV_ROUTES).get("results")
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise EndpointError(f"{self.policy.base_url}: the workers do not report their weight format (an older "
                                f"posttrain_vllm_worker.py?): {DEV_ROUTES}")
        return results

    def _refuse_quantized(self, formats: list[dict]) -> None:
        quantized = sorted({str(f["quantization"]) for f in formats if f.get("quantization")})
        if quantized:
            raise EndpointError(f"{self.policy.base_url}: the server's model is quantized ({', '.join(quantized)}): "
                                "full weights cannot be loaded into its kernel-format parameters; serve the "
                                "unquantized model (no --quantization), or train with model.lora")

    def _refuse_other_root(self, formats: list[dict]) -> None:
        roots = {f.get("sync_root") for f in formats}
        root = roots.pop() if len(roots) == 1 else None
        if root is None or not same_folder(root, self.folder):
            found = "unset" if root is None else root
            raise EndpointError(f"{self.policy.base_url}: the server's workers load only from POSTTRAIN_SYNC_ROOT "
                                f"({found}), not from this stage's sync_folder: start vLLM with "
                                f"POSTTRAIN_SYNC_ROOT={self.folder}")

    def announce(self, version: int, saved: Path) -> None:
        """The server loads the saved version; requests name it from then on; older versions go
        once no request names them."""
        if self.lora:
            name = f"{self.policy.served_model}@{self.nonce}-v{version}"
            self._load_adapter(name, saved)
            self._retarget(name, version)
        elif self.policy.server.get("kind") == "vllm":
            self._reload_vllm(saved, version)
        else:
            self._post("reload_weights", {"weights_path": str(saved), "version": version})
            self._retarget(self.policy.served_model, version)
        current = self.policy.target[0]
        self.retiring += [(old_name, folder) for old_name, folder in self.published if folder != saved]
        self.published, self.published_version = [(current, saved)], version
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
            if self.lora:  # a 500 for an adapter vLLM's cache already evicted: its name stays, never used again
                self._call(self._v1("unload_lora_adapter"), "unload_lora_adapter", {"lora_name": name})
            shutil.rmtree(folder, ignore_errors=True)
        self.retiring = kept

    def _load_adapter(self, name: str, saved: Path) -> None:
        """Load the adapter in `saved` as `name`. A name the server already holds is loaded in place
        (`load_inplace`, sent only then: vLLM keeps the flag on the adapter and rereads it from disk at
        every step while it is set, vllm-project/vllm#33791)."""
        body = {"lora_name": name, "lora_path": str(saved)}
        response = self._call(self._v1("load_lora_adapter"), "load_lora_adapter", body, missing_route=LORA_ROUTES)
        if already_loaded(response):
            response = self._call(self._v1("load_lora_adapter"), "load_lora_adapter", {**body, "load_inplace": True},
                                  missing_route=LORA_ROUTES)
            if already_loaded(response):
                version = self.policy.server.get("version") or "(version unknown)"
                raise EndpointError(f"{self.policy.base_url}: the server already holds an adapter named {name} and "
                                    f"ignores load_inplace (vLLM {version}; it needs vLLM >= {LOAD_INPLACE_SINCE}): "
                                    "upgrade vLLM, or restart it to free the name")
        self._raise_for(response, "load_lora_adapter")

    def _retarget(self, name: str, version: int) -> None:
        with self.policy.lock:
            self.policy.target = (name, version)

    def _reload_vllm(self, saved: Path, version: int) -> None:
        """Full weights into vLLM: every worker checks the version while the server still decodes;
        then pause (after the requests under way), load (or give the last good version back), drop
        the prefix cache, resume; no request starts meanwhile."""
        self._rpc(CHECK_METHOD, saved, what=f"read version {version}")  # a refusal here changes nothing
        self.policy.accepting.clear()
        try:
            self._while_paused(lambda: self._load_or_restore(saved, version))
            self._retarget(self.policy.served_model, version)
        finally:
            self.policy.accepting.set()

    def _while_paused(self, work) -> None:
        """`work()` between /pause and /resume. A /pause that failed or timed out is followed by
        /resume too (the server may have paused anyway, and would hold every request back); only
        MixedWeights leaves it paused, since its weights may be mixed."""
        try:
            self._call(self._root("pause"), "pause", None, params=PAUSE_WAIT, missing_route=DEV_ROUTES,
                       timeout=self.pause_timeout, checked=True)
            work()
        except MixedWeights:
            raise
        except BaseException:
            self._resume(quietly=True)
            raise
        self._resume()

    def _resume(self, quietly: bool = False) -> None:
        try:
            self._call(self._root("resume"), "resume", None, missing_route=DEV_ROUTES, checked=True)
        except EndpointError:
            if not quietly:
                raise

    def _load_or_restore(self, saved: Path, version: int) -> None:
        """Load `saved`, twice if the first try fails (a passing fault); failing that, load the last
        good version back, so that the server resumes on whole weights (and the stage fails)."""
        failure = self._load(saved)
        if failure is not None:
            failure = self._load(saved)  # the second try
        if failure is None:
            self._call(self._root("reset_prefix_cache"), "reset_prefix_cache", None, checked=True)
            return
        base = self.policy.base_url
        last = self.published[0][1] if self.published else None
        if last is None:
            raise MixedWeights(f"{base}: the workers could not load version {version} ({failure}) and there is no "
                               "earlier version of this run to load back: the server stays paused, its weights "
                               "possibly mixed; restart it")
        restore_failure = self._load(last)
        if restore_failure is not None:
            raise MixedWeights(f"{base}: the workers could not load version {version} ({failure}) nor version "
                               f"{self.published_version} back ({restore_failure}): the server stays paused, its "
                               "weights possibly mixed; restart it")
        self._call(self._root("reset_prefix_cache"), "reset_prefix_cache", None, checked=True)
        raise EndpointError(f"{base}: the workers could not load version {version}, twice ({failure}); the server "
                            f"has version {self.published_version} back and was resumed")

    def _load(self, folder: Path) -> str | None:
        """None once every worker loaded `folder`, else why not."""
        try:
            self._rpc(RPC_METHOD, folder, what="load the weights")
        except WorkerCallFailed as exc:
            return exc.reason
        return None

    def _rpc(self, method: str, *args, what: str, hint: str | None = None) -> dict:
        """Every worker's `method(*args)` through /collective_rpc; the answer's JSON ({} for none). A
        failure names what the workers could not do (and `hint`: what the server needs)."""
        body = {"method": method, "args": [str(arg) for arg in args]}
        response = self._call(self._root("collective_rpc"), "collective_rpc", body, missing_route=DEV_ROUTES)
        if response.status_code >= 300:
            reason = f"HTTP {response.status_code}: {response_message(response)}"
            raise WorkerCallFailed(f"{self.policy.base_url}: the workers could not {what} ({reason})"
                                   + (f": {hint}" if hint else ""), reason)
        try:
            answer = response.json() if response.content else {}
        except ValueError:
            answer = {}
        return answer if isinstance(answer, dict) else {}

    def _post(self, route: str, body: dict, missing_route: str | None = None) -> None:
        """One call of the server's /v1 weight API; an error is one line naming the endpoint."""
        self._call(self._v1(route), route, body, missing_route=missing_route, checked=True)

    def _v1(self, route: str) -> str:
        return f"{self.policy.base_url.rstrip('/')}/{route}"

    def _root(self, route: str) -> str:
        """vLLM's development routes sit beside /v1."""
        return f"{self.policy.root_url}/{route}"

    def _call(self, url: str, route: str, body, params: dict | None = None, missing_route: str | None = None,
              timeout: float = TIMEOUT, checked: bool = False):
        """One POST; unreachable, or a route the server did not register, is one line naming the
        endpoint; with `checked`, so is any other failure. The response."""
        import httpx

        headers = {"Authorization": f"Bearer {self.policy.api_key}"} if self.policy.api_key else {}
        try:
            response = httpx.post(url, json=body, params=params, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{self.policy.base_url}: {route}: cannot reach the endpoint "
                                f"({connection_reason(exc)})") from None
        if response.status_code == 404 and route_missing(response) and missing_route is not None:
            raise EndpointError(f"{self.policy.base_url}: the server has no {route} route: {missing_route}")
        if checked:
            self._raise_for(response, route)
        return response

    def _raise_for(self, response, route: str) -> None:
        if response.status_code >= 300:
            raise EndpointError(f"{self.policy.base_url}: {route} failed: HTTP {response.status_code}: "
                                f"{response_message(response)}")


def in_dtype(model, dtype_name: str) -> dict | None:
    """`model`'s state dict in the dtype the server serves (None when it already is): a version
    half the size of fp32 on a bf16 server. Tied weights stay one tensor, so that the save drops the
    copy as it does for the model's own."""
    import torch

    dtype = getattr(torch, dtype_name)
    state = model.state_dict()
    if all(t.dtype == dtype or not t.is_floating_point() for t in state.values()):
        return None
    cast: dict = {}
    by_storage: dict = {}
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            cast[name] = tensor
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in by_storage:
            by_storage[key] = tensor.detach().to(dtype)
        cast[name] = by_storage[key]
    return cast


def same_folder(root: str, folder: Path) -> bool:
    """The server's root and the trainer's sync folder are the same path (both read the same volume)."""
    return os.path.normpath(root) == os.path.normpath(str(folder)) or \
        os.path.realpath(root) == os.path.realpath(str(folder))


def already_loaded(response) -> bool:
    """vLLM's 400 for a name it holds ("... has already been loaded ... set 'load_inplace' ...")."""
    return response.status_code == 400 and "already been loaded" in response_message(response)


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
