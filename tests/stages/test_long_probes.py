"""experiments/long_probes*.py and ``ml.fusion.sets.FusionStream``: streamed fusion equals all-at-once fusion, the
streamed frames equal ``surveillance_sequence`` and ``ProceduralFaces.sequence``, the experiment runs end to end at
toy size (one process and two) on surveillance probes with the true-quality oracle, and bad arguments give one clear
error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.long_probes import parse_args, run_experiment
from experiments.long_probes.setup import (
    LABELS,
    METHODS,
    LongProbesConfig,
    ProbeSpec,
    first_free_identity,
    load_models,
    probe_lengths,
    procedural_config,
    surveillance_config,
)
from experiments.long_probes.probe_stream import stream_sequence
from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.data.surveillance import (
    SurveillanceConfig,
    stream_surveillance_sequence,
    surveillance_sequence,
)
from ml.errors import ConfigError, DataError
from ml.fusion.sets import FusionStream, features_and_styles, fuse_templates
from ml.fusion import ARCFACE_TEMPLATE_112, CAFace
from ml.fusion.caface import save_caface

from tests.conftest import REPO, spread_caface

pytestmark = pytest.mark.usefixtures("one_thread")

SLICES = (1, 6, 2, 9, 13, 1, 8)  # 40 frames fed in uneven pieces, crossing chunk boundaries


def _frames(n: int = 40, d: int = 16, style_dim: int = 8, size: float = 64.0, seed: int = 0):
    """Features with spread norms, styles, landmarks near the ArcFace template (some far: weight 0) and scores."""
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n, d)).astype(np.float32) * rng.uniform(0.5, 4.0, (n, 1)).astype(np.float32)
    styles = rng.normal(size=(n, style_dim, 2)).astype(np.float32)
    template = np.asarray(ARCFACE_TEMPLATE_112, np.float32) * (size / 112.0)
    landmarks = template + rng.normal(0.0, 2.0, (n, 5, 2)).astype(np.float32)
    landmarks[::7] += 20.0  # far from the template: d_i = 0
    scores = rng.uniform(0.2, 1.0, n).astype(np.float32)
    return feats, styles, landmarks, scores


def _feed(stream: FusionStream, feats, styles, landmarks, scores) -> list[np.ndarray]:
    """Feed the frames in SLICES; return the template after each slice."""
    out, lo = [], 0
    for n in SLICES:
        rows = slice(lo, lo + n)
        stream.update(feats[rows], styles=styles[rows], landmarks=landmarks[rows], face_scores=scores[rows],
                      quality=scores[rows])  # the scores stand in for the oracle's true quality
        out.append(stream.template())
        lo += n
    assert lo == feats.shape[0]
    return out


# ---- FusionStream equals fuse_templates


@pytest.mark.parametrize("method", ["average", "norm_weighted", "landmark_score", "quality_oracle"])
def test_baseline_streams_equal_all_at_once_fusion_for_every_prefix(method):
    feats, styles, landmarks, scores = _frames()
    stream = FusionStream(method, image_size=64.0)
    templates = _feed(stream, feats, styles, landmarks, scores)
    ends = np.cumsum(SLICES)
    for end, got in zip(ends, templates):
        want = fuse_templates(method, feats[:end], np.zeros(end, np.int64), landmarks=landmarks[:end],
                              face_scores=scores[:end], image_size=64.0, quality=scores[:end])[0]
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert stream.frames == 40
    assert stream.state_nbytes() <= 3 * 16 * 8  # O(D), not O(frames)


def test_landmark_score_stream_falls_back_to_the_average_when_every_weight_is_zero():
    feats, styles, landmarks, scores = _frames()
    far = landmarks + 40.0  # every image far from the template: all weights 0
    stream = FusionStream("landmark_score", image_size=64.0)
    stream.update(feats[:10], landmarks=far[:10], face_scores=scores[:10])
    stream.update(feats[10:], landmarks=far[10:], face_scores=scores[10:])
    np.testing.assert_allclose(stream.template(), fuse_templates("average", feats, np.zeros(40, np.int64))[0], atol=1e-6)


def test_caface_stream_equals_its_own_update_and_fuse_over_the_same_chunks():
    torch.manual_seed(0)
    model = spread_caface(CAFace(feature_dim=16, style_dim=8))
    feats, styles, landmarks, scores = _frames()
    stream = FusionStream("caface", model=model, chunk_size=8)
    templates = _feed(stream, feats, styles, landmarks, scores)

    def by_hand(end: int) -> np.ndarray:  # chunks [0, 8), [8, 16), … of the first `end` frames
        with torch.no_grad():
            state = model.init_state(1)
            for lo in range(0, end, 8):
                hi = min(lo + 8, end)
                state = model.update(state, torch.from_numpy(feats[lo:hi])[None], torch.from_numpy(styles[lo:hi])[None])
            return model.fuse(state)[0].numpy()

    for end, got in zip(np.cumsum(SLICES), templates):
        np.testing.assert_allclose(got, by_hand(int(end)), atol=1e-6)
    # the evaluate stage's path over the same chunks (fuse_sets, a padded batch of one) agrees too
    want = fuse_templates("caface", feats, np.zeros(40, np.int64), styles=styles, model=model, chunk_size=8)[0]
    np.testing.assert_allclose(templates[-1], want, atol=1e-5)
    # at most one chunk is buffered: the state does not grow with the frames
    assert stream.state_nbytes() < (8 * (16 + 8 * 2) + 4 * (1 + 16 + 128)) * 4 + 1


def test_fusion_stream_bad_input_is_refused_by_name():
    feats, styles, landmarks, scores = _frames()
    with pytest.raises(DataError, match="no frames yet"):
        FusionStream("average").template()
    with pytest.raises(ConfigError, match="unknown fusion method 'median'"):
        FusionStream("median")
    with pytest.raises(ConfigError, match="needs a trained CAFace"):
        FusionStream("caface")
    stream = FusionStream("average").update(feats[:4])
    with pytest.raises(DataError, match="8 channels but this stream fuses 16-d"):
        stream.update(feats[:4, :8])
    with pytest.raises(DataError, match="landmark_score fusion needs landmarks"):
        FusionStream("landmark_score").update(feats[:4])
    with pytest.raises(DataError, match="quality_oracle fusion needs quality"):
        FusionStream("quality_oracle").update(feats[:4])
    torch.manual_seed(0)
    with pytest.raises(DataError, match="needs styles"):
        FusionStream("caface", model=CAFace(feature_dim=16, style_dim=8).eval()).update(feats[:4])
    bad = feats[:4].copy()
    bad[2] = np.nan
    with pytest.raises(DataError, match="row 2 is not finite"):
        FusionStream("norm_weighted").update(bad)
    assert stream.frames == 4  # a refused update leaves the state as it was


# ---- frames and probes


def test_streamed_frames_are_the_bytes_of_procedural_sequence():
    gen = ProceduralFaces(ProceduralConfig(image_size=32), seed=3)
    for length in (1, 9, 21):
        want = gen.sequence(5, length, seq_index=2)
        got = list(stream_sequence(gen, 5, length, seq_index=2))
        assert len(got) == length
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.image, b.image)
            np.testing.assert_array_equal(a.landmarks, b.landmarks)
            assert a.quality == b.quality


@pytest.mark.parametrize("cfg", [SurveillanceConfig(), SurveillanceConfig(usable_fraction=0.3)])
def test_surveillance_frames_are_rendered_only_when_asked_for(cfg, monkeypatch):
    gen = ProceduralFaces(ProceduralConfig(image_size=32), seed=3)
    want = surveillance_sequence(gen, 5, 21, seq_index=2, cfg=cfg)
    rendered = []
    render = gen.render
    monkeypatch.setattr(gen, "render", lambda identity, n: rendered.append(1) or render(identity, n))
    stream = stream_surveillance_sequence(gen, 5, 21, seq_index=2, cfg=cfg)
    assert not rendered  # the knots are drawn, no frame yet
    got = [next(stream) for _ in range(3)]
    assert len(rendered) == 3
    got += list(stream)
    assert len(got) == 21 and len(rendered) == 21
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.image, b.image)
        assert a.quality == b.quality and a.nuisance == b.nuisance
    assert sum(s.quality >= 0.3 for s in got) <= max(1, round(cfg.usable_fraction * 21)) + 1  # one usable window
    with pytest.raises(ValueError, match="length must be a positive integer"):
        stream_surveillance_sequence(gen, 5, 0)  # checked at the call, not at the first frame


def test_probe_lengths_are_stratified_log_uniform_and_seeded():
    cfg = LongProbesConfig(enrolled=12, distractors=4, min_frames=1000, max_frames=20000)
    lengths = probe_lengths(cfg)
    assert lengths.shape == (16,) and lengths.min() >= 1000 and lengths.max() <= 20000
    u = np.sort((np.log(lengths) - np.log(1000)) / (np.log(20000) - np.log(1000)))
    assert np.all((u >= np.arange(16) / 16 - 1e-3) & (u <= np.arange(1, 17) / 16 + 1e-3))  # one per slice
    np.testing.assert_array_equal(lengths, probe_lengths(cfg))
    assert not np.array_equal(lengths, probe_lengths(LongProbesConfig(seed=1)))


def test_the_experiment_knows_every_streamed_fusion_method():
    from ml.fusion.sets import STREAM_METHODS  # the experiment streams every probe, the quality oracle included

    assert METHODS == STREAM_METHODS and set(LABELS) == set(STREAM_METHODS)


def test_probe_identities_come_after_every_prepared_set():
    # params.yaml data: 200 train + 100 held-out + 100 discovery + 30 videos + 10 distractors + 120 unaligned
    assert first_free_identity(REPO / "params.yaml") == 920


# ---- bad arguments


@pytest.mark.parametrize(("argv", "message"), [
    (["--min-frames", "5000", "--max-frames", "1000"], "bounds are reversed: --min-frames 5000 > --max-frames 1000"),
    (["--enrolled", "0", "--distractors", "0"], "no probes"),
    (["--enrolled", "0"], "--enrolled 0: there are no mated probes"),
    (["--methods", "average", "median"], "--methods must name fusion methods"),
    (["--chunk", "0"], "--chunk must be an integer ≥ 1"),
    (["--design", "smooth"], "--design must be one of surveillance, procedural, got 'smooth'"),
])
def test_bad_arguments_raise_one_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_args(argv)


def test_the_command_prints_one_error_line_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "experiments.long_probes", "--min-frames", "300", "--max-frames", "30"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: probe length bounds are reversed: --min-frames 300 > --max-frames 30; swap them "
                      "(e.g. --min-frames 1000 --max-frames 20000)"]


# ---- end to end at toy size


@pytest.fixture(scope="module")
def toy_models(tmp_path_factory) -> dict[str, Path]:
    """A random 32-px ViT (16-d features, 64 style channels), a CAFace for it and a random DFA, on disk."""
    from ml.aligner.dfa import build_aligner, save_aligner
    from ml.models.io import save_model

    root = tmp_path_factory.mktemp("long_probe_models")
    torch.manual_seed(0)
    from ml.fr.backbones.vit import vit_tiny

    kwargs = dict(img_size=32, patch_size=8, dim=32, depth=4, heads=2, embed_dim=16)
    save_model(root / "fr", vit_tiny(**kwargs).eval(), backbone="vit_tiny", kwargs=kwargs)
    save_caface(spread_caface(CAFace(feature_dim=16, style_dim=64)), root / "fusion")
    save_aligner(root / "aligner", build_aligner("dfa_mnet025", input_size=96).eval())
    return {"fr": root / "fr", "fusion": root / "fusion", "aligner": root / "aligner"}


def _toy_config(models: dict[str, Path], **kw) -> LongProbesConfig:
    base = dict(enrolled=3, distractors=1, gallery_only=4, min_frames=20, max_frames=60, booking_stills=2, chunk=16, caface_chunk=8,
                prefixes=(5, 30), workers=1, threads=1, fr_model=models["fr"], fusion_model=models["fusion"],
                aligner=models["aligner"])
    return LongProbesConfig(**{**base, **kw})


def test_toy_run_writes_the_report_and_its_templates_equal_all_at_once_fusion(toy_models, tmp_path):
    cfg = _toy_config(toy_models)
    out = run_experiment(cfg, out_dir=tmp_path, params_path=REPO / "params.yaml", progress=False)
    report = (tmp_path / "reports" / "long_probes.md").read_text()
    assert (tmp_path / "plots" / "long_probes_gain.png").stat().st_size > 1000
    for title in ("## Surveillance-to-Single", "## Surveillance-to-Booking", "## Rank-1 versus probe length"):
        section = report.split(title, 1)[1].split("\n## ", 1)[0]
        for method in cfg.methods:
            assert f"| {LABELS[method]} | " in section, (title, method)
    assert "DFA predictions" in report and "## Throughput" in report and "## Memory" in report
    assert "surveillance sequences" in report and "| true-quality oracle − average (points) |" in report
    assert "- Headroom: the true-quality oracle" in report
    metrics = out["metrics"]
    assert "quality_oracle" in cfg.methods  # a default row, beside the methods
    for gallery in ("single", "booking"):
        for m in cfg.methods:
            assert set(metrics[gallery][m]) >= {"rank1", "rank5", "tpir@fpir=1e-2"}
            assert metrics[gallery][m]["n_mated"] == 3 and metrics[gallery][m]["n_nonmated"] == 1
        assert all(np.isfinite(v) for v in metrics[gallery]["quality_oracle"].values())
    assert all(np.isfinite(v) for v in metrics["prefix"]["quality_oracle"].values())
    assert all(np.isfinite(r.templates["quality_oracle"]).all() for r in out["results"])
    # surveillance probes: most frames heavily degraded (data.surveillance: a usable window of 10 % of the frames)
    assert sum(r.low_quality for r in out["results"]) > 0.7 * sum(r.frames for r in out["results"])
    for m in ("norm_weighted", "landmark_score", "caface", "quality_oracle"):  # agreement with averaging, per prefix
        assert set(metrics["cosine"][m]) == {5, 30, 0}
        mean, low = metrics["cosine"][m][0]
        assert -1.0 <= low <= mean <= 1.0 + 1e-6
    assert all(r.caface_spread is not None and r.caface_spread[0] >= 0 for r in out["results"])
    assert "Why CAFace acts as it does" in report
    assert "Galleries of 7 identities: the 3 probed ones and 4 without a probe (identities 924–927)" in report

    # the streamed templates of the longest probe equal fusing all its frames at once
    spec: ProbeSpec = max(out["specs"], key=lambda s: s.length)
    result = out["results"][spec.index]
    assert result.frames == spec.length and sum(result.seconds.values()) > 0
    models = load_models(cfg)
    proc, seed = procedural_config(REPO / "params.yaml", models.image_size)
    frames = surveillance_sequence(ProceduralFaces(proc, seed=seed), spec.identity, spec.length, spec.seq_index,
                                   surveillance_config(REPO / "params.yaml"))
    images = np.stack([f.image for f in frames])
    quality = np.array([f.quality for f in frames], dtype=np.float32)
    assert np.mean(quality < 0.1) > 0.5 and quality.max() > 0.1  # mostly unusable, with a usable window
    landmarks, scores = models.aligner.predict(images, batch_size=64)
    feats, styles = features_and_styles(models.fr, images)
    groups = np.zeros(spec.length, np.int64)
    for m in cfg.methods:
        want = fuse_templates(m, feats, groups, styles=styles, landmarks=landmarks, face_scores=scores,
                              model=models.caface, image_size=32.0, chunk_size=8, quality=quality)[0]
        np.testing.assert_allclose(result.templates[m], want, atol=1e-4, err_msg=m)
        first5 = fuse_templates(m, feats[:5], groups[:5], styles=styles[:5], landmarks=landmarks[:5],
                                face_scores=scores[:5], model=models.caface, image_size=32.0, chunk_size=8,
                                quality=quality[:5])[0]
        np.testing.assert_allclose(result.prefix_templates[m][5], first5, atol=1e-4, err_msg=m)
    assert result.prefix_frames == {5: 5, 30: min(30, spec.length)}


def test_two_workers_give_the_same_templates_as_one(toy_models, tmp_path):
    kw = dict(aligner=None, methods=("average", "landmark_score", "caface", "quality_oracle"), max_frames=40)
    one = run_experiment(_toy_config(toy_models, **kw), out_dir=tmp_path / "one", progress=False)
    two = run_experiment(_toy_config(toy_models, workers=2, **kw), out_dir=tmp_path / "two", progress=False)
    assert os.getpid() not in {r.pid for r in two["results"]}  # the probes ran in the worker processes
    for a, b in zip(one["results"], two["results"]):
        for m in kw["methods"]:
            np.testing.assert_allclose(a.templates[m], b.templates[m], atol=1e-5)
    assert one["metrics"]["booking"] == two["metrics"]["booking"]
    assert "ground-truth landmarks" in (tmp_path / "two" / "reports" / "long_probes.md").read_text()


def test_the_procedural_design_streams_the_smooth_sequences(toy_models, tmp_path):
    cfg = _toy_config(toy_models, aligner=None, design="procedural", methods=("average", "quality_oracle"), enrolled=1,
                      distractors=0, gallery_only=1, min_frames=20, max_frames=20)
    out = run_experiment(cfg, out_dir=tmp_path, params_path=REPO / "params.yaml", progress=False)
    assert "smooth procedural video-like sequences" in out["report"]
    spec, result = out["specs"][0], out["results"][0]
    models = load_models(cfg)
    proc, seed = procedural_config(REPO / "params.yaml", models.image_size)
    frames = ProceduralFaces(proc, seed=seed).sequence(spec.identity, spec.length, spec.seq_index)
    quality = np.array([f.quality for f in frames], dtype=np.float32)
    feats, _ = features_and_styles(models.fr, np.stack([f.image for f in frames]))
    for m in cfg.methods:
        want = fuse_templates(m, feats, np.zeros(20, np.int64), quality=quality)[0]
        np.testing.assert_allclose(result.templates[m], want, atol=1e-4, err_msg=m)
    assert result.low_quality == int((quality < 0.1).sum())
