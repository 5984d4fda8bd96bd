"""Bit packing and wire formats: the byte layouts compressed gradients travel in (single process)."""

from __future__ import annotations

import pytest
import torch

from mpistrategy.aggregation import bits
from mpistrategy.aggregation.bits import WireFormat, pack_bits, packed_nbytes, unpack_bits
from mpistrategy.aggregation.signs import sign_bits, signs


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 13, 1000])
def test_pack_round_trips_and_takes_the_stated_bytes(width: int, count: int) -> None:
    codes = torch.randint(0, 1 << width, (count,), generator=torch.Generator().manual_seed(width * count))
    packed = pack_bits(codes, width)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, width) == -(-count * width // 8)
    assert torch.equal(unpack_bits(packed, width, count), codes.to(torch.uint8))
    if width < 8:  # the device path (torch ops only) writes the same bytes
        assert torch.equal(bits._pack_torch(codes.to(torch.uint8), width), packed)
        assert torch.equal(bits._unpack_torch(packed, width, count), codes.to(torch.uint8))


def test_bit_order_is_least_significant_first() -> None:
    # codes 1, 2, 3 of 2 bits: stream bits 10 01 11 (code i at bits 2i, 2i+1) -> byte 0b00_11_10_01
    assert pack_bits(torch.tensor([1, 2, 3]), 2).tolist() == [0b00111001]
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0b10000001, 0b1]
    # 3-bit codes straddle bytes: 5 = 101, 6 = 011 (lsb first) -> bits 1,0,1,0,1,1 -> 0b110101
    assert pack_bits(torch.tensor([5, 6]), 3).tolist() == [0b110101]


def test_unpack_batches_of_streams() -> None:
    codes = torch.randint(0, 32, (3, 11), generator=torch.Generator().manual_seed(0))
    streams = torch.stack([pack_bits(row, 5) for row in codes])
    assert torch.equal(unpack_bits(streams, 5, 11), codes.to(torch.uint8))
    assert torch.equal(bits._unpack_torch(streams, 5, 11), codes.to(torch.uint8))


def test_bad_widths_and_short_streams_are_refused() -> None:
    with pytest.raises(ValueError, match="width must be 1 to 8"):
        pack_bits(torch.zeros(3), 9)
    with pytest.raises(ValueError, match="cannot hold 10 codes of 4 bits"):
        unpack_bits(torch.zeros(4, dtype=torch.uint8), 4, 10)


def test_sign_bits_round_trip_with_zero_counted_positive() -> None:
    values = torch.tensor([0.5, -2.0, 0.0, -0.0, 3.0, -1e-30, 7.0, -7.0, 1.0])
    packed = sign_bits(values)
    assert packed.numel() == 2
    assert signs(packed, 9, torch.float32).tolist() == [1, -1, 1, 1, 1, -1, 1, -1, 1]


def test_wire_format_aligns_fields_and_reads_every_rank_in_place() -> None:
    wire = WireFormat.of(("indices", torch.int32, 3), ("values", torch.float64, 3), ("bits", torch.uint8, 5))
    assert wire.offsets == (0, 16, 40) and wire.nbytes == 48
    messages = []
    for rank in range(3):
        parts = {
            "indices": torch.tensor([rank, 1, 2], dtype=torch.int32),
            "values": torch.tensor([0.5, rank, -1.0], dtype=torch.float64),
            "bits": torch.arange(5, dtype=torch.uint8) + rank,
        }
        messages.append(wire.pack(parts, torch.device("cpu")))
    fields = wire.unpack(torch.stack(messages))
    assert fields["indices"][:, 0].tolist() == [0, 1, 2]
    assert fields["values"][:, 1].tolist() == [0.0, 1.0, 2.0]
    assert fields["bits"][2].tolist() == [2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="field 'values' needs 3 elements of torch.float64"):
        wire.pack({**parts, "values": torch.zeros(3)}, torch.device("cpu"))
