"""On-policy distillation (the `distill` stage): its generalized JSD against TRL's GKDTrainer (pinned
TRL) on the same logits and on the same batch through the trainer's own compute_loss, the teacher's
tokenizer check, and the config's rules."""

import pytest
import torch

from models.distill_losses import distill_loss, generalized_jsd
from models.loading import load_tokenizer
from models.losses import IGNORE_INDEX
from models.presets import materialize
from tasks.stages.distill import DistillStage, TeacherMismatch, check_teacher_tokenizer, jsd_loss, on_policy

TRL_VERSION = "1.16.0"


def gkd_trainer_class():
    import trl
    from trl.experimental.gkd import GKDTrainer

    assert trl.__version__ == TRL_VERSION
    return GKDTrainer


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_distill_jsd_matches_trls_generalized_jsd_loss(beta, temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11), 2 * torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :2] = labels[2, 4] = IGNORE_INDEX
    theirs = gkd_trainer_class().generalized_jsd_loss(student, teacher, labels=labels, beta=beta,
                                                      temperature=temperature)
    ours = distill_loss(student, teacher, labels != IGNORE_INDEX, beta, temperature)
    assert theirs.item() > 1e-3
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)


def test_distill_jsd_ends_are_the_two_kls_and_vanish_at_the_teacher():
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 4, 9), torch.randn(2, 4, 9)
    s, t = student.log_softmax(-1), teacher.log_softmax(-1)
    assert generalized_jsd(student, teacher, 0.0) == pytest.approx((t.exp() * (t - s)).sum(-1))  # forward KL
    assert generalized_jsd(student, teacher, 1.0) == pytest.approx((s.exp() * (s - t)).sum(-1))  # reverse KL
    assert generalized_jsd(teacher, teacher, 0.5).abs().max().item() < 1e-6


@pytest.fixture(scope="module")
def student_teacher_batch():
    """Two different tiny models on one tokenizer, and a batch of prompt + completion rows, the prompt
    and the padding masked (labels IGNORE_INDEX) as GKD's collator masks them."""
    from transformers import AutoModelForCausalLM

    folder = materialize("tiny-llama")
    student = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    torch.manual_seed(3)
    teacher = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    rows = [([5, 6, 7], [20, 21, 22, 2]), ([8, 9], [30, 31, 32, 33, 34, 2]), ([5, 6, 7, 8], [40, 2])]
    width = max(len(p) + len(c) for p, c in rows)
    tokenizer = load_tokenizer(folder)
    ids = torch.full((3, width), tokenizer.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    labels = torch.full((3, width), IGNORE_INDEX)
    for row, (prompt, completion) in enumerate(rows):
        ids[row, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        mask[row, :len(prompt) + len(completion)] = 1
        labels[row, len(prompt):len(prompt) + len(completion)] = torch.tensor(completion)
    return student, teacher, tokenizer, {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distill_stage_loss_matches_trls_gkd_trainer_on_the_same_batch(beta, student_teacher_batch, tmp_path):
    """The stage's loss (jsd_loss, what train_step backpropagates) equals GKDTrainer.compute_loss's."""
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig

    student, teacher, tokenizer, batch = student_teacher_batch
    args = GKDConfig(output_dir=str(tmp_path), beta=beta, lmbda=0.0, use_cpu=True, bf16=False, report_to=[])
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    trainer = gkd_trainer_class()(model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_list([{"messages": messages}] * 2))
    with torch.no_grad():
        theirs = trainer.compute_loss(student, dict(batch)).item()
        ours = jsd_loss(student, teacher, batch["input_ids"], batch["attention_mask"], batch["labels"], beta).item()
    assert theirs > 1e-4
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_distill_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    folder = materialize("tiny-llama")
    student = load_tokenizer(folder)
    check_teacher_tokenizer(load_tokenizer(folder), student)  # the same tokenizer passes
    other = load_tokenizer(folder)
    other.add_tokens(["<teacher-only>"])
    other.save_pretrained(str(tmp_path / "teacher"))
    with pytest.raises(TeacherMismatch) as refused:
        check_teacher_tokenizer(load_tokenizer(tmp_path / "teacher"), student)
    message = str(refused.value)
    assert message.startswith("teacher: its tokenizer is not the student's")
    assert "'<teacher-only>'" in message and len(message.splitlines()) == 1
    shifted = load_tokenizer(folder)
    shifted.pad_token = shifted.eos_token  # the same vocabulary, another pad id
    with pytest.raises(TeacherMismatch, match="pad_token_id differs"):
        check_teacher_tokenizer(shifted, student)


def distill_stage(**fields) -> DistillStage:
    return DistillStage(**{"kind": "distill", "id": "distill", "teacher": "sft", "envs": {"arith": 1.0},
                           "max_steps": 4, **fields})


def test_distill_config_takes_trls_meanings_and_refuses_what_cannot_work():
    stage = distill_stage()
    assert (stage.beta, stage.lmbda, stage.temperature) == (0.5, 1.0, 0.9)
    assert all(on_policy(stage, step) for step in range(20))
    mixed = distill_stage(lmbda=0.5, data="warmup")
    share = sum(on_policy(mixed, step) for step in range(400)) / 400
    assert 0.4 < share < 0.6 and on_policy(mixed, 7) == on_policy(distill_stage(lmbda=0.5, data="warmup"), 7)
    assert not any(on_policy(distill_stage(lmbda=0.0, data="warmup"), step) for step in range(20))
    with pytest.raises(ValueError, match="lmbda \\(0.5\\) below 1 trains that share of the steps on a dataset"):
        distill_stage(lmbda=0.5)
    with pytest.raises(ValueError, match="data is read only by off-policy steps"):
        distill_stage(data="warmup")
    with pytest.raises(ValueError, match="an endpoint cannot be a teacher here"):
        distill_stage(teacher={"endpoint": "http://127.0.0.1:8000/v1", "model": "big"})
    with pytest.raises(ValueError, match="teacher and student are the same checkpoint"):
        distill_stage(student="sft")
    assert stage.reads_base_model() and not distill_stage(student="align").reads_base_model()
    assert [ref[:2] for ref in distill_stage(student="align", lmbda=0.2, data="warmup").stage_refs()] == \
        [("teacher", "sft"), ("student", "align"), ("data", "warmup")]


def test_distill_teacher_outside_the_spec_is_keyed_by_its_identity_and_is_no_stage_input():
    outside = distill_stage(teacher={"base": "tiny-qwen3"})
    assert outside.stage_refs() == [] and outside.params()["teacher"]["base"].startswith("preset:tiny-qwen3@")
    assert distill_stage().params()["teacher"] == "sft"
    with pytest.raises(ValueError, match="teacher.model.base"):
        distill_stage(teacher={"base": ""})
