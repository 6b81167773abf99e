"""Every class of bad spec: one line naming the field, exit code 2, nothing written."""

import subprocess
import sys

import pytest
import yaml
from conftest import POSTTRAIN

from flows.cli.main import main

GOOD = {
    "name": "t",
    "store": "file://STORE",
    "envs": {"arith": {"kind": "arith", "digits": 2}},
    "stages": [
        {"id": "warmup", "kind": "synthesize", "env": "arith", "n": 10},
        {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2},
        {"id": "eval", "kind": "evaluate", "checkpoints": ["sft"], "envs": ["arith"], "n": 4},
    ],
}


def write_spec(tmp_path, spec) -> str:
    store = tmp_path / "store"
    text = yaml.safe_dump(spec).replace("STORE", str(store)) if isinstance(spec, dict) else spec
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return str(path)


def with_stage(index, **changes):
    spec = yaml.safe_load(yaml.safe_dump(GOOD))
    spec["stages"][index].update(changes)
    return spec


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.err.strip()


ONPOLICY = {"id": "onpolicy", "kind": "generate", "policy": "sft", "env": "arith", "n": 4}
ALIGN = {"id": "align", "kind": "preference", "policy": "sft", "data": "onpolicy"}
RL = {"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 10}
DISTILL = {"id": "distill", "kind": "distill", "teacher": "sft", "envs": {"arith": 1.0}, "max_steps": 4}

CASES = {
    "unknown key": (with_stage(1, epochz=3), "stages[1].epochz: unknown key"),
    "wrong type": (with_stage(1, max_steps="many"), "stages[1].max_steps: Input should be a valid integer"),
    "unknown stage": (with_stage(1, data="warmpu"), "stages[1].data: unknown stage 'warmpu'"),
    "unknown env": (with_stage(0, env="arithm"), "stages[0].env: unknown env 'arithm' (known: arith)"),
    "checkpoint where a dataset is expected": (
        with_stage(1, data="eval"), "stages[1].data: stage 'eval' produces a evaluation, a dataset is expected here"),
    "dataset where a checkpoint is expected": (
        with_stage(2, checkpoints=["warmup"]),
        "stages[2].checkpoints[0]: stage 'warmup' produces a dataset, a checkpoint is expected here"),
    "unknown stage kind": (with_stage(0, kind="distillation"), "stages[0].kind: unknown kind 'distillation'"),
    "duplicate id": (with_stage(1, id="warmup"), "stages[1].id: duplicate stage id 'warmup'"),
    "bad number": (with_stage(0, n=0), "stages[0].n: Input should be greater than 0"),
    "unknown env kind": ({**GOOD, "envs": {"arith": {"kind": "chess"}}}, "envs.arith.kind: unknown kind 'chess'"),
    "bad env field": ({**GOOD, "envs": {"arith": {"kind": "arith", "digits": 9}}},
                      "envs.arith.digits: Input should be less than or equal to 3"),
    "missing field": ({k: v for k, v in GOOD.items() if k != "envs"}, "envs: missing"),
    "credentials in spec": ({**GOOD, "storage_options": {"secret": "x"}},
                            "storage_options.secret: credentials must come from the environment"),
    "unset env var": ({**GOOD, "storage_options": {"endpoint_url": "${POSTTRAIN_NO_SUCH_VAR}"}},
                      "storage_options.endpoint_url: environment variable POSTTRAIN_NO_SUCH_VAR is not set"),
    "generate policy is a dataset": (
        {**GOOD, "stages": GOOD["stages"] + [{"id": "gen", "kind": "generate", "policy": "warmup", "env": "arith",
                                               "n": 2}]},
        "stages[3].policy: stage 'warmup' produces a dataset, a checkpoint is expected here"),
    "generate nothing": (
        {**GOOD, "stages": GOOD["stages"] + [{"id": "gen", "kind": "generate", "policy": "sft", "env": "arith",
                                               "n": 2, "samples": 0, "greedy": 0}]},
        "stages[3]: Value error, samples + greedy must be at least 1"),
    "preference data not rollouts": (
        {**GOOD, "stages": GOOD["stages"] + [{"id": "align", "kind": "preference", "policy": "sft",
                                               "data": "warmup"}]},
        "stages[3].data: stage 'warmup' produces a dataset, a rollouts or a preference dataset is expected here"),
    "preference from samples 0": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY | {"samples": 0, "greedy": 2}, ALIGN]},
        "stages[3].samples: must be at least 1, generate stage 'onpolicy' feeds preference stage 'align'"),
    "preference from one completion": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY | {"samples": 1, "greedy": 0}, ALIGN]},
        "stages[3]: samples + greedy must be at least 2, generate stage 'onpolicy' feeds preference stage"),
    "preference beta 0": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"beta": 0}]},
        "stages[4].beta: Input should be greater than 0"),
    "preference beta negative": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"beta": -0.1}]},
        "stages[4].beta: Input should be greater than 0"),
    "preference unknown method": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"method": "rso"}]},
        "stages[4].method: Input should be 'dpo', 'ln_dpo', 'ipo', 'kto', 'orpo', 'simpo' or 'cpo'"),
    "preference cpo_alpha for dpo": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"cpo_alpha": 0.5}]},
        "stages[4]: Value error, cpo_alpha is for method cpo (method is dpo)"),
    "preference kto weight for orpo": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"method": "orpo", "desirable_weight": 1.3}]},
        "stages[4]: Value error, desirable_weight is for method kto (method is orpo)"),
    "preference simpo_gamma for cpo": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"method": "cpo", "simpo_gamma": 1.0}]},
        "stages[4]: Value error, simpo_gamma is for method simpo (method is cpo)"),
    "preference kto batch of one": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"method": "kto", "batch_size": 1}]},
        "stages[4]: Value error, batch_size: method kto needs at least 2 rows a step"),
    "preference kto held out": (
        {**GOOD, "stages": GOOD["stages"] + [ONPOLICY, ALIGN | {"method": "kto", "eval_fraction": 0.1}]},
        "stages[4]: Value error, eval_fraction: a held-out loss is measured for paired methods; method kto has none"),
    "preference online simpo": (
        {**GOOD, "stages": GOOD["stages"] + [{"id": "align", "kind": "preference", "policy": "sft", "mode": "online",
                                               "envs": {"arith": 1.0}, "max_steps": 2, "method": "simpo"}]},
        "stages[3]: Value error, mode: online trains method dpo, ln_dpo or ipo (method is simpo)"),
    "preference kto on sft data": (
        {**GOOD, "stages": GOOD["stages"] + [ALIGN | {"method": "kto", "data": "warmup"}]},
        "stages[3].data: stage 'warmup' produces a dataset, a rollouts or a preference dataset or a unpaired "
        "preference dataset is expected here"),
    "rl unknown algorithm": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"algorithm": "ppo"}]},
        "stages[3].algorithm: Input should be 'grpo' or 'steppo'"),
    "rl steppo with a token-level ratio": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"algorithm": "steppo", "importance_sampling_level": "token"}]},
        "stages[3]: Value error, importance_sampling_level: token: steppo's ratio is one per step (sequence"),
    "rl unknown importance sampling level": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"importance_sampling_level": "sequence_token"}]},
        "stages[3].importance_sampling_level: Input should be 'token' or 'sequence'"),
    "distill from an endpoint teacher": (
        {**GOOD, "stages": GOOD["stages"] + [DISTILL | {"teacher": {"endpoint": "http://h:8000/v1", "model": "m"}}]},
        "stages[3].teacher: Value error, an endpoint cannot be a teacher here; give a checkpoint stage's id: the JSD "
        "compares the teacher's whole next-token distribution"),
    "distill off-policy share without data": (
        {**GOOD, "stages": GOOD["stages"] + [DISTILL | {"lmbda": 0.5}]},
        "stages[3]: Value error, lmbda (0.5) below 1 trains that share of the steps on a dataset's own completions: "
        "give data (a dataset stage), or lmbda: 1"),
    "distill data never read": (
        {**GOOD, "stages": GOOD["stages"] + [DISTILL | {"data": "warmup"}]},
        "stages[3]: Value error, data is read only by off-policy steps, and lmbda: 1 makes every step on-policy"),
    "distill teacher is the student": (
        {**GOOD, "stages": GOOD["stages"] + [DISTILL | {"student": "sft"}]},
        "stages[3]: Value error, teacher and student are the same checkpoint ('sft'): nothing to distil"),
    "distill teacher not a checkpoint": (
        {**GOOD, "stages": GOOD["stages"] + [DISTILL | {"teacher": "warmup"}]},
        "stages[3].teacher: stage 'warmup' produces a dataset, a checkpoint is expected here"),
    "distill on several gpus": (
        {**GOOD, "stages": GOOD["stages"] + [DISTILL | {"gpus": 2}]},
        "stages[3].gpus: a distill stage samples and trains one model in one process; it has gpus 2: give it gpus: 1"),
    "rl overlong buffer beyond the budget": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"max_tokens": 32, "overlong": {"buffer": 32}}]},
        "stages[3]: Value error, overlong.buffer (32) must be below max_tokens (32)"),
    "rl unknown dynamic sampling field": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"dynamic_sampling": {"rounds": 3}}]},
        "stages[3].dynamic_sampling.rounds: unknown key"),
    "calc env with one operand": (
        {**GOOD, "envs": {**GOOD["envs"], "calc": {"kind": "calc", "operands": 1}}},
        "envs.calc.operands: Input should be greater than or equal to 2"),
    "generate on a cod env": (
        {**GOOD, "envs": {**GOOD["envs"], "packs": {"kind": "cod"}},
         "stages": GOOD["stages"] + [ONPOLICY | {"env": "packs"}]},
        "stages[3].env: env 'packs' (cod) restarts its context for every task of a pack; only an rl stage "
        "with algorithm: steppo can train on it"),
    "grpo on a cod env": (
        {**GOOD, "envs": {**GOOD["envs"], "packs": {"kind": "cod"}},
         "stages": GOOD["stages"] + [RL | {"envs": {"arith": 1.0, "packs": 1.0}}]},
        "stages[3].envs.packs: env 'packs' (cod) restarts its context"),
    "rl server rollout without its model": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"rollout": {"backend": "server", "endpoint": "http://h:8000/v1"}}]},
        "stages[3].rollout.model: missing"),
    "rl local rollout with an endpoint": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"rollout": {"endpoint": "http://h:8000/v1"}}]},
        "stages[3].rollout: Value error, endpoint is for backend server (backend is local)"),
    "rl server rollout without a sync folder": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"rollout": {"backend": "server", "endpoint": "http://h:8000/v1",
                                                                "model": "m"}}]},
        "stages[3].rollout: Value error, sync_folder: an rl stage on a server publishes its weights there"),
    "rl rollout of an unknown backend": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"rollout": {"backend": "gpu"}}]},
        "stages[3].rollout.backend: unknown backend 'gpu' (expected one of 'local', 'server')"),
    "rl rollout as a string": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"rollout": "server"}]},
        "stages[3].rollout: expected a mapping with a backend, got 'server'"),
    "evaluate server rollout with a sync folder": (
        with_stage(2, rollout={"backend": "server", "endpoint": "http://h:8000/v1", "model": "m",
                               "sync_folder": "/tmp/s"}),
        "stages[2].rollout: Value error, sync_folder: only an rl stage publishes weights"),
    "evaluate server rollout over two checkpoints": (
        with_stage(2, checkpoints=["sft", "sft"], rollout={"backend": "server", "endpoint": "http://h:8000/v1",
                                                            "model": "m"}),
        "stages[2]: Value error, rollout: a server serves one model"),
    "rl asynchronous on the local engine": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"asynchronous": {"max_staleness": 1}}]},
        "stages[3]: Value error, asynchronous: needs rollout.backend server"),
    "rl staleness below the sync interval": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"asynchronous": {"max_staleness": 1}, "rollout": {
            "backend": "server", "endpoint": "http://h:8000/v1", "model": "m", "sync_folder": "/tmp/s",
            "sync_every": 4}}]},
        "stages[3]: Value error, asynchronous.max_staleness (1) must be at least rollout.sync_every - 1 (3)"),
    "rl asynchronous on two gpus": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"asynchronous": {"max_staleness": 1}, "gpus": 2, "rollout": {
            "backend": "server", "endpoint": "http://h:8000/v1", "model": "m", "sync_folder": "/tmp/s"}}]},
        "stages[3].asynchronous: runs in one process (its rollouts overlap the update's collectives), this stage "
        "has gpus 2: give it gpus: 1, or drop asynchronous"),
    "rl asynchronous on two gpus from the defaults": (
        {**GOOD, "defaults": {"gpus": 2}, "stages": GOOD["stages"] + [RL | {
            "asynchronous": {"max_staleness": 1}, "rollout": {"backend": "server", "endpoint": "http://h:8000/v1",
                                                              "model": "m", "sync_folder": "/tmp/s"}}]},
        "stages[3].asynchronous: runs in one process (its rollouts overlap the update's collectives), this stage "
        "has gpus 2 (defaults.gpus): give it gpus: 1, or drop asynchronous"),
    "rl sync folder relative": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"rollout": {"backend": "server", "endpoint": "http://h:8000/v1",
                                                                "model": "m", "sync_folder": "shared/sync"}}]},
        "stages[3].rollout: Value error, sync_folder: 'shared/sync' is relative; the trainer and the server each run "
        "in their own folder, so give the absolute path of a folder both read"),
    "rl importance cap zero": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"importance_cap": 0}]},
        "stages[3].importance_cap: Input should be greater than 0"),
    "cod credit with grpo": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"credit": "cod"}]},
        "stages[3]: Value error, credit: cod"),
    "unknown env kind lists the kinds": (
        {**GOOD, "envs": {**GOOD["envs"], "box": {"kind": "shell"}}},
        "envs.box.kind: unknown kind 'shell' (expected one of 'arith', 'calc', 'search', 'cod', 'openclaw', "
        "'rlm', 'terminal', 'dataset', 'mcp')"),
    "missing terminal task folder": (
        {**GOOD, "envs": {**GOOD["envs"], "term": {"kind": "terminal", "tasks": "/nonexistent/tasks"}}},
        "envs.term.tasks: /nonexistent/tasks: no such task folder"),
    "terminal tasks and generated both": (
        {**GOOD, "envs": {**GOOD["envs"], "term": {"kind": "terminal", "tasks": "t", "generated": {}}}},
        "envs.term: Value error, tasks and generated: give one (task folders, or the generated families)"),
    "unknown generated family": (
        {**GOOD, "envs": {**GOOD["envs"], "claw": {"kind": "openclaw", "generated": {"families": ["juggle"]}}}},
        "envs.claw.generated.families[0]: Input should be 'write-file', "),
    "generated family beyond max_turns": (
        {**GOOD, "envs": {**GOOD["envs"], "term": {"kind": "terminal", "max_turns": 3, "generated": {"train": 2}}}},
        "envs.term.max_turns: 3 is fewer than the fix-script family's oracle needs (4 actions)"),
    "evaluation baseline not among its checkpoints": (
        with_stage(2, baseline="warmup"), "stages[2]: Value error, baseline: 'warmup' is not one of checkpoints (sft)"),
    "rl env weight 0": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"envs": {"arith": 0}}]},
        "stages[3].envs.arith: Input should be greater than 0"),
    "rl unknown env": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"envs": {"arith": 1.0, "chess": 1.0}}]},
        "stages[3].envs.chess: unknown env 'chess'"),
    "rl group of one": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"group_size": 1}]},
        "stages[3].group_size: Input should be greater than or equal to 2"),
    "rl clip range inverted": (
        {**GOOD, "stages": GOOD["stages"] + [RL | {"epsilon_low": 0.3, "epsilon_high": 0.2}]},
        "stages[3]: Value error, epsilon_high (0.2) must be at least epsilon_low (0.3)"),
    "evaluation unknown env": (
        {**GOOD, "evaluation": {"on_new_checkpoint": True, "envs": ["arith", "chess"]}},
        "evaluation.envs[1]: unknown env 'chess' (known: arith)"),
    "evaluation of an unknown stage": (
        {**GOOD, "evaluation": {"on_new_checkpoint": True, "stages": ["sft", "rl"]}},
        "evaluation.stages[1]: unknown stage 'rl'"),
    "evaluation of a stage without checkpoints": (
        {**GOOD, "evaluation": {"on_new_checkpoint": True, "stages": ["warmup"]}},
        "evaluation.stages[0]: stage 'warmup' makes no checkpoints"),
    "evaluation unknown key": ({**GOOD, "evaluation": {"on_new_checkpoints": True}},
                               "evaluation.on_new_checkpoints: unknown key"),
    "judge without a model": (
        {**GOOD, "evaluation": {"judge": {"endpoint": "http://127.0.0.1:8000/v1"}}}, "evaluation.judge.model: missing"),
    "judge endpoint not http": (
        with_stage(2, judge={"endpoint": "ftp://judge", "model": "j"}),
        "stages[2].judge.endpoint: String should match pattern"),
    "workers deployment not flow/name": (
        {**GOOD, "workers": {"deployment": "post-train-stage"}},
        "workers.deployment: String should match pattern"),
    "unknown tracker": (with_stage(1, report_to=["comet"]),
                        "stages[1].report_to[0]: Input should be 'mlflow', 'tensorboard' or 'wandb'"),
    "tracker on a stage that does not train": (with_stage(0, report_to=["mlflow"]), "stages[0].report_to: unknown key"),
    "unknown tracker in defaults": ({**GOOD, "defaults": {"report_to": ["neptune"]}},
                                    "defaults.report_to[0]: Input should be 'mlflow', 'tensorboard' or 'wandb'"),
    "mlflow_uri with credentials": (
        with_stage(1, mlflow_uri="https://user:pw@mlflow.example"),
        "stages[1].mlflow_uri: the URL holds credentials (user:password@ or a secret-looking query parameter such as "
        "api_key); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, in the "
        "environment"),
    "mlflow_uri with credentials in defaults": (
        {**GOOD, "defaults": {"mlflow_uri": "https://token@mlflow.example"}},
        "defaults.mlflow_uri: the URL holds credentials"),
    "micro batch of 0": (with_stage(1, micro_batch_size=0), "stages[1].micro_batch_size: Input should be greater than 0"),
    "unknown mixed precision": (with_stage(1, mixed_precision="fp8"),
                                "stages[1].mixed_precision: Input should be 'no', 'bf16' or 'fp16'"),
    "mixed precision against the weights' precision": (
        {**with_stage(1, mixed_precision="fp16"), "model": {"dtype": "bfloat16"}},
        "stages[1].mixed_precision: fp16 autocast over bfloat16 weights (model.dtype): use the weights' own "
        "precision, or float32 weights"),
    "unknown model device": ({**GOOD, "model": {"device": "tpu"}}, "model.device: Input should be 'auto' or 'cpu'"),
    "missing accelerate config": (with_stage(1, accelerate_config="nowhere.yaml", gpus=2),
                                  "stages[1].accelerate_config: no file 'nowhere.yaml' (relative paths start at the "
                                  "spec's folder)"),
    "not a mapping": ("- just\n- a list\n", "spec: expected a mapping at the top level, got list"),
    "bad yaml": ("name: t\nstages: [\n", "bad YAML"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_spec_is_one_line_exit_2_nothing_written(case, tmp_path, capsys):
    spec, message = CASES[case]
    path = write_spec(tmp_path, spec)
    for command in ("validate", "run"):
        code, err = run_cli(capsys, command, path)
        assert code == 2
        assert message in err, err
        assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("text, gpus, message", [
    ("distributed_type: FSDP\n", 1, "stages[1].accelerate_config: an accelerate config (FSDP, DeepSpeed) shares a stage "
                                    "among processes: it needs gpus of 2 or more, this stage has 1"),
    ("- FSDP\n", 2, "stages[1].accelerate_config: 'fsdp.yaml' is not an accelerate config (a YAML mapping)"),
    ("a: [\n", 2, "stages[1].accelerate_config: 'fsdp.yaml' is not YAML"),
])
def test_a_bad_accelerate_config_is_one_line(text, gpus, message, tmp_path, capsys):
    (tmp_path / "fsdp.yaml").write_text(text)
    code, err = run_cli(capsys, "validate", write_spec(tmp_path, with_stage(1, accelerate_config="fsdp.yaml", gpus=gpus)))
    assert code == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("tracker", ["mlflow", "tensorboard", "wandb"])
def test_a_tracker_whose_package_is_missing_names_its_extra(tracker, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, tracker, None)  # how Python marks a module that cannot be imported
    message = f"{tracker} is not installed; pip install 'posttrain[{tracker}]'"
    code, err = run_cli(capsys, "validate", write_spec(tmp_path, with_stage(1, report_to=["tensorboard", tracker])))
    assert code == 2 and err == f"error: stages[1].report_to: {message}"
    code, err = run_cli(capsys, "validate", write_spec(tmp_path, {**GOOD, "defaults": {"report_to": [tracker]}}))
    assert code == 2 and err == f"error: defaults.report_to: {message}"


def test_cycle_is_reported_with_its_path(tmp_path, capsys):
    spec = with_stage(1, policy="sft2")
    spec["stages"].append({"id": "sft2", "kind": "sft", "data": "warmup", "policy": "sft"})
    code, err = run_cli(capsys, "validate", write_spec(tmp_path, spec))
    assert code == 2 and "cycle sft -> sft2 -> sft" in err


def test_unreadable_file(tmp_path, capsys):
    code, err = run_cli(capsys, "validate", str(tmp_path / "missing.yaml"))
    assert code == 2 and err == f"error: {tmp_path / 'missing.yaml'}: cannot read spec file (No such file or directory)"


def test_unreachable_store_is_refused_before_anything_runs(tmp_path, capsys, s3_endpoint):
    spec = {**GOOD, "store": "s3://no-such-bucket/p", "storage_options": {"endpoint_url": s3_endpoint}}
    code, err = run_cli(capsys, "run", write_spec(tmp_path, spec))
    assert code == 2 and err == "error: store: bucket 'no-such-bucket' does not exist"


def test_status_and_ls_open_the_store_of_a_spec_with_its_options(tmp_path, capsys, s3_endpoint):
    path = write_spec(tmp_path, {**GOOD, "store": "s3://no-such-bucket/p",
                                 "storage_options": {"endpoint_url": s3_endpoint}})
    for command in (["status"], ["status", "some-run"], ["ls"]):
        code, err = run_cli(capsys, *command, "--spec", path)
        assert code == 2 and err == "error: store: bucket 'no-such-bucket' does not exist"
    code, err = run_cli(capsys, "ls", "--spec", str(tmp_path / "nope.yaml"))
    assert code == 2 and err == f"error: {tmp_path / 'nope.yaml'}: cannot read spec file (No such file or directory)"


def test_a_store_of_an_unknown_protocol_is_one_line(tmp_path, capsys):
    code, err = run_cli(capsys, "run", write_spec(tmp_path, {**GOOD, "store": "nosuch://bucket/p"}))
    assert code == 2 and err == "error: store: cannot open nosuch://bucket/p: Protocol not known: nosuch"
    code, err = run_cli(capsys, "status", "--store", "nosuch://bucket/p")
    assert code == 2 and err == "error: store: cannot open nosuch://bucket/p: Protocol not known: nosuch"


def test_workers_need_a_prefect_server(tmp_path, capsys):
    path = write_spec(tmp_path, {**GOOD, "workers": {"deployment": "post-train-stage/gpu-box"}})
    code, err = run_cli(capsys, "run", path)
    assert code == 2 and err == ("error: workers.deployment: stages go to 'post-train-stage/gpu-box' on a Prefect "
                                 "server, but PREFECT_API_URL is not set")
    assert not (tmp_path / "store").exists()


def test_real_process_prints_no_traceback(tmp_path):
    path = write_spec(tmp_path, with_stage(1, data="warmpu"))
    result = subprocess.run([POSTTRAIN, "validate", path], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: stages[1].data: unknown stage 'warmpu'"
    assert "Traceback" not in result.stdout + result.stderr


def test_validate_prints_dag_with_resolved_defaults(tmp_path, capsys):
    spec = yaml.safe_load(yaml.safe_dump(GOOD))
    spec["defaults"] = {"retries": 4, "timeout_seconds": 99, "report_to": ["tensorboard"]}
    spec["stages"][1]["retries"] = 0
    code = main(["validate", write_spec(tmp_path, spec)])
    out = capsys.readouterr().out
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "<-" in line}
    assert "retries=4" in lines["warmup"] and "timeout=99s" in lines["warmup"]
    assert "retries=0" in lines["sft"] and "<- warmup" in lines["sft"]
    assert "report_to=tensorboard" in lines["sft"] and "report_to" not in lines["warmup"]  # only training reports
    assert "<- sft" in lines["eval"]
    assert not (tmp_path / "store").exists()


def test_kinds_without_an_accelerator_take_no_gpu_from_the_defaults(tmp_path, capsys):
    spec = {**GOOD, "defaults": {"gpus": 1},
            "envs": {**GOOD["envs"], "qa": {"kind": "dataset", "source": "qa.jsonl", "rewards": [
                {"function": "posttrain.rewards:exact_match"}]}},
            "stages": [*GOOD["stages"], {"id": "more", "kind": "synthesize", "env": "arith", "n": 4, "gpus": 1}]}
    (tmp_path / "qa.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
    code = main(["validate", write_spec(tmp_path, spec)])
    out = capsys.readouterr().out
    assert code == 0
    gpus = {line.split()[0]: line.split("gpus=")[1].split()[0] for line in out.splitlines() if "<-" in line}
    assert gpus == {"warmup": "0", "qa-data": "0", "sft": "1", "eval": "1", "more": "1"}  # a stage's own gpus stay


def test_quickstart_spec_is_valid():
    from flows.spec import load_spec

    spec, _ = load_spec("pipelines/quickstart.yaml")
    assert [s.kind for s in spec.stages] == ["synthesize", "sft", "generate", "preference", "rl", "evaluate"]
    assert spec.evaluation.evaluates("rl") and not spec.evaluation.evaluates("sft")  # rl's learning curve only


def test_agentic_specs_are_valid_and_cover_every_agentic_env(monkeypatch):
    from flows.spec import load_spec

    monkeypatch.setenv("POSTTRAIN_BUCKET", "b")
    for path in ("pipelines/agentic.yaml", "pipelines/lfm2-gpu.yaml"):
        spec, _ = load_spec(path)
        assert {config.kind for config in spec.envs.values()} == {"terminal", "search", "rlm", "openclaw", "cod"}
        rl = next(stage for stage in spec.stages if stage.kind == "rl")
        assert rl.algorithm == "steppo" and set(rl.envs) == set(spec.envs)


def test_a_bad_task_toml_is_named_with_its_line(tmp_path, capsys):
    task = tmp_path / "tasks" / "count-lines"
    for path, text in {"instruction.md": "Count the lines.", "tests/test.sh": "exit 0", "solution/solve.sh": "wc -l f",
                       "task.toml": '[agent]\ntimeout_sec = "5\n'}.items():
        (task / path).parent.mkdir(parents=True, exist_ok=True)
        (task / path).write_text(text)
    spec = {**GOOD, "envs": {**GOOD["envs"], "term": {"kind": "terminal", "tasks": str(tmp_path / "tasks")}}}
    code, err = run_cli(capsys, "validate", write_spec(tmp_path, spec))
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: envs.term.tasks: {task}/task.toml: invalid TOML (line 2")


def learned_rewards_spec(reward: dict, **rl) -> dict:
    """A dataset env scored by a reward model (or a judge) and an rl stage on it."""
    from conftest import ROOT

    return {"name": "t", "store": "file://STORE", "model": {"base": "tiny-llama"},
            "envs": {"sums": {"kind": "dataset", "source": str(ROOT / "examples" / "prompts.jsonl"),
                              "rewards": [{"function": "posttrain.rewards:answer_format"}, reward]}},
            "stages": [{"id": "prefs", "kind": "dataset", "source": str(ROOT / "examples" / "preferences.jsonl")},
                       {"id": "sft", "kind": "sft", "data": "chats", "max_steps": 2},
                       {"id": "rm", "kind": "reward_model", "policy": "sft", "data": "prefs", "max_steps": 2},
                       {"id": "rl", "kind": "rl", "policy": "sft", "envs": {"sums": 1.0}, "steps": 2, **rl},
                       {"id": "chats", "kind": "dataset", "source": str(ROOT / "examples" / "chats.jsonl")}]}


def with_checked_env(**fields) -> dict:
    """learned_rewards_spec with a second env over the same rows, scored by a check."""
    spec = learned_rewards_spec({"reward_model": "rm"})
    spec["envs"]["checked"] = {**spec["envs"]["sums"], "rewards": [{"function": "posttrain.rewards:answer_format"}],
                               **fields}
    return spec


@pytest.mark.parametrize("spec, message", [
    (learned_rewards_spec({"reward_model": "sft"}),
     "envs.sums.rewards[1].reward_model: stage 'sft' produces a checkpoint, a reward model is expected here"),
    (learned_rewards_spec({"reward_model": "nope"}), "envs.sums.rewards[1].reward_model: unknown stage 'nope'"),
    (learned_rewards_spec({"reward_model": "rm"}, policy="rm"),
     "stages[3].policy: stage 'rm' produces a reward model, a checkpoint is expected here"),
    (learned_rewards_spec({"reward_model": "rm", "output": "raw"}),
     "envs.sums.rewards[1].output: Input should be 'sigmoid' or 'logit'"),
    (learned_rewards_spec({"judge": {"endpoint": "http://127.0.0.1:9/v1", "model": "j", "prompt": "Rate {prompt}"}}),
     "envs.sums.rewards[1].judge: Value error, prompt: a template with {completion}"),
    (learned_rewards_spec({"judge": {"endpoint": "http://127.0.0.1:9/v1", "model": "j", "min_score": 5,
                                     "max_score": 5}}),
     "envs.sums.rewards[1].judge: Value error, max_score (5.0) must be above min_score (5.0)"),
    (learned_rewards_spec({"reward_model": "rm"}, advantage="rloo", algorithm="steppo"),
     "stages[3]: Value error, advantage: rloo gives one advantage per trajectory; use algorithm: grpo"),
    (learned_rewards_spec({"reward_model": "rm"}, advantage="rloo", scale_rewards="group"),
     "stages[3]: Value error, scale_rewards: group divides by each group's std (GRPO); with advantage: rloo"),
    (learned_rewards_spec({"weight": 1.0}),
     "envs.sums.rewards[1]: a reward names its `function`, `reward_model` or `judge`"),
    (with_checked_env(held_out_as="summs"),
     "envs.checked.held_out_as: 'summs' is not another env of task rows (those: sums)"),
], ids=["reward_model is a checkpoint", "unknown reward_model", "reward model as a policy", "reward_model output",
        "judge prompt without completion", "judge score range", "rloo with steppo", "rloo with group scaling",
        "reward without a source", "held_out_as names no env"])
def test_bad_learned_reward_spec_is_one_line_exit_2(spec, message, tmp_path, capsys):
    path = write_spec(tmp_path, spec)
    for command in ("validate", "run"):
        code, err = run_cli(capsys, command, path)
        assert code == 2, err
        assert message in err, err
        assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "store").exists()


def test_check_endpoints_reaches_a_dataset_envs_judge(tmp_path, capsys):
    from conftest import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    path = write_spec(tmp_path, learned_rewards_spec({"judge": {"endpoint": url, "model": "j"}}))
    code, err = run_cli(capsys, "validate", "--check-endpoints", path)
    assert code == 2 and err.startswith(f"error: envs.sums.rewards[1].judge: {url}: cannot reach the endpoint"), err
    assert len(err.splitlines()) == 1
