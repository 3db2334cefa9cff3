"""Protobuf wire-format primitives for writing, without onnx: varints and length prefixes
(reading them, with bounds checks for untrusted bytes: :func:`wire_model.read_varint`).

One home for them: ``_protowire`` (which encodes ONNX messages and needs onnx's descriptors for
field numbers) and ``outputs`` (which must not import onnx: it runs on every write, and scans an
old output's bytes for an external-data entry) both build on these.
"""

from __future__ import annotations

__all__ = ["SMALL_VARINTS", "length_prefixed", "varint"]


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _small_varints() -> list[bytes]:
    """``varint(n)`` for every n < 2**14, built from byte pairs: every import pays for this table,
    and building it by concatenation is ~10x cheaper than calling ``varint`` 16384 times."""
    low = [bytes((i,)) for i in range(128)]  # n < 128: one byte
    continued = [bytes((i | 0x80,)) for i in range(128)]  # low 7 bits, with the continuation bit
    return low + [head + low[high] for high in range(1, 128) for head in continued]


#: ``varint(n)`` for every n below 2**14 (two bytes or fewer): lengths of names and node bodies.
SMALL_VARINTS = _small_varints()


def length_prefixed(payload: bytes) -> bytes:
    """``payload`` preceded by its length, as a length-delimited field's value is written."""
    n = len(payload)
    return (SMALL_VARINTS[n] if n < 16384 else varint(n)) + payload
