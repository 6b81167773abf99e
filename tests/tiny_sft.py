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

    from tasks.common.learner import Learner
    from tasks.common.training import batch_indices, make_optimizer
    from tasks.stages.sft import SftStage, train_step

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
