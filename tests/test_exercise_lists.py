"""Each chapter's exercise summary names every graded exercise.

For every notebook `notebooks/NN_*.ipynb` with an exercise module `exercises/chNN_*.py`, the summary cell is the
markdown cell whose heading line (a line starting with `#`) contains "Exercises". It must name, in backticks, every
graded exercise: each public function or class defined at the top of the exercise module that the chapter's
grader `tests/exercises/test_chNN.py` names, and say `make grade CH=NN`. Chapters added later are checked the same
way, with no list to update here.
"""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _chapters() -> list[tuple[str, Path, Path]]:
    found = []
    for notebook in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        number = notebook.name[:2]
        modules = sorted((ROOT / "exercises").glob(f"ch{number}_*.py"))
        if modules:
            found.append((number, notebook, modules[0]))
    return found


def graded_exercises(module: Path, grader: Path) -> list[str]:
    """The public functions and classes of `module` that `grader` names (as a string or an attribute)."""
    tree = ast.parse(module.read_text(), filename=str(module))
    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    public = [node.name for node in tree.body if isinstance(node, kinds) and not node.name.startswith("_")]
    text = grader.read_text() if grader.exists() else ""
    return [name for name in public if re.search(rf"\b{re.escape(name)}\b", text)]


def summary_cells(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
               for c in cells if c["cell_type"] == "markdown"]
    return [s for s in sources if any(line.lstrip().startswith("#") and "exercises" in line.lower()
                                      for line in s.splitlines())]


CHAPTERS = _chapters()


def test_chapters_found() -> None:
    assert len(CHAPTERS) >= 18, f"expected chapters 00-17 with exercises, found {[c[0] for c in CHAPTERS]}"


@pytest.mark.parametrize(("number", "notebook", "module"), CHAPTERS, ids=[c[0] for c in CHAPTERS])
def test_exercise_summary_names_every_graded_exercise(number: str, notebook: Path, module: Path) -> None:
    grader = ROOT / "tests" / "exercises" / f"test_ch{number}.py"
    graded = graded_exercises(module, grader)
    assert graded, f"{module.name}: no public function of it is named by {grader.name}"
    cells = summary_cells(notebook)
    assert cells, f"{notebook.name}: no markdown cell with a heading line containing 'Exercises'"
    text = "\n".join(cells)
    missing = [name for name in graded if f"`{name}`" not in text and not re.search(rf"`{name}\(", text)]
    assert not missing, (f"{notebook.name}: the 'Exercises' cell does not name {missing} in backticks "
                         f"(graded by {grader.name})")
    assert f"make grade CH={number}" in text, f"{notebook.name}: the 'Exercises' cell must say `make grade CH={number}`"
