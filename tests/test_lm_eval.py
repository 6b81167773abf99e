"""lm-eval (EleutherAI's lm-evaluation-harness) as an evaluation backend: the spec's typed `lm_eval:` (its
task folder in the cache key, bad values one line), lm-eval's results for a checkpoint equal in this process
(lm-eval's HF model, a LoRA adapter included) and through serve-model (lm-eval's local-completions model,
whose loglikelihood requests need serve-model's `echo`), offline over the shipped local tasks
(tests/data/lm_eval_tasks: a multiple-choice task and a generation task over arith.jsonl)."""

import json
import shutil
from pathlib import Path

import httpx
import pytest
import yaml
from test_serve_model import NAME, local_model, trained_checkpoint

from flows.cli.main import main
from flows.spec import load_spec
from flows.stage_requests import stage_request
from tasks.common.benchmarks import LmEvalSettings
from tasks.rollout.harness import LmEvalError, endpoint_model, hf_model, run_lm_eval

TASKS = Path(__file__).parent / "data" / "lm_eval_tasks"
BOTH = LmEvalSettings(tasks=["arith_mc", "arith_gen"], limit=8, apply_chat_template=True, batch_size=4)


def spec_file(tmp_path, lm_eval: dict | None = None, evaluation: dict | None = None, **evaluate) -> Path:
    """A small spec beside a copy of the shipped tasks (`tasks/`), its evaluate stage with `lm_eval`."""
    shutil.copytree(TASKS, tmp_path / "tasks", dirs_exist_ok=True)
    stage = {"id": "eval", "kind": "evaluate", "checkpoints": ["sft"], "envs": ["arith"], "n": 4, **evaluate}
    if lm_eval is not None:
        stage["lm_eval"] = lm_eval
    spec = {"name": "t", "store": f"file://{tmp_path / 'store'}", "envs": {"arith": {"kind": "arith"}},
            "stages": [{"id": "warmup", "kind": "synthesize", "env": "arith", "n": 10},
                       {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2}, stage]}
    if evaluation is not None:
        spec["evaluation"] = evaluation
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def evaluate_key(path: Path) -> str:
    spec, _ = load_spec(path)
    stage = spec.stages[-1]
    return stage_request(spec, stage, {"sft": "t/sft@0123456789abcdef"}, store=spec.store_location(), run_id="r",
                         spec_hash=None).cache_key


def test_lm_eval_spec_fields_are_typed_and_the_task_files_key_the_cache(tmp_path):
    path = spec_file(tmp_path, {"tasks": ["arith_mc"], "include_path": "tasks", "limit": 4, "num_fewshot": 0},
                     humaneval={"limit": 2})
    spec, _ = load_spec(path)
    stage = spec.stages[-1]
    assert (stage.lm_eval.tasks, stage.lm_eval.limit, stage.lm_eval.num_fewshot) == (["arith_mc"], 4, 0)
    assert stage.humaneval.limit == 2 and stage.humaneval.k == [1]
    before = evaluate_key(path)
    assert evaluate_key(path) == before
    rows = (tmp_path / "tasks" / "arith.jsonl").read_text().splitlines()
    (tmp_path / "tasks" / "arith.jsonl").write_text("\n".join(rows[1:]) + "\n")  # a task file's content changed
    assert evaluate_key(path) != before


@pytest.mark.parametrize("lm_eval, evaluation, extra, message", [
    ({"tasks": ["arith_mc"], "include_path": "missing"}, None, {},
     "stages[2].lm_eval.include_path: missing: not found"),
    ({"tasks": ["arith_mc"], "fewshot": 2}, None, {}, "stages[2].lm_eval.fewshot: unknown key"),
    ({"tasks": []}, None, {}, "stages[2].lm_eval.tasks: List should have at least 1 item"),
    (None, {"lm_eval": {"tasks": ["arith_mc"], "include_path": "elsewhere"}}, {},
     "evaluation.lm_eval.include_path: elsewhere: not found"),
    (None, None, {"envs": []},
     "stages[2]: Value error, envs: name at least one env, or a benchmark (lm_eval, humaneval)"),
    (None, None, {"humaneval": {"k": [1, 10]}}, "k: 10 is not between 1 and n_samples (1)"),
])
def test_lm_eval_and_humaneval_bad_fields_are_one_line_errors(tmp_path, capsys, lm_eval, evaluation, extra, message):
    path = spec_file(tmp_path, lm_eval, evaluation, **extra)
    code = main(["validate", str(path)])
    out = capsys.readouterr()
    assert code == 2
    assert message in out.err + out.out and "Traceback" not in out.err


def test_lm_eval_unknown_task_is_one_line():
    with pytest.raises(LmEvalError, match=r"^lm_eval.tasks: nope not found in lm-eval's tasks or lm_eval_tasks/$"):
        run_lm_eval(None, LmEvalSettings(tasks=["arith_mc", "nope"]), TASKS, "t")


def test_lm_eval_in_process_equals_through_serve_model_on_choices_and_generation(base_url):
    """The same checkpoint, lm-eval's HF model here and its local-completions model against serve-model:
    the same metrics and, document by document, the same choice taken and the same greedy generation."""
    model, tokenizer = local_model()
    here_rows, here = run_lm_eval(hf_model(model, tokenizer, BOTH), BOTH, TASKS, "sft")
    served_rows, served = run_lm_eval(endpoint_model(base_url, NAME, trained_checkpoint(), BOTH), BOTH, TASKS, "sft")
    assert served == here
    assert [(r["env"], r["task_id"], r["completion"], r["correct"]) for r in served_rows] == \
        [(r["env"], r["task_id"], r["completion"], r["correct"]) for r in here_rows]
    assert set(here) == {"lm_eval.arith_mc", "lm_eval.arith_gen"} and here["lm_eval.arith_mc"]["n"] == 8
    assert 0 < here["lm_eval.arith_mc"]["acc"] and "exact_match" in here["lm_eval.arith_gen"]
    assert any(r["completion"].startswith("Fantastic question!") for r in here_rows if r["env"] == "lm_eval.arith_gen")


def post(base_url: str, **fields) -> httpx.Response:
    return httpx.post(f"{base_url}/completions", content=json.dumps({"model": NAME, **fields}), timeout=60,
                      headers={"content-type": "application/json"})


def test_lm_eval_echo_on_serve_model_gives_the_prompts_log_probs(base_url):
    """`echo` with `logprobs`, as vLLM answers it: the prompt's tokens first (the first one's log-prob null),
    each with its alternatives and itself; `max_tokens: 0` the prompt alone; the values the model's own."""
    import torch

    model, tokenizer = local_model()
    prompt = tokenizer("I have a great question: what is 3+4?", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    expected = [expected[i, token].item() for i, token in enumerate(prompt[1:])]
    alone = post(base_url, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0).json()["choices"][0]
    assert alone["text"] == tokenizer.decode(prompt) and alone["finish_reason"] == "length"
    logprobs = alone["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert logprobs["top_logprobs"][0] is None
    for token, value, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert top[token] == value and 2 <= len(top) <= 3
    one_more = post(base_url, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0).json()["choices"][0]
    assert len(one_more["logprobs"]["token_logprobs"]) == len(prompt) + 1
    assert one_more["logprobs"]["token_logprobs"][0] is None
    assert one_more["logprobs"]["token_logprobs"][1:-1] == pytest.approx(logprobs["token_logprobs"][1:], abs=1e-6)
    assert one_more["text"].startswith(tokenizer.decode(prompt)) and len(one_more["text"]) > len(alone["text"])
    refused = post(base_url, prompt=prompt, max_tokens=0)
    assert refused.status_code == 400 and "max_tokens 0 needs echo true" in refused.json()["error"]["message"]
    streamed = post(base_url, prompt=prompt, max_tokens=2, echo=True, stream=True)
    assert streamed.status_code == 400 and "echo is not supported with stream" in streamed.json()["error"]["message"]


def test_lm_eval_on_a_lora_checkpoint_equals_its_merged_weights(tmp_path):
    """A LoRA adapter checkpoint, loaded as the evaluate stage loads it (models.loading.load_model: a
    PeftModel), through lm-eval's HF model: the same results as its weights merged."""
    import torch
    from peft import LoraConfig, get_peft_model

    from models.config import ModelConfig
    from models.loading import load_model

    _, tokenizer = local_model()
    base = load_model(trained_checkpoint(), ModelConfig())  # its own: local_model() is shared, LoRA goes in place
    adapter = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    for name, weight in adapter.named_parameters():
        if "lora_B" in name:
            weight.data.normal_(0, 0.05)  # an adapter that changes the model
    adapter.save_pretrained(str(tmp_path / "adapter"))
    tokenizer.save_pretrained(str(tmp_path / "adapter"))
    loaded = load_model(tmp_path / "adapter", ModelConfig(base=str(trained_checkpoint()))).eval()
    settings = LmEvalSettings(tasks=["arith_mc"], limit=8, apply_chat_template=True, batch_size=4)
    rows, metrics = run_lm_eval(hf_model(loaded, tokenizer, settings), settings, TASKS, "lora")
    merged_rows, merged = run_lm_eval(hf_model(loaded.merge_and_unload(), tokenizer, settings), settings, TASKS, "lora")
    assert type(loaded).__name__ == "PeftModelForCausalLM"
    assert metrics == merged and [r["completion"] for r in rows] == [r["completion"] for r in merged_rows]


def test_lm_eval_and_humaneval_metrics_reach_the_report_and_the_leaderboard(tmp_path):
    """Benchmarks sit beside the envs in an evaluation's metrics: the report lists them in a table of their
    own (no rate plotted, no truncation warning), the leaderboard shows each one's headline metric and n."""
    from flows.leaderboard import leaderboard_table
    from tasks.common.benchmarks import headline
    from tasks.common.eval_report import unfinished_warnings, write_eval_report

    arith = {"accuracy": 0.5, "format_rate": 1.0, "doom_loop_rate": 0.0, "truncated_rate": 0.0, "n": 8}
    benchmarks = {"lm_eval.arith_mc": {"acc": 0.875, "acc_stderr": 0.125, "n": 8},
                  "humaneval": {"pass@1": 0.05, "n": 20, "samples": 1}}
    metrics = {"rl": {"arith": arith, **benchmarks}}
    assert unfinished_warnings(metrics, 64) == []
    write_eval_report(metrics, {"rl": "t/rl@0123"}, tmp_path, "evaluation")
    report = (tmp_path / "report.md").read_text()
    assert "| `t/rl@0123` | lm_eval.arith_mc | acc 0.875 · acc_stderr 0.125 · n 8 |" in report
    assert "| `t/rl@0123` | humaneval | pass@1 0.050 · n 20 · samples 1 |" in report
    rows = [{"checkpoint": "t/rl@0123", "env": env, **values, "headline": headline(env, values), "run_id": "r"}
            for env, values in metrics["rl"].items()]
    assert leaderboard_table(rows) == [{"checkpoint": "t/rl@0123", "run": "r", "arith accuracy": 0.5,
                                        "arith format_rate": 1.0, "arith doom_loop_rate": 0.0, "arith n": 8,
                                        "lm_eval.arith_mc acc": 0.875, "lm_eval.arith_mc n": 8,
                                        "humaneval pass@1": 0.05, "humaneval n": 20}]


@pytest.mark.parametrize("flags, message", [
    (["--lm-eval-include", "tasks"], "--lm-eval-include: name the tasks to run with --lm-eval"),
    (["--lm-eval", "arith_mc", "--lm-eval-limit", "0"], "--lm-eval-limit: Input should be greater than 0"),
    (["--lm-eval", "arith_mc", "--lm-eval-fewshot", "-1"],
     "--lm-eval-fewshot: Input should be greater than or equal to 0"),
    (["--humaneval-limit", "0"], "--humaneval-limit: Input should be greater than 0"),
])
def test_lm_eval_and_humaneval_eval_flags_are_one_line_errors(capsys, flags, message):
    assert main(["eval", "t/sft@0123456789abcdef", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_lm_eval_triggered_evaluation_without_the_kept_task_files_is_one_line(tmp_path):
    """A spec whose `evaluation.lm_eval.include_path` no run kept in the store (a store from before):
    the evaluation says so in one line instead of reading a folder of this machine."""
    from artifacts.store import Store
    from flows.evaluate import EvaluationInputError, with_benchmark_sources
    from tasks.stages.evaluate import EvaluateStage

    stage = EvaluateStage(kind="evaluate", id="e", checkpoints=["sft"], lm_eval={"tasks": ["arith_mc"],
                                                                                  "include_path": "lm_eval_tasks"})
    with pytest.raises(EvaluationInputError, match=r"^evaluation.lm_eval.include_path: the task files of spec "
                                                   r"0123456789ab are not in the store"):
        with_benchmark_sources(stage, Store(f"file://{tmp_path}"), "0123456789abcdef", given=False)


def test_lm_eval_task_folder_with_python_is_refused(tmp_path, capsys):
    """lm-eval imports a task's `!function` module from its folder: a task folder holds no Python."""
    path = spec_file(tmp_path, {"tasks": ["arith_mc"], "include_path": "tasks"})
    (tmp_path / "tasks" / "utils.py").write_text("import os\n")
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == ("error: stages[2].lm_eval.include_path: utils.py: task folders hold "
                                               "YAML and data, no Python (lm-eval would import it through "
                                               "`!function`)")
