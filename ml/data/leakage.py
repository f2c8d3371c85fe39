"""Cross-set leakage: one person or one image in two sets that must be disjoint, one person under two names.

A benchmark scores a model on identities it never trained on; the manifests alone cannot show that the same person
is not in both. ``check_leakage`` looks at names and pixels:

- **identity overlap**: an identity name in two sets that must be disjoint (``DISJOINT``) fails;
- **exact duplicates**: identical decoded pixels (SHA-1 of the uint8 array, so a PNG and the JPEG it was decoded
  from are not told apart by their bytes) in two disjoint sets fails; within one set, two identities sharing more
  than ``max_shared_fraction`` of the smaller one's images are one person under two names and fail, fewer shared
  images are label noise and are counted;
- **near duplicates** (reported, never failing): equal 64-bit difference hashes (dHash of a 9 × 8 grey thumbnail:
  survives re-encoding and small brightness changes) in two disjoint sets, beyond the exact duplicates.

Images are read in blocks of ``block`` rows, so memory stays flat whatever the set's size.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["DISJOINT", "Leakage", "check_leakage", "dhash", "fingerprints"]

# (set, set) pairs that may share no identity and no image. "templates" holds held-out identities (IJB-style
# templates of the held-out people), so it may share names with "heldout" but with no training set.
DISJOINT: tuple[tuple[str, str], ...] = (
    ("train", "heldout"), ("train", "templates"), ("train", "discovery"), ("train", "videos"),
    ("heldout", "discovery"), ("templates", "discovery"), ("fusion", "videos"), ("fusion", "templates"),
)


def dhash(images: np.ndarray, side: int = 16) -> np.ndarray:
    """(N, side²/8) uint8 difference hashes of uint8 (N, H, W, 3) images: grey ``side`` × (``side`` + 1)
    area-averaged thumbnail, bit = pixel brighter than its right neighbour. 256 bits: the 64 of the classic 8 × 9
    hash collide between different faces of one aligned layout."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(images)).float().mean(dim=3, keepdim=True).permute(0, 3, 1, 2)
    thumb = F.adaptive_avg_pool2d(x, (side, side + 1))[:, 0].numpy()
    bits = (thumb[:, :, :-1] > thumb[:, :, 1:]).reshape(len(images), side * side)
    return np.packbits(bits, axis=1)


def _informative(hashes: np.ndarray) -> np.ndarray:
    """(N,) bool: hashes with between 10 % and 90 % of bits set (a flat, dark or blurred image hashes to nearly
    all zeros and matches every other such image)."""
    ones = np.unpackbits(hashes, axis=1).sum(axis=1)
    bits = hashes.shape[1] * 8
    return (ones >= 0.1 * bits) & (ones <= 0.9 * bits)


def fingerprints(dataset_dir: Path, manifest: pd.DataFrame, block: int = 2048) -> tuple[list[str], list[bytes | None]]:
    """(exact pixel hash per row, dHash per row or None where it is uninformative) of a dataset's images, read
    ``block`` rows at a time."""
    from ml.data.dataset import load_images

    exact: list[str] = []
    near: list[bytes | None] = []
    for start in range(0, len(manifest), block):
        images = load_images(dataset_dir, manifest.iloc[start:start + block])
        exact.extend(hashlib.sha1(img.tobytes()).hexdigest() for img in images)
        hashes = dhash(images)
        near.extend(h.tobytes() if ok else None for h, ok in zip(hashes, _informative(hashes)))
    return exact, near


@dataclass
class Leakage:
    """Findings: ``failures`` stop the gate (one line each, naming sets, identities, paths and counts); ``notes``
    are reported; ``metrics`` are flat ``validate/leakage/...`` numbers."""

    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _examples(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_leakage(sets: dict[str, tuple[Path, pd.DataFrame]], *, hashed: tuple[str, ...],
                  max_shared_fraction: float = 0.5, disjoint: tuple[tuple[str, str], ...] = DISJOINT) -> Leakage:
    """Check ``sets`` ({name: (dataset dir, manifest)}); names in ``hashed`` are also compared by pixels (the
    others by identity name only). Pairs of ``disjoint`` whose sets are absent are skipped."""
    out = Leakage()
    names = {k: set(m["identity"].astype(str)) for k, (_, m) in sets.items()}
    prints = {k: fingerprints(*sets[k]) for k in hashed if k in sets}
    for a, b in disjoint:
        if a not in sets or b not in sets:
            continue
        shared = sorted(names[a] & names[b])
        out.metrics[f"validate/leakage/{a}_{b}/shared_identities"] = float(len(shared))
        if shared:
            out.failures.append(f"identities in both {a} and {b} ({len(shared)}): {_examples(shared)}")
        if a in prints and b in prints:
            _cross_images(out, a, b, sets, prints)
    for k, (exact, near) in prints.items():
        _within(out, k, sets[k][1], exact, max_shared_fraction)
    return out


def _cross_images(out: Leakage, a: str, b: str, sets: dict, prints: dict) -> None:
    (ea, na), (eb, nb) = prints[a], prints[b]
    index = defaultdict(list)
    for row, h in enumerate(ea):
        index[h].append(row)
    pairs = [(index[h][0], row) for row, h in enumerate(eb) if h in index]
    out.metrics[f"validate/leakage/{a}_{b}/shared_images"] = float(len(pairs))
    if pairs:
        pa, pb = sets[a][1]["path"].to_numpy(), sets[b][1]["path"].to_numpy()
        out.failures.append(f"images in both {a} and {b} ({len(pairs)}): "
                            + _examples([f"{a}/{pa[i]} = {b}/{pb[j]}" for i, j in pairs]))
    exact_b = {j for _, j in pairs}
    near_a = {h for h in na if h is not None}
    near = [j for j, h in enumerate(nb) if j not in exact_b and h is not None and h in near_a]
    out.metrics[f"validate/leakage/{a}_{b}/near_duplicate_images"] = float(len(near))
    if near:
        pb = sets[b][1]["path"].to_numpy()
        out.notes.append(f"{len(near)} image(s) of {b} look like images of {a} (equal dHash; re-encoded copies?): "
                         + _examples([f"{b}/{pb[j]}" for j in near]))


def _within(out: Leakage, name: str, manifest: pd.DataFrame, exact: list[str], max_shared_fraction: float) -> None:
    identities = manifest["identity"].astype(str).to_numpy()
    counts = pd.Series(identities).value_counts()
    holders: dict[str, set[str]] = defaultdict(set)
    for h, ident in zip(exact, identities):
        holders[h].add(ident)
    shared: dict[tuple[str, str], int] = defaultdict(int)
    for ids in holders.values():
        ids = sorted(ids)
        for i, x in enumerate(ids):
            for y in ids[i + 1:]:
                shared[(x, y)] += 1
    noisy = sum(shared.values())
    out.metrics[f"validate/leakage/{name}/duplicates_across_identities"] = float(noisy)
    out.metrics[f"validate/leakage/{name}/repeated_images"] = float(len(exact) - len(holders))
    twins = [(x, y, n) for (x, y), n in sorted(shared.items())
             if n > max_shared_fraction * min(counts[x], counts[y])]
    out.metrics[f"validate/leakage/{name}/identities_under_two_names"] = float(len(twins))
    if twins:
        out.failures.append(
            f"{name}: {len(twins)} pair(s) of identities share most of their images — one person under two names: "
            + _examples([f"{x} and {y} share {n} of {min(counts[x], counts[y])}" for x, y, n in twins]))
    elif noisy:
        out.notes.append(f"{name}: {noisy} image(s) appear under two identities (label noise; below "
                         f"validate.max_shared_fraction = {max_shared_fraction} of either identity)")
