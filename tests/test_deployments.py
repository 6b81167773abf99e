"""The GPU work pool templates and scripts: what a stage's pod requests, rendered by Prefect's own code.

No server and no cluster: the Kubernetes template is rendered by the Kubernetes worker's job
configuration class (`from_template_and_values`, then `prepare_for_flow_run`), and validated with
the functions Prefect's server applies to work pool templates and to flow-run job variables.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.deploy import K8S_GPU_JOB_TEMPLATE, load_job_template, render_job_template, stage_job_variables
from flows.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = ROOT / "deployments"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


@pytest.fixture(scope="module")
def template():
    return load_job_template()


@pytest.fixture(scope="module")
def lfm2():
    spec, _ = load_spec(ROOT / "pipelines" / "lfm2-gpu.yaml")
    return spec


def pod_spec(rendered: dict) -> dict:
    return rendered["job_manifest"]["spec"]["template"]["spec"]


def container(rendered: dict) -> dict:
    return pod_spec(rendered)["containers"][0]


def flow_run_job_variables(template: dict, job_variables: dict) -> None:
    """Prefect's server check of a deployment flow run's job variables against the pool's schema."""
    from prefect.utilities.schema_tools import validate

    validate(job_variables, template["variables"], raise_on_error=True, preprocess=True,
             ignore_required=False, allow_none_with_default=True)


# --- the template ---------------------------------------------------------------------------------

def test_template_extends_prefects_default_kubernetes_template(template):
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    assert set(default["variables"]["properties"]) <= set(template["variables"]["properties"])
    assert {"gpus", "node_selector", "tolerations", "cpu_request", "memory_request", "shm_size",
            "env_from"} <= set(template["variables"]["properties"])

    def leaves(node, path=()):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from leaves(value, (*path, key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from leaves(value, (*path, i))
        else:
            yield path, node

    ours = dict(leaves(template["job_configuration"]))
    for path, value in leaves(default["job_configuration"]):  # nothing of the default is lost or changed
        assert ours.get(path) == value, path
    job = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert job["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert job["nodeSelector"] == "{{ node_selector }}" and job["tolerations"] == "{{ tolerations }}"


def test_template_validates_as_a_work_pool_base_job_template(template):
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.schema_tools import is_valid_schema, validate

    pool = WorkPoolCreate(name="gpu-k8s", type="kubernetes", base_job_template=template)  # validate_base_job_template
    assert pool.base_job_template == template
    is_valid_schema(template["variables"], preprocess=False)
    # what the server checks on `prefect work-pool create`: the defaults satisfy the schema
    defaults = {name: prop["default"] for name, prop in template["variables"]["properties"].items() if "default" in prop}
    validate(defaults, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True,
             allow_none_with_default=True)
    assert json.loads(K8S_GPU_JOB_TEMPLATE.read_text()) == template  # plain JSON, as --base-job-template reads it


def test_job_variables_are_checked_like_the_server_does(template):
    from prefect.utilities.schema_tools import ValidationError

    flow_run_job_variables(template, {"gpus": 2, "node_selector": H100, "tolerations": [GPU_TAINT],
                                      "shm_size": "16Gi", "env_from": [{"secretRef": {"name": "s3"}}]})
    for bad in ({"gpus": -1}, {"gpus": "2"}, {"node_selector": {"nvidia.com/gpu.count": 8}}, {"tolerations": {}}):
        with pytest.raises(ValidationError):
            flow_run_job_variables(template, bad)


def test_a_process_pool_accepts_and_ignores_the_gpus_job_variable():
    from prefect.workers.process import ProcessWorker

    process = ProcessWorker.get_default_base_job_template()
    flow_run_job_variables(process, {"gpus": 2})  # the server lets it through to a process pool
    rendered = render_job_template(process, {"gpus": 2}, worker_type="process")
    assert "gpus" not in json.dumps(rendered)


# --- stage -> job variables -> pod ----------------------------------------------------------------

def test_stage_job_variables_carry_the_resolved_gpus(lfm2):
    gpus = {stage.id: stage_job_variables(lfm2.resolved(stage)) for stage in lfm2.stages}
    assert gpus["rl"] == {"gpus": 2}  # the stage's own
    assert gpus["sft"] == {"gpus": 1}  # the spec's defaults.gpus
    assert gpus["warm-term"] == {"gpus": 0}


def test_a_two_gpu_stage_requests_two_gpus(template, lfm2):
    rendered = render_job_template(template, stage_job_variables(lfm2.resolved(lfm2.stage("rl"))))
    limits = container(rendered)["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 2}  # cpu/memory limits unset by default: their keys are dropped
    assert "nvidia.com/gpu" not in container(rendered)["resources"].get("requests", {})  # k8s: request = limit
    assert pod_spec(rendered)["nodeSelector"] == {}
    assert pod_spec(rendered)["tolerations"] == [GPU_TAINT]
    assert pod_spec(rendered)["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}]
    assert container(rendered)["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]


def test_a_two_gpu_stage_of_a_minimal_spec(template, tmp_path):
    spec = parse_spec({
        "name": "t", "store": f"file://{tmp_path}", "model": {"base": "tiny-llama"},
        "envs": {"arith": {"kind": "arith", "digits": 2}}, "defaults": {"gpus": 1},
        "stages": [{"id": "warmup", "kind": "synthesize", "env": "arith", "n": 10, "gpus": 0},
                   {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2, "gpus": 2}]})
    rendered = render_job_template(template, stage_job_variables(spec.resolved(spec.stage("sft"))))
    assert container(rendered)["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_placement_comes_from_the_pool_and_is_overridable(template, lfm2):
    variables = stage_job_variables(lfm2.resolved(lfm2.stage("rl")))
    # per flow run (or deployment): job variables replace the pool's defaults
    toleration = {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}
    rendered = render_job_template(template, {**variables, "node_selector": H100, "tolerations": [GPU_TAINT, toleration],
                                              "cpu_request": "16", "memory_request": "128Gi", "shm_size": "32Gi"})
    assert pod_spec(rendered)["nodeSelector"] == H100
    assert pod_spec(rendered)["tolerations"] == [GPU_TAINT, toleration]
    assert container(rendered)["resources"] == {"limits": {"nvidia.com/gpu": 2},
                                                "requests": {"cpu": "16", "memory": "128Gi"}}
    assert pod_spec(rendered)["volumes"][0]["emptyDir"]["sizeLimit"] == "32Gi"
    # per pool: new variable defaults (what deployments/k8s-pool.sh writes from GPU_NODE_SELECTOR & co.)
    pool = json.loads(json.dumps(template))
    pool["variables"]["properties"]["node_selector"]["default"] = H100
    pool["variables"]["properties"]["image"]["default"] = "registry.example.com/posttrain:0.1.0"
    rendered = render_job_template(pool, variables)
    assert pod_spec(rendered)["nodeSelector"] == H100
    assert container(rendered)["image"] == "registry.example.com/posttrain:0.1.0"
    assert container(rendered)["resources"]["limits"]["nvidia.com/gpu"] == 2
    # no tolerations at all
    assert pod_spec(render_job_template(template, {**variables, "tolerations": []}))["tolerations"] == []


def test_a_zero_gpu_stage_requests_zero_gpus(template, lfm2):
    """Documented choice: 0 renders as `nvidia.com/gpu: 0`, which Kubernetes accepts (no device is allocated)."""
    rendered = render_job_template(template, stage_job_variables(lfm2.resolved(lfm2.stage("warm-term"))))
    assert container(rendered)["resources"]["limits"] == {"nvidia.com/gpu": 0}


def test_the_prepared_manifest_is_what_kubernetes_takes(template, lfm2):
    rendered = render_job_template(template, {**stage_job_variables(lfm2.resolved(lfm2.stage("rl"))), "cpu_limit": "32",
                                              "env": {"POSTTRAIN_BUCKET": "runs"}},
                                   flow_run_name="lfm2-agentic-rl")
    manifest = rendered["job_manifest"]
    text = json.dumps(manifest)
    assert "{{" not in text and "null" not in text
    assert manifest["apiVersion"] == "batch/v1" and manifest["kind"] == "Job"
    assert manifest["metadata"]["generateName"] == "lfm2-agentic-rl-"
    assert manifest["spec"]["backoffLimit"] == 0 and manifest["spec"]["ttlSecondsAfterFinished"] == 86400
    c = container(rendered)
    assert c["args"] == ["prefect", "flow-run", "execute"] and c["image"]  # Prefect's image unless set
    assert all(set(item) == {"name", "value"} and isinstance(item["value"], str) for item in c["env"])
    assert {"name": "POSTTRAIN_BUCKET", "value": "runs"} in c["env"]
    for quantities in c["resources"].values():  # resource quantities: JSON ints or strings
        assert all(isinstance(q, (int, str)) and not isinstance(q, bool) for q in quantities.values())
    assert c["resources"]["limits"] == {"cpu": "32", "nvidia.com/gpu": 2}
    assert c["envFrom"] == []


# --- scripts and module ---------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["process-pool.sh", "k8s-pool.sh"])
def test_scripts_parse(script):
    path = DEPLOYMENTS / script
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert path.read_text().startswith("#!/usr/bin/env bash\n")


def test_deploy_module_imports_light():
    code = ("import sys, flows.deploy; heavy = {'torch', 'great_expectations', 'prefect_kubernetes', 'transformers'}; "
            "print(sorted(heavy & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["prefect.yaml", "prefect-k8s.yaml"])
def test_prefect_yaml_declares_the_three_deployments_and_the_served_trigger(name):
    """Both files register post-train, post-train-stage and evaluate-on-checkpoint, and their
    trigger is the one `posttrain serve` serves (flows/triggers.py), as Prefect parses it."""
    import yaml
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

    from flows.triggers import checkpoint_trigger

    document = yaml.safe_load((ROOT / "deployments" / name).read_text())
    by_name = {d["name"]: d for d in document["deployments"]}
    assert {n: d["entrypoint"] for n, d in by_name.items()} == {
        "post-train": "flows/post_train.py:post_train", "post-train-stage": "flows/stage_flow.py:stage_flow",
        "evaluate-on-checkpoint": "flows/evaluate.py:evaluate"}
    [trigger] = by_name["evaluate-on-checkpoint"]["triggers"]
    declared, served = DeploymentEventTrigger.model_validate(trigger), checkpoint_trigger()
    for field in ("match", "expect", "parameters", "posture", "threshold"):
        assert getattr(declared, field) == getattr(served, field), field
    assert by_name["post-train"]["schedules"][0]["cron"] == "0 2 * * *"
    assert len({d["work_pool"]["name"] for d in document["deployments"]}) == 1


def test_posttrain_serve_builds_the_trigger_and_a_scheduled_pipeline():
    """What `posttrain serve --spec SPEC --cron CRON` serves: evaluate-on-checkpoint with the
    checkpoint trigger, and the pipeline as post-train/served on that cron schedule."""
    from flows.triggers import deployments

    evaluate, pipeline = deployments("pipelines/quickstart.yaml", "0 2 * * *", "file:///tmp/store")
    assert (evaluate.flow_name, evaluate.name) == ("evaluate", "evaluate-on-checkpoint")
    [trigger] = evaluate.triggers
    assert trigger.expect == {"posttrain.checkpoint.created"}
    assert trigger.parameters["checkpoint_ref"] == "{{ event.payload.ref }}"
    assert (pipeline.flow_name, pipeline.name) == ("post-train", "served")
    assert pipeline.parameters == {"spec": "pipelines/quickstart.yaml", "store": "file:///tmp/store"}
    [schedule] = pipeline.schedules
    assert schedule.schedule.cron == "0 2 * * *"
