"""`posttrain` command line: run | validate | status | eval | serve | serve-model | ls | lineage |
verify | export | contracts | envs | sandbox, and --version. This module holds the parser, the dispatch and
the run/validate/status/contracts/envs/sandbox commands; the others are in flows/cli/artifacts.py,
flows/cli/serving.py and flows/cli/export.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from data_contracts.config import DATASET_KINDS
from flows.cli.artifacts import add_artifact_commands
from flows.cli.export import add_export_command
from flows.cli.common import (
    DEFAULT_STORE,
    QUIET_DEFAULTS,
    UserError,
    check_prefect_api,
    open_named_store,
    open_spec,
    open_store,
    quiet_lost_api,
    resolve_ref,
    temporary_api,
    use_temporary_api,
)
from flows.cli.serving import add_serving_commands


def cmd_validate(args) -> int:
    from flows.cli.report import print_dag

    spec, _ = open_spec(args.spec)
    print_dag(spec)
    if args.check_endpoints:
        from flows.cli.endpoints import check_endpoints

        check_endpoints(spec)
    return 0


def cmd_run(args) -> int:
    from artifacts.store import first_line
    from flows.cli.report import print_run_report

    spec, text = open_spec(args.spec)
    store = open_store(args.store or spec.store, spec.storage_options)
    if args.in_process is not None:
        from flows.cli.in_process import run_in_process

        return run_in_process(args.spec, spec, text, store, args.in_process)
    if spec.workers is None:  # the stages run here: their imports load on the other core meanwhile
        from tasks.runtime.launch import warm_up

        warm_up(lora=spec.model.lora is not None)
    api = check_prefect_api()
    if spec.workers is not None and api is None:
        raise UserError(f"workers.deployment: stages go to {spec.workers.deployment!r} on a Prefect server, "
                        "but PREFECT_API_URL is not set")
    server = temporary_api(api)  # ephemeral mode: it starts while the rest loads

    from flows.post_train import INLINE_EVALUATION, post_train, save_spec
    from flows.spec import spec_folder
    from flows.stage_requests import new_run_id

    spec_hash = save_spec(store, text)
    run_id = new_run_id(spec.name)
    print(f"run {run_id}  (store {store.uri})", flush=True)
    use_temporary_api(server)
    if spec.evaluation.on_new_checkpoint:
        print(INLINE_EVALUATION if api is None else
              f"evaluation.on_new_checkpoint: checkpoint events go to {api}; the evaluate-on-checkpoint "
              "deployment (posttrain serve, or deployments/prefect.yaml) evaluates them", flush=True)
    quiet_lost_api()
    try:
        state = post_train.with_options(flow_run_name=run_id)(store=store.uri, run_id=run_id, spec_text=text,
                                                              spec_hash=spec_hash, spec_dir=spec_folder(args.spec),
                                                              return_state=True)
        ended = f"{state.name}: {state.message}"
    except Exception as exc:  # the flow's engine lost its Prefect API (it could not report a state)
        state, ended = None, f"its flow run could not be reported to Prefect: {first_line(exc)}"
    summary_path = store.path("runs", f"{run_id}.json")
    if not store.exists(summary_path):
        print(f"error: run {run_id} ended before its first stage: {ended}", file=sys.stderr)
        return 1
    summary = store.read_json(summary_path)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2, sort_keys=True))
    print_run_report(summary)
    if state is None:
        print(f"error: run {run_id}: {ended}", file=sys.stderr)
        return 1
    return 0 if summary["state"] == "completed" else 1


def cmd_status(args) -> int:
    from artifacts.refs import valid_run_id
    from flows.cli.report import print_run_list, print_run_status
    from flows.leaderboard import evaluations

    store = open_named_store(args.store, args.spec)
    if args.run_id:
        if not valid_run_id(args.run_id):
            raise UserError(f"run_id: {args.run_id!r} is not a run id (letters, digits, '.', '_', '-')")
        path = store.path("runs", f"{args.run_id}.json")
        if not store.exists(path):
            raise UserError(f"run_id: no run {args.run_id!r} in {store.uri}")
        summary = store.read_json(path)
        print_run_status(summary, evaluations(store, summary["pipeline"]))
    else:
        print_run_list(store, lambda pipeline: evaluations(store, pipeline))
    return 0


def cmd_contracts_check(args) -> int:
    from flows.cli.contracts import ContractInputError, check

    spec = open_spec(args.spec)[0] if args.spec else None
    try:
        return check(args.path, args.kind, spec)
    except ContractInputError as exc:
        raise UserError(str(exc)) from None


def cmd_contracts_docs(args) -> int:
    from artifacts.store import StoreError
    from flows.cli.contracts import ContractInputError, docs

    store = open_store(args.store)
    ref = resolve_ref(store, args.ref)
    try:
        page = docs(store, ref, args.out)
    except (ContractInputError, StoreError) as exc:
        raise UserError(f"{exc}" if isinstance(exc, ContractInputError) else f"ref: {exc}") from None
    print(f"Data Docs for {ref}: {page}")
    return 0


def cmd_envs_check(args) -> int:
    from flows.cli.envs import EnvInputError, check

    spec = open_spec(args.spec)[0] if args.spec else None
    try:
        return check(args.kind, args.tasks, spec, args.generated)
    except EnvInputError as exc:
        raise UserError(str(exc)) from None


def cmd_envs_list(args) -> int:
    from flows.cli.envs import list_kinds

    return list_kinds()


def cmd_sandbox(args) -> int:
    from flows.cli.envs import EnvInputError, sandbox

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return sandbox(command, args.files, args.python)
    except EnvInputError as exc:
        raise UserError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Declarative LLM post-training on Prefect.")
    parser.add_argument("--version", action=VersionAction, help="print the release and code version, and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a pipeline spec as a Prefect flow")
    run.add_argument("spec")
    run.add_argument("--store", help="store URI (overrides the spec's `store`)")
    run.add_argument("--summary-json", help="also write the run summary to this file")
    run.add_argument("--in-process", metavar="STAGE", help="run only STAGE, in this process, its inputs from the "
                     "store (for pdb or breakpoint(); docs/CLI.md)")
    run.set_defaults(func=cmd_run)
    validate = commands.add_parser("validate", help="check a spec and print its stage DAG")
    validate.add_argument("spec")
    validate.add_argument("--check-endpoints", action="store_true", help="also check that every server the stages "
                          "talk to (rollout, teacher, judge) answers and serves its model")
    validate.set_defaults(func=cmd_validate)
    status = commands.add_parser("status", help="recent runs, or one run's stages")
    status.add_argument("run_id", nargs="?")
    status.add_argument("--store", help=f"store URI (default: the spec's `store`, else {DEFAULT_STORE})")
    status.add_argument("--spec", help="read the store this spec names")
    status.set_defaults(func=cmd_status)
    contracts = commands.add_parser("contracts", help="data contracts by hand").add_subparsers(
        dest="contracts_command", required=True)
    check = contracts.add_parser("check", help="validate a Parquet file (exit 0 pass, 1 fail, 2 bad input)")
    check.add_argument("path")
    check.add_argument("--kind", required=True, choices=DATASET_KINDS)
    check.add_argument("--spec", help="take the contract's parameters (context, reward range) from this spec")
    check.set_defaults(func=cmd_contracts_check)
    docs = contracts.add_parser("docs", help="write the Data Docs of a committed dataset to a folder")
    docs.add_argument("ref", help="name@version, or name@latest")
    docs.add_argument("--out", default="data-docs")
    docs.add_argument("--store", default=DEFAULT_STORE)
    docs.set_defaults(func=cmd_contracts_docs)
    envs = commands.add_parser("envs", help="environment tasks by hand").add_subparsers(
        dest="envs_command", required=True)
    env_check = envs.add_parser("check", help="play every task with the oracle and a no-op (exit 0 only if all hold)")
    env_check.add_argument("kind", help="an env kind (its shipped tasks), or an env id of --spec")
    env_check.add_argument("--tasks", help="a task folder instead of the shipped one")
    env_check.add_argument("--spec", help="take the env (by id) and the tokenizer from this spec")
    env_check.add_argument("--generated", type=int, metavar="N", help="check N train and N held-out variants of "
                           "each generated family instead of the shipped tasks (terminal, openclaw)")
    env_check.set_defaults(func=cmd_envs_check)
    env_list = envs.add_parser("list", help="the env kinds a spec can name: built in, and from installed packages")
    env_list.set_defaults(func=cmd_envs_list)
    box = commands.add_parser("sandbox", help="run one command in the envs' sandbox and print what the policy sees")
    box.add_argument("--files", help="a folder copied into the sandbox's /work first (a task's environment/)")
    box.add_argument("--python", action="store_true", help="run the text as a Python cell (the rlm REPL)")
    box.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    box.set_defaults(func=cmd_sandbox)
    add_serving_commands(commands)
    add_artifact_commands(commands)
    add_export_command(commands)
    return parser


class VersionAction(argparse.Action):
    """`--version`, worked out only when asked for (the code version hashes the sources)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """`posttrain X.Y.Z (code <hash>)`: the package release, and the code version that stage cache
    keys and manifests record."""
    from importlib.metadata import PackageNotFoundError, version

    from tasks.runtime.cache import code_version

    try:
        release = version("posttrain")
    except PackageNotFoundError:  # a checkout on the path, not installed
        release = "unknown"
    return f"posttrain {release} (code {code_version()})"


def main(argv: list[str] | None = None) -> int:
    from envs.base import EnvKindError
    from tasks.config import StageKindError

    for key, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, StageKindError, EnvKindError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def console() -> None:
    """The `posttrain` command: `main`, then the interpreter's exit in its own order (threads and
    their exit hooks, such as Prefect's log and event workers draining to the API; then the exit
    handlers: the temporary API server stopped, logging flushed, the fork server gone) and output
    flushed, without the teardown of every imported module that would follow (~0.5 s here,
    with nothing left in it for anyone)."""
    import atexit
    import threading

    code = main()
    threading._shutdown()  # what the interpreter's exit does first: thread hooks, then joins
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
