"""The package's shape: an import graph without cycles, and a core that names no environment."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_rl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """{module: torchtitan_rl modules it imports at module level or in functions}."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                # `from pkg import submodule` imports the submodule, not (only) pkg's names
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def _check_no_cycles(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                raise AssertionError(f"{what} cycle: " + " -> ".join([*stack, node, dep]))
            if dep not in state:
                visit(dep, [*stack, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_the_import_graph_has_no_cycles():
    _check_no_cycles(_imports(), "import")


def _folder(module: str) -> str:
    """The package folder a module lives in (`torchtitan_rl.losses.policy_loss` -> `losses`);
    a module at the package root is its own node (`torchtitan_rl.checks` -> `checks`)."""
    return module.split(".")[1] if module != "torchtitan_rl" else ""


def test_the_folders_import_each_other_without_cycles():
    """Folders form layers: a helper two folders need lives below both (the package root),
    so no folder imports one that imports it back (`losses` -> `models` -> `losses`)."""
    folders: dict[str, set[str]] = {}
    for module, deps in _imports().items():
        out = folders.setdefault(_folder(module), set())
        out |= {_folder(d) for d in deps} - {_folder(module)}
    _check_no_cycles(folders, "folder")


def test_the_design_docs_map_names_every_module():
    """docs/design.md's layout lists each module on a line of its own, under its folder."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    layout = text.split("```\ntorchtitan_rl/\n", 1)[1].split("```", 1)[0]
    listed, folder = set(), ""
    for line in layout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if line.startswith("  ") and not line.startswith("    "):
            folder = name if name.endswith("/") else ""
            listed.add(name)
        elif line.startswith("    ") and folder and name:
            listed.add(folder + name)
    modules = {
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    }
    in_examples = {m for m in modules if "/examples/" in m}
    assert sorted(modules - in_examples - listed) == []
    assert sorted(m for m in listed if m.endswith(".py") and m not in modules) == []


def test_no_module_outside_envs_imports_an_environment():
    """The core reaches environments only through `envs` (its registry and base classes)."""
    seam = {"torchtitan_rl.envs", "torchtitan_rl.envs.base"}
    offenders = {
        module: sorted(d for d in deps if d.startswith("torchtitan_rl.envs") and d not in seam)
        for module, deps in _imports().items()
        if not module.startswith("torchtitan_rl.envs")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_both_backends_implement_the_engine_interface():
    """The generator actor drives one interface; each backend has every member of it."""
    from torchtitan_rl.generation.engine import Engine
    from torchtitan_rl.generation.interface import GenerationEngine
    from torchtitan_rl.generation.vllm_engine import VllmEngine

    members = {"policy_version", "generate", "load_weights", "close"}
    assert members <= set(vars(GenerationEngine))
    for cls in (Engine, VllmEngine):
        assert members <= set(dir(cls)), cls


def test_config_never_imports_the_controller():
    """The config package composes component sections; nothing in it reaches up into the
    controller (the controller reads config, never the other way round)."""
    graph = _imports()
    upward = {
        module: sorted(d for d in deps if d.startswith("torchtitan_rl.controller"))
        for module, deps in graph.items()
        if module.startswith("torchtitan_rl.config")
    }
    assert {m: d for m, d in upward.items() if d} == {}
    assert "torchtitan_rl.config.job" in graph  # the job-wide sections live in config/


def test_the_config_the_controller_and_the_rollout_process_load_without_torchtitan():
    """torchtitan's package takes 7-8 s to import on a 2-core VM (its `__init__` pulls in
    datasets, the validator and Inductor): loading a config (a user's mistake is one line
    after it), the controller (it names the actor classes to spawn them) and starting a
    rollout process (it unpickles the config) do without it; the trainer and generator
    processes import it where their actors run."""
    import subprocess
    import sys

    check = (
        "import sys, torchtitan_rl.config, torchtitan_rl.actors.rollout, "
        "torchtitan_rl.controller.loop; "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('torchtitan')}))"
    )
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=120)  # fmt: skip
    assert run.stdout.strip() == "['torchtitan_rl']", run.stdout + run.stderr[-2000:]


def test_the_loop_holds_the_loop_only():
    """Processes come from the launcher (the loop never asks for a host), the warm start and
    resume live in modules of their own, and the step report is built in one place."""
    source = (PACKAGE / "controller" / "loop.py").read_text()
    for name in ("this_host", "spawn_procs", "setup_torch_elastic_env", "sft_step", "tomli"):
        assert name not in source, name
    for name in ("write_step_records", "report_dropped", "rollout_metrics"):
        assert name not in source, name
    deps = _imports()["torchtitan_rl.controller.loop"]
    assert {
        "torchtitan_rl.controller.launcher",
        "torchtitan_rl.controller.warm_start",
        "torchtitan_rl.controller.resume",
        "torchtitan_rl.controller.report",
    } <= deps


def test_the_controller_stays_under_300_lines():
    """Issue 48: the Controller is a handful of verbs over owners of their own (the fleet,
    the run folder, the pipeline); what grows goes to them."""
    lines = (PACKAGE / "controller" / "loop.py").read_text().splitlines()
    assert len(lines) < 300, len(lines)


def test_the_two_engines_share_the_seam_and_import_neither_the_other():
    """Config, error completion and the async front live once in generation/interface.py;
    neither backend (nor the seam) imports the other backend's modules."""
    graph = _imports()
    native = {
        "torchtitan_rl.generation.engine",
        "torchtitan_rl.generation.model_runner",
        "torchtitan_rl.generation.scheduler",
    }
    vllm = {"torchtitan_rl.generation.vllm_engine", "torchtitan_rl.generation.vllm_support"}
    assert "torchtitan_rl.generation.interface" in graph["torchtitan_rl.generation.engine"]
    assert "torchtitan_rl.generation.interface" in graph["torchtitan_rl.generation.vllm_engine"]
    for module in vllm:
        assert not graph[module] & native, module
    assert not graph["torchtitan_rl.generation.engine"] & vllm
    assert not graph["torchtitan_rl.generation.interface"] & (native | vllm)
