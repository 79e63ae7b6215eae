"""Training-curve figure written next to every run's metrics CSV."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpgs.outputs import write_atomically  # noqa: E402


def plot_training_curves(history: list[dict[str, float]], path: str | Path, title: str = "") -> Path:
    """Loss (train/val) and validation AUC/accuracy per epoch, saved as PNG."""
    epochs = [row["epoch"] for row in history]
    fig, (ax_loss, ax_score) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("train_loss", "val_loss"):
        values = [row.get(key) for row in history]
        if any(v is not None for v in values):
            ax_loss.plot(epochs, values, marker="o", label=key)
    for key in ("val_auc", "val_acc", "val_bacc"):
        values = [row.get(key) for row in history]
        if any(v is not None for v in values):
            ax_score.plot(epochs, values, marker="o", label=key)
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("loss")
    ax_score.set_xlabel("epoch")
    ax_score.set_ylabel("score")
    for ax in (ax_loss, ax_score):
        if ax.get_lines():  # (no validation: the score panel is empty)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return Path(path)
