#!/usr/bin/env bash
# Install minidist into a GPU node's own Python, keeping the torch it already has (its CUDA build), without make:
#   bash scripts/install_gpu_node.sh            # python on PATH, or PYTHON=/path/to/python
# pip is held to the installed torch by a constraint (torch==<installed version>), so it never replaces it with a
# CPU wheel; a torch older than pyproject.toml's floor (or none) is refused rather than silently replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
version=$("$PYTHON" scripts/node_torch.py)
if [ -z "$version" ]; then
    floor=$(grep -o '"torch>=[0-9.]*"' pyproject.toml | tr -d '"')
    echo "error: $PYTHON has no torch satisfying $floor; install the node's CUDA torch first, or use make (CPU)" >&2
    exit 1
fi
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
echo "torch==$version" > "$constraint"
echo "keeping torch $version of $PYTHON"
"$PYTHON" -m pip install -e ".[dev]" -c "$constraint"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
