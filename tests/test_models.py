import torch
from transformers import AutoModelForCausalLM

from models.config import ModelConfig
from models.loading import base_identity, load_model, load_tokenizer, resolve_base
from models.losses import IGNORE_INDEX, completion_nll
from models.presets import PRESETS, materialize


def test_presets_are_normal_hf_folders_with_chat_template():
    for name in PRESETS:
        folder = materialize(name)
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        assert model.config.model_type == PRESETS[name][0]
        limit = 2_000_000 if name.startswith("tiny-") else 6_000_000  # small-llama: 4.8M
        assert sum(p.numel() for p in model.parameters()) < limit
    tokenizer = load_tokenizer(materialize("tiny-llama"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "what is 27+15?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|user|>\nwhat is 27+15?<|end|>\n<|assistant|>\n"
    ids = tokenizer("27 + 15 = 42", add_special_tokens=False)["input_ids"]
    digits = [t for t in tokenizer.convert_ids_to_tokens(ids) if t.strip("Ġ").isdigit()]
    assert digits == list("27154" "2")  # one token per digit
    assert tokenizer.decode(ids) == "27 + 15 = 42"


def test_preset_build_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    rebuilt = AutoModelForCausalLM.from_pretrained(str(materialize("tiny-llama")))
    monkeypatch.delenv("POSTTRAIN_CACHE")
    cached = AutoModelForCausalLM.from_pretrained(str(materialize("tiny-llama")))
    for a, b in zip(rebuilt.parameters(), cached.parameters()):
        assert torch.equal(a, b)


def test_base_identity_and_resolution(tmp_path):
    assert base_identity("tiny-llama").startswith("preset:tiny-llama@")
    assert base_identity("LiquidAI/LFM2-350M") == "hub:LiquidAI/LFM2-350M"
    assert resolve_base("LiquidAI/LFM2-350M") == "LiquidAI/LFM2-350M"  # passed to from_pretrained as is
    assert base_identity(str(materialize("tiny-llama"))).startswith("path:")


def test_lora_checkpoint_round_trip(tmp_path):
    cfg = ModelConfig(base="tiny-llama", lora={"r": 4, "alpha": 8})
    model = load_model(resolve_base("tiny-llama"), cfg, trainable=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.01)
    model.save_pretrained(str(tmp_path))
    reloaded = load_model(tmp_path, cfg)
    ids = torch.tensor([[1, 5, 9, 12]])
    assert torch.allclose(model(ids).logits, reloaded(ids).logits, atol=1e-6)


def test_completion_nll_matches_manual_mean_over_completion_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 1, 2, 3, 6]])
    loss, tokens = completion_nll(logits, labels)
    logp = torch.log_softmax(logits, -1)
    terms = [-logp[b, t - 1, labels[b, t]] for b in range(2) for t in range(1, 5) if labels[b, t] != IGNORE_INDEX]
    assert tokens == len(terms) == 6
    assert torch.allclose(loss, torch.stack(terms).mean())


def test_a_saved_tokenizer_does_not_depend_on_hf_hub_offline(tmp_path, monkeypatch):
    saved = []
    for offline in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        folder = tmp_path / offline
        load_tokenizer(materialize("tiny-llama")).save_pretrained(str(folder))
        saved.append((folder / "tokenizer_config.json").read_text())
    assert saved[0] == saved[1] and "local_files_only" not in saved[0]
