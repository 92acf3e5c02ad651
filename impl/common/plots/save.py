"""Writing a matplotlib figure the one way every figure in the tree does."""
from __future__ import annotations

import pathlib


def save_png(fig, path, dpi: int = 110) -> pathlib.Path:
    """Lay out, write and close ``fig`` (an open figure keeps its memory for the rest of a sweep)."""
    import matplotlib.pyplot as plt

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
