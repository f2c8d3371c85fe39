"""Which denoiser makes faces at the embedded budget: ``python -m experiments.generator_designs [NAME ...]``.

Each design is a delta to params ``generator`` (``DESIGNS``). For each, the generator is trained on the run's
training faces with the run's FR contexts (``tasks.train_generator.fit``, on one thread, as the stage runs beside
another), then the first val face (split ``val``: never trained on) of 32 training identities gives 32 contexts,
4 faces each, sampled as ``synthesize`` samples (params ``synthesize.sampler``). Scored:

- the aligner's face score (share ≥ 0.5) and YuNet's detection rate (``tasks.synthesize_judges.detector_judge``) of
  the faces, each beside the same judge on 128 real training faces made at the generator's size;
- the FR cosine of each face to its context, and the identity consistency of each context's 4 faces;
- training seconds (what ``make run`` pays) and milliseconds per sampled face, both on one thread.

``--autoencoders`` measures the ceiling a latent design's sampler cannot pass instead: each latent design's
autoencoder alone (and ``default``: params as committed), trained as the stage trains it (one thread, float32), its
reconstructions of 128 val faces judged the same way (and their PSNR): ``metrics/generator_autoencoders.jsonl``.

``--contexts`` samples make run's own generator from the stage's identity contexts (its empty-context faces,
embedded and filtered) and from real val faces', at guidance scales 1 to 3: ``metrics/generator_contexts.jsonl``.

Needs a finished ``train_fr@real`` and ``train_aligner`` (``dvc repro train_fr@real train_aligner``). Appends one row
per design to ``metrics/generator_designs.jsonl`` (a design measured again replaces its row) and writes
``reports/generator_designs.md`` with each design's faces (``reports/generator_designs/<name>.png``). Test splits are
never read.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from ml.config import from_mapping
from ml.atomic import atomic_path
from tasks.common import Paths, load_params, section, write_text

log = logging.getLogger("experiments.generator_designs")

# name → (what it is, params `generator` delta). Every delta applies to `BEFORE`: params `generator` as it stood when
# the designs were measured (the KL latent), so a row keeps meaning what it measured after the default moves on.
# The pixel designs denoise the 32-px faces themselves, the UNet seeing p × p patches as channels (lossless, so no
# decoder bounds the faces); the latent ones change that autoencoder; `--judge-default` adds make run's own generator.
BEFORE = {"autoencoder_train.architecture": "kl", "autoencoder_train.block_out_channels": [16, 32, 64],
          "autoencoder_train.latent_channels": 4, "train.model.image_size": 8, "train.model.in_channels": 4,
          "train.model.patch_size": 1, "train.model.block_out_channels": [64, 128], "train.epochs": 27,
          "train.lr": 0.001, "train.lr_schedule": "constant", "train.prediction_type": "epsilon",
          "train.loss_weighting": "uniform"}
PIXEL = {"space": "pixel", "train.model.image_size": 32, "train.model.in_channels": 3, "train.precision": "32-true",
         "train.prediction_type": "epsilon", "train.loss_weighting": "uniform"}
P2 = {**PIXEL, "train.model.patch_size": 2, "train.model.block_out_channels": [32, 64, 128], "train.batch_size": 32}
P4 = {**PIXEL, "train.model.patch_size": 4, "train.model.block_out_channels": [64, 128], "train.batch_size": 64}
TINY = {"autoencoder_train.architecture": "tiny", "autoencoder_train.precision": "32-true",
        "train.precision": "32-true"}  # float32: what make run pays there
F2 = {**TINY, "train.model.image_size": 16, "train.model.patch_size": 2}  # 32 px → 16×16 latent → 8×8 UNet grid
C2 = {"autoencoder_train.latent_channels": 2, "train.model.in_channels": 2}
V_MIN_SNR = {"train.prediction_type": "v_prediction", "train.loss_weighting": "min_snr"}
DESIGNS: dict[str, tuple[str, dict[str, Any]]] = {
    "eps_p2": ("ε, uniform; 2×2 patches (12×16×16), UNet [32, 64, 128]; 1,356 steps of 32",
               {**P2, "train.epochs": 12}),
    "eps_minsnr_p2": ("as eps_p2, min-SNR-5 weighting", {**P2, "train.epochs": 12, "train.loss_weighting": "min_snr"}),
    "v_minsnr_p2": ("v, min-SNR-5; 2×2 patches, UNet [32, 64, 128]; 678 steps of 32",
                    {**P2, **V_MIN_SNR, "train.epochs": 6}),
    "v_minsnr_p4": ("v, min-SNR-5; 4×4 patches (48×8×8), UNet [64, 128]; 684 steps of 64",
                    {**P4, **V_MIN_SNR, "train.epochs": 12}),
    "v_minsnr_p4_small": ("as v_minsnr_p4 with UNet [32, 64]; 2,034 steps of 32",
                          {**P4, **V_MIN_SNR, "train.model.block_out_channels": [32, 64], "train.batch_size": 32,
                           "train.epochs": 18}),
    "v_minsnr_p4_cosine": ("as v_minsnr_p4 at lr 0.002, cosine decay",
                           {**P4, **V_MIN_SNR, "train.epochs": 12, "train.lr": 0.002, "train.lr_schedule": "cosine"}),
    "v_p2": ("v, uniform; as v_minsnr_p2", {**P2, "train.prediction_type": "v_prediction", "train.epochs": 6}),
    "v_p4": ("v, uniform; as v_minsnr_p4", {**P4, "train.prediction_type": "v_prediction", "train.epochs": 12}),
    "edm_p2": ("EDM preconditioning; 2×2 patches, UNet [32, 64, 128]; 678 steps of 32",
               {**P2, "train.prediction_type": "edm", "train.epochs": 6}),
    "edm_p4": ("EDM preconditioning; 4×4 patches, UNet [64, 128]; 684 steps of 64",
               {**P4, "train.prediction_type": "edm", "train.epochs": 12}),
    "edm_p2_long": ("as edm_p2, 3× the steps (2,034)", {**P2, "train.prediction_type": "edm", "train.epochs": 18}),
    "edm_p2_wide": ("as edm_p2 with UNet [64, 64, 128]: twice the channels where the 2×2 patches enter",
                    {**P2, "train.prediction_type": "edm", "train.epochs": 6,
                     "train.model.block_out_channels": [64, 64, 128]}),
    "edm_p2_x15": ("as edm_p2, 15× its steps (10,170): `--preset uiface-long`'s generator, trained in its run",
                   {**P2, "train.prediction_type": "edm", "train.epochs": 90}),
    "edm_p4_long": ("as edm_p4, 3× the steps (2,052)", {**P4, "train.prediction_type": "edm", "train.epochs": 36}),
    "tiny_f2_c4": ("latent: AutoencoderTiny [48, 48] → 4×16×16, FR term; UNet [64, 128] on its 2×2 patches",
                   {**F2, "autoencoder_train.block_out_channels": [48, 48]}),
    "tiny_f2_c2": ("as tiny_f2_c4 with 2 latent channels → 2×16×16 (8×8×8 patches)",
                   {**F2, **C2, "autoencoder_train.block_out_channels": [48, 48]}),
    "tiny32_f2_c2": ("as tiny_f2_c2 with AutoencoderTiny [32, 32] (the KL one's training cost)",
                     {**F2, **C2, "autoencoder_train.block_out_channels": [32, 32]}),
    "tiny_f2_c2_edm": ("as tiny_f2_c2 with EDM preconditioning",
                       {**F2, **C2, "autoencoder_train.block_out_channels": [48, 48], "train.prediction_type": "edm"}),
    "tiny32_f2_c2_edm": ("as tiny32_f2_c2 with EDM preconditioning",
                         {**F2, **C2, "autoencoder_train.block_out_channels": [32, 32], "train.prediction_type": "edm"}),
    "tiny32_f2_c1": ("as tiny32_f2_c2 with 1 latent channel → 1×16×16 (4×8×8 patches: the KL latent's size)",
                     {**F2, "autoencoder_train.block_out_channels": [32, 32], "autoencoder_train.latent_channels": 1,
                      "train.model.in_channels": 1}),
    "tiny32_f2_c2_lean": ("as tiny32_f2_c2 with UNet [48, 96], v, min-SNR-5, lr 0.002 cosine; 1,026 steps of 64",
                          {**F2, **C2, **V_MIN_SNR, "autoencoder_train.block_out_channels": [32, 32],
                           "train.model.block_out_channels": [48, 96], "train.epochs": 18, "train.lr": 0.002,
                           "train.lr_schedule": "cosine"}),
    "edm_p2_lognormal": ("as edm_p2, timesteps drawn at EDM's log-normal noise levels (ln σ ~ N(−1.2, 1.2²))",
                         {**P2, "train.prediction_type": "edm", "train.epochs": 6,
                          "train.timestep_sampling": "log_normal"}),
    "tiny32_f2_c2_lean_lognormal": ("as tiny32_f2_c2_lean, timesteps at EDM's log-normal noise levels, uniform "
                                    "weighting", {**F2, **C2, **V_MIN_SNR, "autoencoder_train.block_out_channels": [32, 32],
                                                  "train.model.block_out_channels": [48, 96], "train.epochs": 18,
                                                  "train.lr": 0.002, "train.lr_schedule": "cosine",
                                                  "train.loss_weighting": "uniform",
                                                  "train.timestep_sampling": "log_normal"}),
    "kl_lean": ("the KL latent with UNet [48, 96]; 1,026 steps of 64",
                {"autoencoder_train.precision": "32-true", "train.precision": "32-true",
                 "train.model.block_out_channels": [48, 96], "train.epochs": 18}),
    "kl": ("the default before tiny32_f2_c2_lean: KL 4×8×8, ε, UNet [64, 128]; 1,539 steps of 64",
           {"autoencoder_train.precision": "32-true", "train.precision": "32-true"}),
}
CONTEXTS, PER_CONTEXT = 32, 4  # val contexts, faces sampled per context
REAL_FACES = 128  # training faces made at the generator's size: what each judge gives real faces there


def with_delta(generator: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """params ``generator`` with dotted keys of ``delta`` set (``train.model.patch_size``: nested keys)."""
    out = copy.deepcopy(generator)
    for key, value in delta.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def design_section(generator: dict[str, Any], name: str) -> dict[str, Any]:
    """params ``generator`` as design ``name`` trains it: ``BEFORE``, then the design's delta."""
    return with_delta(with_delta(generator, BEFORE), DESIGNS[name][1])


def measure(name: str, paths: Paths, work: Path) -> dict[str, Any]:
    """Train design ``name`` into ``work/name`` on one thread and judge it (``judge``); one result row."""
    import torch

    from tasks.train_generator import GeneratorStageConfig, fit

    params = load_params(paths.params)
    cfg = from_mapping(GeneratorStageConfig, design_section(section(params, "generator"), name), "generator")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stage's share of a 2-core run (pipeline.jobs 2)
    try:
        start = time.perf_counter()
        fitted = fit(cfg, paths, work / name, report=False)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return judge(name, paths, work / name, seconds, float(fitted.result.history[-1]["train/loss"]))


def judge(name: str, paths: Paths, model_dir: Path, train_seconds: float, train_loss: float) -> dict[str, Any]:
    """Sample the generator in ``model_dir`` (design ``name``) on one thread and score its faces on val; also how
    ``make run``'s own generator is put beside the designs (``--judge-default``)."""
    import torch

    from ml.aligner.dfa import load_aligner
    from ml.data.dataset import load_images, read_manifest
    from ml.generator.sampler import SamplerConfig
    from tasks.synthesize import generate, load_generator_for, sampler_for
    from tasks.train_generator import GeneratorStageConfig, identity_embeddings, load_fr, resize_faces

    params = load_params(paths.params)
    generator = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    model, extra, autoencoder = load_generator_for(paths, generator, model_dir)
    side = int(extra["context_size"])  # the side of the faces the generator makes
    fr, _, _ = load_fr(paths, generator.fr_source, "generator.fr_source")
    rows = read_manifest(paths.train_set / "manifest.parquet")
    val = rows[rows["split"] == "val"].groupby("identity").head(1).head(CONTEXTS).reset_index(drop=True)
    contexts = identity_embeddings(fr, resize_faces(load_images(paths.train_set, val), side), None)
    train = rows[rows["split"] == "train"].sample(REAL_FACES, random_state=0)
    real = resize_faces(load_images(paths.train_set, train), side)  # real faces made at the generator's size
    sampler = sampler_for(from_mapping(SamplerConfig, section(params, "synthesize")["sampler"],
                                       "synthesize.sampler"), extra)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        faces, _, _ = generate(model, contexts, PER_CONTEXT, sampler, batch_size=64, seed=0, autoencoder=autoencoder)
        ms = 1000 * (time.perf_counter() - start) / len(faces)
    finally:
        torch.set_num_threads(threads)
    aligner, _ = load_aligner(paths.aligner_model)
    grid(faces, real, paths.root / "reports" / "generator_designs" / f"{name}.png")
    what = DESIGNS[name][0] if name in DESIGNS else "make run's generator (params.yaml as committed)"
    return {"design": name, "what": what,
            "delta": DESIGNS[name][1] if name in DESIGNS else {}, "train/seconds": float(train_seconds),
            "train/loss": float(train_loss), "sample/ms_per_face": ms,
            **score(faces, contexts, real, fr, aligner, int(section(params, "data")["image_size"]), side)}


def score(faces: np.ndarray, contexts: np.ndarray, real: np.ndarray, fr: Any, aligner: Any, size: int,
          side: int) -> dict[str, float]:
    """The judges' shares of ``faces`` (``PER_CONTEXT`` per row of ``contexts``) beside the same judges on ``real``
    faces at the generator's ``side``; the FR cosine of each face to its context and each context's consistency."""
    from ml.generator.diversity import per_class_consistency
    from tasks.synthesize_judges import detector_judge
    from tasks.train_generator import identity_embeddings, resize_faces

    _, scores = aligner.predict(resize_faces(faces, size))
    _, real_scores = aligner.predict(resize_faces(real, size))
    emb = identity_embeddings(fr, resize_faces(faces, size), None)
    labels = np.repeat(np.arange(len(contexts)), PER_CONTEXT)
    detector = detector_judge(faces, real, side)
    return {"judge/face_share": float((scores >= 0.5).mean()),
            "judge/real_at_size_face_share": float((real_scores >= 0.5).mean()),
            **{k.replace("synthetic/judge/", "judge/"): v for k, v in detector.items()},
            "context_cosine": float(np.mean(np.sum(emb * np.repeat(contexts, PER_CONTEXT, axis=0), axis=1))),
            "identity_consistency": float(np.mean(list(per_class_consistency(emb, labels).values())))}


# `--contexts`: make run's generator sampled from each kind of identity context, at each guidance scale w
CONTEXT_ROWS = [("candidates", 1.0), ("val faces", 1.0), ("candidates", 2.0), ("candidates", 3.0)]


def judge_contexts(paths: Paths) -> list[dict[str, Any]]:
    """Make run's generator (``models/generator``) sampled, as ``synthesize`` samples, from ``CONTEXTS`` identity
    contexts of each kind: ``candidates``, the stage's own (its empty-context faces, embedded and filtered as
    ``synthesize`` does: UIFace's identity search), and ``val faces``, the embeddings of real val faces of training
    identities (what the design rows are sampled from); at guidance scale w (``synthesize.sampler.guidance_scale``)
    per ``CONTEXT_ROWS``. Same noise for every row. → one row each (``score``)."""
    import dataclasses

    import torch

    from ml.aligner.dfa import load_aligner
    from ml.data.dataset import load_images, read_manifest
    from ml.generator.contexts import select_identity_contexts
    from ml.generator.sampler import SamplerConfig
    from tasks.synthesize import SynthesizeConfig, embed_generated, generate, load_generator_for, sampler_for
    from tasks.train_generator import GeneratorStageConfig, identity_embeddings, load_fr, resize_faces

    params = load_params(paths.params)
    generator = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    synth = from_mapping(SynthesizeConfig, section(params, "synthesize"), "synthesize")
    size = int(section(params, "data")["image_size"])
    model, extra, autoencoder = load_generator_for(paths, generator)
    side = int(extra["context_size"])
    fr, _, _ = load_fr(paths, synth.fr_source, "synthesize.fr_source")
    aligner, _ = load_aligner(paths.aligner_model)
    sampler = sampler_for(from_mapping(SamplerConfig, section(params, "synthesize")["sampler"],
                                       "synthesize.sampler"), extra)
    candidates, _, _ = generate(model, None, synth.candidates, sampler, batch_size=64, seed=synth.seed * 1_000_003,
                                autoencoder=autoencoder, desc="candidates")
    cand_emb, _, _ = embed_generated(fr, aligner, candidates, size)
    keep = select_identity_contexts(cand_emb, CONTEXTS, synth.max_cosine, allow_fewer=True)
    rows = read_manifest(paths.train_set / "manifest.parquet")
    val = rows[rows["split"] == "val"].groupby("identity").head(1).head(CONTEXTS).reset_index(drop=True)
    kinds = {"candidates": cand_emb[keep],
             "val faces": identity_embeddings(fr, resize_faces(load_images(paths.train_set, val), side), None)}
    train = rows[rows["split"] == "train"].sample(REAL_FACES, random_state=0)
    real = resize_faces(load_images(paths.train_set, train), side)
    out = []
    for kind, w in CONTEXT_ROWS:
        torch.manual_seed(0)
        faces, _, _ = generate(model, kinds[kind], PER_CONTEXT, dataclasses.replace(sampler, guidance_scale=w),
                               batch_size=64, seed=7, autoencoder=autoencoder, desc=f"{kind}, w {w:g}")
        out.append({"contexts": kind, "guidance_scale": w, "n_contexts": len(kinds[kind]),
                    **score(faces, kinds[kind], real, fr, aligner, size, side)})
        log.info("%s", out[-1])
    return out


def measure_autoencoder(name: str, paths: Paths) -> dict[str, Any]:
    """Train design ``name``'s autoencoder (``default``: params as committed) as ``train_generator`` trains it, on one
    thread in float32, and judge its reconstructions of ``REAL_FACES`` val faces: one result row."""
    import dataclasses

    import torch

    from ml.aligner.dfa import load_aligner
    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.generator.autoencoder import reconstruct, train_autoencoder
    from tasks.synthesize_judges import detector_judge
    from tasks.train_generator import GeneratorStageConfig, identity_embeddings, load_fr, resize_faces

    params = load_params(paths.params)
    delta = DESIGNS[name][1] if name in DESIGNS else {}
    generator = section(params, "generator")
    cfg = from_mapping(GeneratorStageConfig, design_section(generator, name) if name in DESIGNS else generator,
                       "generator")
    if cfg.space != "latent" or cfg.autoencoder:
        raise SystemExit(f"design {name} trains no autoencoder (space {cfg.space}); --autoencoders takes latent ones")
    ae_cfg = dataclasses.replace(cfg.autoencoder_train, precision="32-true")
    side = cfg.train.model.image_size * ae_cfg.factor
    fr, _, _ = load_fr(paths, cfg.fr_source, "generator.fr_source")
    rows = read_manifest(paths.train_set / "manifest.parquet")
    train = rows[rows["split"] == "train"].reset_index(drop=True)
    images = load_images(paths.train_set, train)
    faces = resize_faces(images, side)
    landmarks = landmarks_array(train)
    landmarks = None if landmarks is None else landmarks * (side / images.shape[1])
    contexts = identity_embeddings(fr, faces, landmarks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        autoencoder, history, seconds = train_autoencoder(ae_cfg, faces, contexts, fr if ae_cfg.fr_weight > 0 else None,
                                                          landmarks, progress=False)
    finally:
        torch.set_num_threads(threads)
    val = rows[rows["split"] == "val"].head(REAL_FACES).reset_index(drop=True)
    real = resize_faces(load_images(paths.train_set, val), side)
    recon, _ = reconstruct(autoencoder, real)
    mse = ((recon.astype(np.float64) - real.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
    size = int(section(params, "data")["image_size"])
    aligner, _ = load_aligner(paths.aligner_model)
    _, scores = aligner.predict(resize_faces(recon, size))
    _, real_scores = aligner.predict(resize_faces(real, size))
    detector = detector_judge(recon, real, side)
    grid(recon, real, paths.root / "reports" / "generator_designs" / f"autoencoder_{name}.png", per_context=1)
    return {"design": name, "what": DESIGNS[name][0] if name in DESIGNS else "make run's autoencoder",
            "delta": delta, "train/seconds": float(seconds), "train/pixel": float(history[-1]["train/pixel"]),
            "psnr": float(np.mean(10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-12)))),
            "judge/face_share": float((scores >= 0.5).mean()),
            "judge/real_at_size_face_share": float((real_scores >= 0.5).mean()),
            **{k.replace("synthetic/judge/", "judge/"): v for k, v in detector.items()}}


def grid(faces: np.ndarray, real: np.ndarray, path: Path, columns: int = 16, zoom: int = 2, gap: int = 2,
         per_context: int = PER_CONTEXT) -> None:
    """The first ``columns`` contexts' faces (one column each, ``per_context`` rows) over a row of real faces at the
    same size, at their own pixels × ``zoom`` (nearest): what the generator made, not a smoothed picture of it."""
    from PIL import Image

    side = faces.shape[1] * zoom
    rows = per_context + 1
    canvas = np.full((rows * (side + gap) + gap, columns * (side + gap) + gap, 3), 255, dtype=np.uint8)
    for c in range(columns):
        for r in range(rows):
            face = faces[c * per_context + r] if r < per_context else real[c]
            y, x = gap + r * (side + gap), gap + c * (side + gap)
            canvas[y:y + side, x:x + side] = face.repeat(zoom, axis=0).repeat(zoom, axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Image.fromarray(canvas).save(tmp, format="png", optimize=True)


def report(rows: list[dict[str, Any]], autoencoders: list[dict[str, Any]] = (),
           contexts: list[dict[str, Any]] = ()) -> str:
    def pct(row: dict[str, Any], key: str) -> str:
        return f"{100 * row[key]:.1f} %" if key in row else "—"

    lines = ["# Generator designs at the embedded budget", "",
             "`python -m experiments.generator_designs`: each design trained on the run's training faces on one "
             "thread, float32; sampled with params `synthesize.sampler` from 32 contexts of val faces of training "
             "identities (4 faces each). Chosen on and scored on: val contexts (no test split is read). A judge's share "
             "is beside the same judge on 128 real training faces made at the generator's size; `default` is "
             "`make run`'s own generator, judged the same way. ms / face: sampling with the default sampler (38 UNet "
             "evaluations a face), read beside other work: it compares designs only roughly. A design measured again "
             "replaces its row, so rows can come from different days and hosts: train s compares the designs measured "
             "together, and the judges' shares the designs judged with the same FR teacher and aligner (a different "
             "real-face share in brackets shows another aligner; `default` is trained and judged with make run's "
             "own).", "",
             "| design | train s | ms / face | aligner: faces (real) | YuNet: faces (real) | context cos | "
             "consistency | what |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row['design']}` | {row['train/seconds']:.0f} | {row['sample/ms_per_face']:.0f} | "
                     f"{pct(row, 'judge/face_share')} ({pct(row, 'judge/real_at_size_face_share')}) | "
                     f"{pct(row, 'judge/detector_face_share')} ({pct(row, 'judge/detector_real_at_size_face_share')})"
                     f" | {row['context_cosine']:.3f} | {row['identity_consistency']:.3f} | {row['what']} |")
    lines += ["", "Each picture: 4 faces per context, one column per context, over a row of real training faces at the "
              "same size (pixels × 2).", ""]
    lines += [f"`{row['design']}`:\n\n![{row['design']}](generator_designs/{row['design']}.png)\n" for row in rows]
    if autoencoders:
        lines += ["## The ceiling: each latent design's autoencoder alone", "",
                  "`python -m experiments.generator_designs --autoencoders`: the autoencoder trained as the stage "
                  "trains it (one thread, float32), its reconstructions of 128 val faces judged as the designs' faces "
                  "are (chosen on and scored on: val). No sampler of that latent can make faces the judges accept "
                  "more often than these.", "",
                  "| autoencoder of | train s | PSNR dB | aligner: faces (real) | YuNet: faces (real) | what |",
                  "|---|---|---|---|---|---|"]
        for row in autoencoders:
            lines.append(f"| `{row['design']}` | {row['train/seconds']:.0f} | {row['psnr']:.1f} | "
                         f"{pct(row, 'judge/face_share')} ({pct(row, 'judge/real_at_size_face_share')}) | "
                         f"{pct(row, 'judge/detector_face_share')} "
                         f"({pct(row, 'judge/detector_real_at_size_face_share')}) | {row['what']} |")
        lines += ["", "Each picture: reconstructions over the val faces they reconstruct (pixels × 2).", ""]
        lines += [f"`{row['design']}`:\n\n![autoencoder {row['design']}](generator_designs/autoencoder_{row['design']}"
                  ".png)\n" for row in autoencoders]
    if contexts:
        lines += ["## Identity contexts: what the stage samples from", "",
                  "`python -m experiments.generator_designs --contexts`: make run's generator, sampled as `synthesize` "
                  f"samples ({PER_CONTEXT} faces each, the same noise for every row) from {CONTEXTS} contexts of two "
                  "kinds: `candidates`, the stage's own (the generator's empty-context faces, embedded and filtered "
                  "as UIFace's identity search does), and `val faces`, embeddings of real val faces of training "
                  "identities (what the design rows above sample from); w: the guidance scale "
                  "(`synthesize.sampler.guidance_scale`, make run's 1). Chosen on: nothing. Scored on: the faces (no "
                  "test split).", "",
                  "| contexts | w | aligner: faces (real) | YuNet: faces (real) | context cos | consistency |",
                  "|---|---|---|---|---|---|"]
        for row in contexts:
            lines.append(f"| {row['contexts']} | {row['guidance_scale']:g} | {pct(row, 'judge/face_share')} "
                         f"({pct(row, 'judge/real_at_size_face_share')}) | {pct(row, 'judge/detector_face_share')} "
                         f"({pct(row, 'judge/detector_real_at_size_face_share')}) | {row['context_cosine']:.3f} | "
                         f"{row['identity_consistency']:.3f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.generator_designs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("designs", nargs="*", metavar="NAME", help=f"designs to train and judge: {', '.join(DESIGNS)} "
                        "(default: all)")
    parser.add_argument("--judge", metavar="DIR", type=Path, help="judge the trained generator in DIR as design NAME "
                        "(one name; its training seconds and last loss from --seconds / --loss) instead of training")
    parser.add_argument("--seconds", type=float, default=float("nan"), help="with --judge: its training seconds")
    parser.add_argument("--loss", type=float, default=float("nan"), help="with --judge: its last training loss")
    parser.add_argument("--judge-default", action="store_true", help="judge make run's models/generator as the row "
                        "`default` (seconds and loss from metrics/train_generator.json)")
    parser.add_argument("--autoencoders", action="store_true", help="train and judge only the autoencoders of the "
                        "named latent designs and `default` (the ceiling their samplers cannot pass)")
    parser.add_argument("--contexts", action="store_true", help="sample make run's models/generator from the stage's "
                        "own identity contexts and from real faces', at guidance 1 to 3 "
                        "(metrics/generator_contexts.jsonl)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the metrics files")
    args = parser.parse_args(argv)
    unknown = [name for name in args.designs if name not in DESIGNS and not (args.autoencoders and name == "default")]
    if unknown:
        parser.error(f"no design named {', '.join(unknown)}; the designs are {', '.join(DESIGNS)}")
    if args.judge is not None and len(args.designs) != 1:
        parser.error("--judge DIR needs exactly one design NAME")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    paths = Paths()
    order = [*DESIGNS, "default"]

    def stored(store: Path) -> dict[str, dict[str, Any]]:
        return {r["design"]: r for r in map(json.loads, store.read_text().splitlines())} if store.is_file() else {}

    def keep(store: Path, row: dict[str, Any]) -> None:  # read again first: designs measured in parallel add rows
        rows = {**stored(store), row["design"]: row}
        log.info("%s: %s", row["design"], {k: v for k, v in row.items() if k not in ("what", "delta")})
        with atomic_path(store) as tmp:
            tmp.write_text("".join(json.dumps(rows[n], sort_keys=True) + "\n" for n in order if n in rows))

    designs, autoencoders = paths.metrics / "generator_designs.jsonl", paths.metrics / "generator_autoencoders.jsonl"
    contexts = paths.metrics / "generator_contexts.jsonl"
    if args.contexts:
        with atomic_path(contexts) as tmp:
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in judge_contexts(paths)))
    elif args.autoencoders:
        for name in args.designs or ["default"]:
            keep(autoencoders, measure_autoencoder(name, paths))
    elif args.judge is not None:
        keep(designs, judge(args.designs[0], paths, args.judge, args.seconds, args.loss))
    elif args.judge_default:
        trained = json.loads((paths.metrics / "train_generator.json").read_text())
        keep(designs, judge("default", paths, paths.generator_model, trained["train/seconds"]
                            + trained.get("autoencoder/seconds", 0.0), trained["train/loss"]))
    elif not args.report_only:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="generator_designs_") as work:
            for name in args.designs or list(DESIGNS):
                keep(designs, measure(name, paths, Path(work)))
    rows, ae_rows = stored(designs), stored(autoencoders)
    write_text(paths.root / "reports" / "generator_designs.md",
               report([rows[n] for n in order if n in rows], [ae_rows[n] for n in order if n in ae_rows],
                      [json.loads(line) for line in contexts.read_text().splitlines()] if contexts.is_file() else []))


if __name__ == "__main__":
    main()
