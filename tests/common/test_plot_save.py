"""save_png writes a PNG where asked (parents created) and releases the figure."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.save import save_png  # noqa: E402


def test_save_png_writes_and_closes(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_png(fig, tmp_path / "deep" / "dir" / "f.png", dpi=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.number not in plt.get_fignums()
