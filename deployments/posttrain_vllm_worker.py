"""A vLLM worker extension: full-weight sync from an rl stage's sync folder to a vLLM server.

Put this file on the vLLM server's PYTHONPATH and start it with its development routes on:

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=deployments vllm serve MODEL \
        --worker-extension-cls posttrain_vllm_worker.PosttrainWorkerExtension ...

vLLM mixes this class into every worker; the rl stage then calls, for each new version,
/pause?mode=wait, /collective_rpc {"method": "posttrain_load_weights", "args": [FOLDER]},
/reset_prefix_cache and /resume (tasks/rollout/weight_sync.py). FOLDER is what the stage saved
with `save_pretrained`: safetensors files in the checkpoint's own tensor names, which the model's
`load_weights` maps onto vLLM's (fused, sharded) parameters. Only the standard library, torch and
safetensors are imported: nothing of posttrain needs installing beside vLLM. The folder must be one
the server's host reads (a shared volume); no pickle is loaded and no symlink followed.
"""

from __future__ import annotations

from pathlib import Path


class PosttrainWorkerExtension:
    """Methods vLLM adds to its workers (`self.model_runner.model` is the served model)."""

    def posttrain_load_weights(self, folder: str) -> int:
        """Load every tensor of the safetensors files in `folder` into the served model; the count."""
        files = safetensors_files(folder)
        loaded = [0]

        def weights():
            from safetensors.torch import load_file

            for file in files:
                for name, tensor in load_file(str(file)).items():
                    loaded[0] += 1
                    yield name, tensor

        self.model_runner.model.load_weights(weights())
        return loaded[0]


def safetensors_files(folder: str) -> list[Path]:
    """The .safetensors files directly in `folder`, a real folder (no symlink: to it or in it)."""
    root = Path(folder)
    if root.is_symlink() or not root.is_dir():
        raise ValueError(f"{folder}: not a folder (or a symlink)")
    files = sorted(path for path in root.iterdir()
                   if path.suffix == ".safetensors" and path.is_file() and not path.is_symlink())
    if not files:
        raise ValueError(f"{folder}: no .safetensors file (weights are never loaded from a pickle)")
    return files
