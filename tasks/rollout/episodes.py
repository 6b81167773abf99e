"""Episodes of an environment played by the local model, token in / token out.

Every turn, all running episodes are decoded as one batch until the env's action stop string
or the end token; the env answers each action, and its observation's tokens are appended to
that episode's context. Earlier turns are never re-tokenized, so the ids the model is trained
on are exactly the ids it sampled. A single-turn env is the one-turn case of the same loop.
An env may restart an episode's context (Turn.restart, CoD's next task of a pack): the next
turn's context is then that fresh chat prompt, and the transcript shows a separator and the prompt.
Each context also keeps the prompt text it started from, so that a policy behind an OpenAI-compatible
endpoint (tasks/rollout/endpoint_policy.py) can send it as chat messages.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

from envs.base import Outcome, Task
from envs.tools.chat import speaks_tools, task_tools
from models.sampling import Generation, SamplingParams, chat_prompt, generate_tokens

TURN_SEED_STRIDE = 7919  # turn t of an episode decodes with its seed + t * stride
# Starting an episode (a sandbox and its files) and grading it (hidden tests) is mostly waiting on
# the sandbox's processes: a few at once took 40 terminal episodes from 4.8 s to 2.1 s on 2 cores.
EPISODE_THREADS = 4


@dataclass
class TurnRecord:
    context_ids: list[int]  # the state: prompt, earlier actions and observations
    action_ids: list[int]  # what the policy sampled this turn
    observation_ids: list[int]  # the env's answer (masked from the loss)
    reward: float  # the env's per-step reward
    truncated: bool  # the action ran out of max_tokens
    kind: str = "action"  # the env's Turn.kind ("action" also for a cut action the env never saw)
    action_logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each action token
    policy_version: int = 0  # the weights' version that sampled the action


@dataclass
class Trajectory:
    env_id: str
    task: Task
    prompt_ids: list[int]
    turns: list[TurnRecord] = field(default_factory=list)
    text: str = ""  # the transcript after the prompt: actions and observations, what the rubric scores
    finished: bool = False  # the env ended the episode (not the token budget or the turn limit)
    outcome: Outcome = field(default_factory=dict)  # the episode's grade after it ended (hidden tests, workspace checks)
    actions: list[str] = field(default_factory=list)  # the policy's text of each turn (what anti-doom checks)

    @property
    def truncated(self) -> bool:
        return not self.finished

    @property
    def completion_tokens(self) -> int:
        """Tokens the policy wrote (observations excluded)."""
        return sum(len(turn.action_ids) for turn in self.turns)

    @property
    def policy_version(self) -> int:
        """The oldest weights' version that sampled one of its actions."""
        return min((turn.policy_version for turn in self.turns), default=0)

    def behaviour_logps(self) -> list[float] | None:
        """The sampler's log-prob of each completion token (0 at the env's), aligned with
        `completion()`; None when an action came without them (a scripted policy)."""
        if any(len(turn.action_logprobs) != len(turn.action_ids) for turn in self.turns):
            return None
        return [v for turn in self.turns for v in turn.action_logprobs + [0.0] * len(turn.observation_ids)]

    def completion(self) -> tuple[list[int], list[int]]:
        """All ids after the prompt and their loss mask (1 on the policy's tokens, 0 on the env's)."""
        ids, mask = [], []
        for turn in self.turns:
            ids += turn.action_ids + turn.observation_ids
            mask += [1] * len(turn.action_ids) + [0] * len(turn.observation_ids)
        return ids, mask


@dataclass(frozen=True)
class Context:
    """What a policy continues: the ids so far, and the chat prompt they began from (its text and its
    length in ids). A local model reads the ids; an endpoint speaks chat messages, so it sends the
    prompt as the user's message and what follows it as the assistant message to continue."""

    ids: list[int]
    prompt: str  # the user prompt the context started from: the task's, or the env's restart text
    prompt_len: int  # ids of the chat-formatted prompt at the start of `ids`

    @classmethod
    def start(cls, tokenizer, prompt: str) -> "Context":
        ids = chat_prompt(tokenizer, prompt)
        return cls(ids, prompt, len(ids))

    def extended(self, more_ids: list[int]) -> "Context":
        return Context(self.ids + more_ids, self.prompt, self.prompt_len)


@dataclass
class LocalPolicy:
    """The policy as a local transformers model, decoded by the generation engine."""

    model: object
    tokenizer: object
    batch_size: int = 64

    def act(self, episodes: list[int], contexts: list[Context], turn: int, params: SamplingParams,
            seeds: list[int]) -> list[Generation]:
        return self.generate_many([c.ids for c in contexts], params, seeds)

    def generate_many(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                      on_done=None) -> list[Generation]:
        """A completion of each prompt with its seed, `batch_size` at a time; `on_done(count)` after each batch."""
        return generate_tokens(self.model, self.tokenizer, prompts, params, batch_size=self.batch_size,
                               row_seeds=seeds, on_batch=on_done)

    def complete(self, prompt: str, params: SamplingParams) -> str:
        """One chat answer to a fresh prompt (an episode's own model call: RLM's `llm_query`)."""
        generation = generate_tokens(self.model, self.tokenizer, [chat_prompt(self.tokenizer, prompt)],
                                     replace(params, stop=()), batch_size=1, seed=0)[0]
        return self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)


@dataclass
class ScriptedPolicy:
    """Replays a fixed list of actions per episode (an oracle's reference solution, or a no-op):
    how env mechanics are tested without a trained model. Runs out → an empty action."""

    tokenizer: object
    scripts: list[list[str]]  # per episode, its actions in order
    respond: Callable[[str], str] = lambda prompt: ""  # its answer to an episode's own model call

    def act(self, episodes: list[int], contexts: list[Context], turn: int, params: SamplingParams,
            seeds: list[int]) -> list[Generation]:
        actions = [self.scripts[i][turn] if turn < len(self.scripts[i]) else "" for i in episodes]
        return [Generation(text, ended_ids(self.tokenizer, text, params.stop), finish_reason="stop")
                for text in actions]

    def complete(self, prompt: str, params: SamplingParams) -> str:
        return self.respond(prompt)


def single_turn(env_id: str, task: Task, prompt_ids: list[int], generation: Generation) -> Trajectory:
    """A one-action episode from a completion decoded without the episode loop (generate's batched
    single-turn path): the trajectory `roll_out` would have recorded for it."""
    truncated = generation.finish_reason == "length"
    turn = TurnRecord(prompt_ids, generation.token_ids, [], 0.0, truncated, action_logprobs=generation.logprobs,
                      policy_version=generation.policy_version)
    return Trajectory(env_id, task, prompt_ids, [turn], generation.text, finished=not truncated,
                      actions=[generation.text])


def roll_out(policy, tokenizer, env, tasks: list[Task], params: SamplingParams, *, seed: int = 0,
             on_finished=None, episode_seeds: list[int] | None = None) -> list[Trajectory]:
    """Play one episode of `env` per task (repeat a task for a group); returns their trajectories.
    Episode i samples with seed `episode_seeds[i]` (default `seed + i`), + TURN_SEED_STRIDE per turn.
    `on_finished(done)` after each turn, with the number of episodes over so far."""
    episode_seeds = episode_seeds if episode_seeds is not None else [seed + i for i in range(len(tasks))]
    params = replace(params, stop=tuple(env.action_stop))
    sub_params = replace(params, temperature=None)  # an episode's own model calls decode greedily
    with ThreadPoolExecutor(EPISODE_THREADS) as pool:
        episodes = start_episodes(pool, env, tasks, lambda prompt: policy.complete(prompt, sub_params))
        trajectories = [Trajectory(env.name, task, chat_prompt(tokenizer, task.prompt, task_tools(task)))
                        for task in tasks]
        try:
            _play(policy, tokenizer, env, episodes, trajectories, params, episode_seeds,
                  on_finished or (lambda done: None))
        finally:  # graded and released even when a turn raised: a sandbox is never left behind
            outcomes = finish_episodes(pool, episodes)
    for trajectory, outcome in zip(trajectories, outcomes):
        trajectory.outcome = outcome
    return trajectories


def start_episodes(pool: ThreadPoolExecutor, env, tasks: list[Task], llm) -> list:
    """An episode of each task, started a few at once (Environment.start may run on several
    threads; the turns stay on this one). If one fails to start, the others are finished first."""
    started = [pool.submit(env.start, task, llm) for task in tasks]
    failed = [future.exception() for future in started if future.exception() is not None]
    if failed:
        finish_episodes(pool, [future.result() for future in started if future.exception() is None])
        raise failed[0]
    return [future.result() for future in started]


def finish_episodes(pool: ThreadPoolExecutor, episodes: list) -> list[Outcome]:
    """Every episode's outcome, graded a few at once; each is finished even when another's finish raises."""
    finished = [pool.submit(episode.finish) for episode in episodes]
    return [future.result() for future in finished]


def action_text(tokenizer, token_ids: list[int], reads_tool_calls: bool) -> str:
    """An action's text. An env that reads tool calls gets special tokens too (LFM2's
    <|tool_call_start|> is one: skipped, its calls would vanish), less the end token."""
    if not reads_tool_calls:
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    kept = len(token_ids)
    while kept and token_ids[kept - 1] in ends:
        kept -= 1
    return tokenizer.decode(token_ids[:kept], skip_special_tokens=False)


def _play(policy, tokenizer, env, episodes, trajectories: list[Trajectory], params: SamplingParams,
          episode_seeds: list[int], on_finished) -> None:
    """Every turn: one batch of actions from the running episodes, and the env's answer to each."""
    contexts = [Context(t.prompt_ids, t.task.prompt, len(t.prompt_ids)) for t in trajectories]
    running = list(range(len(trajectories)))
    for turn in range(env.max_turns):
        generations = policy.act(running, [contexts[i] for i in running], turn, params,
                                 [episode_seeds[i] + turn * TURN_SEED_STRIDE for i in running])
        still_running = []
        for i, gen in zip(running, generations):
            action = action_text(tokenizer, gen.token_ids, speaks_tools(env))
            truncated = gen.finish_reason == "length"
            answer = episodes[i].step(action) if not truncated else None
            observation = answer.observation if answer is not None and not answer.done else ""
            restart = answer.restart if answer is not None and not answer.done else None
            # a restarted context never holds the observation: only the transcript shows it
            observation_ids = tokenizer(observation, add_special_tokens=False)["input_ids"] \
                if observation and restart is None else []
            trajectory = trajectories[i]
            trajectory.turns.append(TurnRecord(contexts[i].ids, gen.token_ids, observation_ids,
                                               answer.reward if answer is not None else 0.0, truncated,
                                               answer.kind if answer is not None else "action", gen.logprobs,
                                               gen.policy_version))
            trajectory.actions.append(action)
            trajectory.text += action + (answer.transcript() if answer is not None else "")
            if answer is None or answer.done:
                trajectory.finished = answer is not None
            else:
                contexts[i] = Context.start(tokenizer, restart) if restart is not None \
                    else contexts[i].extended(gen.token_ids + observation_ids)
                still_running.append(i)
        running = still_running
        on_finished(len(trajectories) - len(running))
        if not running:
            return
    on_finished(len(trajectories))  # the episodes still running are out of turns: over too


def ended_ids(tokenizer, text: str, stop: tuple[str, ...]) -> list[int]:
    """The ids of a finished action as the engine would end them: at a tool call's stop string,
    else with the end token."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if stop and text.endswith(stop) else ids + [tokenizer.eos_token_id]


TASK_POOL = 4096  # train tasks drawn per env; the steps of a stage that plays envs (rl, online preference) sample from it


def step_tasks(pools: dict[str, list], weights: dict[str, float], count: int, seed: int, step: int, draw: int = 0,
               stream: str = "rl"):
    """(env id, task) pairs of a step: envs drawn by weight, tasks drawn from the env's pool; a pure
    function of (stream, seed, step, draw), so a resumed stage draws what it would have drawn."""
    rng = random.Random(f"{stream}:{seed}:{step}" + (f":{draw}" if draw else ""))
    env_ids = rng.choices(list(weights), weights=list(weights.values()), k=count)
    return [(env_id, pools[env_id][rng.randrange(len(pools[env_id]))]) for env_id in env_ids]
