"""Repository hygiene: exercise stubs mirror the solutions, notebooks are stored stripped, dependency lists agree."""

import ast
import json
import os
import re
import subprocess
import sys
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_have_unique_ids(path: Path) -> None:
    """nbformat 4.5 gives every cell an id (a missing one is a warning now, an error in future nbformat)."""
    notebook = json.loads(path.read_text())
    ids = [cell.get("id") for cell in notebook["cells"]]
    missing = [i for i, cell_id in enumerate(ids) if not cell_id]
    assert not missing, f"{path.name}: cells {missing} have no id"
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"
    assert (notebook["nbformat"], notebook["nbformat_minor"]) >= (4, 5), f"{path.name}: nbformat below 4.5"


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


# A stand-in interpreter: `node_torch.py` answers $NODE_TORCH, `-m venv [--system-site-packages] DIR` makes DIR with a
# copy of itself as DIR/bin/python; every call is logged. The Makefile's install runs for real, without pip.
_STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
if [ "$1" = scripts/node_torch.py ]; then echo "$NODE_TORCH"; exit 0; fi
if [ "$1 $2" = "-m venv" ]; then dir="${@: -1}"; mkdir -p "$dir/bin"; cp "$0" "$dir/bin/python"; fi
"""


def _make_install(tmp_path: Path, node_torch: str) -> tuple[list[str], str]:
    work = tmp_path / "repo"
    work.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        (work / name).write_text((ROOT / name).read_text())
    stub, log = tmp_path / "node-python", tmp_path / "calls.log"
    stub.write_text(_STUB)
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "STUB_LOG": str(log), "NODE_TORCH": node_torch}
    subprocess.run(["make", "--no-print-directory", f"PYTHON={stub}", ".venv/.installed"], cwd=work, env=env,
                   check=True, capture_output=True, text=True)
    return log.read_text().splitlines(), (work / ".venv" / "torch-constraint.txt").read_text()


def test_make_keeps_a_gpu_nodes_torch(tmp_path):
    """A Python whose torch satisfies the floor (scripts/node_torch.py says which): a venv that sees it, and pip
    held to that exact version; the CPU wheel is never installed over it."""
    calls, constraint = _make_install(tmp_path, "2.12.0+cu128")
    assert "node-python -m venv --system-site-packages .venv" in calls
    assert constraint == "torch==2.12.0+cu128\n"
    assert "python -m pip install --quiet -e .[dev,bench] -c .venv/torch-constraint.txt" in calls
    assert not any("torch==" in call for call in calls)


def test_make_installs_the_cpu_wheel_without_a_node_torch(tmp_path):
    """The course machines and CI: a fresh venv (not the system's packages) with the pinned CPU wheel."""
    calls, constraint = _make_install(tmp_path, "")
    assert "node-python -m venv .venv" in calls and constraint == ""
    assert "python -m pip install --quiet torch==2.13.0" in calls
    assert calls[-1] == "python -m pip install --quiet -e .[dev,bench] -c .venv/torch-constraint.txt"


def _fake_torch(tmp_path: Path, version: str | None) -> dict:
    if version is not None:
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize("version, kept", [("2.12.0+cu128", True), ("2.11.0", True), ("2.13.0a0+git1234", True),
                                           ("2.10.1+cu126", False), (None, False)])
def test_node_torch_reports_a_torch_the_package_accepts(tmp_path, version, kept):
    """pyproject's floor decides; without torch (or with an older one) the answer is empty: install the wheel."""
    no_site = ["-S"] if version is None else []  # no torch at all: hide the real one in site-packages too
    out = subprocess.run([sys.executable, *no_site, str(ROOT / "scripts" / "node_torch.py")],
                         env=_fake_torch(tmp_path, version), capture_output=True, text=True, check=True).stdout
    assert out.strip() == (version if kept else "")


def test_install_without_make_holds_pip_to_the_installed_torch():
    script = (ROOT / "scripts" / "install_gpu_node.sh").read_text()
    assert "scripts/node_torch.py" in script and 'echo "torch==$version" > "$constraint"' in script
    assert 'pip install -e ".[dev]" -c "$constraint"' in script


def test_make_test_installs_the_kernels_and_make_train_does_not(tmp_path):
    """Triton (~1 GB, chapter 19) is an extra: the tests' and notebooks' targets install it after the base install,
    `make train` never does."""
    _make_install(tmp_path, "")  # the base install done (its stamp written)
    work, stub = tmp_path / "repo", tmp_path / "node-python"
    env = {"PATH": "/usr/bin:/bin", "STUB_LOG": str(tmp_path / "calls.log"), "NODE_TORCH": ""}

    def dry_run(target: str) -> str:
        return subprocess.run(["make", "-n", "--no-print-directory", f"PYTHON={stub}", target], cwd=work, env=env,
                              check=True, capture_output=True, text=True).stdout

    kernels = 'pip install --quiet -e ".[kernels]" -c .venv/torch-constraint.txt'
    assert kernels in dry_run("test") and kernels in dry_run("book")
    assert "pip" not in dry_run("train") and "kernels" not in dry_run("train")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["kernels"] == ["triton"]
