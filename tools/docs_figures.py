"""Regenerate the figures the README shows (docs/*.png) from the full-size experiments.

    python3 tools/docs_figures.py          # ~4 minutes on 2 cores; needs matplotlib

Runs three-layer-sparse, three-layer-blocks and depth (seed 0, full size) into a temporary
directory with experiments.py and copies their PNGs into docs/.
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ["three-layer-sparse_heatmaps.png", "three-layer-blocks_heatmaps.png", "depth.png"]


def main():
    try:
        import matplotlib  # noqa: F401  (only checked here; experiments.py draws)
    except ImportError:
        print("needs matplotlib: python3 -m pip install matplotlib", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results")
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments.py"), "three-layer-sparse",
                               "three-layer-blocks", "depth", "--out", out])
        if proc.returncode not in (0, 1):
            return proc.returncode
        os.makedirs(os.path.join(ROOT, "docs"), exist_ok=True)
        for name in FIGURES:
            shutil.copy(os.path.join(out, name), os.path.join(ROOT, "docs", name))
            print(f"docs/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
