"""The ``synthesize`` stage's figures: the sample grid, the privacy pairs and the t0 histogram."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tasks.common import pyplot, save_figure


def sample_grid(images: np.ndarray, labels: np.ndarray, path: Path, rows: int = 8, cols: int = 8,
                title: str = "") -> None:
    """One row per identity (its first ``cols`` faces), each row labelled, ``title`` above."""
    plt = pyplot()
    ids = list(dict.fromkeys(labels.tolist()))[:rows]
    fig, axes = plt.subplots(len(ids), cols, figsize=(1.1 * cols + 0.6, 1.1 * len(ids) + 0.5), squeeze=False)
    for r, identity in enumerate(ids):
        members = np.flatnonzero(labels == identity)[:cols]
        for c in range(cols):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            if c < len(members):
                ax.imshow(images[members[c]])
        axes[r, 0].set_ylabel(f"id {identity}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def plot_nearest_real(faces: np.ndarray, labels: np.ndarray, privacy: dict[str, np.ndarray], real_faces: np.ndarray,
                      path: Path, pairs: int = 8) -> None:
    """The synthetic faces closest to a real training face, each beside that face, with their FR cosine."""
    plt = pyplot()
    order = np.argsort(-privacy["face_max_cos"])
    chosen, seen = [], set()
    for i in order:  # one face per synthetic identity
        if int(labels[i]) not in seen:
            seen.add(int(labels[i]))
            chosen.append(int(i))
        if len(chosen) == pairs:
            break
    fig, axes = plt.subplots(2, len(chosen), figsize=(1.3 * len(chosen) + 0.4, 3.2), squeeze=False)
    for c, i in enumerate(chosen):
        for r, img in enumerate((faces[i], real_faces[privacy["face_nearest"][i]])):
            axes[r, c].imshow(img)
            axes[r, c].set_xticks([])
            axes[r, c].set_yticks([])
        axes[0, c].set_title(f"cos {privacy['face_max_cos'][i]:.2f}", fontsize=8)
    axes[0, 0].set_ylabel("synthetic", fontsize=8)
    axes[1, 0].set_ylabel("nearest real", fontsize=8)
    fig.suptitle("Privacy: synthetic faces closest to a real training face (FR cosine)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def plot_t0(t0: np.ndarray, steps_t: int, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.hist(t0, bins=min(25, max(5, len(np.unique(t0)))), color="tab:purple")
    ax.set(xlabel="t0 (c_e only for t ≥ t0)", ylabel="faces", xlim=(0, steps_t),
           title="UIFace stage boundary per face")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
