"""The value codec: a small, versioned, self-describing binary format — never pickle.

State outlives code: a checkpoint written today is restored by next month's release, maybe
in another Python. Pickle ties bytes to class paths and can execute code on load, so state
values are limited to plain data with a fixed encoding. :func:`encode_value` writes the
fast form when it can: tag ``P`` followed by one MessagePack value (the `msgpack` C
extension; a published, language-neutral format, unlike ``marshal``). It is used only when
the value is made of exactly ``None``, ``bool``, ``int`` within 64 bits, ``float``, ``str``,
``bytes``/``bytearray``, ``list`` and ``dict`` — types MessagePack round-trips exactly.
Anything else anywhere in the value (a tuple, a big int, a datetime, a dict subclass,
nesting deeper than MessagePack unpacks) makes the whole value use the tagged form below, which
:func:`encode_canonical` always writes and which every release has written, so older
checkpoints keep decoding:

==========  =====  ==========================================================
type        tag    payload
==========  =====  ==========================================================
None        ``N``  —
bool        ``T``  ``F``  —
int         ``i``  varint length + big-endian two's complement (any size)
float       ``f``  8-byte big-endian IEEE 754 double
str         ``s``  varint length + UTF-8
bytes       ``b``  varint length + bytes (``bytearray`` decodes as ``bytes``)
list        ``l``  varint count + elements
tuple       ``t``  varint count + elements
dict        ``d``  varint count + key, value pairs in insertion order
datetime    ``D``  8-byte signed microseconds since the Unix epoch, UTC; timezone-aware
                   values only, decoded in UTC
date        ``a``  4-byte signed proleptic ordinal
(fast)      ``P``  one MessagePack value (see above; decoded with lists, str
                   and bytes as written, map keys of any of these types)
==========  =====  ==========================================================

The two forms of one value decode to equal values of the same types, but their bytes
differ: bytes that are compared rather than decoded (map-state fields) must come from
:func:`encode_canonical`.

Anything else (sets, dataclasses, numpy scalars, naive datetimes) raises
:class:`CodecError` naming the type. Convert such values to the types above first.
"""

from __future__ import annotations

import datetime as dt
import operator
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]  # no py.typed: its names are Any

from microbatch.errors import StateError

_F64 = struct.Struct(">d")
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class CodecError(StateError):
    """A value cannot be encoded, or bytes cannot be decoded."""


def _varint(n: int, out: bytearray) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


class _NotExact(Exception):
    """Raised inside msgpack for a type it would not round-trip exactly (tuple, subclass,
    big int, datetime, ...): the value then takes the tagged form."""


def _refuse(value: Any) -> Any:
    raise _NotExact


FAST_TAG = b"P"
_FAST_TAG_BYTE = FAST_TAG[0]
# A Packer per thread: reusing one is twice as fast as msgpack.packb, but a Packer's
# buffer must not be shared between threads.
_packers = threading.local()


def _packer() -> msgpack.Packer:
    try:
        return _packers.packer
    except AttributeError:
        # strict_types: tuples, subclasses and unknown types go to _refuse instead of
        # being packed as their base type (a tuple would come back as a list).
        _packers.packer = msgpack.Packer(use_bin_type=True, strict_types=True, default=_refuse)
        return _packers.packer


def encode_value(value: Any) -> bytes:
    """Encode one supported value (see the module table): the fast ``P`` form when the value
    is exactly representable in it, else the tagged form. Not for bytes that are compared:
    use :func:`encode_canonical` there."""
    try:
        packed: bytes = _packer().pack(value)
    except (_NotExact, ValueError, TypeError, OverflowError):
        # ValueError: nested too deeply or too long for MessagePack, or a lone surrogate in
        # a str; the tagged form handles the first two and reports the third as before.
        return encode_canonical(value)
    if len(packed) >= _DEEP_NESTING and _may_be_too_deep(packed):
        return encode_canonical(value)
    return FAST_TAG + packed


def encode_values(values: Sequence[Any]) -> list[bytes]:
    """``[encode_value(v) for v in values]``, at the speed of one ``map`` when every value
    is exactly representable in the fast form (a run of flat records, the usual case);
    else value by value. Raises ``CodecError`` for the first value it refuses."""
    try:
        packed = list(map(_packer().pack, values))
    except (_NotExact, ValueError, TypeError, OverflowError):
        return [encode_value(v) for v in values]
    if packed and max(map(len, packed)) >= _DEEP_NESTING:
        return [encode_value(v) for v in values]
    return list(map(FAST_TAG.__add__, packed))


# msgpack packs containers nested a little deeper than it unpacks (about 1024 levels): a
# value that deep needs at least that many container headers (bytes 0x80-0x9f, 0xdc-0xdf).
_DEEP_NESTING = 1000
_NOT_CONTAINER_HEADERS = bytes(
    b for b in range(256) if not (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF)
)


def _may_be_too_deep(packed: bytes) -> bool:
    """Whether ``packed`` might not unpack (checked only for long values; header-like bytes
    inside strings make it unpack to be sure)."""
    if len(packed.translate(None, _NOT_CONTAINER_HEADERS)) < _DEEP_NESTING:
        return False
    try:
        msgpack.unpackb(packed, raw=False, strict_map_key=False)
    except msgpack.StackError:
        return True
    return False


def encode_canonical(value: Any) -> bytes:
    """The tagged encoding (the module table without ``P``): one byte string per value, the
    same in every release, for bytes that are compared or hashed rather than decoded."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: Any, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif value is True:
        out += b"T"
    elif value is False:
        out += b"F"
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
        out += b"i"
        _varint(len(raw), out)
        out += raw
    elif isinstance(value, float):
        out += b"f" + _F64.pack(value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"s"
        _varint(len(raw), out)
        out += raw
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        out += b"b"
        _varint(len(raw), out)
        out += raw
    elif isinstance(value, list | tuple):
        out += b"l" if isinstance(value, list) else b"t"
        _varint(len(value), out)
        for element in value:
            _encode(element, out)
    elif isinstance(value, dict):
        out += b"d"
        _varint(len(value), out)
        for k, v in value.items():
            _encode(k, out)
            _encode(v, out)
    elif isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise CodecError(f"naive datetime {value!r}: attach a timezone (e.g. UTC) first")
        delta = value - _EPOCH
        micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        out += b"D" + _I64.pack(micros)
    elif isinstance(value, dt.date):
        out += b"a" + _I32.pack(value.toordinal())
    else:
        raise CodecError(
            f"cannot encode state value of type {type(value).__name__}: supported are None, "
            "bool, int, float, str, bytes, list, tuple, dict, aware datetime, date"
        )


def decode_value(data: bytes) -> Any:
    """Decode bytes written by :func:`encode_value` or :func:`encode_canonical`; corrupt
    input raises CodecError."""
    if data and data[0] == _FAST_TAG_BYTE:
        return _decode_fast(data)
    try:
        value, pos = _decode(memoryview(data), 0)
    except (
        IndexError,
        struct.error,
        UnicodeDecodeError,
        ValueError,
        OverflowError,
        TypeError,
    ) as e:
        raise CodecError(f"corrupt state value ({len(data)} bytes): {e}") from None
    if pos != len(data):
        raise CodecError(f"corrupt state value: {len(data) - pos} trailing bytes")
    return value


def decode_values(datas: Sequence[bytes]) -> list[Any]:
    """``[decode_value(d) for d in datas]``, in one pass of MessagePack's unpacker when
    every one is of the fast form: each is one complete value, so their concatenation
    holds exactly them, in order. Else — or if that pass does not give one value per
    input — value by value (which raises ``CodecError`` for the corrupt one). For bytes
    written by :func:`encode_value` and carried intact (a batch's own exchange rows);
    stored bytes go through :func:`decode_value`."""
    if len(datas) < _UNPACK_FROM or set(map(_first_byte, datas)) != {_FAST_TAG_BYTE}:
        return [decode_value(d) for d in datas]
    packed = b"".join(map(_after_tag, datas))
    unpacker = msgpack.Unpacker(
        raw=False, use_list=True, strict_map_key=False, ext_hook=_no_ext,
        max_buffer_size=len(packed),
    )  # fmt: skip
    unpacker.feed(packed)
    try:
        values = list(unpacker)
    except (msgpack.UnpackException, ValueError, TypeError):
        values = []
    if len(values) != len(datas):
        return [decode_value(d) for d in datas]
    return values


#: Fewer values than this are decoded one by one: an unpacker costs a few calls' worth.
_UNPACK_FROM = 8
_first_byte = operator.itemgetter(0)
_after_tag = operator.itemgetter(slice(1, None))


def _decode_fast(data: bytes) -> Any:
    try:
        return msgpack.unpackb(
            data[1:], raw=False, use_list=True, strict_map_key=False, ext_hook=_no_ext
        )
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        # ExtraData (trailing bytes), OutOfData (truncated), FormatError, StackError, and
        # TypeError for an unhashable (list or dict) map key in corrupt input.
        raise CodecError(f"corrupt state value ({len(data)} bytes, tag P): {e!r}") from None


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"MessagePack extension type {code}: never written by this codec")


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        if byte < 0x80:
            return n, pos
        shift += 7


def _take(buf: memoryview, pos: int, n: int) -> bytes:
    if pos + n > len(buf):
        raise IndexError("value runs past the end of its bytes")
    return bytes(buf[pos : pos + n])


def _decode(buf: memoryview, pos: int) -> tuple[Any, int]:
    tag = chr(buf[pos])
    pos += 1
    if tag == "N":
        return None, pos
    if tag in "TF":
        return tag == "T", pos
    if tag in "isb":
        n, pos = _read_varint(buf, pos)
        raw = _take(buf, pos, n)
        if tag == "i":
            return int.from_bytes(raw, "big", signed=True), pos + n
        return (raw.decode("utf-8") if tag == "s" else raw), pos + n
    if tag == "f":
        return _F64.unpack(_take(buf, pos, 8))[0], pos + 8
    if tag in "lt":
        n, pos = _read_varint(buf, pos)
        items = []
        for _ in range(n):
            item, pos = _decode(buf, pos)
            items.append(item)
        return (items if tag == "l" else tuple(items)), pos
    if tag == "d":
        n, pos = _read_varint(buf, pos)
        result = {}
        for _ in range(n):
            k, pos = _decode(buf, pos)
            result[k], pos = _decode(buf, pos)
        return result, pos
    if tag == "D":
        micros = _I64.unpack(_take(buf, pos, 8))[0]
        return _EPOCH + dt.timedelta(microseconds=micros), pos + 8
    if tag == "a":
        return dt.date.fromordinal(_I32.unpack(_take(buf, pos, 4))[0]), pos + 4
    raise ValueError(f"unknown tag {tag!r} at byte {pos - 1}")
