"""``cohort.torch``: state_dict <-> Cohort weights round trips.

Skipped when PyTorch is not installed, unless ``COHORT_REQUIRE_TORCH=1``.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import pytest

if os.environ.get("COHORT_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from cohort.torch import from_state_dict, load_weights, to_state_dict  # noqa: E402


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 3),
    )


def _trained_bn_model(seed: int) -> nn.Module:
    """A model whose BatchNorm running stats moved away from their defaults."""
    model = _model(seed)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, 4))
    return model


def test_from_state_dict_types_and_buffers():
    model = _trained_bn_model(0)
    weights = from_state_dict(model)
    sd = model.state_dict()
    expected = [k for k, v in sd.items() if v.is_floating_point()]
    assert list(weights) == expected  # state_dict order, floats only
    assert "1.running_mean" in weights and "1.running_var" in weights
    assert "1.num_batches_tracked" not in weights  # integer buffer left out
    for name, arr in weights.items():
        assert isinstance(arr, np.ndarray)
        assert arr.dtype == np.float32
        assert arr.flags.c_contiguous and arr.flags.writeable
        np.testing.assert_array_equal(arr, sd[name].numpy())
    # Copies: changing the array leaves the model alone, and the other way round.
    weights["0.weight"][...] = 123.0
    assert not torch.any(model[0].weight == 123.0)
    with torch.no_grad():
        model[1].running_mean.add_(1.0)
    assert not np.allclose(weights["1.running_mean"], model[1].running_mean.numpy())


def test_round_trip_into_fresh_model():
    src = _trained_bn_model(0)
    dst = _model(1)
    weights = from_state_dict(src)
    # What train() receives: read-only arrays.
    for arr in weights.values():
        arr.flags.writeable = False
    returned = load_weights(dst, weights)
    assert returned is dst
    for name, tensor in dst.state_dict().items():
        if tensor.is_floating_point():
            assert torch.equal(tensor, src.state_dict()[name]), name
    # num_batches_tracked is not part of the weights: the model keeps its own value.
    assert int(dst[1].num_batches_tracked) == 0
    # Same outputs in eval mode (BatchNorm uses the running stats).
    src.eval()
    dst.eval()
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.allclose(src(x), dst(x))
    # And back again.
    again = from_state_dict(dst)
    assert list(again) == list(weights)
    for name in weights:
        np.testing.assert_array_equal(again[name], weights[name])


def test_to_state_dict_plain():
    weights = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.ones(2, np.float32)}
    weights["b"].flags.writeable = False
    sd = to_state_dict(weights)
    assert isinstance(sd, OrderedDict)
    assert list(sd) == ["a", "b"]
    for name, tensor in sd.items():
        assert isinstance(tensor, torch.Tensor)
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        np.testing.assert_array_equal(tensor.numpy(), weights[name].astype(np.float32))
    sd["a"].add_(1.0)  # a copy: the input is unchanged
    assert weights["a"][0, 0] == 0.0


def test_to_state_dict_into_state_dict_and_model():
    model = _model(2)
    weights = from_state_dict(_trained_bn_model(3))
    target = model.state_dict()
    out = to_state_dict(weights, target)
    assert out is target
    assert torch.equal(model[0].weight, torch.from_numpy(weights["0.weight"]))  # shared storage
    out_model = to_state_dict(weights, _model(4))
    assert isinstance(out_model, nn.Module)
    assert torch.equal(out_model[3].bias, torch.from_numpy(weights["3.bias"]))


def test_errors():
    model = _model(0)
    weights = from_state_dict(model)
    with pytest.raises(KeyError):
        load_weights(model, {**weights, "nope": np.zeros(1, np.float32)})
    missing = dict(weights)
    del missing["0.weight"]
    with pytest.raises(KeyError):
        load_weights(model, missing)
    bad = dict(weights)
    bad["0.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(RuntimeError):
        load_weights(model, bad)
