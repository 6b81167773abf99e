#!/usr/bin/env bash
# One GPU box as a Prefect process work pool: creates (or updates) the pool `gpu-box` and the
# global concurrency limit `gpu` (one slot per GPU), then starts a worker on this box.
# Run it from the repository root on the GPU box, with PREFECT_API_URL pointing at the server.
#
#   PREFECT_API_URL=http://<server>:4200/api deployments/process-pool.sh          # set up + start a worker
#   deployments/process-pool.sh --setup-only                                    # set up, no worker
#
# Environment: POOL (default gpu-box); GPU_SLOTS (default: the GPUs nvidia-smi lists);
# WORKER_NAME (default: this host's name). Safe to run again: the pool is overwritten with the
# same settings and the limit is updated to GPU_SLOTS.
#
# Every flow run is a subprocess of the worker and gets the worker's environment, so export here
# what the flow runs need: POSTTRAIN_REQUEST_KEY (the same key as where `posttrain run` runs:
# the worker then runs only stage requests signed with it, docs/SECURITY.md#signed-stage-requests),
# PREFECT_API_AUTH_STRING (the server's auth string), and for evaluations
# POSTTRAIN_ALLOWED_STORES, POSTTRAIN_ALLOWED_VARIABLES and POSTTRAIN_ALLOWED_ENDPOINTS.
set -euo pipefail

POOL="${POOL:-gpu-box}"
if [[ -z "${GPU_SLOTS:-}" ]]; then
  command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: set GPU_SLOTS" >&2; exit 2; }
  GPU_SLOTS="$(nvidia-smi -L | grep -c '^GPU ' || true)"
fi
[[ "$GPU_SLOTS" =~ ^[0-9]+$ && "$GPU_SLOTS" -gt 0 ]] || { echo "GPU_SLOTS must be a positive integer, got '$GPU_SLOTS'" >&2; exit 2; }
[[ -n "${PREFECT_API_URL:-}" ]] || PREFECT_API_URL="$(prefect config view 2>/dev/null | sed -n "s/^PREFECT_API_URL='\(.*\)'.*/\1/p")"
[[ -n "${PREFECT_API_URL:-}" ]] || echo "warning: PREFECT_API_URL is not set; this uses a temporary local server" >&2

# The pool: `--overwrite` makes this idempotent (an existing pool keeps its name, its queues and its deployments).
prefect work-pool create "$POOL" --type process --overwrite

# GPU slots: stages take `gpus` slots of this limit, so at most GPU_SLOTS GPUs are in use at once.
if prefect gcl inspect gpu >/dev/null 2>&1; then
  prefect gcl update gpu --limit "$GPU_SLOTS" --enable
else
  prefect gcl create gpu --limit "$GPU_SLOTS"
fi
echo "pool $POOL (process), global concurrency limit gpu = $GPU_SLOTS slots"

[[ "${1:-}" == "--setup-only" ]] && exit 0
[[ -n "${POSTTRAIN_REQUEST_KEY:-}" ]] \
  || echo "warning: POSTTRAIN_REQUEST_KEY is not set: this worker runs any stage request the Prefect API hands it" >&2
# The worker runs each flow run as a subprocess on this box; run it under systemd/tmux to keep it up.
exec prefect worker start --pool "$POOL" --type process --name "${WORKER_NAME:-$(hostname)}"
