"""The served model of `posttrain serve-model` (models/serving/__init__.py tells the whole server):
one loaded checkpoint, on its device, its engine thread (batch.py) and its runtime adapters
(weights.py), turning requests (requests.py) into jobs and finished jobs into answers (responses.py)."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from models.config import ModelConfig
from models.loading import ADAPTER_CONFIG, load_model, load_tokenizer
from models.sampling import Generation, SamplingParams, generate_tokens
from models.serving.batch import Batcher, Job
from models.serving.echo import echo_choices
from models.serving.limits import MAX_CHOICES, Limits, ServingError
from models.serving.weights import Adapters, LoadAdapter, ReloadWeights, copy_weights, weight_files
from models.serving.requests import ChatRequest, CompletionRequest, SamplingRequest
from models.serving.responses import chat_logprobs, completion_logprobs, envelope, usage

SENTINEL = "\x00posttrain-final-message\x00"  # stands for the final message's content while rendering


def render_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                  tools: list[dict] | None = None) -> str:
    """The chat template's text (`tools`: OpenAI tool schemas, rendered by the template); to continue
    the final message, everything the template writes after its content (the end-of-turn marker) is
    cut, found by rendering a sentinel in its place."""
    if not continue_final_message:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    *earlier, final = messages
    rendered = tokenizer.apply_chat_template([*earlier, {**final, "content": SENTINEL}], tools=tools, tokenize=False,
                                             add_generation_prompt=False)
    cut = rendered.rfind(SENTINEL)
    if cut < 0:
        raise ServingError(400, "continue_final_message: the chat template drops the final message's content")
    return rendered[:cut] + final["content"]


def response_text(tokenizer, generation: Generation, stop: tuple[str, ...], include_stop: bool) -> str:
    """OpenAI's text ends before the stop string; vLLM's include_stop_str_in_output keeps it
    (and nothing the token that held it wrote after it)."""
    if not include_stop:
        return generation.text
    text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
    hits = [(text.find(s), -len(s), s) for s in stop if s in text]
    if not hits:
        return text
    position, _, found = min(hits)
    return text[:position + len(found)]


class ServedModel:
    """One loaded checkpoint, on its device (`serving_device`), its engine thread and its runtime
    adapters; a request waits for the engine at most `limits.queue_timeout` seconds."""

    def __init__(self, folder: str | Path, name: str, model: ModelConfig | None = None,
                 limits: Limits | None = None, lora_folder: str | Path | None = None, tool_parser=None):
        self.name, self.created = name, int(time.time())
        # reads an answer's tool calls (envs/tools/parsers: `parse(text)` -> content, calls, malformed);
        # None: tool_choice other than "none" is refused, as vLLM without --enable-auto-tool-choice
        self.tool_parser = tool_parser
        self.limits = limits or Limits()
        model = model or model_config(folder)
        self.device = serving_device(model)
        self.tokenizer = load_tokenizer(folder)
        self.model = load_model(folder, model).to(self.device).eval()
        if lora_folder is not None and hasattr(self.model, "peft_config"):
            raise ValueError("--lora-folder: runtime adapters need a full-weight checkpoint; serve the adapter's "
                             "base model instead")
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        self.vocab = self.model.get_input_embeddings().weight.shape[0]
        self.adapters = Adapters(lora_folder, name)
        self.weights_version = 0  # set by full-weight reloads
        self.batcher = Batcher(self._decode, self.limits.batch_window)

    def card(self, name: str | None = None) -> dict:
        """vLLM's model card: an adapter's names its `parent`; the served model's its `max_model_len`."""
        return {"id": name or self.name, "object": "model", "created": self.created, "owned_by": "posttrain",
                **({"parent": self.name} if name else {"max_model_len": self.context})}

    def cards(self) -> list[dict]:
        return [self.card(), *(self.card(adapter) for adapter in self.adapters.served())]

    def adapter_of(self, name: str) -> str | None:
        """The adapter a request's `model` names (None: the served weights); 404 for an unknown name."""
        if name == self.name:
            return None
        if name in self.adapters.names:
            return name
        raise ServingError(404, f"The model `{name}` does not exist (this server serves "
                                f"{', '.join(f'`{n}`' for n in [self.name, *self.adapters.served()])}).",
                           param="model")

    def chat_job(self, request: ChatRequest) -> tuple[Job, list[int]]:
        if request.tool_choice not in (None, "none") and self.tool_parser is None:
            raise ServingError(400, f"tool_choice {request.tool_choice if isinstance(request.tool_choice, str) else 'named'!r}"
                                    " needs serve-model started with --enable-auto-tool-choice --tool-call-parser NAME",
                               param="tool_choice")
        if request.stream and request.tool_schemas() is not None and self.tool_parser is not None:
            raise ServingError(400, "stream: tool calls are not streamed by serve-model (send stream false)",
                               param="stream")
        prompt_ids = self.tokenizer(render_prompt(self.tokenizer, [m.template_turn() for m in request.messages],
                                                  request.add_generation_prompt, request.continue_final_message,
                                                  request.tool_schemas()),
                                    add_special_tokens=False)["input_ids"]
        return self._job(request, [prompt_ids], "messages"), prompt_ids

    def completion_job(self, request: CompletionRequest) -> tuple[Job, list[list[int]]]:
        prompts = [p if isinstance(p, list) else self.tokenizer(p, add_special_tokens=False)["input_ids"]
                   for p in request.prompts()]
        for ids in prompts:
            if not ids:
                raise ServingError(400, "prompt: a prompt has no tokens", param="prompt")
            if max(ids) >= self.vocab:
                raise ServingError(400, f"prompt: token id {max(ids)} is outside the vocabulary "
                                        f"(0..{self.vocab - 1})", param="prompt")
        return self._job(request, prompts, "prompt"), prompts

    def _job(self, request: SamplingRequest, prompts: list[list[int]], field: str) -> Job:
        adapter = self.adapter_of(request.model)
        if len(prompts) * request.n > MAX_CHOICES:
            raise ServingError(400, f"n: {len(prompts)} prompts × n {request.n} is more than {MAX_CHOICES} choices",
                               param="n")
        params = request.sampling(min(self._room(len(ids), field) for ids in prompts))
        copies = copies_of(request, params)
        seed = request.seed or 0
        return Job([ids for ids in prompts for _ in range(copies)], params,
                   [seed + j for _ in prompts for j in range(copies)], adapter, copies)

    def _decode(self, prompts, params: SamplingParams, seeds: list[int], adapter: str | None, abandoned, on_step):
        with self.adapters.active(self.model, adapter):
            generations = generate_tokens(self.model, self.tokenizer, prompts, params, batch_size=len(prompts),
                                          row_seeds=seeds, abandoned=abandoned, on_step=on_step)
        for generation in generations:
            generation.policy_version = self.weights_version
        return generations

    def load_adapter(self, request: LoadAdapter) -> None:
        self.adapters.adapter_folder(request.lora_path)  # refused before the engine is waited for
        with self.batcher.engine:
            self.model = self.adapters.load(self.model, request)

    def reload_weights(self, request: ReloadWeights) -> None:
        """Full weights from the LoRA folder, copied in between two batches."""
        if self.adapters.folder is None:
            raise ServingError(404, "runtime weight loading is off (start serve-model with --lora-folder)")
        files = weight_files(self.adapters.inside(request.weights_path, "weights_path"))
        with self.batcher.engine:
            if self.adapters.names:  # trained on the weights about to change
                raise ServingError(400, f"unload the runtime adapters first ({', '.join(self.adapters.served())})")
            copy_weights(self.model, files)
            self.weights_version = request.version

    def unload_adapter(self, name: str) -> None:
        with self.batcher.engine:
            self.model = self.adapters.unload(self.model, name)

    def complete(self, request: ChatRequest) -> dict:
        """A chat request answered in this process (no HTTP): through the engine thread, as a request is."""
        job, prompt_ids = self.chat_job(request)
        self.batcher.submit(job).finished.wait()
        if job.error is not None:
            raise job.error
        return self.chat_answer(request, job, prompt_ids)

    def choices(self, request: SamplingRequest, job: Job) -> list[Generation]:
        """Every choice of a finished job, prompt by prompt (greedy copies decoded once)."""
        copies = copies_of(request, job.params)
        return [g for k in range(0, len(job.generations), copies)
                for g in (job.generations[k:k + copies] * (request.n // copies))]

    def chat_answer(self, request: ChatRequest, job: Job, prompt_ids: list[int]) -> dict:
        choices = []
        for index, generation in enumerate(self.choices(request, job)):
            message, finish = self.message(request, self.text(request, job, generation), generation.finish_reason)
            choice = {"index": index, "message": message, "finish_reason": finish,
                      "logprobs": chat_logprobs(self.tokenizer, generation) if request.logprobs else None}
            choices.append({**choice, "token_ids": generation.token_ids} if request.return_token_ids else choice)
        answer = {**envelope("chat.completion", request.model), **self.version_of(job), "choices": choices,
                  "usage": usage(len(prompt_ids), self.choices(request, job))}
        return {**answer, "prompt_token_ids": prompt_ids} if request.return_token_ids else answer

    def message(self, request: ChatRequest, text: str, finish_reason: str) -> tuple[dict, str]:
        """The answer's message: its tool calls read by the parser (finish_reason "tool_calls") where
        the request offers tools, else its text."""
        if self.tool_parser is None or request.tool_schemas() is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self.tool_parser.parse(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, finish_reason
        calls = [{**call.openai(), "id": f"call_{uuid.uuid4().hex[:24]}"} for call in parsed.calls]
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, "tool_calls"

    def completion_answer(self, request: CompletionRequest, job: Job, prompts: list[list[int]]) -> dict:
        choices = []
        for index, generation in enumerate(self.choices(request, job)):
            choice = {"index": index, "text": self.text(request, job, generation),
                      "finish_reason": generation.finish_reason,
                      "logprobs": completion_logprobs(self.tokenizer, generation, request.return_tokens_as_token_ids)
                      if request.logprobs is not None else None}
            if request.return_token_ids:
                choice |= {"token_ids": generation.token_ids, "prompt_token_ids": prompts[index // request.n]}
            choices.append(choice)
        if request.echo:
            echo_choices(self, request, job, prompts, choices)
        return {**envelope("text_completion", request.model), **self.version_of(job), "choices": choices,
                "usage": usage(sum(len(p) for p in prompts), self.choices(request, job))}

    def version_of(self, job: Job) -> dict:
        """serve-model's `weights_version` of an answer from the served weights once they were reloaded."""
        if job.adapter is not None or not job.generations or not job.generations[0].policy_version:
            return {}
        return {"weights_version": job.generations[0].policy_version}

    def text(self, request: SamplingRequest, job: Job, generation: Generation) -> str:
        return response_text(self.tokenizer, generation, job.params.stop, request.include_stop_str_in_output)

    def _room(self, prompt_tokens: int, field: str = "messages") -> int:
        """Tokens left in the context window after the prompt: the most a request decodes (256
        when the model's config names no context)."""
        if self.context is None:
            return 256
        if prompt_tokens >= self.context:
            raise ServingError(400, f"{field}: the prompt is {prompt_tokens} tokens, the model's context is "
                                    f"{self.context}", param=field)
        return self.context - prompt_tokens


def copies_of(request: SamplingRequest, params: SamplingParams) -> int:
    """Rows decoded per prompt: `n`, or one when decoding greedily (its choices are all the same)."""
    return 1 if params.temperature is None else request.n


def serving_device(model: ModelConfig) -> str:
    """Where a served model runs: the first GPU the process sees when CUDA is present and
    `model.device` is auto, else the CPU."""
    import torch

    return "cuda:0" if model.device == "auto" and torch.cuda.is_available() else "cpu"


def model_config(folder: str | Path) -> ModelConfig:
    """For a folder without its spec's model config: the default one; a LoRA adapter checkpoint
    names its base model itself (as the path it was trained from)."""
    adapter = Path(folder) / ADAPTER_CONFIG
    if adapter.exists():
        return ModelConfig(base=json.loads(adapter.read_text())["base_model_name_or_path"])
    return ModelConfig()


