"""`make book`: tools/build_book.py executes a notebook and renders it with its outputs; the index links it."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "03_rope.ipynb"  # the fastest chapter with figures: a few seconds


def _first_heading(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    source = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
    return next(line for line in source.splitlines() if line.startswith("#")).lstrip("#").strip()


def test_book_renders_a_chapter_with_its_figures(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "build_book.py"), "--out", str(tmp_path),
                             str(NOTEBOOK)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"build_book.py failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"

    page = (tmp_path / f"{NOTEBOOK.stem}.html").read_text(encoding="utf-8")
    title = _first_heading(NOTEBOOK)
    assert title in page, f"the page does not contain the chapter title {title!r}"
    # The stored notebook has no outputs, so an embedded PNG image proves that the cells ran and the figures were
    # inlined. (The page's CSS holds a small PNG of its own: look for an <img>.)
    figures = re.findall(r'<img[^>]*src="data:image/png;base64,', page)
    assert figures, "no figure embedded in the page as an <img> with a base64 PNG"

    index = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert f'href="{NOTEBOOK.stem}.html"' in index and title in index, "index.html does not link the chapter"
