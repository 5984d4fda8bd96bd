"""Running a benchmark script for real (quick mode, 2 ranks) and checking what it wrote: JSON values and PNG files."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

from mpistrategy.launch import mpiexec_command
from tests.mpi_harness import clean_environ

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# bytes per pixel of 8-bit PNGs by colour type: grey, RGB, grey + alpha, RGBA
_PNG_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}


def run_benchmark(script: str, results: Path, *args: str, timeout: float = 600) -> str:
    """Run ``benchmarks/<script> --quick --results <results> *args`` under ``mpiexec -n 2``; return its stdout."""
    command = [*mpiexec_command(), "-n", "2", sys.executable, str(BENCHMARKS / script)]
    done = subprocess.run(
        [*command, "--quick", "--results", str(results), *args],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def assert_positive(value: Any, what: str) -> None:
    """``value`` is a finite float above zero (a time or a ratio of times)."""
    assert type(value) is float and math.isfinite(value) and value > 0, f"{what} = {value!r}"


def assert_finite(value: Any, what: str) -> None:
    """``value`` is a finite float (a difference of times, which may be negative)."""
    assert type(value) is float and math.isfinite(value), f"{what} = {value!r}"


def assert_count(value: Any, what: str) -> None:
    """``value`` is an int above zero (not a bool)."""
    assert type(value) is int and value > 0, f"{what} = {value!r}"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of the 8-bit PNG at ``path`` after checking the whole file: signature, every chunk's
    CRC, IHDR first and IEND last, and image data that inflates to exactly one filter byte plus ``width`` pixels
    per row for ``height`` rows, not all of one value."""
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path}: not a PNG"
    chunks, offset = [], len(PNG_SIGNATURE)
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: {kind!r} chunk fails its CRC"
        chunks.append((kind, body))
        offset += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", f"{path}: chunks {[k for k, _ in chunks]}"
    width, height, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    assert depth == 8 and colour in _PNG_CHANNELS, f"{path}: bit depth {depth}, colour type {colour}"
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(pixels) == height * (1 + width * _PNG_CHANNELS[colour]), f"{path}: image data of the wrong size"
    assert len(set(pixels)) > 16, f"{path}: a blank image"
    return width, height
