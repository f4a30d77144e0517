"""The import rule of docs/design.md, and the tests' own, read from the source.

docs/design.md's import floors, read from the source: entry points -> jobs -> model and frame ->
families -> contract -> parts -> config, no cycles, nothing imports trainer.py, at most 18 modules
on 8 floors; a family's diffusers classes only in its adapter in families/ (and tools/). And the tests' own: no test module imports another (shared helpers and
fixtures live in conftest.py), and the fast subset reaches every module but the demo's."""

import ast

import tomllib
from conftest import REPO

from model_adapter import ADAPTERS

# The word in each family's class names (CogVideoXAdapter: cogvideox, as in CogVideoXTransformer3DModel),
# read from the registry, so a new family is held by its registry line alone.
FAMILIES = {family: name.removesuffix("Adapter").lower() for family, (_, name) in ADAPTERS.items()}
# docs/design.md's floors: a module imports only from its own floor or below.
LAYERS = {
    **dict.fromkeys(["trainer", "render"], 6),  # the entry points
    **dict.fromkeys(["ckpt", "cache", "validate"], 5),  # the jobs a run does beside the loop
    **dict.fromkeys(["model", "command"], 4),  # the model as training builds it; every command's frame
    **{f"families.{p.stem}": 3 for p in REPO.glob("families/*.py")},
    "model_adapter": 2,  # the contract and the registry
    **dict.fromkeys(
        ["weights", "lora", "data", "decode", "parallel", "metrics", "faults", "memory", "ranks"], 1
    ),
    "config": 0,
}


def modules() -> dict:
    """Every module by its import name: the root's, and the families'."""
    return {p.stem: p for p in REPO.glob("*.py")} | {
        f"families.{p.stem}": p for p in REPO.glob("families/*.py")
    }


def is_main_block(node) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"


def our_imports(path) -> set[str]:
    """Our modules that `path` imports anywhere in it (function-local imports included), but in its
    `if __name__ == "__main__":` block: run as a script, a job module is an entry point (validate.py
    is the render command's documented name)."""
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if not is_main_block(node)]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names} | {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names |= {node.module, node.module.split(".")[0]}
    return names & LAYERS.keys()


def import_graph() -> dict[str, set[str]]:
    found = modules()
    assert found.keys() == LAYERS.keys(), (
        "place every module in a layer (docs/design.md, Files and import layers)"
    )
    return {name: our_imports(path) for name, path in found.items()}


def test_imports_go_one_way():
    graph = import_graph()
    upward = [(m, i) for m, imports in graph.items() for i in imports if LAYERS[i] > LAYERS[m]]
    assert upward == []
    assert [m for m, imports in graph.items() if "trainer" in imports] == []


def test_validation_reads_no_checkpoint():
    """validate.py samples and measures what it is handed (the trainer's model): reading checkpoints
    and LoRA files to render is the render command's (render.py), so validate.py imports no other
    job."""
    assert import_graph()["validate"] & {"ckpt", "cache", "command", "render"} == set()


def test_no_import_cycles():
    graph, done, path = import_graph(), set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module) :] + [module])}"
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_family_classes_stay_in_their_adapters():
    """No module but a family's adapter imports that family's classes.

    No module but a family's adapter imports that family's classes (CogVideoX*, Wan*, their VAEs,
    pipelines and modules), so a fork adds a family in one file."""
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "diffusers",
                "transformers",
            ):
                names = [alias.name for alias in node.names] + [node.module]
                for family, word in FAMILIES.items():
                    if name != f"families.{family}":
                        assert not [n for n in names if word in n.lower()], (path.name, names)


def test_no_test_module_imports_another():
    """No test module imports another.

    A test module that imports another runs (and collects) the other's module-level code and
    fixtures in its own namespace, and breaks when the other is split or renamed: shared helpers
    belong in conftest.py."""
    tests = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    found = []
    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            found += [
                (path.name, node.lineno, name)
                for name in names
                if name.split(".")[0] in tests or name.startswith("tests.")
            ]
    assert found == [], f"move what these import into tests/conftest.py: {found}"


def fast_tests(path) -> list[str]:
    """The tests of a test module that `pytest -m "not slow"` runs: those not marked slow, by
    decorator or by the module's pytestmark."""
    tree = ast.parse(path.read_text())
    module_marks = [
        ast.unparse(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(target, "id", "") == "pytestmark" for target in node.targets)
    ]
    if any("pytest.mark.slow" in marks for marks in module_marks):
        return []
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test_")
        and "pytest.mark.slow" not in map(ast.unparse, node.decorator_list)
    ]


def test_the_fast_subset_keeps_every_module_but_the_demo():
    """The fast subset keeps quick tests of every module but the demo's.

    docs/testing.md's fast subset: the slow marker is registered, strictly, and every test module
    but the demo's (one launch.sh run) keeps quick tests in it, so a change anywhere meets a test
    there."""
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["strict_markers"] and [m for m in options["markers"] if m.startswith("slow:")]
    left_out = [p.name for p in sorted((REPO / "tests").glob("test_*.py")) if not fast_tests(p)]
    assert left_out == ["test_demo.py"], "keep a quick test of each module outside @pytest.mark.slow"


def test_the_run_is_set_up_before_the_cache_pass():
    """trainer.py takes its adapter from the setup step (model.setup_adapter), not from the cache
    pass: it imports no prepare from cache.py, and cache.py loads no adapter itself (its command
    takes the setup step's) and checks nothing of the model but the clips' shapes against it."""
    trainer_imports = [
        alias.name
        for node in ast.walk(ast.parse((REPO / "trainer.py").read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "cache"
        for alias in node.names
    ]
    assert "prepare" not in trainer_imports
    cache_names = {
        node.id if isinstance(node, ast.Name) else node.attr
        for node in ast.walk(ast.parse((REPO / "cache.py").read_text()))
        if isinstance(node, (ast.Name, ast.Attribute))
    }
    model_checks = {
        "load_adapter",
        "check_heads",
        "check_offload_blocks",
        "check_guidance",
        "check_lora_targets",
        "clip_rate",
        "Weights",
    }
    assert cache_names & model_checks == set()


def test_run_settings_reach_the_adapter_through_its_constructor():
    """No module, benchmark, tool or test sets a run setting on a built adapter
    (model_adapter.RunSettings hands them to the family's constructor): no assignment to these
    attributes but on self."""
    settings = {"shift", "audio_loss_weight", "trains_sound", "frame_rate"}
    paths = [
        path
        for folder in ("", "families/", "bench/", "tools/", "tests/")
        for path in REPO.glob(f"{folder}*.py")
    ]
    pokes = [
        (path.name, node.lineno)
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Assign, ast.AugAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and target.attr in settings
        and not (isinstance(target.value, ast.Name) and target.value.id == "self")
    ]
    assert pokes == []


def test_the_house_is_small():
    """One job per module: at most 18 modules at the root, each opening with one line that names its
    job, on at most 8 import floors (the longest chain of imports, entry point to config.py)."""
    roots = sorted(REPO.glob("*.py"))
    assert len(roots) <= 18, [p.name for p in roots]
    for path in roots:
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = docstring.split("\n\n")[0]
        assert first and "\n" not in first and first.endswith("."), (path.name, first)
    graph = import_graph()

    def chain(module) -> int:
        return 1 + max((chain(m) for m in graph[module] if m != module), default=0)

    assert max(chain(m) for m in graph) <= 8


# The functions besides the frame, the commands' own and the families' check_config that read a whole
# config (docs/design.md: each function receives the section, or the values, it uses).
WHOLE_CONFIG_READERS = {
    ("model", "setup_adapter"),
    ("model_adapter", "of"),
    ("model_adapter", "config_sets"),
    ("model_adapter", "check_config"),
}
FRAME = {"trainer", "render", "command", "config"}
COMMANDS = {("cache", "prepare"), ("ckpt", "export_checkpoint"), ("ckpt", "rehash")}


def test_functions_receive_their_sections():
    """A function outside the frame that reads a whole config (a parameter annotated Config, or a
    `cfg` whose sections it reads) is one of the few docs/design.md lists."""
    import dataclasses

    from config import Config

    sections = {field.name for field in dataclasses.fields(Config)}
    readers = set()
    for name, path in modules().items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for arg in fn.args.args + fn.args.kwonlyargs:
                annotated = (
                    arg.annotation is not None and ast.unparse(arg.annotation).strip("\"'") == "Config"
                )
                read = arg.arg == "cfg" and any(
                    isinstance(x, ast.Attribute)
                    and isinstance(x.value, ast.Name)
                    and x.value.id == "cfg"
                    and x.attr in sections
                    for x in ast.walk(fn)
                )
                if annotated or read:
                    readers.add((name, fn.name))
    others = {
        (module, fn)
        for module, fn in readers
        if module not in FRAME and (module, fn) not in COMMANDS and fn != "check_config"
    }
    assert others <= WHOLE_CONFIG_READERS, sorted(others - WHOLE_CONFIG_READERS)
    assert len(WHOLE_CONFIG_READERS - {("model_adapter", "check_config")}) <= 4


def test_the_old_render_name_says_where_the_command_went():
    """`python validate.py`, the render command's old name, renders nothing and names render.py."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(REPO / "validate.py"), "--cfg", "x.toml"], capture_output=True, text=True
    )
    assert done.returncode == 1 and "python render.py" in done.stderr
