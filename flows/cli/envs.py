"""`posttrain envs check KIND | list` and `posttrain sandbox -- CMD`: env tasks, the env kinds and
the sandbox by hand."""

from __future__ import annotations

from pathlib import Path

TABLE_ROWS = 100  # above this many tasks, the table lists failures only


class EnvInputError(Exception):
    """Bad input to an envs command (exit code 2)."""


def env_config(kind: str, tasks: str | None, spec, generated: int | None = None):
    """The env's config: the spec's env of that id, else the kind's defaults (`tasks` overrides the
    folder; `generated`: that many variants per split of each generated family instead)."""
    from pydantic import ValidationError

    from envs.loader import ENV_CONFIG, ENV_KINDS

    if generated is not None:
        if spec is not None or tasks:
            raise EnvInputError("--generated: give it alone (not with --spec or --tasks)")
        if not 1 <= generated <= 1000:
            raise EnvInputError(f"--generated: {generated} variants per split; give 1 to 1000")
        if kind not in ENV_KINDS or "generated" not in type(ENV_CONFIG.validate_python({"kind": kind})).model_fields:
            raise EnvInputError(f"--generated: {kind!r} has no generated families (terminal and openclaw have)")
        return ENV_CONFIG.validate_python({"kind": kind, "generated": {"train": generated, "eval": generated}})
    if spec is not None:
        if kind not in spec.envs:
            raise EnvInputError(f"env {kind!r} is not in the spec (it has: {', '.join(spec.envs)})")
        config = spec.envs[kind]
        return config.model_copy(update={"tasks": tasks}) if tasks else config
    if kind not in ENV_KINDS:
        raise EnvInputError(f"unknown env kind {kind!r} (kinds: {', '.join(ENV_KINDS)})")
    try:
        return ENV_CONFIG.validate_python({"kind": kind, **({"tasks": tasks} if tasks else {})})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"][1:]) or kind
        raise EnvInputError(f"{where}: {error['msg']}") from None


def check(kind: str, tasks: str | None, spec, generated: int | None = None) -> int:
    """Plays every task with the oracle and with a no-op; prints the table; 0 only if all hold."""
    from envs.loader import make_env
    from envs.sandbox import SandboxUnavailable
    from models.loading import load_tokenizer, resolve_base
    from tasks.rollout.env_check import check_env

    config = env_config(kind, tasks, spec, generated)
    try:
        env = make_env(kind if spec is not None else config.kind, config)
        tokenizer = load_tokenizer(resolve_base(spec.model.base if spec is not None else "tiny-llama"))
        if getattr(env, "reads_data", False) and spec is not None:
            env.use_rows(*source_rows(env, spec))
        rows = check_env(env, tokenizer)
    except (SandboxUnavailable, ValueError) as exc:
        raise EnvInputError(str(exc)) from None
    shown = rows if len(rows) <= TABLE_ROWS else [row for row in rows if not row.ok]
    width = max([len("task")] + [len(row.task_id) for row in shown])
    print(f"{'task':<{width}}  oracle  no-op  ok")
    for row in shown:
        note = f"  {row.errors}" if row.errors else ""
        print(f"{row.task_id:<{width}}  {row.oracle_reward:6.3g}  {row.no_op_reward:5.3g}  "
              f"{'yes' if row.ok else 'NO'}{note}")
    failed = sum(not row.ok for row in rows)
    if len(shown) < len(rows):
        print(f"(failures only: {len(rows)} tasks)")
    print(f"{env.name}: {len(rows) - failed}/{len(rows)} tasks hold (oracle = full reward "
          f"{rows[0].full_reward:g}, no-op = 0)" if rows else f"{env.name}: no tasks")
    return 0 if rows and failed == 0 else 1


def source_rows(env, spec) -> list[list[dict]]:
    """The rows of a row-reading env's dataset stages, read from their sources as the dataset stage
    imports them (prompts), without a store: the train rows, then the held-out ones if given apart."""
    from data_contracts.sources import options_for, rows_of, source_files
    from tasks.stages.dataset import imported_rows, picked

    stages, store, tables = {stage.id: stage for stage in spec.stages}, spec.store_location(), []
    for stage_id in env.data_stages():
        source = stages[stage_id].sources().get("source")
        if source is None or source.kind == "hub":
            raise EnvInputError(f"env {env.name}: its rows come from stage {stage_id}, whose source this command "
                                "cannot read (a local file or a URL can be)")
        files = source_files(source, options_for(source, store.uri, store.options))
        stage = stages[stage_id]
        tables.append(imported_rows(stage, "prompts", picked(stage, rows_of(files, stage.split, stage.source))))
    return tables


def list_kinds() -> int:
    """One row per env kind a spec can name: where it comes from and its class."""
    from envs.loader import ENV_KINDS_BY_NAME

    rows = [(name, kind.source, f"{kind.env_class.__module__}:{kind.env_class.__name__}")
            for name, kind in ENV_KINDS_BY_NAME.items()]
    widths = [max(len(row[i]) for row in [("kind", "from", "class"), *rows]) for i in range(3)]
    for row in [("kind", "from", "class"), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def sandbox(command: list[str], files: str | None, python: bool) -> int:
    """Runs one command (or Python cell) in exactly the envs' sandbox; prints what the policy would see."""
    from envs.sandbox import Sandbox, SandboxUnavailable

    if not command:
        raise EnvInputError("sandbox: no command given (posttrain sandbox -- CMD ...)")
    seed_files = _folder_files(Path(files)) if files else {}
    try:
        with Sandbox(files=seed_files) as box:
            text = " ".join(command)
            result = box.run_python(text) if python else box.run(text)
    except SandboxUnavailable as exc:
        raise EnvInputError(str(exc)) from None
    print(result.observation())
    return 0 if result.exit_code == 0 else 1


def _folder_files(folder: Path) -> dict[str, bytes]:
    if not folder.is_dir():
        raise EnvInputError(f"--files {folder}: not a folder")
    from envs.task_files import files_below

    try:
        return {relative: path.read_bytes() for relative, path in files_below(folder).items()}
    except ValueError as exc:
        raise EnvInputError(f"--files {exc}") from None
