"""``torch.ops.kvsqueeze.static_attend``: a static cache layer's attention as one opaque operator.

``torch.compile`` traces a static layer's writes (in-place tensor ops) into the graph, but not the attention: the
kernels read Python plans.  The operator takes the layer's tensors as arguments (so the graph orders it after the
step's writes), calls the layer's ``step_attention`` and then its ``flush``, which writes the
parts in place (declared, so the graph neither reorders nor copies them).  Layers
are found by a number, in a registry that does not keep them alive.  Two operators, the same work:

* ``static_attend``: the layer's plan built from the tensors and its kernel (C++ on a CPU, the reference
  otherwise); it reads the token count on the host, so it is tagged ``cudagraph_unsafe`` (a graph recorded around
  it would replay the count of its recording);
* ``static_attend_graphed``: the Triton kernels of :mod:`triton_static`, which read the counts on the device, so a
  CUDA graph may record the whole decode step.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register_layer(layer) -> int:
    """A number for ``layer`` (anything with ``step_attention(query, mask, tensors, scaling)`` and
    ``flush(tensors)``)."""
    key = next(_IDS)
    _LAYERS[key] = layer
    return key


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _run(query, mask, state, parts, layer, scaling):
    lay = _LAYERS.get(layer)
    if lay is None:
        raise RuntimeError(f"static cache layer {layer} no longer exists (its cache was freed)")
    tensors = [*state, *parts]
    out = lay.step_attention(query, mask, tensors, scaling).contiguous()
    lay.flush(tensors)
    return out


# Each operator also runs the layer's flush after attending, writing ``parts`` in place: as a traced write of its own,
# inductor computed every layer's flush ahead of the attention operators that read the parts, into copies of the
# whole parts, copied back after each operator (0.7 ms per layer per step at 4k tokens on a CPU).
# (Optional[...]: the form torch.library reads an operator's schema from)
@torch.library.custom_op("kvsqueeze::static_attend", mutates_args=("parts",), tags=_TAGS)
def static_attend(query: torch.Tensor, mask: Optional[torch.Tensor], state: list[torch.Tensor],  # noqa: UP045
                  parts: list[torch.Tensor], layer: int, scaling: float) -> torch.Tensor:
    """Reads the token count on the host (builds the layer's plan): no CUDA graph may record it."""
    return _run(query, mask, state, parts, layer, scaling)


@torch.library.custom_op("kvsqueeze::static_attend_graphed", mutates_args=("parts",))
def static_attend_graphed(query: torch.Tensor, mask: Optional[torch.Tensor],  # noqa: UP045
                          state: list[torch.Tensor], parts: list[torch.Tensor], layer: int,
                          scaling: float) -> torch.Tensor:
    """Reads nothing on the host (kernels/triton_static.py): a CUDA graph replays it with the step's counts."""
    return _run(query, mask, state, parts, layer, scaling)


def _fake(query, mask, state, parts, layer, scaling):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


static_attend.register_fake(_fake)
static_attend_graphed.register_fake(_fake)
