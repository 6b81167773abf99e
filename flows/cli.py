"""`posttrain` command line: run | validate | status | eval | serve | serve-model | lineage | verify |
contracts | envs | sandbox."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from data_contracts.config import DATASET_KINDS

DEFAULT_STORE = "file://.posttrain/store"
_QUIET_DEFAULTS = {
    "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GX_ANALYTICS_ENABLED": "False",
    "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
    # Prefect gives its temporary server 20 s to start, too little on a busy 2-core machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


def _store(uri: str, storage_options: dict | None = None):
    from artifacts.store import Store, StoreError

    try:
        store = Store(uri, storage_options)
        store.check_reachable()
    except StoreError as exc:
        raise UserError(f"store: {exc}") from None
    return store


def _check_prefect_api() -> str | None:
    """The Prefect API of PREFECT_API_URL if one is named (None: ephemeral mode); a named server
    that does not answer is bad input, before anything runs."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if api is None:
        return None
    import httpx

    try:
        httpx.get(f"{api.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"PREFECT_API_URL {api}: the Prefect server does not answer ({reason})") from None
    return api


def _load(path: str):
    from flows.spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as exc:
        raise UserError(str(exc)) from None


def cmd_validate(args) -> int:
    from flows.report import print_dag

    spec, _ = _load(args.spec)
    print_dag(spec)
    return 0


def cmd_run(args) -> int:
    from flows.report import print_run_report

    spec, text = _load(args.spec)
    store = _store(args.store or spec.store, spec.storage_options)
    api = _check_prefect_api()
    if spec.workers is not None and api is None:
        raise UserError(f"workers.deployment: stages go to {spec.workers.deployment!r} on a Prefect server, "
                        "but PREFECT_API_URL is not set")

    from flows.post_train import INLINE_EVALUATION, new_run_id, post_train, save_spec

    spec_hash = save_spec(store, text)
    run_id = new_run_id(spec.name)
    print(f"run {run_id}  (store {store.uri})", flush=True)
    if spec.evaluation.on_new_checkpoint:
        print(INLINE_EVALUATION if api is None else
              f"evaluation.on_new_checkpoint: checkpoint events go to {api}; the evaluate-on-checkpoint "
              "deployment (posttrain serve, or deployments/prefect.yaml) evaluates them", flush=True)
    state = post_train.with_options(flow_run_name=run_id)(spec.model_dump(mode="json"), store.uri, run_id,
                                                          spec_hash, return_state=True)
    summary_path = store.path("runs", f"{run_id}.json")
    if not store.exists(summary_path):
        print(f"run {run_id} ended {state.name} before its first stage: {state.message}", file=sys.stderr)
        return 1
    summary = store.read_json(summary_path)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2, sort_keys=True))
    print_run_report(summary)
    return 0 if summary["state"] == "completed" else 1


def cmd_status(args) -> int:
    from flows.leaderboard import evaluations
    from flows.report import print_run_list, print_run_status

    store = _store(args.store)
    if args.run_id:
        path = store.path("runs", f"{args.run_id}.json")
        if not store.exists(path):
            raise UserError(f"run_id: no run {args.run_id!r} in {store.uri}")
        summary = store.read_json(path)
        print_run_status(summary, evaluations(store, summary["pipeline"]))
    else:
        print_run_list(store, lambda pipeline: evaluations(store, pipeline))
    return 0


def cmd_eval(args) -> int:
    from flows.eval_cli import run_eval
    from flows.evaluate import EvaluationInputError

    if args.endpoint:
        return _eval_endpoint(args)
    if not args.ref:
        raise UserError("ref: name a checkpoint (name@version), or an endpoint with --endpoint and --model")
    store = _store(args.store)
    _check_prefect_api()
    try:
        return run_eval(store, args.ref, args.env, args.n, args.max_new_tokens)
    except EvaluationInputError as exc:
        raise UserError(str(exc)) from None


def _eval_endpoint(args) -> int:
    from flows.eval_cli import run_endpoint_eval
    from flows.evaluate import EvaluationInputError
    from tasks.endpoint_policy import EndpointError

    if args.ref:
        raise UserError("ref: evaluate a checkpoint or an endpoint, not both (serve the checkpoint with serve-model)")
    if not args.model or not args.spec:
        raise UserError(f"--endpoint: also name --model (what {args.endpoint} serves) and --spec (the envs)")
    spec, _ = _load(args.spec)
    try:
        return run_endpoint_eval(spec, args.env, args.n, args.max_new_tokens, args.endpoint, args.model)
    except (EvaluationInputError, EndpointError) as exc:
        raise UserError(str(exc).splitlines()[0]) from None


def cmd_serve(args) -> int:
    from flows.triggers import serve

    if args.spec:
        _load(args.spec)
    if _check_prefect_api() is None:
        raise UserError("PREFECT_API_URL: `posttrain serve` needs a Prefect server to receive events "
                        "(start one with `prefect server start`, then set PREFECT_API_URL=http://127.0.0.1:4200/api)")
    if args.cron and not args.spec:
        raise UserError("--cron: schedules a pipeline; name its spec with --spec")
    serve(args.spec, args.cron, args.store)
    return 0


def cmd_serve_model(args) -> int:
    from flows.serve_model_cli import ServeModelInputError, serve_model

    store = _store(args.store)
    try:
        return serve_model(args.ref, store.uri, args.host, args.port, args.name)
    except ServeModelInputError as exc:
        raise UserError(str(exc)) from None


def _ref(text: str):
    from artifacts.refs import BadRef, Ref

    try:
        return Ref.parse(text)
    except BadRef as exc:
        raise UserError(f"ref: {exc}") from None


def cmd_lineage(args) -> int:
    from artifacts.lineage import lineage_lines
    from artifacts.store import StoreError

    store = _store(args.store)
    try:
        print("\n".join(lineage_lines(store, _ref(args.ref))))
    except StoreError as exc:
        raise UserError(f"ref: {exc}") from None
    return 0


def cmd_verify(args) -> int:
    from artifacts.store import StoreError

    store, ref = _store(args.store), _ref(args.ref)
    try:
        problems = store.verify(ref)
    except StoreError as exc:
        raise UserError(f"ref: {exc}") from None
    if problems:
        print(f"{ref}: TAMPERED")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"{ref}: ok ({len(store.manifest(ref)['files'])} files match their manifest)")
    return 0


def cmd_contracts_check(args) -> int:
    from flows.contracts_cli import ContractInputError, check

    spec = _load(args.spec)[0] if args.spec else None
    try:
        return check(args.path, args.kind, spec)
    except ContractInputError as exc:
        raise UserError(str(exc)) from None


def cmd_contracts_docs(args) -> int:
    from artifacts.store import StoreError
    from flows.contracts_cli import ContractInputError, docs

    store, ref = _store(args.store), _ref(args.ref)
    try:
        page = docs(store, ref, args.out)
    except (ContractInputError, StoreError) as exc:
        raise UserError(f"{exc}" if isinstance(exc, ContractInputError) else f"ref: {exc}") from None
    print(f"Data Docs for {ref}: {page}")
    return 0


def cmd_envs_check(args) -> int:
    from flows.envs_cli import EnvInputError, check

    spec = _load(args.spec)[0] if args.spec else None
    try:
        return check(args.kind, args.tasks, spec)
    except EnvInputError as exc:
        raise UserError(str(exc)) from None


def cmd_sandbox(args) -> int:
    from flows.envs_cli import EnvInputError, sandbox

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return sandbox(command, args.files, args.python)
    except EnvInputError as exc:
        raise UserError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Declarative LLM post-training on Prefect.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a pipeline spec as a Prefect flow")
    run.add_argument("spec")
    run.add_argument("--store", help="store URI (overrides the spec's `store`)")
    run.add_argument("--summary-json", help="also write the run summary to this file")
    run.set_defaults(func=cmd_run)
    validate = commands.add_parser("validate", help="check a spec and print its stage DAG")
    validate.add_argument("spec")
    validate.set_defaults(func=cmd_validate)
    status = commands.add_parser("status", help="recent runs, or one run's stages")
    status.add_argument("run_id", nargs="?")
    status.add_argument("--store", default=DEFAULT_STORE)
    status.set_defaults(func=cmd_status)
    contracts = commands.add_parser("contracts", help="data contracts by hand").add_subparsers(
        dest="contracts_command", required=True)
    check = contracts.add_parser("check", help="validate a Parquet file (exit 0 pass, 1 fail, 2 bad input)")
    check.add_argument("path")
    check.add_argument("--kind", required=True, choices=DATASET_KINDS)
    check.add_argument("--spec", help="take the contract's parameters (context, reward range) from this spec")
    check.set_defaults(func=cmd_contracts_check)
    docs = contracts.add_parser("docs", help="write the Data Docs of a committed dataset to a folder")
    docs.add_argument("ref", help="name@version")
    docs.add_argument("--out", default="data-docs")
    docs.add_argument("--store", default=DEFAULT_STORE)
    docs.set_defaults(func=cmd_contracts_docs)
    envs = commands.add_parser("envs", help="environment tasks by hand").add_subparsers(
        dest="envs_command", required=True)
    env_check = envs.add_parser("check", help="play every task with the oracle and a no-op (exit 0 only if all hold)")
    env_check.add_argument("kind", help="an env kind (its shipped tasks), or an env id of --spec")
    env_check.add_argument("--tasks", help="a task folder instead of the shipped one")
    env_check.add_argument("--spec", help="take the env (by id) and the tokenizer from this spec")
    env_check.set_defaults(func=cmd_envs_check)
    box = commands.add_parser("sandbox", help="run one command in the envs' sandbox and print what the policy sees")
    box.add_argument("--files", help="a folder copied into the sandbox's /work first (a task's environment/)")
    box.add_argument("--python", action="store_true", help="run the text as a Python cell (the rlm REPL)")
    box.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    box.set_defaults(func=cmd_sandbox)
    evaluation = commands.add_parser("eval", help="evaluate a checkpoint (the evaluation flow, by hand), or a "
                                     "model behind an OpenAI-compatible endpoint")
    evaluation.add_argument("ref", nargs="?", help="a checkpoint, name@version")
    evaluation.add_argument("--endpoint", help="instead: an OpenAI-compatible base URL (…/v1)")
    evaluation.add_argument("--model", help="with --endpoint: the model name it serves")
    evaluation.add_argument("--spec", help="with --endpoint: the spec whose envs and evaluation settings to use")
    evaluation.add_argument("--env", action="append", help="env id of the checkpoint's spec, or an env kind "
                            "(repeatable; default: the spec's evaluation.envs)")
    evaluation.add_argument("--n", type=int, help="tasks per env (default: the spec's evaluation.n)")
    evaluation.add_argument("--max-new-tokens", type=int)
    evaluation.add_argument("--store", default=DEFAULT_STORE)
    evaluation.set_defaults(func=cmd_eval)
    serve = commands.add_parser("serve", help="serve the evaluate-on-checkpoint trigger (and a pipeline) "
                                "against PREFECT_API_URL")
    serve.add_argument("--spec", help="also serve this pipeline as deployment post-train/served")
    serve.add_argument("--cron", help="run that pipeline on this cron schedule, e.g. '0 2 * * *'")
    serve.add_argument("--store", help="store URI for the served pipeline (overrides its spec's)")
    serve.set_defaults(func=cmd_serve)
    serve_model = commands.add_parser("serve-model", help="serve a checkpoint as an OpenAI-compatible API")
    serve_model.add_argument("ref", help="a checkpoint, name@version")
    serve_model.add_argument("--port", type=int, default=8000)
    serve_model.add_argument("--host", default="127.0.0.1")
    serve_model.add_argument("--name", help="model name the API lists (default: the ref)")
    serve_model.add_argument("--store", default=DEFAULT_STORE)
    serve_model.set_defaults(func=cmd_serve_model)
    for name, func, text in (("lineage", cmd_lineage, "print the inputs of an artifact back to the spec"),
                             ("verify", cmd_verify, "re-hash an artifact's files against its manifest")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("ref", help="name@version")
        sub.add_argument("--store", default=DEFAULT_STORE)
        sub.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    for key, value in _QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
