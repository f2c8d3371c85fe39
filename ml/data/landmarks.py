"""Predicted landmarks for faces whose manifest has none (the user's real faces).

Real aligned faces come without landmarks: ingest leaves the manifest's ``landmarks`` null. The ``align`` stage
predicts them with the trained DFA aligner and stores them beside its aligned set as one parquet table, so that
whatever needs keypoints (KP-RPE backbones) can read them without the prepared datasets being rewritten:

    predicted_landmarks.parquet   dataset (string: the prepared dataset's folder name, e.g. ``train``),
                                  path (string: the manifest row's path), landmarks (list<float32> of 10 pixel
                                  coordinates x0, y0, ..., x4, y4 in ArcFace order), score (float32: DFA face score)
    predicted_landmarks.json      per dataset: the content digest of the dataset the predictions were made on,
                                  the image count; and the aligner they came from

:func:`manifest_keypoints` gives a manifest's keypoints: the manifest's own where it has them (procedural ground
truth, the synthetic set's DFA predictions), the predicted ones where it has none, and says which were used. A
prediction for another version of the dataset (digest mismatch) or a missing one is refused naming the row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ml.atomic import atomic_path
from ml.errors import DataError

__all__ = ["PREDICTED_INFO", "PREDICTED_TABLE", "manifest_keypoints", "read_predicted", "write_predicted"]

PREDICTED_TABLE = "predicted_landmarks.parquet"
PREDICTED_INFO = "predicted_landmarks.json"
KEYPOINT_SOURCES = ("manifest", "aligner")  # where a row's keypoints came from

_SCHEMA = pa.schema([("dataset", pa.string()), ("path", pa.string()), ("landmarks", pa.list_(pa.float32())),
                     ("score", pa.float32())])


def write_predicted(folder: str | os.PathLike, predictions: dict[str, tuple[pd.DataFrame, np.ndarray, np.ndarray]],
                    digests: dict[str, str], aligner: str) -> None:
    """Write the table and its info into ``folder``: ``predictions[dataset] = (manifest rows, landmarks (N, 5, 2)
    pixel x, y, scores (N,))``; ``digests[dataset]`` is that dataset's content digest."""
    folder = Path(folder)
    names, paths, values, scores = [], [], [], []
    for name, (rows, landmarks, score) in predictions.items():
        landmarks = np.asarray(landmarks, dtype=np.float32)
        if landmarks.shape != (len(rows), 5, 2) or not np.isfinite(landmarks).all():
            raise DataError(f"predicted landmarks for dataset {name!r}: expected finite (N={len(rows)}, 5, 2), got "
                            f"{landmarks.shape}")
        names += [name] * len(rows)
        paths += [str(p) for p in rows["path"]]
        values += list(landmarks.reshape(len(rows), 10))
        scores += [float(s) for s in score]
    table = pa.Table.from_arrays([pa.array(names, pa.string()), pa.array(paths, pa.string()),
                                  pa.array(values, pa.list_(pa.float32())), pa.array(scores, pa.float32())],
                                 schema=_SCHEMA)
    with atomic_path(folder / PREDICTED_TABLE) as tmp:
        pq.write_table(table, tmp)
    info = {"aligner": aligner,
            "datasets": {name: {"digest": digests[name], "images": len(rows)}
                         for name, (rows, _, _) in predictions.items()}}
    with atomic_path(folder / PREDICTED_INFO) as tmp:
        tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def read_predicted(folder: str | os.PathLike) -> tuple[pd.DataFrame, dict]:
    """(table indexed by (dataset, path) with a ``landmarks`` float32 (10,) column, info); DataError naming the
    file when either is missing or unreadable."""
    folder = Path(folder)
    table, info = folder / PREDICTED_TABLE, folder / PREDICTED_INFO
    for f in (table, info):
        if not f.is_file():
            raise DataError(f"{f}: no predicted landmarks; the align stage writes them for faces ingested without "
                            "landmarks: run `dvc repro align`")
    try:
        df = pq.read_table(table).to_pandas()
        meta = json.loads(info.read_text(encoding="utf-8"))
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataError(f"{folder}: cannot read the predicted landmarks ({exc}); run `dvc repro align`") from exc
    return df.set_index(["dataset", "path"]), meta


def manifest_keypoints(dataset_dir: str | os.PathLike, rows: pd.DataFrame, predicted_dir: str | os.PathLike
                       ) -> tuple[np.ndarray, str]:
    """float32 (N, 5, 2) pixel keypoints of ``rows`` of the dataset at ``dataset_dir`` and where they came from:
    ``manifest`` when every row carries landmarks, else ``aligner`` (rows without landmarks take the align stage's
    predictions from ``predicted_dir``, which must have been made on this very dataset: same content digest)."""
    from ml.data.dataset import landmarks_array, read_dataset_info

    dataset_dir = Path(dataset_dir)
    keypoints = landmarks_array(rows)
    missing = np.flatnonzero(~np.isfinite(keypoints).all(axis=(1, 2)))
    if missing.size == 0:
        return keypoints, "manifest"
    table, info = read_predicted(predicted_dir)
    name = dataset_dir.name
    recorded = (info.get("datasets") or {}).get(name)
    digest = read_dataset_info(dataset_dir)["digest"]
    if recorded is None:
        raise DataError(f"{dataset_dir}: {missing.size} of {len(rows)} faces have no landmarks and "
                        f"{Path(predicted_dir) / PREDICTED_INFO} has no predictions for dataset {name!r}; "
                        "run `dvc repro align`")
    if recorded.get("digest") != digest:
        raise DataError(f"{Path(predicted_dir) / PREDICTED_TABLE}: the landmarks of dataset {name!r} were predicted "
                        f"on another version of {dataset_dir} (digest {str(recorded.get('digest'))[:12]} vs "
                        f"{digest[:12]}); run `dvc repro align`")
    for i in missing:
        rel = str(rows["path"].iloc[i])
        try:
            keypoints[i] = np.asarray(table.at[(name, rel), "landmarks"], dtype=np.float32).reshape(5, 2)
        except KeyError:
            raise DataError(f"{dataset_dir / rel} (row {rows.index[i]}): no landmarks in the manifest nor among the "
                            f"align stage's predictions; run `dvc repro align`") from None
    return keypoints, "aligner"
