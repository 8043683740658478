"""Repository hygiene: exercise stubs mirror the solutions, notebooks are stored stripped, dependency lists agree."""

import ast
import json
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted(p.name for p in (ROOT / "exercises").glob("*.py") if p.name != "__init__.py")
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _public_functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name: node for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_")}


def _signature(fn: ast.FunctionDef) -> str:
    """Arguments with annotations and defaults, the return annotation and the decorators, as source text."""
    returns = ast.unparse(fn.returns) if fn.returns else ""
    decorators = ",".join(ast.unparse(d) for d in fn.decorator_list)
    return f"{decorators} {fn.name}({ast.unparse(fn.args)}) -> {returns}"


def test_every_exercise_has_a_solution_and_back() -> None:
    solutions = sorted(p.name for p in (ROOT / "solutions").glob("*.py") if p.name != "__init__.py")
    assert EXERCISES, "exercises/ has no chapter modules"
    assert EXERCISES == solutions


@pytest.mark.parametrize("name", EXERCISES)
def test_exercise_is_a_clean_stub_of_its_solution(name: str) -> None:
    stubs = _public_functions(ROOT / "exercises" / name)
    answers = _public_functions(ROOT / "solutions" / name)
    assert sorted(stubs) == sorted(answers), f"{name}: public functions differ"
    for fn_name, stub in stubs.items():
        assert _signature(stub) == _signature(answers[fn_name]), f"{name}:{fn_name}: signatures differ"
        body = stub.body
        assert len(body) == 2, f"{name}:{fn_name}: the stub body must be a docstring and a raise only"
        doc = ast.get_docstring(stub)
        assert doc and len(doc) > 200, f"{name}:{fn_name}: the stub needs a docstring that teaches"
        raise_ = body[1]
        assert isinstance(raise_, ast.Raise) and raise_.exc is not None, f"{name}:{fn_name}: must end in raise"
        exc = raise_.exc.func if isinstance(raise_.exc, ast.Call) else raise_.exc
        assert isinstance(exc, ast.Name) and exc.id == "NotImplementedError", \
            f"{name}:{fn_name}: must raise NotImplementedError"


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "no notebooks under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_stripped(path: Path) -> None:
    notebook = json.loads(path.read_text())
    for i, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs; strip them before committing"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


def _requirement_name(spec: str) -> str:
    # "torch==2.13.0" -> "torch"; "pytest-timeout" -> "pytest-timeout"; names compare case- and _/- insensitively.
    return re.split(r"[<>=!~;\[\s]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _environment_pip_list(text: str) -> list[str]:
    """The entries under `- pip:` in environment.yml (a simple file: read by indentation, no YAML library)."""
    entries, pip_indent = [], None
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped.strip():
            continue
        indent = len(stripped) - len(stripped.lstrip())
        if pip_indent is None:
            if stripped.strip() == "- pip:":
                pip_indent = indent
        elif indent > pip_indent and stripped.strip().startswith("- "):
            entries.append(stripped.strip()[2:].strip())
        else:
            break
    return entries


def test_pyproject_and_environment_list_the_same_packages() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        declared += extra
    pip_list = _environment_pip_list((ROOT / "environment.yml").read_text())
    assert pip_list, "environment.yml has no `- pip:` list"
    # `-e .[dev]` installs the project itself; every other entry is a package.
    listed = {_requirement_name(e) for e in pip_list if not e.startswith("-e")}
    assert listed == {_requirement_name(d) for d in declared}
    # Pins must agree too (torch is pinned to one CPU build).
    pinned = {_requirement_name(d): d.replace(" ", "") for d in declared if "==" in d}
    for entry in pip_list:
        if _requirement_name(entry) in pinned:
            assert entry.replace(" ", "") == pinned[_requirement_name(entry)], f"{entry} != pyproject's pin"


def test_torch_installs_agree_with_the_accepted_range():
    """pyproject accepts torch >= a minimum (a GPU node keeps its CUDA build); the Makefile and environment.yml
    install one CPU version first, the same in both, inside that range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = next(d for d in project["dependencies"] if _requirement_name(d) == "torch").replace(" ", "")
    assert spec.startswith("torch>="), f"{spec}: pyproject should accept the torch a GPU node already has"
    minimum = tuple(int(x) for x in spec[len("torch>="):].split("."))
    env = next(e for e in _environment_pip_list((ROOT / "environment.yml").read_text())
               if _requirement_name(e) == "torch").replace(" ", "")
    make_pins = re.findall(r"pip install --quiet torch==([\d.]+)", (ROOT / "Makefile").read_text())
    assert env.startswith("torch==") and make_pins == [env[len("torch=="):]]
    assert tuple(int(x) for x in make_pins[0].split(".")) >= minimum
