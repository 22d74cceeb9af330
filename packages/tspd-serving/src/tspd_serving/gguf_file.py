"""GGUF files (llama.cpp's format) through the ``gguf`` package: the header, the metadata and
the tensors' descriptions, parsed once per process (:func:`open_gguf`).

A GGUF file carries the model config (``llama.*`` metadata), the tokenizer
(``tokenizer.ggml.*``, built by :mod:`.gguf_vocab`) and the tensors. This module reads what the
tokenizer and the config need, without torch; the engine's ``tspd_engine.model.gguf_model``
turns the metadata into a model config and the tensors into Hugging Face-named weights.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType, ReaderTensor

from tspd_serving.errors import CheckpointError


class _Reader(GGUFReader):
    """``GGUFReader`` reading its header through a plain ``ndarray`` view of the mapping.

    The reader slices its ``np.memmap`` once per value it parses, and each memmap slice runs
    numpy's Python-level ``memmap.__array_finalize__``: for SmolLM2's 49,152 tokens and 48,900
    merges that is most of a 3.4 s parse, paid by every rank process. A plain view of the same
    pages slices in C (0.7 s measured on this machine); the values are the same bytes.
    """

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> npt.NDArray[Any]:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        size = np.dtype(dtype).itemsize
        arr: npt.NDArray[Any] = plain[offset : offset + size * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        """A flat array value as three parts, not one (or two) per element.

        The parent class parses an array element by element, a numpy view per number and two
        per string: 147,000 views for SmolLM2's vocabulary, 1.2 s of every rank's start-up
        that only the tokenizer ever reads. Here a number array is one view (``contents()``
        reads it whole, as before) and a string array one byte view whose element lengths are
        only walked to find its end; :meth:`GgufFile.get` decodes it on first use
        (:func:`_strings`). Nested arrays, and everything else, go to the parent.
        """
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        head = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        start = orig_offs + 12
        itype = GGUFValueType(int(head[0]))
        n = int(count[0])
        scalar = self.gguf_scalar_to_np.get(itype)
        if scalar is not None:
            values = self._get(start, scalar, n)
            if len(values) != n:
                raise ValueError(f"an array of {n} {itype.name} runs past the end of the file")
            return 12 + int(values.nbytes), [head, count, values], [2], [GGUFValueType.ARRAY, itype]
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        end = _skip_strings(self.__dict__.get("_plain", self.data), start, n, self._order())
        blob = self._get(start, np.uint8, end - start)
        return end - orig_offs, [head, count, blob], [], [GGUFValueType.ARRAY, itype]

    def _order(self) -> str:
        return "big" if (self.byte_order == "S") == (sys.byteorder == "little") else "little"


def _skip_strings(data: npt.NDArray[Any], start: int, n: int, order: str) -> int:
    """Where ``n`` GGUF strings (u64 length, then bytes) from ``start`` end."""
    view = np.asarray(data).view(np.uint8).reshape(-1).data
    size = len(view)
    off = start
    for _ in range(n):
        if off + 8 > size:
            raise ValueError(f"a string array of {n} runs past the end of the file")
        off += 8 + int.from_bytes(view[off : off + 8], order)  # type: ignore[arg-type]
    if off > size:
        raise ValueError(f"a string array of {n} runs past the end of the file")
    return off


def _strings(blob: npt.NDArray[Any], n: int, order: str) -> list[str]:
    """The ``n`` strings of a string array's bytes (:meth:`_Reader._get_field_parts`)."""
    raw = blob.tobytes()
    out = []
    off = 0
    for _ in range(n):
        length = int.from_bytes(raw[off : off + 8], order)  # type: ignore[arg-type]
        out.append(raw[off + 8 : off + 8 + length].decode("utf-8"))
        off += 8 + length
    return out


class GgufFile:
    """One parsed GGUF file: its metadata and memory-mapped tensors (read-only, shareable by
    the threads of one process)."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise CheckpointError(f"GGUF file {path} does not exist")
        try:
            self.reader: GGUFReader = _Reader(path)
        except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as exc:
            why = str(exc)
            if "GGMLQuantizationType" in why:  # a type id newer (or other) than gguf knows
                number = re.search(r"(\d+)\)? is not a valid", why)
                why = f"unknown quant type {number.group(1) if number else '?'} in a tensor"
            raise CheckpointError(f"{path} is not a readable GGUF file: {why}") from exc
        self.path = path
        self._strings: dict[str, list[str]] = {}
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self.arch = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalar, string or list), or ``default``."""
        field = self.reader.get_field(key)
        if field is None:
            return default
        try:
            if field.types == [GGUFValueType.ARRAY, GGUFValueType.STRING] and not field.data:
                if key not in self._strings:  # a string array, decoded once
                    order = self.reader._order()  # type: ignore[attr-defined]
                    self._strings[key] = _strings(field.parts[-1], int(field.parts[-2][0]), order)
                return list(self._strings[key])
            return field.contents()
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.path}: metadata {key!r} is unreadable: {exc}") from exc

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path} lacks the metadata key {key!r}")
        return value


@functools.lru_cache(maxsize=2)
def _cached(path: Path, stamp: tuple[int, int]) -> GgufFile:
    return GgufFile(path)


def open_gguf(path: Path) -> GgufFile:
    """The parsed file at ``path``, parsed once per process (config, weights and tokenizer all
    read it; parsing a 50k-token vocabulary's metadata costs seconds)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise CheckpointError(f"GGUF file {path} cannot be read: {exc}") from exc
    return _cached(path.resolve(), (st.st_mtime_ns, st.st_size))
