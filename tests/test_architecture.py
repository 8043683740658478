"""The package's shape, checked from its source (docs/ARCHITECTURE.md states the rules):

- one import direction, `comm → model → foundations → parallel → trust → train → {plan, debug, convert}`, for every
  import in the package, those inside functions and under TYPE_CHECKING included; no import cycle;
- every collective and point-to-point call goes through `minidist.comm` (so the ledger and the flight recorder see
  every byte): no `torch.distributed` communication call anywhere else;
- small pieces: no module over 450 lines, no function over 60, at most 8 modules at the top level;
- the map is the territory: every path docs/ARCHITECTURE.md names exists, and every chapter has its row.
"""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minidist"

# Layer of each top-level name of the package; a module may import only from its own layer or lower ones.
LAYERS: dict[str, int] = {
    "comm": 0, "out_files": 0,  # the bottom: communication, and writing files never through a link
    "kernels": 0,  # chapter 19: Triton kernels (torch and triton only)
    "model": 1,
    "flops": 2, "memory": 2, "hardware": 2, "precision": 2, "data": 2,  # foundations
    "parallel": 3,
    "trust": 4,
    "train": 5,
    "plan": 6, "debug": 6, "convert": 6,  # the tools on top: none of them imports another
    "native": 6,  # chapter 18: minidist beside PyTorch's own stack, a tool too
}
LAYER_NAMES = ["comm", "model", "foundations", "parallel", "trust", "train", "plan/debug/convert"]

COMMUNICATION = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "P2POp", "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "send_object_list",
    "recv_object_list",
}
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_LEVEL_MODULES = 450, 60, 8

# The torch.distributed names the package and the notebooks may use: each exists in torch 2.11, the oldest torch
# pyproject.toml admits (the CUDA torch a GPU node may already have). A new name joins this list only after a look
# at 2.11: `all_gather_single` and `reduce_scatter_single`, for one, arrived in 2.13.
TORCH_2_11_DISTRIBUTED = {
    "GroupMember", "P2POp", "ProcessGroup", "ReduceOp", "TCPStore", "Work", "all_gather_into_tensor", "all_reduce",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "destroy_process_group",
    "get_process_group_ranks", "get_rank", "get_world_size", "group", "init_process_group", "irecv", "is_available",
    "is_initialized", "isend", "new_group", "recv", "reduce_scatter_tensor", "send",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def sources() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(p): (p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, tree: ast.Module) -> set[tuple[str, int]]:
    """(module of the package, line) for every import in `tree`, wherever it stands. `from a import b` counts as
    an import of a.b when a.b is a module of the package, else of a."""
    known = sources()
    package = name if (known[name][0].name == "__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(alias.name, node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add((child if child in known else base, node.lineno))
    return {(m, line) for m, line in found if m == "minidist" or m.startswith("minidist.")}


def top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_every_top_level_name_has_a_layer() -> None:
    unplaced = sorted({top(m) for m in sources() if top(m) and top(m) not in LAYERS and top(m) != "__main__"})
    assert not unplaced, f"modules outside every layer (add them to LAYERS and docs/ARCHITECTURE.md): {unplaced}"


def direction_violations(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """'path:line (layer) imports module (layer)' for every import of a higher layer, or of a sibling tool."""
    wrong = []
    for name, (path, tree) in modules.items():
        if not top(name) or top(name) not in LAYERS:
            continue
        here = LAYERS[top(name)]
        for target, line in sorted(imported_modules(name, tree)):
            there = LAYERS.get(top(target))
            if there is None or top(target) == top(name):
                continue
            if there > here or (there == here == LAYERS["plan"]):
                wrong.append(f"{path.name}:{line} ({LAYER_NAMES[here]}) imports {target} ({LAYER_NAMES[there]})")
    return wrong


def test_imports_go_one_way() -> None:
    wrong = direction_violations(sources())
    assert not wrong, "imports against the direction comm → model → foundations → parallel → trust → train → " \
                      "{plan, debug, convert}:\n" + "\n".join(wrong)


def test_the_direction_check_sees_a_late_import() -> None:
    """An import inside a function counts: comm reaching up into train, and one tool into another, are caught."""
    code = "def f():\n    from minidist.train import loop\n    import minidist.flops\n"
    fake = {"minidist.comm.communicator": (Path("communicator.py"), ast.parse(code)),
            "minidist.plan.search": (Path("search.py"), ast.parse("from minidist.debug import diff\n"))}
    found = sorted(direction_violations(fake))
    assert found == ["communicator.py:2 (comm) imports minidist.train.loop (train)",
                     "communicator.py:3 (comm) imports minidist.flops (foundations)",
                     "search.py:1 (plan/debug/convert) imports minidist.debug.diff (plan/debug/convert)"], found


def test_no_import_cycle() -> None:
    graph = {name: {m for m, _ in imported_modules(name, tree) if m in sources() and m != name}
             for name, (_, tree) in sources().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            pytest.fail("import cycle: " + " -> ".join(cycle), pytrace=False)


def distributed_uses(tree: ast.Module, aliases: tuple[str, ...] = ("torch.distributed",)) -> list[tuple[int, str, str]]:
    """(line, as written, name) of every name taken from torch.distributed: attributes of the module under any of
    its names (`import torch.distributed as dist`, `from torch import distributed`) and `from torch.distributed
    import X`."""
    names = set(aliases)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and not node.level:
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in names:
            uses.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}", node.attr))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            uses += [(node.lineno, f"torch.distributed.{a.name}", a.name) for a in node.names]
    return uses


def distributed_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every torch.distributed communication call or import of one."""
    return [(line, written) for line, written, name in distributed_uses(tree) if name in COMMUNICATION]


def test_every_byte_goes_through_comm() -> None:
    direct = [f"{path.relative_to(ROOT)}:{line}: {call}"
              for name, (path, tree) in sources().items() if top(name) != "comm"
              for line, call in distributed_calls(tree)]
    assert not direct, "torch.distributed communication outside minidist/comm/ (use Comm: the ledger and the " \
                       "flight recorder must see every byte):\n" + "\n".join(direct)


def test_the_communication_check_sees_each_spelling() -> None:
    """The check above would catch a direct call however torch.distributed is imported."""
    code = ("import torch.distributed as dist\nimport torch\nfrom torch import distributed as d2\n"
            "from torch.distributed import all_reduce\n"
            "def f(x):\n    dist.barrier()\n    torch.distributed.send(x, 1)\n    d2.all_gather_into_tensor(x, x)\n"
            "    dist.get_rank()\n")
    found = sorted(name for _, name in distributed_calls(ast.parse(code)))
    assert found == sorted(["torch.distributed.all_reduce", "dist.barrier", "torch.distributed.send",
                            "d2.all_gather_into_tensor"]), found


def distributed_names(tree: ast.Module) -> set[str]:
    """Every name taken from torch.distributed (`dist` counts as its alias even where a cell imported it)."""
    return {name for _, _, name in distributed_uses(tree, ("torch.distributed", "dist"))}


def notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("!", "%")))


def test_every_torch_distributed_name_exists_in_torch_2_11() -> None:
    trees = {path.relative_to(ROOT): tree for path, tree in sources().values()}
    trees |= {p.relative_to(ROOT): ast.parse(notebook_code(p)) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    newer = {f"{path}: dist.{name}" for path, tree in trees.items()
             for name in distributed_names(tree) - TORCH_2_11_DISTRIBUTED}
    assert not newer, "torch.distributed names outside the torch 2.11 list (a GPU node's torch may lack them; " \
                      "use what 2.11 has, e.g. all_gather_into_tensor / reduce_scatter_tensor):\n" + \
                      "\n".join(sorted(newer))
    sample = ast.parse("import torch.distributed as dist\ndist.all_gather_single(out, x)\n")
    assert distributed_names(sample) - TORCH_2_11_DISTRIBUTED == {"all_gather_single"}  # the check can fail


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for _, (path, tree) in sources().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines "
                                    f"(max {MAX_FUNCTION_LINES})")
    assert not too_long, "\n".join(too_long)
    top_level = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, f"{len(top_level)} top-level modules: {top_level}"


def architecture_text() -> str:
    return (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_the_map_names_only_what_exists() -> None:
    """A path in backticks is a file or folder of the repository (`tests/parity.py`) or of the package, written
    whole (`minidist/parallel/pp/`) or as it appears in its package's row (`pp/`, `schedules.py`)."""
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*(?:\.py|/))`", architecture_text()))
    package = [p.relative_to(PACKAGE).as_posix() + ("/" if p.is_dir() else "")
               for p in PACKAGE.rglob("*") if p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__")]
    missing = sorted(path for path in named if not (ROOT / path).exists()
                     and not any(f"/{have}".endswith(f"/{path}") for have in package))
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_chapter_and_package_is_on_the_map() -> None:
    text = architecture_text()
    chapters = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    rows = set(re.findall(r"^\| (\d\d)\b", text, re.M))
    assert not set(chapters) - rows, f"chapters without a row in ARCHITECTURE's chapter table: " \
                                     f"{sorted(set(chapters) - rows)}"
    packages = sorted({top(m) for m in sources() if top(m) and top(m) != "__main__"})
    unmapped = [p for p in packages if f"`{p}/`" not in text and f"`{p}.py`" not in text]
    assert not unmapped, f"packages and modules ARCHITECTURE.md does not mention: {unmapped}"
