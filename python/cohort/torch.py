"""PyTorch helpers: Cohort's weights (a dict of NumPy arrays) to and from a model's
``state_dict``.

::

    from cohort.torch import from_state_dict, load_weights

    def train(weights, task):
        model = Net()
        load_weights(model, weights)          # copies into the model, in place
        ...                                   # your training loop
        return cohort.TrainResult(from_state_dict(model), n, {"loss": loss})

PyTorch is imported when a helper is first called, so ``import cohort.torch`` works
without it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Mapping, Optional

import numpy as np

__all__ = ["to_state_dict", "from_state_dict", "load_weights"]


def _torch() -> Any:
    """The ``torch`` module, or an ImportError that says how to get it."""
    try:
        import torch  # noqa: PLC0415 - imported lazily on purpose
    except ImportError as exc:
        raise ImportError(
            "cohort.torch needs PyTorch, which is not installed: pip install torch "
            "(or pip install 'cohort[torch]')"
        ) from exc
    return torch


def _as_tensor(torch: Any, name: str, value: Any) -> Any:
    """A float32 CPU tensor that owns a copy of ``value`` (a NumPy array, possibly
    read-only, or a tensor)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=torch.float32).clone().contiguous()
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"weights[{name!r}]: expected a numeric array, got dtype {arr.dtype}")
    return torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))


def _is_module(obj: Any) -> bool:
    return hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict") and callable(
        getattr(obj, "state_dict")
    )


def to_state_dict(
    weights: Mapping[str, Any],
    model_or_state_dict: Optional[Any] = None,
) -> Any:
    """Cohort's weights as PyTorch tensors, optionally loaded into a model.

    Args:
        weights: A dict of tensor name to array (what ``train`` receives: read-only
            float32 arrays), or of tensors.
        model_or_state_dict: Where to load them, if anywhere:

            * an ``nn.Module``: loaded with ``model.load_state_dict`` (each parameter
              keeps its own dtype and device). Entries ``weights`` does not hold are
              accepted only if they are integer buffers (``num_batches_tracked``,
              which :func:`from_state_dict` leaves out); they keep their values.
            * a ``state_dict`` (a mapping of name to tensor): each named tensor is
              overwritten in place with ``copy_`` (keeping its dtype and device).

    Returns:
        Without ``model_or_state_dict``: an ``OrderedDict`` of name to float32 CPU
        tensor, in the order of ``weights``, each a copy (changing it does not change
        ``weights``). With it: the same model or state_dict, loaded.

    Raises:
        ImportError: PyTorch is not installed.
        KeyError: A name is unknown to the model or state_dict, or the model has a
            floating-point tensor that ``weights`` lacks.
        RuntimeError: A shape differs from the model's (from ``load_state_dict``).
        TypeError: A value is not numeric.
    """
    torch = _torch()
    tensors: "OrderedDict[str, Any]" = OrderedDict(
        (str(name), _as_tensor(torch, str(name), value)) for name, value in weights.items()
    )
    if model_or_state_dict is None:
        return tensors
    if _is_module(model_or_state_dict):
        model = model_or_state_dict
        current = model.state_dict()
        unknown = [k for k in tensors if k not in current]
        if unknown:
            raise KeyError(f"the model has no tensor named {', '.join(map(repr, unknown[:5]))}")
        missing = [
            k
            for k, v in current.items()
            if k not in tensors and isinstance(v, torch.Tensor) and v.is_floating_point()
        ]
        if missing:
            raise KeyError(f"weights lack the model's tensor(s) {', '.join(map(repr, missing[:5]))}")
        model.load_state_dict(tensors, strict=False)
        return model
    if isinstance(model_or_state_dict, Mapping):
        target = model_or_state_dict
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name not in target:
                    raise KeyError(f"the state_dict has no tensor named {name!r}")
                dest = target[name]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise RuntimeError(
                        f"{name}: shape {tuple(tensor.shape)} does not match the state_dict's "
                        f"{tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
        return target
    raise TypeError(
        "model_or_state_dict must be an nn.Module or a state_dict, got "
        f"{type(model_or_state_dict).__name__}"
    )


def from_state_dict(model_or_state_dict: Any) -> Dict[str, np.ndarray]:
    """A model's tensors as Cohort's weights.

    Parameters and floating-point buffers (BatchNorm's ``running_mean`` and
    ``running_var``) are included, in ``state_dict`` order. Integer and boolean
    buffers, such as BatchNorm's ``num_batches_tracked``, are left out: Cohort
    averages floating-point tensors only, and such counters are not meaningful to
    average. :func:`to_state_dict` and :func:`load_weights` accept weights without
    them and leave the model's own values in place.

    Args:
        model_or_state_dict: An ``nn.Module``, or a ``state_dict`` (a mapping of name
            to tensor or array).

    Returns:
        A dict of name to float32, C-contiguous NumPy array: detached CPU copies that
        share no memory with the model.

    Raises:
        ImportError: PyTorch is not installed.
        TypeError: The argument is neither a model nor a mapping.
    """
    torch = _torch()
    state = model_or_state_dict
    if _is_module(state):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise TypeError(
            f"expected an nn.Module or a state_dict, got {type(model_or_state_dict).__name__}"
        )
    out: Dict[str, np.ndarray] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point():
                continue  # num_batches_tracked and other integer buffers
            arr = value.detach().to(device="cpu", dtype=torch.float32).numpy()
        else:
            arr = np.asarray(value)
            if arr.dtype.kind != "f":
                continue
        out[str(name)] = np.array(arr, dtype=np.float32, order="C", copy=True)
    return out


def load_weights(model: Any, weights: Mapping[str, Any]) -> Any:
    """Copies Cohort's weights into ``model``, in place.

    The same as ``to_state_dict(weights, model)``: each parameter and buffer keeps its
    dtype and device; integer buffers absent from ``weights`` (``num_batches_tracked``)
    keep their values.

    Args:
        model: An ``nn.Module``.
        weights: A dict of name to array, such as ``train``'s ``weights``.

    Returns:
        ``model``, for chaining.

    Raises:
        ImportError: PyTorch is not installed.
        KeyError: A name is unknown to the model, or a floating-point tensor of the
            model is missing from ``weights``.
        RuntimeError: A shape differs from the model's.
    """
    if not _is_module(model):
        raise TypeError(f"load_weights needs an nn.Module, got {type(model).__name__}")
    return to_state_dict(weights, model)
