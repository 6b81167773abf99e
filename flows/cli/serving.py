"""`posttrain eval | serve | serve-model`: evaluations by hand, the checkpoint trigger served, and
checkpoints behind an OpenAI-compatible API."""

from __future__ import annotations

import os

from flows.cli.common import (
    DEFAULT_STORE,
    UserError,
    check_prefect_api,
    open_spec,
    open_store,
    resolve_ref,
)


def cmd_eval(args) -> int:
    if args.endpoint:
        check_endpoint_url(args.endpoint)  # before the evaluation's modules (Prefect) load
        return _eval_endpoint(args)
    from flows.cli.eval import run_eval
    from flows.evaluate import EvaluationInputError

    if not args.ref:
        raise UserError("ref: name a checkpoint (name@version), or an endpoint with --endpoint and --model")
    benchmarks = benchmark_settings(args)
    store = open_store(args.store)
    ref = str(resolve_ref(store, args.ref))
    check_prefect_api()
    try:
        return run_eval(store, ref, args.env, args.n, args.max_new_tokens, benchmarks)
    except EvaluationInputError as exc:
        raise UserError(str(exc)) from None


def benchmark_settings(args) -> dict | None:
    """`--lm-eval TASK ...` and `--humaneval-limit N`: the benchmarks to run instead of the spec's (a bad
    value is one line naming its flag)."""
    from tasks.common.benchmarks import HumanEvalSettings, LmEvalSettings

    if args.lm_eval_include and not args.lm_eval:
        raise UserError("--lm-eval-include: name the tasks to run with --lm-eval")
    benchmarks = {}
    if args.lm_eval:
        benchmarks["lm_eval"] = flag_settings(
            LmEvalSettings, {"limit": "lm-eval-limit", "num_fewshot": "lm-eval-fewshot"}, tasks=args.lm_eval,
            include_path=args.lm_eval_include, limit=args.lm_eval_limit, num_fewshot=args.lm_eval_fewshot,
            apply_chat_template=args.lm_eval_chat_template)
    if args.humaneval_limit is not None:
        benchmarks["humaneval"] = flag_settings(HumanEvalSettings, {"limit": "humaneval-limit"},
                                                limit=args.humaneval_limit)
    return benchmarks or None


def flag_settings(settings_class, flags: dict[str, str], **values) -> dict:
    """The settings the flags give, as a dict; UserError naming the flag of a bad value."""
    from pydantic import ValidationError

    try:
        return settings_class(**values).model_dump()
    except ValidationError as exc:
        error = exc.errors()[0]
        raise UserError(f"--{flags[error['loc'][0]]}: {error['msg']}") from None


def check_endpoint_url(url: str) -> None:
    """No credentials in `--endpoint`: the URL shows in the lines printed and in every error naming
    it (checked before the evaluation's modules load)."""
    from artifacts.urls import CREDENTIALS, holds_credentials

    if holds_credentials(url):
        raise UserError(f"--endpoint: {CREDENTIALS}; give the key through --api-key-env")


def _eval_endpoint(args) -> int:
    from artifacts.store import first_line
    from flows.cli.eval import run_endpoint_eval
    from flows.evaluate import EvaluationInputError
    from tasks.rollout.endpoint_policy import EndpointConfigError, EndpointError

    if args.ref:
        raise UserError("ref: evaluate a checkpoint or an endpoint, not both (serve the checkpoint with serve-model)")
    if not args.model or not args.spec:
        raise UserError(f"--endpoint: also name --model (what {args.endpoint} serves) and --spec (the envs)")
    spec, _ = open_spec(args.spec)
    try:
        return run_endpoint_eval(spec, args.env, args.n, args.max_new_tokens, args.endpoint, args.model,
                                 args.api_key_env)
    except (EvaluationInputError, EndpointError, EndpointConfigError) as exc:
        raise UserError(first_line(exc)) from None


def cmd_serve(args) -> int:
    from flows.triggers import serve

    if args.spec:
        open_spec(args.spec)
    if check_prefect_api() is None:
        raise UserError("PREFECT_API_URL: `posttrain serve` needs a Prefect server to receive events "
                        "(start one with `prefect server start`, then set PREFECT_API_URL=http://127.0.0.1:4200/api)")
    if args.cron and not args.spec:
        raise UserError("--cron: schedules a pipeline; name its spec with --spec")
    allow_served_stores(args.spec, args.store)
    serve(args.spec, args.cron, args.store)
    return 0


def allow_served_stores(spec_path: str | None, store: str | None) -> None:
    """Triggered evaluations open only the stores POSTTRAIN_ALLOWED_STORES names (artifacts/allow_list.py):
    the served pipeline's store joins them, for the flow runs this process starts."""
    from artifacts.allow_list import VARIABLE, allowed_entries, entry_for
    from artifacts.store import StoreLocation

    entries = allowed_entries()
    if spec_path:
        spec, _ = open_spec(spec_path)
        entries.append(entry_for(spec.store_location(store)))
    elif store:
        entries.append(entry_for(StoreLocation(uri=store)))
    os.environ[VARIABLE] = " ".join(entries)
    print(f"evaluations open only these stores ({VARIABLE}): {' '.join(entries) or 'none'}", flush=True)


def cmd_serve_model(args) -> int:
    from flows.cli.serve_model import ServeModelInputError, serve_model
    from models.serving.limits import Limits

    limits = Limits(args.max_body_bytes, args.read_timeout, args.queue_timeout, args.max_connections,
                    args.request_timeout, args.batch_window)
    api_key = args.api_key
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise UserError(f"--api-key-env: environment variable {args.api_key_env} is not set")
    try:
        return serve_model(args.ref, args.store, args.host, args.port, args.name, limits, args.device,
                           lora_folder=args.lora_folder, api_key=api_key, insecure_no_auth=args.insecure_no_auth,
                           tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
    except ServeModelInputError as exc:
        raise UserError(str(exc)) from None


def add_serving_commands(commands) -> None:
    from models.serving.limits import Limits

    evaluation = commands.add_parser("eval", help="evaluate a checkpoint (the evaluation flow, by hand), or a "
                                     "model behind an OpenAI-compatible endpoint")
    evaluation.add_argument("ref", nargs="?", help="a checkpoint, name@version or name@latest")
    evaluation.add_argument("--endpoint", help="instead: an OpenAI-compatible base URL (…/v1)")
    evaluation.add_argument("--model", help="with --endpoint: the model name it serves")
    evaluation.add_argument("--api-key-env", help="with --endpoint: the environment variable holding its API key")
    evaluation.add_argument("--spec", help="with --endpoint: the spec whose envs and evaluation settings to use")
    evaluation.add_argument("--env", action="append", help="env id of the checkpoint's spec, or an env kind "
                            "(repeatable; default: the spec's evaluation.envs)")
    evaluation.add_argument("--n", type=int, help="tasks per env (default: the spec's evaluation.n)")
    evaluation.add_argument("--max-new-tokens", type=int)
    evaluation.add_argument("--lm-eval", action="append", metavar="TASK", help="an lm-eval task to run "
                            "(repeatable; instead of the spec's evaluation.lm_eval; without --env, no env runs)")
    evaluation.add_argument("--lm-eval-include", metavar="DIR", help="with --lm-eval: a folder of task YAMLs")
    evaluation.add_argument("--lm-eval-limit", type=int, metavar="N", help="with --lm-eval: documents per task")
    evaluation.add_argument("--lm-eval-fewshot", type=int, metavar="N", help="with --lm-eval: few-shot examples")
    evaluation.add_argument("--lm-eval-chat-template", action="store_true",
                            help="with --lm-eval: prompts through the checkpoint's chat template")
    evaluation.add_argument("--humaneval-limit", type=int, metavar="N",
                            help="also HumanEval's first N problems (greedy, pass@1)")
    evaluation.add_argument("--store", default=DEFAULT_STORE)
    evaluation.set_defaults(func=cmd_eval)
    serve = commands.add_parser("serve", help="serve the evaluate-on-checkpoint trigger (and a pipeline) "
                                "against PREFECT_API_URL")
    serve.add_argument("--spec", help="also serve this pipeline as deployment post-train/served")
    serve.add_argument("--cron", help="run that pipeline on this cron schedule, e.g. '0 2 * * *'")
    serve.add_argument("--store", help="store URI for the served pipeline (overrides its spec's)")
    serve.set_defaults(func=cmd_serve)
    serve_model = commands.add_parser("serve-model", help="serve a checkpoint as an OpenAI-compatible API")
    serve_model.add_argument("ref", help="a checkpoint, name@version or name@latest")
    serve_model.add_argument("--port", type=int, default=8000)
    serve_model.add_argument("--host", default="127.0.0.1", help="the address to listen on; off loopback "
                             "(127.0.0.0/8, ::1, localhost) it needs a key, or --insecure-no-auth")
    serve_model.add_argument("--name", help="model name the API lists (default: the ref)")
    serve_model.add_argument("--store", default=DEFAULT_STORE)
    serve_model.add_argument("--device", choices=("auto", "cpu"), help="auto: the first GPU when CUDA is present, "
                             "else the CPU (default: the model.device of the checkpoint's spec, auto)")
    serve_model.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                             help="largest request body accepted (default 1 MiB; larger: 413)")
    serve_model.add_argument("--read-timeout", type=float, default=Limits.read_timeout,
                             help="seconds a request's headers, then its body, may take to arrive (default 30)")
    serve_model.add_argument("--queue-timeout", type=float, default=Limits.queue_timeout,
                             help="seconds a request waits for the ones ahead of it before a 503 (default 60)")
    serve_model.add_argument("--max-connections", type=int, default=Limits.max_connections,
                             help="connections and requests at once; more get a 503 (default 256)")
    serve_model.add_argument("--request-timeout", type=float, default=Limits.request_timeout,
                             help="seconds a request may take in all before a 504 (default 600)")
    serve_model.add_argument("--batch-window", type=float, default=Limits.batch_window,
                             help="seconds an idle engine waits for more requests to batch with one (default 0.01)")
    serve_model.add_argument("--lora-folder", help="allow vLLM's runtime LoRA endpoints, loading only adapters "
                             "saved under this folder (default: off)")
    key = serve_model.add_mutually_exclusive_group()
    key.add_argument("--api-key-env", help="environment variable holding the API key every /v1 request must send")
    key.add_argument("--api-key", help="the API key itself, as vLLM's flag (other local users can read a "
                     "process's arguments: prefer --api-key-env)")
    serve_model.add_argument("--insecure-no-auth", action="store_true", help="serve off loopback without a key "
                             "(only behind a proxy that authenticates)")
    serve_model.add_argument("--enable-auto-tool-choice", action="store_true", help="answer tool calls as OpenAI "
                             "`tool_calls`, read by --tool-call-parser (as vLLM's flag; docs/TOOLS.md)")
    serve_model.add_argument("--tool-call-parser", choices=("hermes", "lfm2", "llama3"), default="hermes",
                             help="the template family whose tool calls are read (default hermes: Qwen3)")
    serve_model.set_defaults(func=cmd_serve_model)
