"""Pure-torch quantization reference: integer groups, fp8, bit packing and storage accounting.

Nothing here imports transformers; cache layouts and kernels are checked against these functions.
"""

from .accounting import bits_per_element, param_nbytes
from .fp8 import FP8_DTYPES, FP8_MAX, fp8_dequantize, fp8_quantize, fp8_reduce_dims
from .integer import dequantize_groups, fake_quantize, group_view, quantize_groups, ungroup_view
from .packing import pack_bits, packed_nbytes, unpack_bits
from .params import PARAM_TORCH_DTYPES, param_torch_dtype, scale_floor, to_param

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "PARAM_TORCH_DTYPES",
    "bits_per_element",
    "dequantize_groups",
    "fake_quantize",
    "fp8_dequantize",
    "fp8_quantize",
    "fp8_reduce_dims",
    "group_view",
    "pack_bits",
    "packed_nbytes",
    "param_nbytes",
    "param_torch_dtype",
    "quantize_groups",
    "scale_floor",
    "to_param",
    "unpack_bits",
    "ungroup_view",
]
