"""``torch.ops.kvsqueeze.static_attend``: a static cache layer's attention as one opaque operator.

``torch.compile`` traces a static layer's writes (in-place tensor ops) into the graph, but not the attention: the
kernels read Python plans.  The operator takes the layer's tensors as arguments (so the graph orders it after the
step's writes and before the flush that follows) and, when it runs, builds the layer's plan from them and calls the
layer's kernel (C++ on a CPU, Triton on a GPU, the reference otherwise).  Layers are found by a number, in a
registry that does not keep them alive.

On a GPU the operator reads the token count on the host, so it is tagged ``cudagraph_unsafe``: a graph recorded
around it would replay the count of its recording.  CUDA graphs then cover the rest of the step (docs/gpu.md).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register_layer(layer) -> int:
    """A number for ``layer`` (anything with ``plan_from(tensors, query_length)`` and an ``attend`` function)."""
    key = next(_IDS)
    _LAYERS[key] = layer
    return key


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


# (Optional[...]: the form torch.library reads the operator's schema from)
@torch.library.custom_op("kvsqueeze::static_attend", mutates_args=(), tags=_TAGS)
def static_attend(query: torch.Tensor, mask: Optional[torch.Tensor], tensors: list[torch.Tensor],  # noqa: UP045
                  layer: int, scaling: float) -> torch.Tensor:
    lay = _LAYERS.get(layer)
    if lay is None:
        raise RuntimeError(f"static cache layer {layer} no longer exists (its cache was freed)")
    plan = lay.plan_from(tensors, query.shape[2])
    return lay.attend(query, plan, mask, scaling).contiguous()


@static_attend.register_fake
def _(query, mask, tensors, layer, scaling):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
