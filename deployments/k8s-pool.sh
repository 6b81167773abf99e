#!/usr/bin/env bash
# A Kubernetes work pool for GPU stages, from deployments/k8s-gpu-job-template.json: each flow run
# becomes a Job whose pod requests `gpus` nvidia.com/gpu (set per stage from the spec). Also creates
# (or updates) the global concurrency limit `gpu` that caps GPU slots across the cluster.
#
#   POSTTRAIN_IMAGE=registry.example.com/posttrain:0.1.0 GPU_SLOTS=16 deployments/k8s-pool.sh
#   deployments/k8s-pool.sh --start-worker    # also run a worker here (needs prefect-kubernetes + kubeconfig)
#
# Environment (each optional except GPU_SLOTS; they become the pool's variable defaults):
#   POOL                 pool name (default gpu-k8s)
#   GPU_SLOTS            GPUs this pool may use at once (the `gpu` global concurrency limit)
#   POSTTRAIN_IMAGE      image of the flow-run pods (built from deployments/Dockerfile.worker)
#   K8S_NAMESPACE        namespace of the Jobs (default: default)
#   K8S_SERVICE_ACCOUNT  service account of the pods (e.g. one bound to an IAM role through IRSA for S3)
#   GPU_NODE_SELECTOR    JSON object, e.g. '{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}'
#   S3_SECRET            name of a Kubernetes Secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (envFrom)
#   WORKER_SECRET        name of a Kubernetes Secret with POSTTRAIN_REQUEST_KEY (the same key as where
#                        `posttrain run` runs: pods then run only stage requests signed with it) and
#                        PREFECT_API_AUTH_STRING, and for evaluations POSTTRAIN_ALLOWED_STORES,
#                        POSTTRAIN_ALLOWED_VARIABLES, POSTTRAIN_ALLOWED_ENDPOINTS (envFrom)
# Safe to run again: the pool is overwritten (run it with the same variables to keep its defaults)
# and the limit is updated to GPU_SLOTS.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
POOL="${POOL:-gpu-k8s}"
PYTHON="${PYTHON:-python3}"
[[ "${GPU_SLOTS:-}" =~ ^[0-9]+$ && "${GPU_SLOTS:-0}" -gt 0 ]] \
  || { echo "set GPU_SLOTS to the number of GPUs this pool may use at once" >&2; exit 2; }

TEMPLATE="$(mktemp "${TMPDIR:-/tmp}/posttrain-k8s-template.XXXXXX.json")"
trap 'rm -f "$TEMPLATE"' EXIT
"$PYTHON" - "$HERE/k8s-gpu-job-template.json" "$TEMPLATE" <<'EOF'
import json, os, sys

template = json.load(open(sys.argv[1]))
props = template["variables"]["properties"]
for variable, env in [("image", "POSTTRAIN_IMAGE"), ("namespace", "K8S_NAMESPACE"),
                      ("service_account_name", "K8S_SERVICE_ACCOUNT")]:
    if os.environ.get(env):
        props[variable]["default"] = os.environ[env]
if os.environ.get("GPU_NODE_SELECTOR"):
    selector = json.loads(os.environ["GPU_NODE_SELECTOR"])
    if not isinstance(selector, dict):
        sys.exit("GPU_NODE_SELECTOR must be a JSON object")
    props["node_selector"]["default"] = selector
secrets = [os.environ[name] for name in ("S3_SECRET", "WORKER_SECRET") if os.environ.get(name)]
if secrets:
    props["env_from"]["default"] = [{"secretRef": {"name": name}} for name in secrets]
json.dump(template, open(sys.argv[2], "w"), indent=2)
EOF
[[ -n "${POSTTRAIN_IMAGE:-}" ]] || echo "warning: POSTTRAIN_IMAGE not set: pods get Prefect's image unless a deployment sets job_variables.image" >&2
[[ -n "${WORKER_SECRET:-}" ]] || echo "warning: WORKER_SECRET not set: pods get no POSTTRAIN_REQUEST_KEY and run any stage request the Prefect API hands them" >&2

prefect work-pool create "$POOL" --type kubernetes --base-job-template "$TEMPLATE" --overwrite

if prefect gcl inspect gpu >/dev/null 2>&1; then
  prefect gcl update gpu --limit "$GPU_SLOTS" --enable
else
  prefect gcl create gpu --limit "$GPU_SLOTS"
fi
echo "pool $POOL (kubernetes), global concurrency limit gpu = $GPU_SLOTS slots"

if [[ "${1:-}" == "--start-worker" ]]; then
  exec prefect worker start --pool "$POOL" --type kubernetes
fi
cat <<EOF
Start a worker in the cluster (Prefect's Helm chart), e.g.:
  helm repo add prefect https://prefecthq.github.io/prefect-helm && helm repo update
  helm install prefect-worker prefect/prefect-worker --namespace ${K8S_NAMESPACE:-default} \\
    --set worker.config.workPool=$POOL --set worker.apiConfig=selfHostedServer \\
    --set worker.selfHostedServerApiConfig.apiUrl=\$PREFECT_API_URL
EOF
