"""Argument checks and autocast shared by the functional API and the modules, so that both check
(and cast) alike: errors name the argument and never truncate a value."""

import operator
from typing import Optional, Tuple

import torch
from torch import Tensor

unsafe_view = torch.ops.aten._unsafe_view.default  # a reshape whose result is not a view (as matmul's)

FORMATS = ("channels_first", "tokens")
EMBED_FORMATS = ("channels_first", "channels_last", "tokens")  # patch_embed's out_format


def autocast_dtype(t: Tensor) -> Optional[torch.dtype]:
    """The dtype torch.autocast computes ops on t's device in, or None where it is off (or the
    device has none: meta)."""
    if not torch._C._is_any_autocast_enabled():  # the usual case, in one call (torch.compile folds it)
        return None
    device_type = "cuda" if t.is_cuda else t.device.type  # (is_cuda: no device object)
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast(*tensors):
    """Cast floating tensors to the autocast dtype, as torch.autocast does for nn.Linear and the
    convs: float64 stays float64, and devices without autocast (meta) are left alone."""
    dtype = autocast_dtype(tensors[0])
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


def check_optional_tensor(value, what: str) -> None:
    """A TypeError naming `what` unless value is a tensor or None (as torch's ops raise for a bias)."""
    if value is not None and not isinstance(value, Tensor):
        raise TypeError(f"{what} must be a tensor or None, got {type(value).__name__}")


def as_int(value, what: str) -> int:
    """value as an int: floats, strings and bools are a TypeError naming `what`, never truncated."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def as_bool(value, what: str) -> bool:
    """value, which must be a bool: a string such as 'no' or a number is a TypeError naming `what`,
    never read by its truth."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_sizes(where: str, minimum: int, **sizes) -> Tuple[int, ...]:
    """The given sizes as ints, in order: non-integers are a TypeError (as torch's modules raise), sizes
    below `minimum` a ValueError, each naming the argument."""
    values = tuple(as_int(v, f"{where}: {k}") for k, v in sizes.items())
    if any(v < minimum for v in values):
        given = ", ".join(f"{k}={v}" for k, v in zip(sizes, values))
        raise ValueError(f"{where}: sizes must be >= {minimum}, got {given}")
    return values

def as_grid(grid, where: str) -> list:
    """A patch grid as ints; floats, strings and other non-integers are a TypeError, not truncated."""
    try:
        return [operator.index(g) for g in grid]
    except TypeError:
        raise TypeError(f"{where}: grid must be a sequence of ints, got {grid!r}") from None


def check_format(name, value, allowed=FORMATS):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_pad(where, pad):
    if pad not in (None, "dynamic"):
        raise ValueError(f"{where}: pad must be None or 'dynamic', got {pad!r}")
