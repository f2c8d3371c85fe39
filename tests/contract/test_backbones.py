"""The backbone registry's contract, over every entry of ``BACKBONES`` with tiny sizes: its input contract is
known from the name alone and matches the built model's, a forward gives finite (B, D) embeddings (KP-RPE models
with their keypoints), and a saved model directory loads back to the same outputs and the same config."""

import json

import pytest
import torch

from ml.fr.backbones import BACKBONES, build_backbone, input_contract
from ml.fr.backbones.vit import INPUT_CONTRACT
from ml.models.io import CONFIG, load_model, save_model
from tests.unit.test_vit import _images, tiny_kwargs


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_registry_contract_and_round_trip(name, tmp_path):
    torch.manual_seed(0)
    kwargs = tiny_kwargs(name)
    model = build_backbone(name, **kwargs).eval()
    contract = input_contract(model)
    assert contract == input_contract(name, **kwargs)  # from the name alone, without weights
    assert contract["embedding_dim"] == 16
    assert {k: contract[k] for k in ("colour", "mean", "std", "layout")} == {
        k: INPUT_CONTRACT[k] for k in ("colour", "mean", "std", "layout")
    }
    x = _images(model)
    inputs = (x,)
    if getattr(model, "needs_keypoints", False):  # KP-RPE: 5 pixel landmarks per image
        inputs = (x, torch.rand(3, 5, 2, generator=torch.Generator().manual_seed(1)) * (contract["size"] - 1))
    with torch.no_grad():
        y = model(*inputs)
    assert y.shape == (3, 16)
    assert torch.isfinite(y).all()

    save_model(tmp_path / "m", model, backbone=name, kwargs=kwargs, extra={"data_digest": "abc"})
    loaded, config = load_model(tmp_path / "m")
    assert not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(*inputs), y)
    on_disk = json.loads((tmp_path / "m" / CONFIG).read_text())
    assert on_disk["backbone"] == name
    assert on_disk["kwargs"] == kwargs
    assert on_disk["input_contract"] == json.loads(json.dumps(contract))
    assert on_disk["extra"] == {"data_digest": "abc"}
    assert config == on_disk
