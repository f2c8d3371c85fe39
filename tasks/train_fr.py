"""Stage ``train_fr@<source>``: train a face recogniser on one training source.

``dvc.yaml`` runs it as a ``foreach`` over ``pipeline.fr_sources``: ``real`` is the prepared training set
(procedural faces, or the user's real set); ``synthetic`` is the synthesize stage's UIFace set
(``data/synthetic``); ``mixed`` is both, the synthetic identities as extra classes after the real ones;
``real_matched`` is the real set cut to the synthetic set's budget — its first K identities (label order), the first
M training images of each, K × M as the synthetic set's — so that UIFace's Table 3 compares like with like.
Writes ``models/fr/<source>/`` (``model.safetensors`` + ``config.json``), ``metrics/train_fr_<source>.json`` and
the loss curve (``plots/train_fr_<source>_history.csv`` for ``dvc plots``, ``plots/train_fr_<source>_loss.png``
for people). The ``val`` split of the training datasets (the real set's; the synthetic set has none) is measured
after every epoch as ``val/accuracy``, a curve beside ``train/*``. The model is logged to MLflow and registered as a
new ``faceops-fr`` version with alias ``candidate``, tagged with its training source and data digest.

Faces ingested from a RecordIO are read from it in place (``data.train_reader``: ``auto``, the default, does so
whenever ``prepare`` recorded the records; ``png`` reads the prepared PNGs from the dataset's shards), decoded in
DataLoader workers. With ``fr.stream`` no face is held decoded: ``fr.num_workers`` DataLoader workers decode each
batch's faces from the shards (or the RecordIO) every epoch, for sets larger than memory; same batches, same model.
With ``fr.stream_from`` (a copy of the training dataset's directory, e.g. ``s3://bucket/datasets/train``) the faces
stream from there a window of shards at a time (``ml.data.shard_stream``), in that module's order.
A KP-RPE backbone reads each face's landmarks from the manifest, or for real faces (ingested without landmarks)
the ones the ``align`` stage predicted with the DFA aligner; ``config.json`` records which (``keypoints_source``)
and ``train/keypoints_from_aligner`` the share of training images whose keypoints were predicted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from ml.fr.train import FRConfig
from ops.tracking import registered_note
from tasks import registered_model
from tasks.common import (
    Paths, StageResult, launch_rank, load_params, numerics, plot_history, section, stage_main, write_history_csv,
    write_json,
)
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)

REGISTERED_MODEL = registered_model("train_fr")
SOURCES = ("real", "synthetic", "mixed", "real_matched")


def source_datasets(paths: Paths, source: str) -> list[Path]:
    """The dataset directories one training source reads (``mixed``: real, then synthetic)."""
    if source not in SOURCES:
        raise ConfigError(f"unknown training source {source!r}; available: {', '.join(SOURCES)}")
    found = {"real": [paths.train_set], "synthetic": [paths.synthetic_set],
             "mixed": [paths.train_set, paths.synthetic_set], "real_matched": [paths.train_set]}[source]
    for d in found + ([paths.synthetic_set] if source == "real_matched" else []):
        if not (d / "manifest.parquet").is_file():
            stage = "synthesize" if d == paths.synthetic_set else "prepare"
            raise DataError(f"training source {source!r} reads {d}, which holds no dataset: run `dvc repro {stage}`.")
    return found


def training_rows(paths: Paths, source: str) -> tuple[list[tuple[Path, Any]], str, str]:
    """([(dataset dir, its training rows with labels offset so the datasets' identities stay distinct)],
    data digest, data source name) of a training source."""
    import hashlib

    from ml.data.dataset import read_dataset_info, read_manifest

    parts, digests, kinds, offset = [], [], [], 0
    for d in source_datasets(paths, source):
        manifest = read_manifest(d / "manifest.parquet")
        rows = manifest[manifest["split"] == "train"].reset_index(drop=True)
        if source == "real_matched":
            rows, budget = matched_rows(rows, read_dataset_info(paths.synthetic_set))
            digests.append(budget)
        rows["label"] = rows["label"] + offset
        offset = int(rows["label"].max()) + 1
        parts.append((d, rows))
        info = read_dataset_info(d)
        digests.append(info["digest"])
        kinds.append(info["source"])
    digest = digests[0] if len(digests) == 1 else hashlib.sha256("+".join(digests).encode()).hexdigest()
    return parts, digest, "+".join(kinds)


def matched_rows(rows: Any, synthetic: dict[str, Any]) -> tuple[Any, str]:
    """(``rows`` cut to the synthetic set's K identities × M images, a tag of that budget for the digest): the first
    K identities by label, the first M rows of each; every kept identity must have M training images."""
    k = int(synthetic["identity_count"])
    m = int(synthetic["image_count"]) // max(k, 1)
    counts = rows.groupby("label").size()
    if len(counts) < k or counts.sort_index().iloc[:k].min() < m:  # labels 0 … K' − 1 (checked by validate)
        raise DataError(f"training source 'real_matched' needs {k} real identities with {m} training images each "
                        f"(the synthetic set's budget), but the real set has {len(counts)} identities with "
                        f"{int(counts.min())}–{int(counts.max())} images; drop `real_matched` from "
                        "pipeline.fr_sources")
    kept = rows[rows["label"] < k]  # labels are 0 … K' − 1 in identity order (the validate gate checks it)
    return kept.groupby("label", sort=False).head(m).reset_index(drop=True), f"matched:{k}x{m}"


def validation_rows(parts: list[tuple[Path, Any]]) -> list[tuple[Path, Any]]:
    """[(dataset dir, its ``val`` rows labelled as ``training_rows`` labelled that dataset's training rows)]; rows
    of an identity without training images are left out."""
    from ml.data.dataset import read_manifest

    out = []
    for d, rows in parts:
        manifest = read_manifest(d / "manifest.parquet")
        label_of = dict(zip(rows["identity"], rows["label"]))
        val = manifest[(manifest["split"] == "val") & manifest["identity"].isin(label_of)].reset_index(drop=True)
        val["label"] = val["identity"].map(label_of).astype(int)
        if len(val):
            out.append((d, val))
    return out


# below this many faces DataLoader workers cost more to start than they save: each forkserver worker imports torch,
# while one process already decodes thousands of faces a second (benchmarks: recordio_vs_folder)
READER_MIN_IMAGES = 16384


def _reader(dataset_dir: Path, data: DataConfig) -> str:
    """``data.train_reader`` resolved for ``dataset_dir``: ``recordio`` or ``png`` (the dataset's own shards)."""
    from ml.data.records import has_records

    reader = data.train_reader
    if reader == "auto":
        return "recordio" if has_records(dataset_dir) else "png"
    if reader == "recordio" and not has_records(dataset_dir):
        raise DataError(f"data.train_reader is 'recordio' but {dataset_dir} was not ingested from a RecordIO "
                        "(no records.parquet); use data.train_reader: auto or png")
    return reader


def face_dataset(dataset_dir: Path, rows: Any, data: DataConfig) -> Any:
    """The faces of ``rows`` as a Dataset decoded on access (``fr.stream``): the RecordIO they were ingested from
    or the dataset's shards, as ``data.train_reader`` says."""
    from ml.data.records import ShardDataset, recordio_dataset

    if _reader(dataset_dir, data) == "recordio":
        return recordio_dataset(dataset_dir, rows, image_size=data.image_size)
    return ShardDataset(dataset_dir, rows)


def streamed_faces(url: str, parts: list[tuple[Path, Any]], data: DataConfig, source: str) -> Any:
    """``fr.stream_from``: the training faces of the stage's one dataset as an ``ml.data.shard_stream.ShardStream`` over
    the copy of its directory at ``url`` (its manifest and labels are the local checkout's); a copy that holds
    another dataset (another content digest) is refused."""
    import json

    import fsspec

    from ml.data.dataset import INFO_FILE, SHARDS_DIR, read_dataset_info
    from ml.data.shard_stream import ShardStream

    if len(parts) != 1:
        raise ConfigError(f"fr.stream_from streams one dataset, but train_fr@{source} trains on {len(parts)}; "
                          "train it from the local shards (fr.stream_from: '')")
    dataset_dir, rows = parts[0]
    url = url.rstrip("/")
    try:
        with fsspec.open(f"{url}/{INFO_FILE}", "rt") as f:
            copied = json.load(f).get("digest")
    except FileNotFoundError:
        raise DataError(f"fr.stream_from: {url}/{INFO_FILE} not found; copy the dataset directory {dataset_dir} "
                        f"there (e.g. `aws s3 sync {dataset_dir} {url}`)") from None
    local = read_dataset_info(dataset_dir)["digest"]
    if copied != local:
        raise DataError(f"fr.stream_from: {url} holds dataset digest {copied!r}, but {dataset_dir} has {local!r}; "
                        "copy the dataset there again")
    keys = [str(p).rsplit(".", 1)[0] for p in rows["path"]]
    return ShardStream(f"{url}/{SHARDS_DIR}", keys, rows["label"].to_numpy(), image_size=data.image_size)


def load_rows(dataset_dir: Path, rows: Any, data: DataConfig, *, progress: bool = False) -> Any:
    """uint8 (N, S, S, 3) faces of ``rows``: from the RecordIO they were ingested from when ``data.train_reader``
    says so (``auto``: whenever the dataset records one), decoded by as many DataLoader workers as the stage has
    cores; otherwise from the dataset's shards. Both give the same pixels."""
    from ml.data.dataset import load_images
    from ml.data.records import decode_all
    from tasks.common import stage_cores

    if _reader(dataset_dir, data) == "png":
        return load_images(dataset_dir, rows, expected_size=(data.image_size, data.image_size), progress=progress)
    dataset = face_dataset(dataset_dir, rows, data)
    workers = stage_cores() if len(rows) >= READER_MIN_IMAGES else 0
    log.info("reading %d faces of %s in place from %s (%d workers)", len(rows), dataset_dir.name, dataset.rec_path,
             workers)
    images, _ = decode_all(dataset, num_workers=workers)
    return images


def training_keypoints(paths: Paths, parts: list[tuple[Path, Any]]) -> tuple[Any, dict[Path, str]]:
    """float32 (N, 5, 2) keypoints of the concatenated ``parts`` and, per dataset, where they came from:
    ``manifest`` or ``aligner`` (real faces: the align stage's predictions in ``data/aligned``, see
    ``ml.data.landmarks``)."""
    import numpy as np

    from ml.data.landmarks import manifest_keypoints

    out, sources = [], {}
    for d, rows in parts:
        keypoints, sources[d] = manifest_keypoints(d, rows, paths.aligned_set)
        out.append(keypoints)
    return np.concatenate(out), sources


def run(cfg: FRConfig, data: DataConfig, paths: Paths, *, source: str = "real", tracker: Any = None) -> StageResult:
    from ml.fr.backbones import input_contract
    from ml.models.io import save_model
    from ml.fr.train import train_fr

    import numpy as np
    import pandas as pd

    parts, digest, data_source = training_rows(paths, source)
    model_dir = paths.fr_model(source)
    if cfg.stream_from:  # streamed a window at a time from a copy of the dataset, e.g. in an object store
        images = streamed_faces(cfg.stream_from, parts, data, source)
    elif cfg.stream:  # decoded by the DataLoader's workers each epoch, never held: sets larger than memory
        from torch.utils.data import ConcatDataset

        images = ConcatDataset([face_dataset(d, r, data) for d, r in parts])
    else:
        images = np.concatenate([load_rows(d, r, data, progress=True) for d, r in parts])
    rows = pd.concat([r for _, r in parts], ignore_index=True)
    labels = rows["label"].to_numpy()
    val_parts = validation_rows(parts)

    loggers = None
    if tracker is not None:
        from ops.tracking import lightning_logger

        loggers = [lightning_logger(tracker)]
    # KP-RPE backbones read the manifest's landmarks (ground truth for procedural data, the DFA aligner's for the
    # synthetic set) or, for real faces ingested without landmarks, those the align stage predicted
    kprpe = bool(input_contract(cfg.backbone).get("needs_keypoints"))
    keypoints, keypoint_sources = training_keypoints(paths, parts) if kprpe else (None, {})
    val = None
    if val_parts:
        val_rows = pd.concat([r for _, r in val_parts], ignore_index=True)
        val = (np.concatenate([load_rows(d, r, data) for d, r in val_parts]),
               val_rows["label"].to_numpy(), *([training_keypoints(paths, val_parts)[0]] if kprpe else []))
    res = train_fr(cfg, images, labels, loggers=loggers, keypoints=keypoints, val=val)
    if res.global_rank != 0:  # DDP: every rank trains; rank 0 alone writes the model, metrics and registry entry
        return StageResult(f"train_fr@{source}", outputs=[],
                           summary=f"rank {res.global_rank} done; rank 0 saves and logs the model")

    from ml.data.dataset import read_dataset_info

    ingested = [(read_dataset_info(d).get("generator") or {}).get("ingested_from") for d, _ in parts]
    extra = {
        "training_data_digest": digest,
        "training_source": source,
        "training_data_source": data_source,
        # where the user's real faces came from (null for procedural and synthetic data)
        "training_data_path": next((p for p in ingested if p), None),
        "training_identities": int(labels.max()) + 1,
        "training_images": int(len(labels)),
        **numerics(cfg.accelerator, cfg.precision),  # precision ("auto" resolved for this machine) and threads
        # KP-RPE: where each training dataset's keypoints came from (manifest | aligner); empty for other backbones
        "keypoints_source": {d.relative_to(paths.root).as_posix(): src for d, src in keypoint_sources.items()},
    }
    save_model(model_dir, res.model, backbone=res.backbone, kwargs=res.backbone_kwargs, extra=extra)
    last = res.history[-1] if res.history else {}
    result = StageResult(f"train_fr@{source}", outputs=[model_dir])
    result.metrics = {
        "train/loss": float(last.get("train/loss", float("nan"))),
        "train/accuracy": float(last.get("train/accuracy", float("nan"))),
        "train/seconds": float(res.seconds),
        "train/images_per_second": float(len(labels) * max(len(res.history), 1) / max(res.seconds, 1e-9)),
    }
    if keypoint_sources:  # share of the training images whose keypoints the align stage predicted
        predicted = sum(len(r) for d, r in parts if keypoint_sources[d] == "aligner")
        result.metrics["train/keypoints_from_aligner"] = float(predicted / len(labels))
    if "val/accuracy" in last:
        result.metrics.update({"val/accuracy": float(last["val/accuracy"]), "val/images": float(len(val[1]))})
    write_json(paths.metrics / f"train_fr_{source}.json", result.metrics)
    write_history_csv(paths.plots / f"train_fr_{source}_history.csv", res.history,
                      ["epoch", "train/loss", "train/accuracy", *(["val/accuracy"] if "val/accuracy" in last else [])])
    h = res.history
    plot_history(paths.plots / f"train_fr_{source}_loss.png", [
        {"title": "train/loss", "ylabel": "loss", "curves": [("train/loss", h, "train/loss")]},
        {"title": "accuracy (closed set, cosine arg-max)", "ylabel": "accuracy", "ylim": (0, 1),
         "curves": [("train", h, "train/accuracy"), ("val (images not trained on)", h, "val/accuracy")]}])
    result.summary = (
        f"{res.backbone} trained on {len(labels)} images of {extra['training_identities']} identities in "
        f"{res.seconds:.0f}s (train/accuracy {result.metrics['train/accuracy']:.3f}"
        + (f", val/accuracy {result.metrics['val/accuracy']:.3f}" if "val/accuracy" in result.metrics else "")
        + f") → {model_dir}"
    )
    if keypoint_sources:
        result.summary += "; keypoints: " + ", ".join(f"{d.name} from the {src}" for d, src in keypoint_sources.items())
    if tracker is not None:
        for d, _ in parts:
            tracker.log_dataset(d, context="train" if len(parts) == 1 else f"train-{d.name}")
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / f"train_fr_{source}_loss.png", artifact_path="plots")
        # `candidate` is the real-data model (what promotion compares); the others get `candidate-<source>`
        alias = "candidate" if source == "real" else f"candidate-{source}"
        version = tracker.log_model_dir(
            model_dir, REGISTERED_MODEL, alias=alias,
            tags={"source": source, "data_source": data_source, "data_digest": digest,
                  "backbone": res.backbone},
        )
        result.summary += f"; {registered_note(REGISTERED_MODEL, version, alias)}"
    return result


def main(source: str = "real") -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(FRConfig, section(params, "fr"), "fr")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    source_datasets(paths, source)  # unknown source or missing data: fail before opening a run
    if launch_rank(cfg.devices) != 0:  # an extra DDP rank (multi-GPU / multi-node): no tracking run of its own
        log.info(run(cfg, data, paths, source=source).summary)
        return
    with stage_run(f"train_fr@{source}", {"fr": section(params, "fr")}, paths.root) as tracker:
        result = run(cfg, data, paths, source=source, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    import sys

    stage_main(lambda: main(*sys.argv[1:2]), f"train_fr@{(sys.argv[1:2] or ['real'])[0]}")
