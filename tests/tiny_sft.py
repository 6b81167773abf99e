"""A few SFT steps of tiny-llama on given examples, saved as a checkpoint folder: the quick,
real models the serving and judge tests put behind an endpoint."""

import atexit
import shutil
import tempfile
from pathlib import Path


def tiny_llama():
    """(model, tokenizer) of the untrained tiny-llama preset."""
    from transformers import AutoModelForCausalLM

    from models.loading import load_tokenizer
    from models.presets import materialize

    return AutoModelForCausalLM.from_pretrained(str(materialize("tiny-llama"))), \
        load_tokenizer(materialize("tiny-llama"))


def sft_folder(model, tokenizer, examples: list, steps: int, prefix: str) -> Path:
    """`steps` SFT steps (batch 16, lr 3e-3) over `examples`; the folder goes away at exit."""
    from accelerate import Accelerator

    from tasks.stages.sft import SftStage, train_step
    from tasks.train.learner import Learner
    from tasks.train.loop import batch_indices, make_optimizer

    stage = SftStage(kind="sft", id="t", data="t", max_steps=steps, batch_size=16, learning_rate=3e-3)
    optimizer, scheduler = make_optimizer(model, stage, steps)
    accelerator = Accelerator()
    model.train()
    for step in range(steps):
        batch = [examples[i] for i in batch_indices(len(examples), 16, 0, step)]
        train_step(Learner(model, accelerator, optimizer, scheduler), batch, tokenizer.pad_token_id)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, True)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def judge_folder(replies: str) -> Path:
    """tiny-llama after a short SFT on judge requests about one-digit arith answers, exactly as the
    judge client sends them (tasks/rollout/judge_client.py: the completion fenced, the rules in a
    system message), in one of the forms posttrain's judges answer: `yes_no`, tasks/rollout/judge.py's
    question answered `VERDICT: yes` (right) or `VERDICT: no` (a wrong number); `score`, a judge
    reward's default prompt answered `SCORE: 10` or `SCORE: 0`. (One model taught both mixes them up.)
    30 steps teach the form, not the grading (the yes/no model answers yes to nearly all): the tests
    check how a judge is asked and read, and the fenced requests are 3.5 times as long as the bare
    prompts were."""
    from envs.arith import ArithEnv, ArithEnvConfig
    from envs.dataset import JudgeScoring
    from models.serving.model import render_prompt
    from tasks.common.encoding import encode_ids
    from tasks.rollout.judge import verdict_question
    from tasks.rollout.judge_client import Question, ScoreForm

    arith = ArithEnv(ArithEnvConfig(kind="arith", digits=1))
    scoring = JudgeScoring(endpoint="http://127.0.0.1:1/v1", model="judge")
    model, tokenizer = tiny_llama()
    examples = []
    for task in arith.tasks("train", 128, 0):
        right = arith.reference_completion(task)
        wrong = right.replace(f"is {task.answer}.", f"is {int(task.answer) + 1}.")
        for completion, verdict, score in ((right, "yes", "10"), (wrong, "no", "0")):
            row = {"prompt": task.prompt, "answer": task.answer, "completion": completion}
            question, reply = (verdict_question(row), f"VERDICT: {verdict}") if replies == "yes_no" else \
                (Question.of(scoring.prompt, ScoreForm(scoring.min_score, scoring.max_score), task.prompt,
                             completion, task.answer), f"SCORE: {score}")
            prompt_ids = tokenizer(render_prompt(tokenizer, question.messages, True, False),
                                   add_special_tokens=False)["input_ids"]
            reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            examples.append(encode_ids(prompt_ids, reply_ids, 448))
    return sft_folder(model, tokenizer, examples, 30, f"posttrain-judge-{replies}-")
