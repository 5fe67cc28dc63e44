"""Declared value schemas: Kafka values decoded into Arrow columns, not Python objects.

``KafkaSource(value_schema=JsonSchema({"user_id": "string", "ts": "long"}))`` declares
what each Kafka value holds. Stage 1 then decodes a whole Arrow batch of values at once
(``pyarrow.json``, in C++) into typed columns, keys them per distinct key and hands stage
2 the columns: no record becomes a Python dict unless a user function asks for it.

A value that does not match — not UTF-8, not JSON, not a JSON object, a declared field
missing or null (unless declared ``nullable``), or of the wrong type — is a dead letter
``schema_mismatch`` whose error names the field; it is never a null counted silently.
Fields the schema does not declare are ignored: a record holds the declared fields only.

The decoding is the same whichever reader read Kafka (both hand stage 1 the raw value
bytes), so both readers give the same records and the same dead letters by construction.
How a batch is decoded:

0. with the native extension (``microbatch_native.decode_json``, Rust's serde_json), each
   value is parsed once straight into the declared columns, and *accepted* only where its
   verdict is certain to be Python's: an object whose declared fields are present (or
   null, when nullable) and of exactly the declared type. Every other value — bad, odd
   (``-0``, ``NaN``, an integer past 64 bits) or unknown to serde_json — takes the steps
   below, so the fast path can only be faster, never decide otherwise. Half the CPU of
   step 1 or less (Nexmark's bids: 0.52 against 1.16 µs a value,
   ``bench/bench_json_decode.py``);
1. values without a line break are joined into one newline-delimited buffer and parsed
   by ``pyarrow.json`` with the declared types (strict: a number is never a string);
2. a block that fails to parse, or parses into another number of rows than it has
   values, is split in two and each half parsed again, down to single values;
3. a single value Arrow refuses, and every value with a line break, is checked by
   :meth:`JsonSchema.decode_record` in Python, which accepts it or names what is wrong.

So one bad value among 10,000 costs ~2·log2(10,000) extra parses of ever smaller blocks,
and good values never meet Python. Declared types: ``string``, ``long`` (alias
``bigint``), ``int``, ``double``, ``boolean``. A schema is a :class:`ValueSchema`: an
Avro one would implement the same three methods.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from microbatch.errors import ConfigError
from microbatch.native_buffers import array_of

__all__ = ["SCHEMA_MISMATCH", "Decoded", "JsonSchema", "SchemaMismatch", "ValueSchema", "kind_of"]

SCHEMA_MISMATCH = "schema_mismatch"

#: Declared type → (Arrow type's name, Spark DDL type).
_TYPES: dict[str, tuple[str, str]] = {
    "string": ("string", "STRING"),
    "long": ("int64", "BIGINT"),
    "int": ("int32", "INT"),
    "double": ("double", "DOUBLE"),
    "boolean": ("bool", "BOOLEAN"),
}
_ALIASES = {"bigint": "long", "int64": "long", "integer": "int", "int32": "int",
            "float64": "double", "bool": "boolean"}  # fmt: skip
_FROM_ARROW = {t: name for name, (t, _) in _TYPES.items()}


def _arrow_type(kind: str) -> pa.DataType:

    return pa.type_for_alias(_TYPES[kind][0])


_BOUNDS = {"long": (-(2**63), 2**63 - 1), "int": (-(2**31), 2**31 - 1)}
_LEAF_ROWS = 16  # a failing block this small: each value is parsed on its own


#: Declared type → its number in ``microbatch_native.decode_json``.
_NATIVE_KINDS = {"string": 0, "long": 1, "int": 2, "double": 3, "boolean": 4}


def _native_decoder() -> Any:
    """``microbatch_native.decode_json``, or None without the extension."""
    try:
        from microbatch_native import decode_json
    except ImportError:
        return None
    return decode_json


class SchemaMismatch(ValueError):
    """A value that does not match its declared schema; ``field`` is None when the value
    as a whole is wrong (not JSON, not an object)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


class Decoded(NamedTuple):
    """A decoded batch: the good values' columns, their positions in the input, and the
    position and error of every value that did not match."""

    table: pa.Table
    rows: np.ndarray
    bad: list[tuple[int, str]]


class ValueSchema(Protocol):
    """What stage 1 needs of a declared schema (JSON now; Avro can implement it too)."""

    @property
    def arrow_schema(self) -> pa.Schema: ...

    def decode(self, values: pa.Array, keep: Collection[str] | None = None) -> Decoded:
        """The non-null binary ``values`` as columns of :attr:`arrow_schema` (those in
        ``keep`` only, when given; every field is still checked)."""
        ...

    def decode_record(self, value: bytes) -> Any:
        """One value as a record, or :class:`SchemaMismatch` (stage 1 decodes record by
        record when enrichment follows)."""
        ...


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """UTF-8 JSON objects with declared fields: ``{name: type}`` (types above), fields
    in ``nullable`` may be missing or null (they are None then); every other declared
    field must be present and non-null."""

    fields: Mapping[str, str]
    nullable: Iterable[str] = ()

    def __post_init__(self) -> None:
        if isinstance(self.fields, pa.Schema) or not isinstance(self.fields, Mapping):
            raise ConfigError(
                "JsonSchema takes {field: type}, e.g. {'user_id': 'string', 'ts': 'long'} "
                f"(or JsonSchema.from_arrow(schema)), got {self.fields!r}"
            )
        if not self.fields:
            raise ConfigError("JsonSchema declares no field")
        canonical = {}
        for name, kind in self.fields.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"JsonSchema field names must be non-empty strings: {name!r}")
            key = _ALIASES.get(str(kind).lower(), str(kind).lower())
            if key not in _TYPES:
                raise ConfigError(
                    f"JsonSchema field {name!r} has unknown type {kind!r}; known types: "
                    f"{', '.join(_TYPES)} (aliases {', '.join(sorted(_ALIASES))})"
                )
            canonical[name] = key
        nullable = frozenset([self.nullable] if isinstance(self.nullable, str) else self.nullable)
        unknown = sorted(nullable - canonical.keys())
        if unknown:
            raise ConfigError(
                f"JsonSchema nullable names fields it does not declare: {unknown} "
                f"(declared: {sorted(canonical)})"
            )
        object.__setattr__(self, "fields", canonical)
        object.__setattr__(self, "nullable", nullable)

    @classmethod
    def from_arrow(cls, schema: pa.Schema) -> JsonSchema:
        """The schema of a pyarrow schema's fields (their ``nullable`` flags kept)."""
        fields, nullable = {}, []
        for f in schema:
            if str(f.type) not in _FROM_ARROW:
                raise ConfigError(
                    f"JsonSchema.from_arrow: field {f.name!r} has Arrow type {f.type}; "
                    f"supported: {', '.join(str(t) for t in _FROM_ARROW)}"
                )
            fields[f.name] = _FROM_ARROW[str(f.type)]
            if f.nullable:
                nullable.append(f.name)
        return cls(fields, nullable)

    def type_of(self, name: str) -> str | None:
        return self.fields.get(name)

    @property
    def arrow_schema(self) -> pa.Schema:
        """The declared fields as Arrow columns (with their nullability)."""
        return pa.schema(
            pa.field(n, _arrow_type(t), nullable=n in self.nullable) for n, t in self.fields.items()
        )

    @property
    def spark_ddl(self) -> str:
        """The declared fields as a Spark DDL string (``from_json``, ``createDataFrame``)."""
        return ", ".join(
            f"`{n}` {_TYPES[t][1]}{'' if n in self.nullable else ' NOT NULL'}"
            for n, t in self.fields.items()
        )

    # One value, in Python: the reference the Arrow path must agree with -----------------

    def decode_record(self, value: bytes) -> dict[str, Any]:
        """One value as a dict of the declared fields, or :class:`SchemaMismatch`."""
        try:
            obj = json.loads(value.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise SchemaMismatch(None, f"value is not UTF-8: {e}") from None
        except ValueError as e:
            raise SchemaMismatch(None, f"value is not JSON: {e}") from None
        if type(obj) is not dict:
            raise SchemaMismatch(None, f"value is a JSON {_json_kind(obj)}, not an object")
        return {name: self._field(obj, name, kind) for name, kind in self.fields.items()}

    def _field(self, obj: dict[str, Any], name: str, kind: str) -> Any:
        if name not in obj or obj[name] is None:
            if name in self.nullable:
                return None
            what = "missing" if name not in obj else "null"
            raise SchemaMismatch(name, f"field {name!r} is {what} (declared {kind}, not nullable)")
        v = obj[name]
        ok = (
            (kind == "string" and type(v) is str)
            or (kind == "boolean" and type(v) is bool)
            or (kind in _BOUNDS and type(v) is int and _BOUNDS[kind][0] <= v <= _BOUNDS[kind][1])
            or (kind == "double" and type(v) in (int, float) and _fits_double(v))
        )
        if not ok:
            raise SchemaMismatch(
                name, f"field {name!r}: expected {kind}, got {_json_kind(v)} {_shown(v)}"
            )
        if kind == "string" and not v.isascii() and not _is_text(v):
            # JSON may escape half a UTF-16 pair ("\ud800"); json takes it, Arrow cannot
            # hold it (nor any UTF-8 sink): a dead letter, never a failed batch.
            raise SchemaMismatch(
                name, f"field {name!r}: a lone UTF-16 surrogate in the string {_shown(v)}"
            )
        return float(v) if kind == "double" else v

    # A batch of values, in Arrow ------------------------------------------------------------

    def decode(self, values: pa.Array, keep: Collection[str] | None = None) -> Decoded:
        """The non-null binary ``values`` as columns (see the module docstring). With
        ``keep``, only those fields become columns (in declared order), the others being
        checked all the same: a value is accepted or refused exactly as without it."""
        if values.null_count:
            raise ValueError("JsonSchema.decode takes non-null values (tombstones are not JSON)")
        kept = self._kept(keep)
        native = _native_decoder()
        if native is None or not len(values):
            return self._projected(self._decode_arrow(values), kept)
        accepted, table = self._decode_native(native, values, kept)
        if accepted.all():
            return Decoded(table, np.arange(len(values), dtype=np.int64), [])
        deferred = np.nonzero(~accepted)[0]
        rest = self._projected(self._decode_arrow(values.take(pa.array(deferred))), kept)
        rows = np.concatenate([np.nonzero(accepted)[0], deferred[rest.rows]])
        order = np.argsort(rows, kind="stable")
        return Decoded(
            pa.concat_tables([table, rest.table]).take(pa.array(order)),
            rows[order],
            [(int(deferred[row]), error) for row, error in rest.bad],
        )

    def _kept(self, keep: Collection[str] | None) -> pa.Schema:
        """The declared fields ``keep`` names (all without it), as Arrow columns."""
        schema = self.arrow_schema
        if keep is None:
            return schema
        unknown = sorted(set(keep) - set(schema.names))
        if unknown:
            raise ValueError(f"JsonSchema.decode keep= names fields it does not declare: {unknown}")
        return pa.schema([f for f in schema if f.name in keep])

    @staticmethod
    def _projected(decoded: Decoded, kept: pa.Schema) -> Decoded:
        if decoded.table.schema.names == kept.names:
            return decoded
        return decoded._replace(table=decoded.table.select(kept.names))

    def _decode_native(
        self, native: Any, values: pa.Array, kept: pa.Schema
    ) -> tuple[np.ndarray, pa.Table]:
        """(accepted per value, the accepted values' kept columns) from the extension."""
        n = len(values)
        offsets = np.frombuffer(values.buffers()[1], dtype=np.int32)[values.offset :][: n + 1]
        data = values.buffers()[2]
        raw = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        flags, columns = native(
            offsets,
            raw,
            list(self.fields),
            [_NATIVE_KINDS[kind] for kind in self.fields.values()],
            [name in self.nullable for name in self.fields],
            [name in kept.names for name in self.fields],
        )
        accepted = np.frombuffer(flags, dtype=np.uint8).astype(bool)
        rows = int(accepted.sum())
        arrays = [
            array_of(field.type, rows, held, validity, nulls, starts)
            for field, (validity, nulls, held, starts) in zip(kept, columns, strict=True)
        ]
        return accepted, pa.Table.from_arrays(arrays, schema=kept)

    def _decode_arrow(self, values: pa.Array) -> Decoded:
        """``values`` decoded by ``pyarrow.json`` and, where it refuses, by Python."""
        schema = self._parse_schema
        pieces: list[tuple[int, pa.Table | None, Any]] = []  # (first row, table | None, row)
        start = 0
        for ok, length in _runs(_without_line_breaks(values)):
            if ok:
                self._blocks(values.slice(start, length), start, pieces)
            else:
                for i in range(start, start + length):
                    pieces.append(self._one(values[i].as_py(), i))
            start += length
        tables, rows, bad = [], [], []
        for first, table, row in pieces:
            if table is not None:
                tables.append(table)
                rows.append(np.arange(first, first + table.num_rows, dtype=np.int64))
            elif isinstance(row, str):
                bad.append((first, row))
            else:
                tables.append(pa.Table.from_pylist([row], schema=schema))
                rows.append(np.array([first], dtype=np.int64))
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        positions = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        table, positions = self._required(table, positions, values, bad)
        return Decoded(table, positions, sorted(bad))

    @property
    def _parse_schema(self) -> pa.Schema:
        """Every field nullable: a missing required field is found per column afterwards,
        not by failing (and splitting) whole blocks."""
        return pa.schema([pa.field(n, _arrow_type(t)) for n, t in self.fields.items()])

    def _blocks(self, values: pa.Array, first: int, pieces: list[Any]) -> None:
        table = self._parse(values)
        if table is not None:
            pieces.append((first, table, None))
        elif len(values) <= _LEAF_ROWS:
            pieces.extend(self._one(values[i].as_py(), first + i) for i in range(len(values)))
        else:
            half = len(values) // 2
            self._blocks(values.slice(0, half), first, pieces)
            self._blocks(values.slice(half), first + half, pieces)

    def _one(self, value: bytes, row: int) -> tuple[int, pa.Table | None, Any]:
        """One value: Arrow's parse if it takes it alone, else Python's verdict."""
        table = self._parse(pa.array([value], pa.binary()))
        if table is not None:
            return (row, table, None)
        try:
            return (row, None, self.decode_record(value))
        except SchemaMismatch as e:
            return (row, None, str(e))

    def _parse(self, values: pa.Array) -> pa.Table | None:
        """``values`` (no line breaks) parsed as newline-delimited JSON, or None if Arrow
        refuses them or finds another number of rows (an empty value, two objects in one)."""
        joined = pc.binary_join_element_wise(values, b"", b"\n")
        offsets = np.frombuffer(joined.buffers()[1], dtype=np.int32)
        begin, end = int(offsets[joined.offset]), int(offsets[joined.offset + len(joined)])
        data = joined.buffers()[2].slice(begin, end - begin)
        # Blocks of ~1 MiB parse ~20 % faster than one block of a whole 50k-value batch
        # (13 MB); a block must hold the longest value and its line break.
        lengths = np.diff(offsets[joined.offset : joined.offset + len(joined) + 1])
        longest = int(lengths.max()) if len(lengths) else 0
        block = max(min(end - begin, _BLOCK_BYTES), longest + 1, 1 << 16)
        try:
            table = pj.read_json(
                pa.BufferReader(data),
                read_options=pj.ReadOptions(use_threads=False, block_size=block),
                parse_options=pj.ParseOptions(
                    explicit_schema=self._parse_schema, unexpected_field_behavior="ignore"
                ),
            )
        except Exception:  # ArrowInvalid, and UnicodeDecodeError for bad UTF-8
            return None
        return table if table.num_rows == len(values) else None

    def _required(
        self, table: pa.Table, rows: np.ndarray, values: pa.Array, bad: list[tuple[int, str]]
    ) -> tuple[pa.Table, np.ndarray]:
        """Rows with a null in a non-nullable field become bad, with Python's message."""
        required = [n for n in self.fields if n not in self.nullable]
        if not table.num_rows or not any(table.column(n).null_count for n in required):
            return table.cast(self.arrow_schema), rows
        missing = np.zeros(table.num_rows, dtype=bool)
        for n in required:
            missing |= table.column(n).is_null().to_numpy(zero_copy_only=False)
        for i in np.nonzero(missing)[0].tolist():
            try:
                self.decode_record(values[int(rows[i])].as_py())
                error = "a non-nullable field is null"  # not reached: Python finds it too
            except SchemaMismatch as e:
                error = str(e)
            bad.append((int(rows[i]), error))
        keep = pa.array(~missing)
        return table.filter(keep).cast(self.arrow_schema), rows[~missing]


#: The block size :meth:`JsonSchema._parse` hands ``pyarrow.json``: measured on Nexmark's
#: bids (~270 bytes), 1 MiB blocks cost 0.34 CPU-s per 200k against 0.41 for 13 MB ones.
_BLOCK_BYTES = 1 << 20


def kind_of(field: pa.Field) -> str:
    """The declared type name of an Arrow field (its Arrow type's name if none)."""
    return _FROM_ARROW.get(str(field.type), str(field.type))


def _without_line_breaks(values: pa.Array) -> np.ndarray:
    """Per value: True if it has no line break (one scan of the data buffer when none has)."""
    data = values.buffers()[2]
    # The smallest byte of the whole data buffer, read in place: above "\r" (13) no value
    # can hold "\n" (10) or "\r". A fifth of the cost of copying it out for two finds.
    if data is None or not data.size or pc.min(_bytes_of(data)).as_py() > ord("\r"):
        return np.ones(len(values), dtype=bool)
    broken = pc.or_(pc.match_substring(values, "\n"), pc.match_substring(values, "\r"))
    flags: np.ndarray = broken.to_numpy(zero_copy_only=False)
    return ~flags


def _bytes_of(data: pa.Buffer) -> pa.Array:
    """A buffer's bytes as a uint8 array, without a copy."""
    return pa.Array.from_buffers(pa.uint8(), data.size, [None, data])


def _runs(flags: np.ndarray) -> list[tuple[bool, int]]:
    """(flag, length) of each run of equal flags."""
    if not len(flags):
        return []
    edges = np.nonzero(flags[1:] != flags[:-1])[0] + 1
    starts = [0, *edges.tolist()]
    ends = [*edges.tolist(), len(flags)]
    return [(bool(flags[s]), e - s) for s, e in zip(starts, ends, strict=True)]


def _shown(v: Any) -> str:
    """A JSON value as an error shows it: its JSON, cut at 40 characters."""
    shown = json.dumps(v)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _is_text(v: str) -> bool:
    """Whether ``v`` is encodable as UTF-8 (holds no lone surrogate)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fits_double(v: int | float) -> bool:
    """NaN and Infinity are taken, as by Arrow, Spark and ``json``; an integer too large
    for a double is not."""
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"
