"""The model card (README.md) of an exported checkpoint: what it is, the base model, the lineage
walked back through the store's manifests (datasets, stages and their key parameters, read from
the spec each run kept in the store) and the store's evaluations of that very checkpoint."""

from __future__ import annotations

from artifacts.refs import Ref
from artifacts.store import Store, StoreError
from flows.leaderboard import checkpoint_step, evaluations

# the parameters a card shows of each stage (those it has): what a reader asks first
KEY_PARAMETERS = ("method", "mode", "algorithm", "advantage", "importance_sampling_level", "loss_aggregation", "steps",
                  "max_steps", "epochs", "batch_size", "prompts_per_step", "group_size", "learning_rate", "beta",
                  "desirable_weight", "undesirable_weight", "simpo_gamma", "cpo_alpha", "teacher", "student", "lmbda",
                  "lr_schedule", "env", "envs", "n", "samples", "source", "split", "format", "limit", "eval_fraction")
SHOWN_WHEN_SET = ("eval_fraction",)  # 0 means off: not worth a cell
EVALUATION_COLUMNS = ("accuracy", "format_rate", "doom_loop_rate", "mean_completion_tokens")


def lineage(store: Store, ref: Ref) -> list[dict]:
    """The manifests of `ref` and of everything it was made from, each once, nearest first."""
    seen, order, queue = set(), [], [str(ref)]
    while queue:
        text = queue.pop(0)
        if text in seen:
            continue
        seen.add(text)
        manifest = store.manifest(text)
        order.append(manifest)
        queue += list(manifest["inputs"].values())
    return order


def stage_parameters(store: Store, manifest: dict, specs: dict) -> dict:
    """The key parameters of the stage that made `manifest`, from the spec its run kept in the store
    ({} when it kept none or it no longer reads); `specs` caches the specs by hash."""
    from flows.spec import SpecError, checkpoint_spec

    producer = manifest["producer"]
    spec_hash = producer.get("spec")
    if spec_hash not in specs:
        try:
            specs[spec_hash] = checkpoint_spec(store, manifest)
        except (SpecError, StoreError):
            specs[spec_hash] = None
    spec = specs[spec_hash]
    stage = next((s for s in spec.stages if s.id == producer.get("stage_id")), None) if spec else None
    if stage is None:
        return {}
    params = stage.model_dump()
    return {key: params[key] for key in KEY_PARAMETERS
            if params.get(key) is not None and (params[key] or key not in SHOWN_WHEN_SET)}


def model_card(store: Store, ref: Ref, base: str, weights: str, adapter: bool) -> str:
    """The card's markdown: `weights` says what the folder holds (merged, dtype), `adapter` whether
    it is a LoRA adapter (loaded with peft)."""
    manifests = lineage(store, ref)
    producer = manifests[0]["producer"]
    front = ["---", f"library_name: {'peft' if adapter else 'transformers'}", "tags:", "- posttrain"]
    if "/" in base and not base.startswith(("/", ".")):  # a hub id
        front.append(f"base_model: {base}")
    lines = [*front, "---", "", f"# {ref.name}", "",
             f"Exported by posttrain from `{ref}` (pipeline `{producer.get('pipeline')}`, run "
             f"`{producer.get('run_id')}`): {weights}.", "", "## Base model", "", f"`{base}`"]
    if producer.get("base_model"):
        lines[-1] += f" (identity `{producer['base_model']}`)"
    lines += ["", "## How it was made", "", "Each artifact, from this checkpoint back to the data it started from:",
              "", "| artifact | kind | stage | parameters |", "|---|---|---|---|"]
    specs: dict = {}
    for manifest in manifests:
        made_by = manifest["producer"]
        params = stage_parameters(store, manifest, specs)
        step = checkpoint_step(manifest) if manifest["kind"] == "checkpoint" else None
        shown = ", ".join(f"{key}={value}" for key, value in params.items())
        if step is not None:
            shown = f"trained steps={step}" + (f", {shown}" if shown else "")
        lines.append(f"| `{manifest['ref']}` | {manifest['kind']} | {made_by.get('stage_id')} "
                     f"({made_by.get('stage_kind')}) | {shown} |")
    datasets = [m["ref"] for m in manifests if m["kind"] == "dataset"]
    if datasets:
        lines += ["", "Datasets: " + ", ".join(f"`{d}`" for d in datasets) + "."]
    lines += ["", "## Evaluation", "", *evaluation_lines(store, ref, producer.get("pipeline"))]
    return "\n".join(lines) + "\n"


def evaluation_lines(store: Store, ref: Ref, pipeline: str | None) -> list[str]:
    """The store's evaluations of this checkpoint, one row per env and task count (greedy)."""
    rows = [row for row in evaluations(store, pipeline) if row["checkpoint"] == str(ref)] if pipeline else []
    if not rows:
        return ["No evaluation of this checkpoint in the store."]
    lines = ["Held-out tasks of each env, greedy decoding:", "",
             "| env | n | " + " | ".join(EVALUATION_COLUMNS) + " | evaluation |",
             "|---|---|" + "---|" * len(EVALUATION_COLUMNS) + "---|"]
    for row in rows:
        cells = [f"{row[c]:.4g}" if isinstance(row.get(c), (int, float)) else "" for c in EVALUATION_COLUMNS]
        lines.append(f"| {row['env']} | {row['n']} | " + " | ".join(cells) + f" | `{row['evaluation']}` |")
    return lines
