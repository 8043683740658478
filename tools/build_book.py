"""Build the course book: execute every notebook and render it, outputs and figures included, as HTML.

    python tools/build_book.py                                 # all of notebooks/*.ipynb -> book/
    python tools/build_book.py --out /tmp/b notebooks/03_rope.ipynb

Each notebook runs top to bottom in a fresh Python kernel, in the notebooks/ folder (as `jupyter lab` and
`pytest --nbval-lax` run it), and becomes book/NN_name.html; book/index.html links the chapters by the first
heading of each notebook. The notebooks in the repository stay as they are (stored without outputs).

Nothing is downloaded while building: figures are embedded in the pages as base64 PNG images, and the styles come
from the installed JupyterLab theme. Reading is another matter: nbconvert's pages load MathJax from a CDN, so the
math renders only when the reader is online.
"""

from __future__ import annotations

import argparse
import html
import sys
import time
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parents[1]


def chapter_title(notebook: nbformat.NotebookNode, fallback: str) -> str:
    """The text of the notebook's first markdown heading ("# 03 · RoPE: ..." -> "03 · RoPE: ...")."""
    for cell in notebook.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return fallback


def render_notebook(path: Path, out_dir: Path, timeout: int = 900) -> str:
    """Execute the notebook at `path` and write out_dir/<stem>.html; return its chapter title.

    A failing cell raises (nbclient's CellExecutionError, with the cell and its traceback) and writes no page: a
    chapter whose checks fail is no chapter of the book.
    """
    notebook = nbformat.read(path, as_version=4)
    title = chapter_title(notebook, path.stem)
    ExecutePreprocessor(timeout=timeout, kernel_name="python3").preprocess(
        notebook, {"metadata": {"path": str(path.parent)}})
    page, _ = HTMLExporter(template_name="lab").from_notebook_node(notebook, resources={"metadata": {"name": title}})
    (out_dir / f"{path.stem}.html").write_text(page, encoding="utf-8")
    return title


def write_index(out_dir: Path, chapters: list[tuple[str, str]]) -> None:
    """book/index.html: one link per chapter, in file order. chapters: (file name, title) pairs."""
    items = "\n".join(f'    <li><a href="{html.escape(name)}">{html.escape(title)}</a></li>'
                      for name, title in chapters)
    (out_dir / "index.html").write_text(f"""<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>minidist: the course</title>
  <style>body {{ font-family: sans-serif; max-width: 46em; margin: 3em auto; line-height: 1.6; }}</style>
</head>
<body>
  <h1>minidist: distributed LLM training from first principles</h1>
  <p>Each chapter is a notebook, executed when this book was built; its checks are the asserts in its cells.</p>
  <ul>
{items}
  </ul>
</body>
</html>
""", encoding="utf-8")


def build(notebooks: list[Path], out_dir: Path, timeout: int = 900) -> list[str]:
    """Render every notebook, one at a time (the machine may be small), and the index; return the names of the
    notebooks that failed. A failure is reported and the build goes on, so one broken chapter leaves the others
    readable."""
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for path in notebooks:
        print(f"{path.name} ...", end=" ", flush=True)
        start = time.perf_counter()
        try:
            title = render_notebook(path, out_dir, timeout)
        except Exception as error:  # a failing cell, a dead kernel, a timeout: report it, build the rest
            print(f"FAILED\n{error}", file=sys.stderr, flush=True)
            failed.append(path.name)
            (out_dir / f"{path.stem}.html").unlink(missing_ok=True)  # no stale page from an earlier build
            continue
        print(f"{title} ({time.perf_counter() - start:.0f} s)", flush=True)
    # The index lists every page in the folder, so rebuilding one chapter keeps the others linked.
    write_index(out_dir, _existing_pages(out_dir))
    return failed


def _existing_pages(out_dir: Path) -> list[tuple[str, str]]:
    """(file name, title) of chapter pages already in out_dir, the title read back from each page's <title>."""
    found = []
    for page in sorted(out_dir.glob("*.html")):
        if page.name == "index.html":
            continue
        text = page.read_text(encoding="utf-8", errors="replace")
        start, end = text.find("<title>"), text.find("</title>")
        title = html.unescape(text[start + 7:end]) if 0 <= start < end else page.stem
        found.append((page.name, title))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute the notebooks and render them to HTML (see the module "
                                                 "docstring).")
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to render (default: every notebooks/*.ipynb)")
    parser.add_argument("--out", type=Path, default=ROOT / "book", help="output folder (default: book/)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one cell may run (default: 900)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    missing = [str(p) for p in notebooks if not p.is_file()]
    if missing:
        print(f"error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    failed = build([p.resolve() for p in notebooks], args.out, args.timeout)
    print(f"book: {args.out / 'index.html'}")
    if failed:
        print(f"error: {len(failed)} notebook(s) failed, their pages are missing: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
