"""Imports only go down the layers (docs/ARCHITECTURE.md), the two wings of tasks/ never import each
other, and no product module takes part in an import cycle: every module's imports, read with ast,
function-level ones included."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top to bottom: a module may import its own layer's modules and any layer below it, never above.
# tasks.stages sit above the two wings (tasks.rollout: play and score episodes; tasks.train: update
# and record), which sit on one floor above the stage contract (tasks.common, tasks.config).
LAYERS = [
    ["flows.cli"],
    ["flows"],
    ["tasks.runtime"],
    ["tasks.request", "tasks.kinds"],
    ["tasks.stages"],
    ["tasks.rollout", "tasks.train"],
    ["tasks.common", "tasks.config"],
    ["envs"],
    ["models", "data_contracts"],
    ["artifacts"],
]
PROJECT = {"flows", "tasks", "envs", "models", "data_contracts", "artifacts"}
WINGS = ("tasks.rollout", "tasks.train")
STANDALONE = {"envs.sandbox.agent", "envs.sandbox.proc", "envs.sandbox.worker"}  # copied into the sandbox


def layer_of(module: str) -> int | None:
    """The index of the most specific layer prefix that `module` falls under."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, module) of every project import in the file's source."""
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from tasks.stages import sft`: the submodule is what is imported; `from x import Name`: x
            submodules = [f"{node.module}.{alias.name}" for alias in node.names if is_module(f"{node.module}.{alias.name}")]
            if len(submodules) < len(node.names):
                found.append((node.lineno, node.module))
            found += [(node.lineno, module) for module in submodules]
    return [(line, module) for line, module in found if module.split(".")[0] in PROJECT]


def is_module(dotted: str) -> bool:
    path = ROOT / Path(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def project_files() -> list[Path]:
    """Every module of the project's packages (empty package markers aside)."""
    return sorted(path for package in PROJECT for path in (ROOT / package).rglob("*.py")
                  if "__pycache__" not in path.parts and path.read_text().strip())


def upward_imports() -> list[str]:
    return [problem for path in project_files() for problem in import_problems(path, path.read_text())]


def import_problems(path: Path, source: str) -> list[str]:
    """What the module at `path` (under ROOT), with this source, imports against the layers."""
    problems = []
    importer = module_name(path)
    if importer not in STANDALONE:
        own = layer_of(importer)
        for line, imported in imported_modules(path, source):
            target = layer_of(imported)
            where = f"{path.relative_to(ROOT)}:{line}: {importer} imports {imported}"
            if target is not None and target < own:
                problems.append(f"{where} (a higher layer)")
            elif wing(importer) and wing(imported) and wing(importer) != wing(imported):
                problems.append(f"{where} (the wings of tasks/ do not import each other; share through tasks.common)")
            elif stage_kind(importer) and stage_kind(imported) and stage_kind(imported) != stage_kind(importer):
                problems.append(f"{where} (stage kinds do not import each other; share through tasks.common)")
    return problems


def stage_kind(module: str) -> str | None:
    """The stage kind a module belongs to (`tasks.stages.rl.update` -> `rl`), None outside tasks.stages."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["tasks", "stages"] and len(parts) > 2 else None


def wing(module: str) -> str | None:
    return next((name for name in WINGS if module == name or module.startswith(name + ".")), None)


def import_graph(sources: dict[Path, str] | None = None) -> dict[str, set[str]]:
    """module -> the project modules it imports (function-level imports included); `sources` replaces
    or adds files' text (a probe checked in memory)."""
    texts = {path: path.read_text() for path in project_files()}
    texts.update(sources or {})
    modules = {module_name(path) for path in texts}
    return {module_name(path): {imported for _, imported in imported_modules(path, text)
                                if imported in modules and imported != module_name(path)}
            for path, text in texts.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk of `graph`, each as the path that closes it."""
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def test_every_project_module_is_in_a_layer():
    assert [module_name(path) for path in project_files() if layer_of(module_name(path)) is None] == []


def test_no_module_imports_a_higher_layer():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import():
    """The checker itself: an env importing the rollout loop is caught (a source checked in memory: a
    file written into envs/ would change the code version of stages other tests run meanwhile)."""
    probe = "def f():\n    from tasks.rollout.episodes import roll_out\n"
    assert import_problems(ROOT / "envs" / "_layer_probe.py", probe) == \
        ["envs/_layer_probe.py:2: envs._layer_probe imports tasks.rollout.episodes (a higher layer)"]


def test_no_product_module_imports_in_a_cycle():
    """A cycle hidden by an import inside a function is still a cycle: it ties two modules' fates
    (neither can be read, tested or moved without the other)."""
    assert import_cycles(import_graph()) == []


def test_the_check_sees_a_cycle_through_a_function_level_import():
    probe = ROOT / "tasks" / "common" / "ranks.py"
    source = probe.read_text() + "\ndef _probe():\n    from tasks.common.context import StageContext\n"
    context = ROOT / "tasks" / "common" / "context.py"
    cycles = import_cycles(import_graph({probe: source, context: context.read_text() +
                                         "\ndef _probe():\n    from tasks.common import ranks\n"}))
    assert {"tasks.common.context", "tasks.common.ranks"} in [set(cycle) for cycle in cycles]


def test_the_wings_do_not_import_each_other():
    probe = ROOT / "tasks" / "rollout" / "_probe.py"
    assert import_problems(probe, "from tasks.common.context import StageContext\n") == []
    assert import_problems(probe, "def f():\n    from tasks.train.loop import start_training\n") == \
        ["tasks/rollout/_probe.py:2: tasks.rollout._probe imports tasks.train.loop "
         "(the wings of tasks/ do not import each other; share through tasks.common)"]


def test_a_package_kind_imports_its_own_modules_not_another_kind():
    probe = ROOT / "tasks" / "stages" / "rl" / "_probe.py"
    assert import_problems(probe, "from tasks.stages.rl.batch import Row\n") == []
    assert import_problems(probe, "from tasks.stages.sft import run\n") == \
        ["tasks/stages/rl/_probe.py:1: tasks.stages.rl._probe imports tasks.stages.sft "
         "(stage kinds do not import each other; share through tasks.common)"]
