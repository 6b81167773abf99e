"""`openclaw`: OpenClaw-style workspace tasks (PinchBench-like), solved with workspace tools and skills.

Data (`tasks` in the config, default envs/data/openclaw/): `tasks/<id>.md` (front matter, the
prompt, then a `## Oracle` section: the reference actions, one per line, the last one the final
reply), `tasks/files/` (files a task copies into its workspace), `skills/<name>/SKILL.md` (front
matter `name` and `description`, then instructions) and `web.json` (the pages web_search and
web_fetch answer from; there is no network). Front matter is `key: value` lines between `---`
fences; a value that starts with `[`, `{` or `"` is JSON, any other is a plain string. Each
episode gets a fresh sandbox whose /work holds the task's files and every skill folder; the
task's grader (envs/openclaw/graders.py) scores the workspace snapshot and the transcript.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.base import NO_OUTCOME, CatalogueEnv, Outcome, RewardFunc, Rubric, SubPolicy, Task
from envs.openclaw.families import GeneratedClawTasks, request
from envs.openclaw.graders import check_grader
from envs.openclaw.native import native_actions, native_episode, native_task
from envs.openclaw.shortcuts import shortcut_lines
from envs.openclaw.tools import OpenClawEpisode, ToolError, parse_call, workspace_path
from envs.sandbox import Sandbox, SandboxLimits
from envs.shortcuts import FlawedTeacher
from envs.task_files import files_below, regular_file
from envs.tools.chat import ToolChat
from envs.tools.episode import ToolEpisode

DATA = Path(__file__).parents[1] / "data" / "openclaw"
TOOLS_HELP = ('Tools, one per turn: <tool>{"name":"exec","command":"ls"}</tool>; also read {path}, '
              'write {path,content}, edit {path,old,new}, memory_search {query}, memory_get {path}, '
              'web_search {query}, web_fetch {url}. '
              'A reply without a tool ends the task.')
SKILLS_HELP = "Skills (read skills/<name>/SKILL.md first): {skills}."
ORACLE_HEADING = "## Oracle"
TASK_KEYS = {"id", "category", "grading_type", "timeout_seconds", "workspace_files", "split", "grader", "grader_args",
             "skills"}
SKILL_KEYS = {"name", "description"}


class OpenClawEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["openclaw"]
    tasks: str | None = None  # a folder shaped like envs/data/openclaw (tasks/, skills/, web.json); None: that one
    # the tasks drawn from the generated families instead of the folder's task files (its skills and web stay)
    generated: GeneratedClawTasks | None = None
    max_turns: int = Field(6, ge=2)
    sandbox: SandboxLimits = SandboxLimits()
    # how the model calls the tools: `tags`, <tool>{json}</tool> as TOOLS_HELP tells it; `native`, the tools
    # as OpenAI schemas shown by the model's chat template and called in its own format (envs/tools)
    tool_format: Literal["tags", "native"] = "tags"
    # native: the template's tool-call family (envs/tools/parsers); auto: read from the chat template
    # (the tiny presets' template writes none: name one)
    tool_parser: Literal["auto", "hermes", "lfm2", "llama3"] = "auto"
    # the share of tasks whose synthesize-stage oracle teacher acts without reading (envs/shortcuts.py)
    teacher_shortcut_rate: float = Field(0.0, ge=0, le=1)


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    files: dict[str, str]  # workspace path -> content (SKILL.md and anything beside it)


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def front_matter(text: str, source: Path) -> tuple[dict[str, object], str]:
    """The `key: value` fields between the leading `---` fences, and the text after them."""
    lines = text.split("\n")
    closing = [i for i, line in enumerate(lines) if line.strip() == "---" and i > 0]
    if lines[0].strip() != "---" or not closing:
        raise ValueError(f"{source}: no front matter (a `---` line, `key: value` lines, a `---` line)")
    fields: dict[str, object] = {}
    for number, line in enumerate(lines[1:closing[0]], 2):
        if not line.strip():
            continue
        key, colon, value = (part.strip() for part in line.partition(":"))
        if not colon or not key.isidentifier() or key in fields:
            raise ValueError(f"{source}:{number}: not a new `key: value` line: {line.strip()!r}")
        try:
            fields[key] = json.loads(value) if value[:1] in ('[', '{', '"') else value
        except ValueError as exc:
            raise ValueError(f"{source}:{number}: {key} is not valid JSON: {exc}") from None
    return fields, "\n".join(lines[closing[0] + 1:])


def load_skill(folder: Path) -> Skill:
    source = folder / "SKILL.md"
    if not source.is_file():
        raise ValueError(f"{source}: missing (every skill folder holds a SKILL.md)")
    fields, _ = front_matter(read_text(source), source)
    if set(fields) != SKILL_KEYS or not all(isinstance(value, str) and value for value in fields.values()):
        raise ValueError(f"{source}: front matter needs exactly a non-empty `name` and `description`")
    if fields["name"] != folder.name:
        raise ValueError(f"{source}: name {fields['name']!r} is not the folder's name {folder.name!r}")
    files = {f"skills/{folder.name}/{relative}": read_text(path) for relative, path in files_below(folder).items()}
    return Skill(fields["name"], fields["description"], files)


def load_web(source: Path) -> list[dict[str, str]]:
    if not source.exists():
        return []
    try:
        pages = json.loads(source.read_text())["pages"]
        if not all(isinstance(page, dict) and set(page) == {"url", "title", "text"}
                   and all(isinstance(value, str) for value in page.values()) for page in pages):
            raise ValueError("each page is {url, title, text}, all strings")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{source}: not a web fixture ({{\"pages\": [{{url, title, text}}]}}): {exc}") from None
    return pages


def workspace_files(entries: object, files: Path, source: Path) -> dict[str, str]:
    """The task's workspace: a file name under tasks/files/, or {"path": ..., "content": ...} inline."""
    if not isinstance(entries, list):
        raise ValueError(f"{source}: workspace_files must be a JSON list")
    workspace = {}
    for entry in entries:
        try:
            if isinstance(entry, str):
                path = workspace_path(entry)
                if not regular_file(files / path, files).is_file():
                    raise ValueError(f"workspace file {entry!r} is not in {files}")
                workspace[path] = read_text(files / path)
            elif isinstance(entry, dict) and set(entry) == {"path", "content"} and all(
                    isinstance(value, str) for value in entry.values()):
                workspace[workspace_path(entry["path"])] = entry["content"]
            else:
                raise ValueError(f"a workspace file is a name or {{\"path\", \"content\"}}, not {entry!r}")
        except (ToolError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None
    return workspace


def oracle_lines(body: str, source: Path) -> tuple[str, list[str]]:
    """The prompt and the reference actions (tool calls, then the final reply) of a task's body."""
    prompt, heading, oracle = body.partition(f"\n{ORACLE_HEADING}\n")
    actions = [line.strip() for line in oracle.splitlines() if line.strip()]
    if not heading or not prompt.strip() or not actions:
        raise ValueError(f"{source}: the body is the prompt, then `{ORACLE_HEADING}` and the reference actions")
    try:
        calls = [parse_call(action) for action in actions]
    except ToolError as exc:
        raise ValueError(f"{source}: bad oracle action: {exc}") from None
    if calls[-1] is not None or any(call is None for call in calls[:-1]):
        raise ValueError(f"{source}: oracle actions are tool calls, one per line, then one final reply")
    return prompt.strip(), actions


def load_task(source: Path, skills: dict[str, Skill], files: Path) -> Task:
    fields, body = front_matter(read_text(source), source)
    if not {"id", "category", "grading_type", "timeout_seconds", "split", "grader"} <= set(fields) <= TASK_KEYS:
        raise ValueError(f"{source}: front matter needs id, category, grading_type, timeout_seconds, split, grader "
                         f"(and may have workspace_files, grader_args, skills); got {', '.join(fields)}")
    if fields["id"] != source.stem:
        raise ValueError(f"{source}: id {fields['id']!r} is not the file's name")
    if fields["grading_type"] != "automated" or fields["split"] not in ("train", "eval"):
        raise ValueError(f"{source}: grading_type must be automated and split train or eval")
    if not str(fields["timeout_seconds"]).isdigit() or int(fields["timeout_seconds"]) < 1:
        raise ValueError(f"{source}: timeout_seconds must be a positive integer")
    task_skills = fields["skills"] if "skills" in fields else []
    if not isinstance(task_skills, list) or not all(isinstance(name, str) and name in skills for name in task_skills):
        raise ValueError(f"{source}: skills must be a JSON list of shipped skills ({', '.join(skills)})")
    grader_args = fields["grader_args"] if "grader_args" in fields else {}
    try:
        check_grader(fields["grader"], grader_args)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    workspace = workspace_files(fields["workspace_files"] if "workspace_files" in fields else [], files, source)
    prompt, actions = oracle_lines(body, source)
    offered = "; ".join(f"{name}: {skills[name].description}" for name in task_skills)
    full_prompt = "\n".join([TOOLS_HELP, *([SKILLS_HELP.format(skills=offered)] if task_skills else []), prompt])
    return Task(id=fields["id"], prompt=full_prompt, answer="", info={
        "category": fields["category"], "split": fields["split"], "timeout_seconds": int(fields["timeout_seconds"]),
        "workspace": workspace, "grader": fields["grader"], "grader_args": grader_args, "oracle": actions})


def generated_task(family: str, split: str, index: int, seed: int) -> Task:
    """Variant `index` of a generated family (envs/openclaw/families.py) as a task."""
    made = request(family, split, index, seed)
    return Task(id=f"{family}-{split[0]}{index}", prompt=f"{TOOLS_HELP}\n{made.prompt}", answer="", info={
        "category": family, "family": family, "split": split, "timeout_seconds": 60, "workspace": made.workspace,
        "grader": made.grader, "grader_args": made.grader_args, "oracle": list(made.oracle)})


def graded(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """The task's grader on the finished episode (a missing outcome raises: an ungraded episode is no 0)."""
    return outcome["graded"]


def tool_calls(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    return outcome["tool_calls"]


def tool_errors(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    return outcome["tool_errors"]


def well_formed(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """The format check: every tool call parsed and the episode ended with a reply (a failing tool
    is no format error)."""
    return float(outcome["bad_calls"] == 0 and outcome["replied"] == 1.0)


def calls_well_formed(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """`well_formed` of the native format (envs/tools' metrics)."""
    return float(outcome["malformed_calls"] == 0 and outcome["replied"] == 1.0)


class OpenClawEnv(FlawedTeacher, CatalogueEnv):
    config_class = OpenClawEnvConfig
    action_stop = ("</tool>",)

    def __init__(self, config: OpenClawEnvConfig, name: str = "openclaw"):
        super().__init__(config, name)
        native = config.tool_format == "native"
        self.speaks_tools = native  # native: the stage gives it the policy's tokenizer (use_chat)
        self.action_stop = () if native else ("</tool>",)  # native turns end on the model's end token
        self.chat: ToolChat | None = None
        root = Path(config.tasks) if config.tasks is not None else DATA
        if not (root / "tasks").is_dir():
            raise ValueError(f"{root}: no tasks/ folder of task files")
        folders = sorted(path for path in (root / "skills").glob("*") if path.is_dir())
        self.skills = {skill.name: skill for skill in map(load_skill, folders)}
        self.web = load_web(root / "web.json")
        self.catalogue = config.generated.catalogue(generated_task) if config.generated is not None else [
            load_task(path, self.skills, root / "tasks" / "files") for path in sorted((root / "tasks").glob("*.md"))]
        if native:
            self.catalogue = [native_task(task, TOOLS_HELP) for task in self.catalogue]
        self.rubric = Rubric([
            RewardFunc("task", graded, 1.0),
            RewardFunc("tool_calls", tool_calls, 0.0),
            RewardFunc("tool_errors", tool_errors, 0.0),
        ], correct=graded, formatted=calls_well_formed if native else well_formed)

    def use_chat(self, tokenizer) -> None:
        """The policy's tool-call format (native only)."""
        try:
            self.chat = ToolChat.of(tokenizer, self.config.tool_parser)
        except ValueError as exc:  # no template, or one of no known family (UnknownToolFormat)
            raise ValueError(f"env {self.name}: tool_parser: {exc}") from None

    def start(self, task: Task, llm: SubPolicy | None = None) -> OpenClawEpisode | ToolEpisode:
        """A fresh sandbox holding the task's files and the skill folders (SandboxUnavailable propagates)."""
        wall = min(self.config.sandbox.wall_seconds, float(task.info["timeout_seconds"]))
        limits = self.config.sandbox.model_copy(update={"wall_seconds": wall})
        files = {path: content for skill in self.skills.values() for path, content in skill.files.items()}
        chat = self.tool_chat() if self.speaks_tools else None
        sandbox = Sandbox(limits, files={**files, **task.info["workspace"]})
        workspace = OpenClawEpisode(sandbox, self.web, task.info["grader"], task.info["grader_args"])
        return native_episode(workspace, chat) if chat is not None else workspace

    def oracle_actions(self, task: Task) -> list[str]:
        return self.in_format(task.info["oracle"])

    def shortcut_actions(self, task: Task) -> list[str] | None:
        """The teacher's shortcut: its family's, acting without reading (envs/openclaw/shortcuts.py)."""
        lines = shortcut_lines(task)
        return None if lines is None else self.in_format(lines)

    def in_format(self, lines: list[str]) -> list[str]:
        """Tag-format actions (calls, then the reply) in the env's tool format."""
        return native_actions(self.tool_chat(), lines) if self.speaks_tools else list(lines)

    def tool_chat(self) -> ToolChat:
        if self.chat is None:
            raise RuntimeError(f"env {self.name}: no tool-call format (the stage gives it the tokenizer: use_chat)")
        return self.chat
