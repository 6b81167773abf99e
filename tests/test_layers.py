"""Imports only go down the layers (docs/ARCHITECTURE.md): every module's imports, read with ast,
function-level ones included."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top to bottom: a module may import its own layer's modules and any layer below it, never above.
# tasks.stages sit above tasks.config and tasks.common, below tasks.kinds (which lists them).
LAYERS = [
    ["flows.cli"],
    ["flows"],
    ["tasks.runtime"],
    ["tasks.request", "tasks.kinds"],
    ["tasks.stages"],
    ["tasks.common", "tasks.config"],
    ["envs"],
    ["models", "data_contracts"],
    ["artifacts"],
]
PROJECT = {"flows", "tasks", "envs", "models", "data_contracts", "artifacts"}
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
            found += [(node.lineno, node.module)]
            # `from tasks.stages import sft`: the submodule is what is imported
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if (ROOT / Path(*node.module.split(".")) / f"{alias.name}.py").exists()]
    return [(line, module) for line, module in found if module.split(".")[0] in PROJECT]


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
            elif stage_kind(importer) and stage_kind(imported) and stage_kind(imported) != stage_kind(importer):
                problems.append(f"{where} (stage kinds do not import each other; share through tasks.common)")
    return problems


def stage_kind(module: str) -> str | None:
    """The stage kind a module belongs to (`tasks.stages.rl.update` -> `rl`), None outside tasks.stages."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["tasks", "stages"] and len(parts) > 2 else None


def flows_import_cycles() -> list[list[str]]:
    """Cycles among the modules of `flows` (its cli aside), function-level imports included."""
    graph = {}
    for path in project_files():
        module = module_name(path)
        if module.startswith("flows.") and not module.startswith("flows.cli"):
            graph[module] = {imported for _, imported in imported_modules(path, path.read_text())
                             if imported.startswith("flows.") and not imported.startswith("flows.cli")}
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
    probe = "def f():\n    from tasks.common.rollouts import roll_out\n"
    assert import_problems(ROOT / "envs" / "_layer_probe.py", probe) == \
        ["envs/_layer_probe.py:2: envs._layer_probe imports tasks.common.rollouts (a higher layer)"]


def test_flows_import_no_cycle():
    """flows/triggers.py imports the flows it serves; they do not import it back."""
    assert flows_import_cycles() == []


def test_a_package_kind_imports_its_own_modules_not_another_kind():
    probe = ROOT / "tasks" / "stages" / "rl" / "_probe.py"
    assert import_problems(probe, "from tasks.stages.rl.batch import Row\n") == []
    assert import_problems(probe, "from tasks.stages.sft import run\n") == \
        ["tasks/stages/rl/_probe.py:1: tasks.stages.rl._probe imports tasks.stages.sft "
         "(stage kinds do not import each other; share through tasks.common)"]
