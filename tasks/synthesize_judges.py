"""Judges of ``synthesize``'s faces that are not the FR model conditioning the generator.

- ``face_judge``: the DFA aligner's face score and a Fréchet distance in its features (trained here, on procedural
  faces against non-face crops, never on generated ones);
- ``detector_judge``: the share of faces OpenCV Zoo's YuNet detector finds (nobody here trained it);
- ``identity_judge``: whether a recogniser nobody here trained (``synthesize.identity_judge``: OpenCV Zoo's SFace by
  default) sees the synthetic identities as identities, beside real identities of the same shape and size.

Each returns flat ``synthetic/judge/*`` metrics; the ones needing the ``reference`` extra return none, with a log
line, where it is not installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ml.errors import ConfigError
from tasks.common import Paths

log = logging.getLogger(__name__)

def face_judge(aligner: Any, synthetic_faces: np.ndarray, synthetic_scores: np.ndarray, real_faces: np.ndarray,
               size: int, nonfaces: int = 500, seed: int = 0, generator_size: int | None = None,
               reconstruct: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, float]:
    """A judge independent of the FR model that conditions the generator: the DFA aligner (trained on procedural
    faces against non-face crops, never on generated faces).

    - its face score at its own threshold 0.5 → ``synthetic/judge/face_share`` and ``face_score_mean`` of the
      synthetic faces, beside ``real_face_share`` (the real training faces) and ``nonface_share`` (held-out non-face
      crops: what a blob scores);
    - a Fréchet distance in its backbone's features (``DFA.features``, ``frechet_distance``) between the synthetic
      faces and as many real training faces → ``synthetic/judge/frechet``, beside ``frechet_real`` (two disjoint
      real samples of that size: what the same distribution scores, the floor) and ``frechet_nonface`` (the
      non-face crops against real faces: what blobs score). Needs twice as many real faces as synthetic ones;
    - where the generator makes faces smaller than ``size`` (``generator_size``), the share of the first
      ``nonfaces`` real faces made at that size and resized back (``real_at_size_face_share``: the most a generator
      of that size can reach), and of ``reconstruct``'s output for those faces (a latent generator's autoencoder,
      uint8 faces in and out: ``reconstruction_face_share``, the most a generator decoding through it can reach);
    - YuNet's detection rate beside it (``detector_judge``)."""
    from ml.aligner.data import HELDOUT_NONFACE_START, nonface_crops
    from ml.generator.diversity import frechet_distance
    from tasks.train_generator import resize_faces

    blobs = nonface_crops(0, HELDOUT_NONFACE_START, nonfaces, size)
    _, real_scores = aligner.predict(real_faces)
    _, blob_scores = aligner.predict(blobs)
    out = {"synthetic/judge/face_share": float((synthetic_scores >= 0.5).mean()),
           "synthetic/judge/face_score_mean": float(synthetic_scores.mean()),
           "synthetic/judge/real_face_share": float((real_scores >= 0.5).mean()),
           "synthetic/judge/nonface_share": float((blob_scores >= 0.5).mean())}
    small = resize_faces(real_faces[:nonfaces], generator_size or size)
    if generator_size is not None and generator_size != size:
        _, at_size = aligner.predict(resize_faces(small, size))
        out["synthetic/judge/real_at_size_face_share"] = float((at_size >= 0.5).mean())
    if reconstruct is not None:
        _, recon_scores = aligner.predict(resize_faces(reconstruct(small), size))
        out["synthetic/judge/reconstruction_face_share"] = float((recon_scores >= 0.5).mean())
    out.update(detector_judge(synthetic_faces, real_faces[:nonfaces], generator_size or size))
    n = min(len(synthetic_faces), len(real_faces) // 2, len(blobs))
    if n < 2:
        return out
    order = np.random.default_rng(seed).permutation(len(real_faces))
    real_a, real_b = aligner.features(real_faces[order[:n]]), aligner.features(real_faces[order[n:2 * n]])
    synthetic = aligner.features(synthetic_faces[:n])
    return {**out, "synthetic/judge/frechet": frechet_distance(synthetic, real_a),
            "synthetic/judge/frechet_real": frechet_distance(real_b, real_a),
            "synthetic/judge/frechet_nonface": frechet_distance(aligner.features(blobs[:n]), real_a),
            "synthetic/judge/frechet_faces": float(n)}


DETECTOR_SIZE = 128  # YuNet finds faces from about 10 px on, but a crop of a few dozen pixels gives it no context


def detector_judge(synthetic_faces: np.ndarray, real_faces: np.ndarray, generator_size: int) -> dict[str, float]:
    """A second judge nobody here trained: the share of faces OpenCV Zoo's YuNet detector finds
    (``ml.aligner.yunet``; each face upscaled to ``DETECTOR_SIZE`` and padded), for the synthetic faces
    (``synthetic/judge/detector_face_share``) and for real faces made at the generator's size and upscaled the same
    way (``detector_real_at_size_face_share``: what a perfect generator of that size scores). Empty, with a log
    line, where YuNet cannot run (the ``reference`` extra is not installed)."""
    from ml.aligner.yunet import yunet_available, yunet_landmarks
    from tasks.train_generator import resize_faces

    reason = yunet_available()
    if reason is not None:
        log.warning("synthetic/judge/detector_* skipped: %s", reason)
        return {}
    found = {}
    for key, faces in (("detector_face_share", synthetic_faces),
                       ("detector_real_at_size_face_share", resize_faces(real_faces, generator_size))):
        _, scores = yunet_landmarks(resize_faces(faces, DETECTOR_SIZE))
        found[f"synthetic/judge/{key}"] = float((scores > 0).mean())
    return found


REFERENCE_JUDGE = "sface"  # synthesize.identity_judge's default: the reference extra's SFace unless models/fr has one
JUDGE_IDENTITIES, JUDGE_FACES = 24, 8  # identities × faces each the identity judge embeds, synthetic and real alike


def load_identity_judge(paths: Paths, name: str) -> Any | None:
    """The recogniser ``synthesize.identity_judge`` names: ``models/fr/<name>`` when it holds one (an imported or
    trained FR source), else for ``sface`` the ``reference`` extra's SFace file (None, with a log line, when the
    extra is not installed); ``""`` → None (no identity judge). Another name without a model is a ConfigError."""
    if not name:
        return None
    if (paths.fr_model(name) / "config.json").is_file():
        from ml.models.io import load_model

        return load_model(paths.fr_model(name))[0]
    if name != REFERENCE_JUDGE:
        raise ConfigError(f"synthesize.identity_judge is {name!r} but {paths.fr_model(name)} holds no FR model: "
                          f"import one (`faceops import`), or name `{REFERENCE_JUDGE}` (the reference extra's) or '' "
                          "(none)")
    from ml.fr.pretrained import reference_sface

    try:
        return reference_sface()
    except ConfigError as exc:
        log.warning("synthetic/judge/identity_* skipped: %s", exc)
        return None


def judge_reference(paths: Paths, identities: int, per: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Real faces shaped like a synthetic set: ``identities`` training identities (seeded draw among those with
    ``per`` or more training-split faces) with ``per`` faces each → (faces (M, S, S, 3) uint8, labels (M,))."""
    from ml.data.dataset import load_images, read_manifest

    rows = read_manifest(paths.train_set / "manifest.parquet")
    rows = rows[rows["split"] == "train"]
    counts = rows["label"].value_counts()
    eligible = np.sort(counts.index[counts >= per].to_numpy())
    chosen = np.random.default_rng(seed).permutation(eligible)[:identities]
    rows = rows[rows["label"].isin(chosen)].groupby("label", sort=True).head(per).reset_index(drop=True)
    if rows.empty:  # no training identity has that many faces: identity_judge logs it and judges none
        return np.zeros((0, 1, 1, 3), np.uint8), np.zeros(0, np.int64)
    return load_images(paths.train_set, rows), rows["label"].to_numpy()


def judge_identities(judge: Any, faces: np.ndarray, labels: np.ndarray, paths: Paths, generator_size: int,
                     seed: int = 0) -> dict[str, float]:
    """``identity_judge`` of the first ``JUDGE_IDENTITIES`` synthetic identities' first ``JUDGE_FACES`` faces
    (``faces`` (N, s, s, 3) at the generator's size, ``labels`` (N,)) beside as many real training identities of as
    many faces (``judge_reference``): a recogniser at 112 px costs tens of milliseconds a face on a CPU core."""
    per = min(JUDGE_FACES, int(np.bincount(labels)[np.unique(labels)].min()))
    chosen = np.unique(labels)[:JUDGE_IDENTITIES]
    rows = np.concatenate([np.flatnonzero(labels == c)[:per] for c in chosen])
    return identity_judge(judge, faces[rows], labels[rows], *judge_reference(paths, len(chosen), per, seed),
                          generator_size)


def identity_judge(judge: Any, synthetic_faces: np.ndarray, labels: np.ndarray, real_faces: np.ndarray,
                   real_labels: np.ndarray, generator_size: int) -> dict[str, float]:
    """Do the synthetic identities look like identities to ``judge``, a recogniser nobody here trained?

    ``synthetic_faces`` (N, s, s, 3) uint8 at the generator's size with their identity ``labels`` (N,); the real
    reference (``real_faces`` / ``real_labels``: ``judge_reference``, as many identities with as many faces) is made
    at the generator's size (``generator_size``) the same way, so the two sets differ in their source alone. Both
    are embedded at the judge's input size →

    - ``synthetic/judge/identity_consistency``: mean over identities of the mean pairwise cosine within one;
    - ``synthetic/judge/identity_auc``: ROC AUC of same- vs different-identity cosines over every pair (0.5: the
      judge sees no identities, 1: it separates every one);
    - ``…/real_at_size_identity_consistency`` and ``…/real_at_size_identity_auc``: the same for the real identities.
    """
    from ml.fr.pretrained import pair_auc
    from ml.generator.diversity import identity_consistency
    from ml.fr.train import embed
    from tasks.train_generator import resize_faces

    out: dict[str, float] = {}
    for prefix, faces, y in (("", synthetic_faces, labels), ("real_at_size_", real_faces, real_labels)):
        if len(np.unique(y)) < 2:
            log.warning("synthetic/judge/%sidentity_*: fewer than 2 identities to judge", prefix)
            continue
        if prefix:  # made at the generator's size, as a generator of that size would make them
            faces = resize_faces(faces, generator_size)
        emb = embed(judge, resize_faces(faces, int(judge.input_contract["size"])), flip=False)
        out[f"synthetic/judge/{prefix}identity_consistency"] = identity_consistency(emb, y)
        out[f"synthetic/judge/{prefix}identity_auc"] = pair_auc(emb, y)
    return out
