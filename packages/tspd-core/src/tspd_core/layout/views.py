"""Strided views of one field inside a rank's contiguous uint8 arena.

The engine allocates one contiguous byte arena of ``contract.plan.arena_bytes`` and views each
field through it. :func:`field_geometry` gives the numbers (page-0 offset, strides, shape,
dtype) so torch can build the same view with ``as_strided``; :func:`field_view` builds it in
numpy. dtypes numpy lacks (``bfloat16``, the ``float8`` family) are viewed as unsigned
integers of the same width: the bit patterns, which is what a copy needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tspd_core.layout.contract import CacheContract
from tspd_core.layout.errors import ContractError

_NUMPY_DTYPES: dict[str, type[np.generic]] = {
    "uint8": np.uint8,
    "int8": np.int8,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "float8_e8m0fnu": np.uint8,
    "bfloat16": np.uint16,
    "float16": np.float16,
    "int32": np.int32,
    "float32": np.float32,
    "int64": np.int64,
    "float64": np.float64,
}


@dataclass(frozen=True, slots=True)
class FieldGeometry:
    """Where one field's pages live in the arena (all byte quantities).

    Page ``p`` starts at ``page0_offset + p · page_stride``; inside a page the field is a
    C-contiguous ``shape`` tensor of ``dtype``, so ``strides_bytes`` is
    ``(page_stride, *c_strides(shape) · itemsize)``.
    """

    field_id: str
    group_id: str
    page0_offset: int
    page_stride: int
    page_count: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def strides_bytes(self) -> tuple[int, ...]:
        """Byte strides of the ``(page_count, *shape)`` view."""
        inner = [self.itemsize]
        for extent in reversed(self.shape[1:]):
            inner.append(inner[-1] * extent)
        return (self.page_stride, *reversed(inner))

    @property
    def aligned(self) -> bool:
        """True when the page-0 offset and the page stride are whole elements, so a typed
        view of the arena (``arena.view(dtype)``) can address the field."""
        return self.page0_offset % self.itemsize == 0 and self.page_stride % self.itemsize == 0

    @property
    def element_offset(self) -> int:
        """Page 0's offset in elements of ``dtype`` (requires :attr:`aligned`)."""
        assert self.aligned, f"{self.field_id}: offset/stride are not whole {self.dtype} elements"
        return self.page0_offset // self.itemsize

    @property
    def element_strides(self) -> tuple[int, ...]:
        """Strides of the ``(page_count, *shape)`` view in elements (requires :attr:`aligned`)."""
        assert self.aligned, f"{self.field_id}: offset/stride are not whole {self.dtype} elements"
        return tuple(stride // self.itemsize for stride in self.strides_bytes)

    @property
    def extent_bytes(self) -> int:
        """Bytes from page 0's start to the end of the last page's payload."""
        return (self.page_count - 1) * self.page_stride + math.prod(self.shape) * self.itemsize


def field_geometry(contract: CacheContract, field_id: str) -> FieldGeometry:
    """The placement of ``field_id`` in ``contract``'s arena."""
    f = contract.field(field_id)
    return FieldGeometry(
        field_id=field_id,
        group_id=f.group_id,
        page0_offset=contract.page0_offset(field_id),
        page_stride=f.page_stride_bytes,
        page_count=contract.group(f.group_id).page_count,
        shape=f.shape,
        dtype=f.dtype,
        itemsize=f.itemsize,
    )


def numpy_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype :func:`field_view` uses for a contract dtype."""
    try:
        return np.dtype(_NUMPY_DTYPES[dtype])
    except KeyError:
        raise ContractError(f"unknown dtype {dtype!r}") from None


def field_view(arena_u8: npt.NDArray[np.uint8], contract: CacheContract, field_id: str) -> Any:
    """A ``(page_count, *shape)`` view of ``field_id`` over ``arena_u8`` (no copy).

    ``arena_u8`` must be the whole arena: a 1-D, C-contiguous uint8 array of exactly
    ``contract.plan.arena_bytes``. Writes through the view land in the arena.
    """
    if arena_u8.dtype != np.uint8 or arena_u8.ndim != 1 or not arena_u8.flags.c_contiguous:
        raise ContractError("field_view needs the arena as a 1-D C-contiguous uint8 array")
    if arena_u8.size != contract.plan.arena_bytes:
        raise ContractError(
            f"arena has {arena_u8.size} bytes but the contract describes "
            f"{contract.plan.arena_bytes}"
        )
    geo = field_geometry(contract, field_id)
    return np.ndarray(
        (geo.page_count, *geo.shape),
        dtype=numpy_dtype(geo.dtype),
        buffer=arena_u8.data,
        offset=geo.page0_offset,
        strides=geo.strides_bytes,
    )
