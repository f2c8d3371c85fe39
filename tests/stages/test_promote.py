"""Model-registry promotion against a real MLflow store (SQLite file) and a real Prefect server on loopback.

A tiny prepared dataset and tiny random models: three FR models whose gate numbers are measured once and ordered
(low < mid < high), so the gate's thresholds can sit between them. The lifecycle: a first candidate below the floor
is rejected; the next one is promoted on the floors alone; a better one is promoted (the old champion becomes
@previous); a worse one is rejected with the aliases unchanged; rollback restores @previous once. Around it: the
decision logic by hand, the gate checks, every benchmark's declared metrics, an alias move that fails midway and is
undone, an unreachable tracking server, the CLI, and the champion served by ``mlflow.pyfunc`` and ``mlflow models
serve``.
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ml.errors import ConfigError, DataError
from ops import promote as p
from ops.promote import registry as promote_registry
from tasks.common import Paths

from tests.servers import closed_port_url, mlflow_model_server, prefect_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

VIT = dict(depth=1, dim=32, heads=2, embed_dim=16, drop_path=0.0)  # vit_tiny at 64 px, patch 8: 64 tokens, 16-d
FR_SEEDS = (0, 1, 2)
DATA = dict(seed=0, train_identities=4, images_per_identity=4, heldout_identities=8, heldout_images_per_identity=4,
            gallery_images_per_identity=1, verification_pairs=200, template_identities=4, templates_per_identity=2,
            frames_per_template=2, discovery_identities=6, discovery_images_per_identity=6, video_identities=2,
            fusion_identities=2, fusion_clean_images=1, fusion_sources=1, fusion_copies=2,
            video_distractors=1, video_frames=[2, 3], booking_stills=1, unaligned_identities=4,
            unaligned_images_per_identity=3, unaligned_test_identities=2, unaligned_size=64)
EVALUATE = dict(fars=[0.01, 0.1], ranks=[1, 5], fpirs=[0.1], distractor_ranks=[1, 5], batch_size=64, ssk_n_init=2,
                ssk_max_iter=50, nnc_k=3, fusion_chunk_size=8)
SYNTHESIZE = dict(batch_size=16, sampler=dict(mode="baseline", attention_injection=False, steps=2))
PROMOTE = dict(retries=1, retry_delay_s=0.0, generator_identities=3, generator_images_per_identity=2,
               generator_steps=2,
               aligner=dict(benchmarks=["alignment"], primary="test/nme", min_improvement=0.0,
                            guards={"test/failure@0.1": 1.0}, floors={"test/nme": 100.0}),
               fusion=dict(benchmarks=["fusion"], primary="sets/templates/caface/tar@far=1e-2", min_improvement=0.0,
                           guards={}, floors={"sets/templates/caface/tar@far=1e-2": 0.0}))
PRIMARY = "verification/mean_accuracy"


def write_params(root: Path, **promote) -> None:
    params = {"data": DATA, "evaluate": EVALUATE, "synthesize": SYNTHESIZE, "promote": {**PROMOTE, **promote}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def save_fr(model_dir: Path, seed: int) -> Path:
    from ml.fr.backbones import build_backbone
    from ml.models.io import save_model

    torch.manual_seed(seed)
    return save_model(model_dir, build_backbone("vit_tiny", **VIT).eval(), backbone="vit_tiny", kwargs=VIT)


def register(root: Path, model_dir: Path, name: str = "faceops-fr", stage: str = "train_fr@real") -> str:
    """Register a model the way the stages do: FR as a pyfunc embedder, the others as a run artifact."""
    from ops.tracking import stage_run

    with stage_run(stage, {}, root) as tracker:
        if name == "faceops-fr":
            return tracker.log_model_dir(model_dir, name)
        return tracker.register_model_dir(name, model_dir=model_dir)


def registry(name: str = "faceops-fr") -> tuple[dict, dict]:
    """(aliases, {version: tags}) of ``name``."""
    from mlflow import MlflowClient

    client = MlflowClient()
    aliases = {a: str(v) for a, v in client.get_registered_model(name).aliases.items()}
    return aliases, {str(v.version): dict(v.tags) for v in client.search_model_versions(f"name = '{name}'")}


def promote_runs() -> list:
    import mlflow

    return mlflow.search_runs(experiment_names=["faceops"], filter_string="tags.`faceops.stage` = 'promote'",
                              output_format="list")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Workspace: params, a tiny prepared dataset, an MLflow SQLite store, a Prefect server; three FR models."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.prepare import DataConfig, run as prepare

    tmp = tmp_path_factory.mktemp("promote")
    root = tmp / "ws"
    root.mkdir()
    (root / "dvc.yaml").write_text("stages: {}\n")
    write_params(root)
    prepare(DataConfig(**{**DATA, "video_frames": tuple(DATA["video_frames"])}), Paths(root), workers=1)
    fr_dirs = {seed: save_fr(tmp / f"fr{seed}", seed) for seed in FR_SEEDS}
    with pytest.MonkeyPatch.context() as mp, prefect_server(tmp / "prefect") as prefect_env:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
        mp.chdir(tmp)  # MLflow puts a SQLite store's artifacts under ./mlruns of the working directory
        with temporary_settings({PREFECT_API_URL: prefect_env["PREFECT_API_URL"]}):
            ctx = p.bench_context(root)
            primary = {seed: p.run_benchmarks("fr", d, ctx)[PRIMARY] for seed, d in fr_dirs.items()}
            yield {"root": root, "tmp": tmp, "fr": fr_dirs, "primary": primary, "versions": {}, "prefect": prefect_env}
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)  # the flow runs' last log lines reach the server before it stops


def flow(ws, **kwargs) -> dict:
    from flows.promote import promote_flow

    return promote_flow(root=str(ws["root"]), **kwargs)


# ───────────────────────────────────────────────────────────────────────── decision logic by hand

GATE = p.Gate(benchmarks=("recognition",), primary="acc", min_improvement=0.01, guards={"err": 0.02},
              floors={"acc": 0.5, "err": 0.3})
UP = {"acc": True, "err": False}


def test_decide_by_hand():
    # improvement exactly the margin passes (0.81 − 0.80 is 0.010000000000000009 in floats), guard at its limit holds
    d = p.decide("fr", GATE, UP, "3", {"acc": 0.81, "err": 0.22}, "2", {"acc": 0.80, "err": 0.20})
    assert d.outcome == "promoted" and [r.result for r in d.rules] == ["pass", "pass", "pass", "pass"]
    primary, guard, floor_acc, floor_err = d.rules
    assert primary.improvement == pytest.approx(0.01) and primary.check.startswith("improvement +0.0100 ≥ 0.0100")
    assert guard.check == "0.2200 ≤ 0.2000 + 0.0200" and floor_err.check == "0.2200 ≤ 0.3000"
    # a lower-is-better guard regressing past its tolerance fails even though the primary improved a lot
    d = p.decide("fr", GATE, UP, "3", {"acc": 0.95, "err": 0.2201 + 0.0100}, "2", {"acc": 0.80, "err": 0.20})
    assert d.outcome == "rejected" and [r.result for r in d.rules] == ["pass", "FAIL", "pass", "pass"]
    assert "REJECTED" in d.headline() and "guard err" in d.headline() and "@champion stays v2" in d.headline()
    # an improvement below the margin fails; NaN fails its rule
    d = p.decide("fr", GATE, UP, "3", {"acc": 0.805, "err": float("nan")}, "2", {"acc": 0.80, "err": 0.20})
    assert [r.result for r in d.rules] == ["FAIL", "FAIL", "pass", "FAIL"]
    assert d.summary()["rules"][1]["candidate"] is None  # NaN → null in the JSON
    # no champion: primary and guards are n/a, the floors decide (err is a maximum)
    d = p.decide("fr", GATE, UP, "1", {"acc": 0.6, "err": 0.25}, None, None)
    assert d.outcome == "promoted" and [r.result for r in d.rules] == ["n/a", "n/a", "pass", "pass"]
    assert "first @champion" in d.headline()
    d = p.decide("fr", GATE, UP, "1", {"acc": 0.6, "err": 0.31}, None, None)
    assert d.outcome == "rejected" and "there is still no @champion" in d.headline()
    table = d.markdown()
    assert "| `acc` ↑ | 0.6000 | — | — |" in table and "| floor | `err` ↓ | 0.3100 ≤ 0.3000 | **FAIL** |" in table


def test_rollback_plan_drops_candidate_aliases_of_the_demoted_version():
    state = p.RegistryState("faceops-fr", {"champion": "3", "previous": "2", "candidate": "3",
                                           "candidate-synthetic": "4"})
    plan = p.plan_rollback(state)
    assert (plan.demoted, plan.restored, plan.dropped) == ("3", "2", ("candidate",))
    with pytest.raises(p.PromotionError, match="no @previous version"):
        p.plan_rollback(p.RegistryState("faceops-fr", {"champion": "3"}))
    with pytest.raises(p.PromotionError, match="no @champion"):
        p.plan_rollback(p.RegistryState("faceops-fr", {"previous": "2"}))


# ───────────────────────────────────────────────────────────────────────── config and benchmarks


def test_registry_io_waits_the_first_delay_then_doubles():
    from flows.promote import _io, connect

    io = connect.with_options(**_io(p.PromoteConfig(retries=3, retry_delay_s=2.0)))
    assert io.retries == 3 and io.retry_delay_seconds == [2.0, 4.0, 8.0]
    io = connect.with_options(**_io(p.PromoteConfig(retries=2, retry_delay_s=0.5)))
    assert io.retries == 2 and io.retry_delay_seconds == [0.5, 1.0]
    assert connect.with_options(**_io(p.PromoteConfig(retries=0))).retries == 0


def test_config_rejects_bad_gates():
    from ml.config import from_mapping

    with pytest.raises(ConfigError, match=r"promote\.fr\.primry.*Did you mean 'promote\.fr\.primary'"):
        from_mapping(p.PromoteConfig, {"fr": {"benchmarks": ["recognition"], "primry": "x"}}, "promote")
    with pytest.raises(ConfigError, match=r"promote\.fr\.guards\.identification/rank1' = -0\.1"):
        from_mapping(p.PromoteConfig, {"fr": {"benchmarks": ["recognition"], "primary": "x",
                                              "guards": {"identification/rank1": -0.1}}}, "promote")
    with pytest.raises(ConfigError, match=r"'alignment' measures faceops-aligner, not faceops-fr.*recognition"):
        from_mapping(p.PromoteConfig, {"fr": {"benchmarks": ["alignment"], "primary": "test/nme"}}, "promote")
    with pytest.raises(ConfigError, match="unknown model 'faceops-face'"):
        p.model_key("faceops-face")
    assert p.model_key("faceops-fusion") == p.model_key("fusion") == "fusion"


def test_gate_naming_an_unknown_metric_lists_what_the_benchmarks_produce(ws):
    ctx = p.bench_context(ws["root"], p.PromoteConfig(fr=p.Gate(("recognition",), PRIMARY, 0.0,
                                                                 {"verification/procedural/acuracy": 0.01}, {})))
    with pytest.raises(ConfigError) as err:
        p.check_gate("fr", ctx)
    message = str(err.value)
    assert "promote.fr.guards" in message and "'verification/procedural/acuracy'" in message
    assert "verification/procedural/accuracy" in message and "templates/tar@far=1e-1" in message


def tiny_model(benchmark: str, model_dir: Path, fr_dir: Path) -> Path:
    """A random tiny model of the kind ``benchmark`` measures, fitted to the FR model's feature sizes."""
    from ml.aligner.dfa import build_aligner, save_aligner
    from ml.fr.backbones import build_backbone
    from ml.discovery.facegcd import FaceGCD, save_facegcd
    from ml.fusion.caface import CAFace, save_caface
    from ml.generator.uiface import GeneratorModelConfig, IDConditionedUNet, save_generator
    from ml.models.io import read_model_config

    contract = read_model_config(fr_dir, what="FR model")["input_contract"]
    torch.manual_seed(0)
    if benchmark == "alignment":
        return save_aligner(model_dir, build_aligner(input_size=64))
    if benchmark == "discovery":
        vit = build_backbone("vit_tiny", **{**VIT, "depth": 2})
        return save_facegcd(FaceGCD(vit, prefix_length=2, proj_dim=16, proj_hidden=32, proj_bottleneck=8), model_dir)
    if benchmark == "fusion":
        caface = CAFace(feature_dim=contract["embedding_dim"], style_dim=contract["style_dim"], num_clusters=2,
                        style_embed_dim=8, norm_embed_dim=8, depth=1, heads=2, mixer_depth=1)
        return save_caface(caface.eval(), model_dir)
    assert benchmark == "generation", benchmark
    config = GeneratorModelConfig(image_size=16, block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4,
                                  id_dim=contract["embedding_dim"], context_dim=16)
    return save_generator(model_dir, IDConditionedUNet(config).eval(), extra={"space": "pixel"})


def test_every_benchmark_produces_what_it_declares(ws, tmp_path):
    import dataclasses

    fr_dir = ws["fr"][0]
    ctx = dataclasses.replace(p.bench_context(ws["root"]), fr_dir=fr_dir, fr_model="local FR")
    for name, bench in p.BENCHMARKS.items():
        model_dir = fr_dir if name == "recognition" else tiny_model(name, tmp_path / name, fr_dir)
        declared = bench.metrics(ctx)
        values = bench.run(model_dir, ctx)
        assert set(declared) <= set(values), (name, sorted(set(declared) - set(values)))
        assert all(math.isfinite(values[m]) for m in declared), (name, values)
        rates = [m for m in declared if not m.startswith("synthetic/") and m != "test/nme"]
        assert all(0.0 <= values[m] <= 1.0 for m in rates), (name, values)
    names = list(p.BENCHMARKS["recognition"].metrics(ctx))
    assert names[:2] == ["verification/procedural/accuracy", PRIMARY] and "templates/tar@far=1e-2" in names


def test_benchmark_needing_the_fr_champion_says_so(ws, tmp_path):
    ctx = p.bench_context(ws["root"])
    with pytest.raises(p.PromotionError, match="faceops-fr@champion"):
        p.BENCHMARKS["fusion"].run(tmp_path, ctx)


# ───────────────────────────────────────────────────────────────────────── the lifecycle through the flow


@pytest.fixture(scope="module")
def lifecycle(ws):
    """Run the whole promotion lifecycle through the Prefect flow; keep the registry after each step."""
    low, mid, high = sorted(FR_SEEDS, key=lambda s: ws["primary"][s])
    r = ws["primary"]
    assert r[low] < r[mid] < r[high], r  # the premise: three distinct numbers (seeded, deterministic)
    fr_gate = dict(benchmarks=["recognition"], primary=PRIMARY, min_improvement=(r[high] - r[mid]) / 2,
                   guards={"identification/rank1": 1.0}, floors={PRIMARY: (r[low] + r[mid]) / 2})
    write_params(ws["root"], fr=fr_gate)
    root, steps = ws["root"], {}

    def step(label: str, model_dir: Path | None = None, **kwargs) -> None:
        version = register(root, model_dir) if model_dir is not None else None
        result = flow(ws, **kwargs)
        steps[label] = {"version": version, "result": result, "registry": registry()}
        if version:
            ws["versions"][version] = model_dir

    step("low first", ws["fr"][low])      # v1: below the floor, no champion
    step("mid first", ws["fr"][mid])      # v2: first champion on the floors
    step("high", ws["fr"][high])          # v3: beats v2 by more than the margin
    step("low again", ws["fr"][low])      # v4: worse than v3
    step("rollback", rollback=True)
    with pytest.raises(p.PromotionError, match="no @previous version") as second:
        flow(ws, rollback=True)
    return {"steps": steps, "gate": fr_gate, "r": r, "order": (low, mid, high), "second_rollback": second.value}


def test_first_candidate_below_the_floor_is_rejected_and_recorded(lifecycle):
    s = lifecycle["steps"]["low first"]
    aliases, tags = s["registry"]
    assert s["result"]["decision"] == "rejected" and "champion" not in aliases
    assert tags["1"]["promotion.decision"] == "rejected" and tags["1"]["promotion.champion"] == "none"
    floor = next(r for r in s["result"]["rules"] if r["kind"] == "floor")
    low = lifecycle["order"][0]
    assert floor["candidate"] == pytest.approx(lifecycle["r"][low]) and floor["passed"] is False
    assert floor["threshold"] == pytest.approx(lifecycle["gate"]["floors"][PRIMARY])


def test_first_candidate_passing_the_floors_becomes_champion(lifecycle):
    s = lifecycle["steps"]["mid first"]
    aliases, tags = s["registry"]
    assert s["result"]["decision"] == "promoted" and aliases["champion"] == "2" and "previous" not in aliases
    assert [r["passed"] for r in s["result"]["rules"]] == [None, None, True]  # primary, guard n/a; floor passes
    assert tags["2"]["promotion.decision"] == "promoted"


def test_better_candidate_is_promoted_and_old_champion_becomes_previous(lifecycle):
    s = lifecycle["steps"]["high"]
    aliases, tags = s["registry"]
    assert s["result"]["decision"] == "promoted"
    assert (aliases["champion"], aliases["previous"], aliases["candidate"]) == ("3", "2", "3")
    primary = s["result"]["rules"][0]
    _, mid, high = lifecycle["order"]
    assert primary["candidate"] == pytest.approx(lifecycle["r"][high])
    assert primary["champion"] == pytest.approx(lifecycle["r"][mid]) and primary["passed"] is True
    summary = json.loads(tags["3"]["promotion.summary"])
    assert summary["decision"] == "promoted" and summary["champion"] == "2"
    assert set(summary["metrics"]) == {"candidate", "champion"}


def test_worse_candidate_is_rejected_aliases_unchanged_decision_recorded(lifecycle, ws):
    from mlflow import MlflowClient

    s = lifecycle["steps"]["low again"]
    aliases, tags = s["registry"]
    assert s["result"]["decision"] == "rejected"
    assert (aliases["champion"], aliases["previous"], aliases["candidate"]) == ("3", "2", "4")
    assert tags["4"]["promotion.decision"] == "rejected" and tags["4"]["promotion.champion"] == "3"
    assert "REJECTED: faceops-fr v4" in s["result"]["headline"] and "@champion stays v3" in s["result"]["headline"]
    # the MLflow record: both models' numbers and the decision as markdown + JSON
    client = MlflowClient()
    run = client.get_run(tags["4"]["promotion.run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["faceops.promote.decision"] == "rejected"
    assert "candidate/verification/mean_accuracy" in run.data.metrics
    assert "champion/verification/mean_accuracy" in run.data.metrics
    files = {a.path for a in client.list_artifacts(run.info.run_id, "promotion")}
    assert files == {"promotion/decision.md", "promotion/decision.json"}
    # ... tagged with the Prefect flow run that made it, which published the same table as an artifact
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        flow_ids = {str(f.id) for f in prefect.read_flow_runs()}
        artifacts = [a for a in prefect.read_artifacts() if a.key == "promote-faceops-fr"]
    assert run.data.tags["prefect.flow_run_id"] in flow_ids
    assert any("REJECTED: faceops-fr v4" in str(a.data) for a in artifacts)


def test_rollback_restores_previous_once(lifecycle):
    s = lifecycle["steps"]["rollback"]
    aliases, tags = s["registry"]
    assert s["result"]["decision"] == "rolled_back"
    assert aliases["champion"] == "2" and "previous" not in aliases and aliases["candidate"] == "4"
    assert tags["3"]["promotion.rolled_back_to"] == "2" and tags["3"]["promotion.decision"] == "promoted"
    assert "cannot be repeated" in str(lifecycle["second_rollback"])


# ───────────────────────────────────────────────────────────────────────── bad input, nothing half-written


def test_unknown_metric_in_gate_fails_before_the_registry_is_touched(lifecycle, ws):
    before, runs = registry(), len(promote_runs())
    write_params(ws["root"], fr={**lifecycle["gate"], "floors": {"verification/procedural/acuracy": 0.5}})
    try:
        with pytest.raises(ConfigError, match=r"promote\.fr\.floors.*acuracy.*They produce: .*procedural/accuracy"):
            flow(ws)
    finally:
        write_params(ws["root"], fr=lifecycle["gate"])
    assert registry() == before and len(promote_runs()) == runs


def test_failed_alias_move_is_undone(lifecycle, ws):
    """A promotion whose @champion move fails after @previous moved and the tags were written leaves the registry
    exactly as it was, and its MLflow run ends FAILED naming the error."""
    from mlflow import MlflowClient

    class Flaky(MlflowClient):
        def set_registered_model_alias(self, name, alias, version):
            if alias == "champion" and version == "4":
                raise RuntimeError("server went away")
            return super().set_registered_model_alias(name, alias, version)

    before = registry()
    state = p.registry_state(MlflowClient(), "faceops-fr")
    decision = p.decide("fr", p.Gate(("recognition",), PRIMARY, 0.0), {PRIMARY: True}, "4", {PRIMARY: 0.9}, "2",
                        {PRIMARY: 0.8})
    with pytest.raises(RuntimeError, match="server went away"):
        p.record(decision, state, root=ws["root"], client=Flaky())
    assert registry() == before
    failed = [r for r in promote_runs() if r.info.status == "FAILED"]
    assert any("server went away" in r.data.tags.get("promotion.error", "") for r in failed)


def test_unreachable_tracking_server_retries_then_names_the_endpoint(lifecycle, ws, monkeypatch):
    url = closed_port_url()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    probes: list[str] = []
    real_check = promote_registry.check_tracking

    def counted(uri: str, *args, **kwargs) -> None:
        probes.append(uri)
        real_check(uri, *args, **kwargs)

    monkeypatch.setattr(promote_registry, "check_tracking", counted)  # what p.connect calls
    with pytest.raises(p.RegistryUnreachable, match=rf"{url} is unreachable.*after 2 attempts"):
        flow(ws)
    # Prefect really ran the connect task twice (promote.retries: 1), each time probing the endpoint
    assert probes == [url, url]


def test_fusion_gate_embeds_faces_with_the_fr_champion(lifecycle, ws, tmp_path):
    from mlflow import MlflowClient

    with pytest.raises(p.PromotionError, match=r"faceops-fusion is not in the MLflow registry.*--stage train_fusion"):
        flow(ws, model="fusion")
    champion = str(MlflowClient().get_model_version_by_alias("faceops-fr", "champion").version)
    model_dir = tiny_model("fusion", tmp_path / "fusion", ws["versions"][champion])
    version = register(ws["root"], model_dir, "faceops-fusion", "train_fusion")
    result = flow(ws, model="fusion")
    assert result["decision"] == "promoted" and result["candidate"] == version
    assert result["fr_model"] == f"faceops-fr v{champion}"
    assert f"faces embedded by faceops-fr v{champion}" in result["markdown"]


def test_aligner_first_candidate_registered_as_run_artifact(ws, tmp_path):
    from ml.aligner.dfa import build_aligner, save_aligner

    torch.manual_seed(0)
    model_dir = save_aligner(tmp_path / "aligner", build_aligner(input_size=64))
    version = register(ws["root"], model_dir, "faceops-aligner", "train_aligner")
    result = flow(ws, model="aligner")
    assert result["decision"] == "promoted" and result["candidate"] == version
    assert registry("faceops-aligner")[0]["champion"] == version
    assert 0.0 <= result["metrics"]["candidate"]["test/nme"] <= 100.0


# ───────────────────────────────────────────────────────────────────────── CLI


def test_cli_dry_run_prints_the_table_and_writes_nothing(lifecycle, ws, monkeypatch, capfd):
    from typer.testing import CliRunner

    from faceops.cli import app

    monkeypatch.chdir(ws["root"])
    before, runs = registry(), len(promote_runs())
    out = CliRunner().invoke(app, ["promote", "fr", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "DRY RUN, nothing written — would be REJECTED: faceops-fr v4" in out.output
    assert "| rule | metric | check | result |" in out.output and "candidate v4" in out.output
    assert registry() == before and len(promote_runs()) == runs
    capfd.readouterr()
    out = CliRunner().invoke(app, ["promote", "faceops-fr", "--rollback"])
    assert out.exit_code == 2 and "no @previous version" in out.output
    logged = capfd.readouterr()  # what Prefect's handlers wrote besides the command's own line
    assert "Traceback" not in logged.out + logged.err, logged  # an expected refusal: its reason, once


def test_cli_help_teaches():
    from typer.testing import CliRunner

    from faceops.cli import app

    out = CliRunner().invoke(app, ["promote", "--help"])
    assert out.exit_code == 0 and "--rollback" in out.output and "--dry-run" in out.output
    assert "previous" in out.output and "Exit status" in out.output


# ───────────────────────────────────────────────────────────────────────── serving the champion


def _faces(ws, n: int = 5) -> np.ndarray:
    from ml.data.formats import read_verification_bin

    images, _ = read_verification_bin(ws["root"] / "data/prepared/verification/procedural.bin")
    return images[:n]


def _expected(ws, images: np.ndarray) -> np.ndarray:
    from mlflow import MlflowClient

    from ml.models.io import load_model
    from ml.fr.train import embed

    version = str(MlflowClient().get_model_version_by_alias("faceops-fr", "champion").version)
    feats = embed(load_model(ws["versions"][version])[0], images, flip=True)
    return feats / np.linalg.norm(feats, axis=1, keepdims=True)


def test_pyfunc_champion_returns_normalised_embeddings(lifecycle, ws):
    import mlflow

    images = _faces(ws)
    model = mlflow.pyfunc.load_model("models:/faceops-fr@champion")
    out = np.asarray(model.predict(images))
    assert out.shape == (5, VIT["embed_dim"]) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(out, _expected(ws, images), atol=1e-5)


def test_mlflow_models_serve_answers_invocations(lifecycle, ws):
    import os

    images = _faces(ws, 3)
    log = ws["tmp"] / "serve.log"
    with mlflow_model_server("models:/faceops-fr@champion", {"MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]},
                             log=log) as url:
        request = urllib.request.Request(f"{url}/invocations", data=json.dumps({"inputs": images.tolist()}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.loads(response.read())
    out = np.asarray(body["predictions"], dtype=np.float32)
    assert out.shape == (3, VIT["embed_dim"])
    np.testing.assert_allclose(out, _expected(ws, images), atol=1e-4)


def test_data_error_for_a_version_without_a_model_directory(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(DataError, match="expected one faceops model directory"):
        p.find_model_dir(tmp_path, "faceops-fr v9")
