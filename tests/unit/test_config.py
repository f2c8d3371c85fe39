from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from ml.config import from_mapping
from ml.errors import ConfigError
from tasks.params import apply_delta, check_params, load_preset, parse_assignments

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Inner:
    p: float = 0.5


@dataclass(frozen=True)
class Cfg:
    epochs: int = 3
    lr: float = 1e-3
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    fars: tuple[float, ...] = (0.1,)
    pair: tuple[int, float] = (1, 0.5)
    inner: Inner = field(default_factory=Inner)


def test_defaults_and_conversion():
    cfg = from_mapping(Cfg, {"lr": 1, "fars": [0.01, 0.001], "pair": [2, 3], "inner": {"p": 1}}, "fr")
    assert cfg == Cfg(lr=1.0, fars=(0.01, 0.001), pair=(2, 3.0), inner=Inner(p=1.0))
    assert isinstance(cfg.pair[1], float)
    assert isinstance(cfg.lr, float)


def test_unknown_key_named_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown params key 'fr.epoch'.*Did you mean 'fr.epochs'"):
        from_mapping(Cfg, {"epoch": 2}, "fr")


@pytest.mark.parametrize("key", ["aws_secret_access_key", "access_key", "password", "api-token", "PrivateKey"])
def test_a_credential_key_is_refused_saying_where_credentials_go(key):
    with pytest.raises(ConfigError, match=rf"'fr.{key}' looks like a credential.*through the environment") as err:
        from_mapping(Cfg, {key: "s3cr3t"}, "fr")
    assert "s3cr3t" not in str(err.value)  # the message never repeats the value


def test_storage_credential_key_names_the_aws_variables():
    from ops.remote import StorageConfig

    with pytest.raises(ConfigError, match=r"'storage.secret_key' looks like a credential.*AWS_SECRET_ACCESS_KEY"):
        from_mapping(StorageConfig, {"secret_key": "x"}, "storage")
    with pytest.raises(ConfigError, match=r"Did you mean 'storage.region'"):  # a typo is still a typo
        from_mapping(StorageConfig, {"regoin": "x"}, "storage")


@pytest.mark.parametrize(
    ("mapping", "key"),
    [({"epochs": "2"}, "fr.epochs"), ({"epochs": True}, "fr.epochs"), ({"lr": "fast"}, "fr.lr"),
     ({"mode": "c"}, "fr.mode"), ({"fars": 0.1}, "fr.fars"), ({"pair": [1, 2, 3]}, "fr.pair"), ({"pair": [1.5, 2]}, r"fr.pair\[0\]"), ({"inner": {"q": 1}}, "fr.inner.q")],
)
def test_wrong_types_name_the_key(mapping, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_mapping(Cfg, mapping, "fr")


def test_shipped_params_are_valid():
    check_params(yaml.safe_load((REPO / "params.yaml").read_text()))


def test_parse_assignments():
    assert parse_assignments(["fr.epochs=2", "evaluate.fars=[0.01, 0.1]", "data.ingest_folder="]) == {
        "fr.epochs": 2, "evaluate.fars": [0.01, 0.1], "data.ingest_folder": ""}
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        parse_assignments(["epochs=2"])


def test_exponent_floats_are_numbers_on_the_way_in_and_back(tmp_path):
    """PyYAML's YAML 1.1 reads ``3e-4`` as a string; params are YAML 1.2 (DVC reads them with ruamel)."""
    from tasks.common import load_params

    assert parse_assignments(["fr.lr=3e-4", "fr.weight_decay=1E+2", "fr.epochs=2"]) == {
        "fr.lr": 3e-4, "fr.weight_decay": 100.0, "fr.epochs": 2}
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    apply_delta(params, {"fr.lr": 1e-05})  # ruamel writes it back as 1e-05
    assert load_params(params)["fr"]["lr"] == 1e-05
    assert parse_assignments(["data.ingest_folder=1e5x"])["data.ingest_folder"] == "1e5x"


def test_apply_delta_keeps_comments_and_validates(tmp_path):
    params = tmp_path / "params.yaml"
    original = (REPO / "params.yaml").read_text()
    params.write_text(original)
    changes = apply_delta(params, {"fr.epochs": 2, "data.procedural.blur_prob": 0.1})
    assert changes["fr.epochs"][1] == 2
    text = params.read_text()
    assert "# stage train_fr" in text  # comments survive
    loaded = yaml.safe_load(text)
    assert loaded["fr"]["epochs"] == 2 and loaded["data"]["procedural"] == {"blur_prob": 0.1}


@pytest.mark.parametrize(("delta", "match"), [
    ({"fr.epoch": 2}, r"fr\.epoch"), ({"fr.epochs": "many"}, r"fr\.epochs"), ({"nosuch.key": 1}, "nosuch"),
])
def test_apply_delta_rejects_bad_keys_without_writing(tmp_path, delta, match):
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    before = params.read_text()
    with pytest.raises(ConfigError, match=match):
        apply_delta(params, delta)
    assert params.read_text() == before
    assert list(tmp_path.iterdir()) == [params]  # no temp file left behind


@pytest.mark.parametrize("name", sorted(yaml.safe_load((REPO / "presets.yaml").read_text())))
def test_every_preset_is_valid(tmp_path, name):
    delta = load_preset(name, REPO)
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    apply_delta(params, delta)  # checks every section of the result
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        load_preset("nope", REPO)
