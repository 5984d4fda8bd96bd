"""Bit packing and message layouts: how compressed gradients are laid out as bytes on the wire.

Bit packing. :func:`pack_bits` turns ``n`` codes, unsigned integers below ``2**width`` (``1 <= width <= 8``), into a
stream of ``ceil(n * width / 8)`` bytes: code ``i`` occupies bits ``[i * width, (i + 1) * width)`` of the stream,
least significant bit first, and bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``. :func:`unpack_bits`
inverts it for a batch of streams (one per rank). Host tensors go through NumPy's ``packbits``/``unpackbits``
(20-50x faster than the equivalent torch ops on a CPU); device tensors through torch ops on their device.

Messages. A :class:`WireFormat` lays out named fields (runs of one dtype) in one byte message, every field at an
offset that is a multiple of 8 bytes and the message padded to a multiple of 8 bytes, so that after an allgather
the fields of every rank's message can be read in place from the ``(ranks, nbytes)`` buffer without copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

_ALIGN = 8


def packed_nbytes(count: int, width: int) -> int:
    """Bytes of the stream that packs ``count`` codes of ``width`` bits."""
    return math.ceil(count * width / 8)


def _check_width(width: int) -> None:
    if not 1 <= width <= 8:
        raise ValueError(f"bit packing: width must be 1 to 8 bits per code, got {width}.")


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack ``codes`` (any integer dtype, values in ``[0, 2**width)``) into a 1-D uint8 stream (see the module
    docstring for the bit order)."""
    _check_width(width)
    codes = codes.reshape(-1).to(torch.uint8)
    if width == 8:
        return codes.contiguous()
    if codes.is_cpu:
        return _pack_numpy(codes, width)
    return _pack_torch(codes, width)


def unpack_bits(streams: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` codes of each stream in ``streams`` (uint8, shape ``(..., nbytes)``): shape ``(..., count)``,
    uint8."""
    _check_width(width)
    if streams.shape[-1] < packed_nbytes(count, width):
        raise ValueError(
            f"bit packing: {streams.shape[-1]} bytes cannot hold {count} codes of {width} bits "
            f"({packed_nbytes(count, width)} bytes needed)."
        )
    if width == 8:
        return streams[..., :count]
    if streams.is_cpu:
        return _unpack_numpy(streams, width, count)
    return _unpack_torch(streams, width, count)


def _pack_numpy(codes: torch.Tensor, width: int) -> torch.Tensor:
    array = codes.numpy()
    if width == 1:
        return torch.from_numpy(np.packbits(array, bitorder="little"))
    bits = np.unpackbits(array[:, None], axis=1, count=width, bitorder="little")
    return torch.from_numpy(np.packbits(bits.reshape(-1), bitorder="little"))


def _unpack_numpy(streams: torch.Tensor, width: int, count: int) -> torch.Tensor:
    array = streams.contiguous().numpy()
    bits = np.unpackbits(array, axis=-1, count=count * width, bitorder="little")
    if width == 1:
        return torch.from_numpy(bits)
    grouped = bits.reshape(*bits.shape[:-1], count, width)
    return torch.from_numpy(np.packbits(grouped, axis=-1, bitorder="little")[..., 0])


def _bit_weights(width: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << b for b in range(width)], dtype=torch.uint8, device=device)


def _pack_torch(codes: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`pack_bits` with torch ops only (for tensors on a device)."""
    shifts = torch.arange(width, dtype=torch.uint8, device=codes.device)
    bits = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    padded = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
    return (padded.view(-1, 8) * _bit_weights(8, codes.device)).sum(1, dtype=torch.uint8)


def _unpack_torch(streams: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """:func:`unpack_bits` with torch ops only (for tensors on a device)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=streams.device)
    bits = ((streams.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., : count * width]
    grouped = bits.reshape(*bits.shape[:-1], count, width)
    return (grouped * _bit_weights(width, streams.device)).sum(-1, dtype=torch.uint8)


@dataclass(frozen=True)
class Field:
    """One run of ``count`` elements of ``dtype`` in a message (packed bits are a uint8 field of their bytes)."""

    name: str
    dtype: torch.dtype
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


@dataclass(frozen=True)
class WireFormat:
    """A message of named fields, each starting at a multiple of 8 bytes; ``nbytes`` is padded to a multiple of 8.

    Every rank of an exchange builds the same format for a bucket (it depends only on the bucket's size and the
    scheme's options), so the messages of all ranks have equal length and one allgather carries them.
    """

    fields: tuple[Field, ...]
    offsets: tuple[int, ...] = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        offsets, position = [], 0
        for part in self.fields:
            offsets.append(position)
            position += _aligned(part.nbytes)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "nbytes", position)

    @classmethod
    def of(cls, *fields: tuple[str, torch.dtype, int]) -> WireFormat:
        """A format from ``(name, dtype, count)`` triples, in message order."""
        return cls(tuple(Field(*spec) for spec in fields))

    def pack(self, parts: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """One message (uint8, ``nbytes``) holding ``parts[name]`` (``count`` elements of ``dtype``) for every
        field; padding bytes are zero."""
        message = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        for part, offset in zip(self.fields, self.offsets, strict=True):
            value = parts[part.name].reshape(-1)
            if value.numel() != part.count or value.dtype != part.dtype:
                raise ValueError(
                    f"wire format: field {part.name!r} needs {part.count} elements of {part.dtype}, got "
                    f"{value.numel()} of {value.dtype}."
                )
            message[offset : offset + part.nbytes] = value.contiguous().view(torch.uint8)
        return message

    def unpack(self, messages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field of every message in ``messages`` (uint8, shape ``(ranks, nbytes)``), as views of shape
        ``(ranks, count)``."""
        if messages.dim() != 2 or messages.shape[1] != self.nbytes:
            raise ValueError(f"wire format: expected messages of shape (ranks, {self.nbytes}), got {messages.shape}.")
        return {
            part.name: messages[:, offset : offset + part.nbytes].view(part.dtype)
            for part, offset in zip(self.fields, self.offsets, strict=True)
        }


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
