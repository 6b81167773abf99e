"""`posttrain export REF --out DIR`: a committed checkpoint as a plain folder (merged LoRA, dtype,
tokenizer with its chat template, a model card with lineage and evaluations), from a local or S3
store, refused in one line where it cannot be, and pushed to a (stand-in) hub."""

import json
import os
import subprocess

import pytest
import yaml
from conftest import POSTTRAIN
from hub_stand_in import HubStandIn

from artifacts.store import Store
from flows.cli.main import main
from flows.spec import spec_hash_of

SPEC = {
    "name": "qs",
    "store": "STORE",
    "model": {"base": "tiny-llama", "lora": {"r": 4, "alpha": 8}},
    "envs": {"arith": {"kind": "arith", "digits": 2}},
    "stages": [
        {"id": "warmup", "kind": "synthesize", "env": "arith", "n": 16},
        {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 3, "learning_rate": 0.001},
    ],
}
TOKEN = "hf_test_write_token"


def lora_adapter(folder):
    """tiny-llama's LoRA adapter, its B matrices random (a fresh adapter adds nothing), and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora, load_tokenizer
    from models.presets import materialize

    torch.manual_seed(0)  # the same adapter every time: the same ref in every store
    model = add_lora(AutoModelForCausalLM.from_pretrained(str(materialize("tiny-llama"))),
                     ModelConfig(lora=LoraConfig(r=4, alpha=8)))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.2)
    model.save_pretrained(str(folder))
    load_tokenizer(materialize("tiny-llama")).save_pretrained(str(folder))
    return folder


def committed(tmp_path, store: Store) -> dict:
    """The run's spec kept in the store, its warmup dataset, the sft LoRA checkpoint and an evaluation of it."""
    text = yaml.safe_dump({**SPEC, "store": store.uri}, sort_keys=False)
    spec_hash = spec_hash_of(text)
    store.write_bytes(store.path("specs", f"{spec_hash}.yaml"), text.encode())

    def producer(stage_id, kind):
        return {"pipeline": "qs", "run_id": "qs-r1", "stage_id": stage_id, "stage_kind": kind, "spec": spec_hash,
                "cache_key": f"k-{stage_id}", "code_version": "c", "config_hash": "h"}

    data = tmp_path / "warmup"
    data.mkdir()
    (data / "part-0.parquet").write_bytes(b"rows")
    refs = {"warmup": str(store.commit("qs/warmup", "dataset", data, producer=producer("warmup", "synthesize")))}
    refs["sft"] = str(store.commit("qs/sft", "checkpoint", lora_adapter(tmp_path / "sft"),
                                   producer={**producer("sft", "sft"), "base_model": "preset:tiny-llama@x"},
                                   inputs={"warmup": refs["warmup"]}, metrics={"steps": 3}))
    results = tmp_path / "eval"
    results.mkdir()
    (results / "part-0.parquet").write_bytes(b"episodes")
    metrics = {"sft": {"arith": {"accuracy": 0.625, "n": 16, "format_rate": 1.0, "doom_loop_rate": 0.0,
                                 "mean_completion_tokens": 12.5}}}
    refs["eval"] = str(store.commit("qs/sft.eval", "dataset", results, producer=producer("sft.eval", "evaluate"),
                                    inputs={"sft": refs["sft"]}, metrics=metrics))
    return refs


@pytest.fixture(scope="module")
def lora_store(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("export")
    store = Store(f"file://{tmp_path / 'store'}")
    return store, committed(tmp_path, store)


def export(capsys, *args) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def greedy(model, tokenizer, steps=12) -> list[int]:
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             min_new_tokens=steps)
    return out[0, ids.shape[1]:].tolist()


def test_export_merged_lora_loads_alone_and_decodes_the_greedy_tokens_of_the_adapter(lora_store, tmp_path, capsys):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.presets import materialize

    store, refs = lora_store
    code, out, err = export(capsys, refs["sft"], "--out", tmp_path / "merged", "--store", store.uri, "--merge-lora")
    assert (code, err) == (0, "")
    assert f"{refs['sft']} -> {tmp_path / 'merged'} (the base model with the LoRA adapter merged in, float32)" in out
    files = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= files
    assert "adapter_config.json" not in files and not any(name.endswith(".bin") for name in files)
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # nothing left beside it

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    assert tokenizer.chat_template  # the chat template travels with it
    base = AutoModelForCausalLM.from_pretrained(str(materialize("tiny-llama")))
    adapted = PeftModel.from_pretrained(base, str(store.fetch(refs["sft"]))).eval()
    assert greedy(merged.eval(), tokenizer) == greedy(adapted, tokenizer)
    ids = torch.tensor([tokenizer("12 + 30 = 42")["input_ids"]])
    with torch.no_grad():  # the adapter changes the model: the equality above is the merge's
        assert (merged(ids).logits - adapted.get_base_model()(ids).logits).abs().max() < 1e-4
        with adapted.disable_adapter():
            assert (merged(ids).logits - adapted(ids).logits).abs().max() > 1e-2


def test_export_dtype_and_the_adapter_as_trained(lora_store, tmp_path, capsys):
    from safetensors import safe_open

    store, refs = lora_store
    assert export(capsys, refs["sft"], "--out", tmp_path / "bf16", "--store", store.uri, "--merge-lora",
                  "--dtype", "bf16")[0] == 0
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as weights:
        assert {str(weights.get_tensor(name).dtype) for name in weights.keys()} == {"torch.bfloat16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"

    code, out, _ = export(capsys, refs["sft"], "--out", tmp_path / "adapter", "--store", store.uri)
    assert code == 0 and "a LoRA adapter over the base model (load it with peft)" in out
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= files
    assert "model.safetensors" not in files
    assert (tmp_path / "adapter" / "README.md").read_text().startswith("---\nlibrary_name: peft\n")


def test_export_model_card_holds_the_lineage_and_the_evaluations(lora_store, tmp_path, capsys):
    store, refs = lora_store
    assert export(capsys, refs["sft"], "--out", tmp_path / "card", "--store", store.uri, "--merge-lora")[0] == 0
    card = (tmp_path / "card" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- posttrain\n---\n\n# qs/sft\n")
    assert f"Exported by posttrain from `{refs['sft']}` (pipeline `qs`, run `qs-r1`)" in card
    assert "`tiny-llama` (identity `preset:tiny-llama@x`)" in card
    assert (f"| `{refs['sft']}` | checkpoint | sft (sft) | trained steps=3, max_steps=3, epochs=1.0, "
            "batch_size=32, learning_rate=0.001, lr_schedule=cosine |") in card
    assert f"| `{refs['warmup']}` | dataset | warmup (synthesize) | teacher=oracle, env=arith, n=16 |" in card
    assert f"Datasets: `{refs['warmup']}`." in card
    assert f"| arith | 16 | 0.625 | 1 | 0 | 12.5 | `{refs['eval']}` |" in card


def test_export_refuses_in_one_line_and_leaves_nothing_half_written(lora_store, tmp_path, capsys):
    store, refs = lora_store
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    assert export(capsys, refs["sft"], "--out", taken, "--store", store.uri) == \
        (2, "", f"error: --out: {taken} already exists and is not an empty folder; export writes a new one")
    assert export(capsys, refs["warmup"], "--out", tmp_path / "a", "--store", store.uri) == \
        (2, "", f"error: ref: {refs['warmup']} is a dataset, not a checkpoint")
    assert export(capsys, "qs/sft", "--out", tmp_path / "a", "--store", store.uri) == \
        (2, "", "error: ref: not an artifact ref (expected name@version, 16 hex digits): 'qs/sft'")
    assert export(capsys, refs["sft"], "--out", tmp_path / "a", "--store", store.uri, "--dtype", "fp16") == \
        (2, "", "error: --dtype: a LoRA adapter is exported as trained; add --merge-lora to export full weights in "
                "fp16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no folder, no temporary one
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is taken as the place to write
    assert export(capsys, "qs/sft@latest", "--out", empty, "--store", store.uri)[0] == 0
    assert (empty / "adapter_model.safetensors").is_file()


def test_export_from_an_s3_store(lora_store, tmp_path, capsys, s3_endpoint):
    store = Store("s3://posttrain-test/export-store", {"endpoint_url": s3_endpoint})
    refs = committed(tmp_path, store)
    assert refs["sft"] == lora_store[1]["sft"]
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, "store": store.uri, "storage_options": {"endpoint_url": s3_endpoint}}))
    code, out, err = export(capsys, refs["sft"], "--out", tmp_path / "from-s3", "--spec", spec, "--merge-lora")
    assert (code, err) == (0, "")
    local = tmp_path / "local"
    assert export(capsys, lora_store[1]["sft"], "--out", local, "--store", lora_store[0].uri, "--merge-lora")[0] == 0
    assert (tmp_path / "from-s3" / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    assert "| arith | 16 | 0.625 |" in (tmp_path / "from-s3" / "README.md").read_text()


def test_export_push_to_hub_uploads_the_folder_to_a_stand_in_of_the_hub(lora_store, tmp_path, capsys):
    store, refs = lora_store
    with HubStandIn(TOKEN) as hub:
        def push(out, token, *args):
            # HF_HUB_OFFLINE=1 stays set (conftest): the push lifts it for its own requests
            env = {**os.environ, "HF_ENDPOINT": hub.url, **({"HF_TOKEN": token} if token else {})}
            env.pop("HF_TOKEN", None) if token is None else None
            return subprocess.run([POSTTRAIN, "export", refs["sft"], "--out", str(tmp_path / out), "--store",
                                   store.uri, "--push-to-hub", "me/tiny", *args], capture_output=True, text=True,
                                  env=env, timeout=300)

        missing = push("a", None)
        assert (missing.returncode, missing.stderr.strip()) == \
            (2, "error: --push-to-hub: set HF_TOKEN in the environment (a token with write access)")
        assert hub.requests == [] and not (tmp_path / "a").exists()

        pushed = push("b", TOKEN, "--merge-lora")
        assert pushed.returncode == 0, pushed.stderr[-2000:]
        assert f"pushed to {hub.url}/me/tiny/commit/" in pushed.stdout
        sent = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
        assert hub.repos["me/tiny"] == sent and "model.safetensors" in sent
        assert hub.cards == [{"library_name": "transformers", "tags": ["posttrain"]}]
        assert hub.commits == [{"summary": f"posttrain export of {refs['sft']}", "description": ""}]
        assert [(method, path.split("?")[0]) for method, path, _ in hub.requests if "agent-harnesses" not in path] == [
            ("POST", "/api/repos/create"), ("POST", "/api/validate-yaml"),
            ("POST", "/api/models/me/tiny/preupload/main"), ("POST", "/api/models/me/tiny/commit/main")]

        refused = push("c", "hf_wrong")
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert refused.stderr.startswith("error: --push-to-hub me/tiny: ")
        assert f"(the folder is written: {tmp_path / 'c'})" in refused.stderr
        assert hub.requests[-1][2] == 401 and len(hub.commits) == 1


def test_export_full_weights_in_a_dtype_and_merge_lora_refused_on_them(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from models.presets import materialize

    store = Store(f"file://{tmp_path / 'store'}")
    full = str(store.commit("t/full", "checkpoint", materialize("tiny-llama"), producer={}))  # no spec kept
    assert export(capsys, full, "--out", tmp_path / "x", "--store", store.uri, "--merge-lora") == \
        (2, "", f"error: --merge-lora: {full} holds full weights, not a LoRA adapter")
    code, out, _ = export(capsys, full, "--out", tmp_path / "fp16", "--store", store.uri, "--dtype", "fp16")
    assert code == 0 and out.endswith("(full weights, float16)\n")
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp16")).dtype.__str__() == "torch.float16"
    assert "No evaluation of this checkpoint in the store." in (tmp_path / "fp16" / "README.md").read_text()
