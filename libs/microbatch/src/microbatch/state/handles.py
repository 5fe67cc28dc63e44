"""What user code sees: per-key value, list and map state and timers.

A :class:`KeyContext` is bound to one key; ``ctx.value("count")`` returns a handle on
the state named ``count`` *for that key*. Values are stored encoded (see ``codec``), so
mutating a returned list or dict never changes state behind the backend's back — call
``set``/``update``/``put`` to write. Every write marks the key's key-group changed, which
is what makes incremental checkpoints correct.

TTL (seconds, optional, per state name) is measured on the backend's clock and restarts
on every write of an entry; an expired entry reads as absent and is dropped at the next
checkpoint. List TTL is per element, map TTL per entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from microbatch.state.codec import decode_value, encode_canonical, encode_value, encode_values
from microbatch.state.spec import Kind, StateSpec
from microbatch.state.timers import TimerQueue

_MISSING = object()


class StateTables(Protocol):
    """The part of a backend the handles use: its tables, clock and timers, and the
    bookkeeping of writes. :class:`~microbatch.state.backend.KeyedStateBackend` is one;
    naming it here would make the two modules import each other."""

    timers: TimerQueue

    def now_ms(self) -> int: ...

    def expiry_for(self, spec: StateSpec) -> int | None: ...

    def touch(self, kg: int, key_bytes: bytes, expires: int | None) -> None: ...

    def touch_many(self, written: Sequence[tuple[int, bytes]], expires: int | None) -> None: ...

    def declare(self, name: str, kind: Kind, ttl: float | None) -> StateSpec: ...

    def table(self, kg: int, name: str, create: bool = False) -> dict[bytes, Any] | None: ...

    def register_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None: ...

    def delete_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None: ...

    processing_timers: TimerQueue

    def register_processing_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None: ...

    def delete_processing_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None: ...


class _Handle:
    def __init__(self, ctx: KeyContext, spec: StateSpec) -> None:
        self._ctx = ctx
        self._spec = spec
        self._backend = ctx.backend

    def _table(self, create: bool = False) -> dict[bytes, Any] | None:
        return self._backend.table(self._ctx.key_group, self._spec.name, create)

    def _expiry(self) -> int | None:
        return self._backend.expiry_for(self._spec)

    def _alive(self, expires: int | None) -> bool:
        return expires is None or expires > self._backend.now_ms()

    def _touch(self, expires: int | None) -> None:
        self._backend.touch(self._ctx.key_group, self._ctx.key_bytes, expires)


#: Types of values a handle may hand out twice: nothing done to them can change state.
_IMMUTABLE = frozenset({type(None), bool, int, float, str, bytes})


class ValueState(_Handle):
    """One value per key."""

    #: The stored bytes last decoded and their value, when it is immutable: a ``get`` in
    #: a loop decodes once (the bytes object is the same until the next ``set``).
    _seen: tuple[bytes, Any] | None = None

    def get(self, default: Any = None) -> Any:
        table = self._table()
        entry = table.get(self._ctx.key_bytes) if table else None
        if entry is None or not self._alive(entry[1]):
            return default
        data = entry[0]
        seen = self._seen
        if seen is not None and seen[0] is data:
            return seen[1]
        value = decode_value(data)
        if type(value) in _IMMUTABLE:
            self._seen = (data, value)
        return value

    def set(self, value: Any) -> None:
        expires = self._expiry()
        self._table(create=True)[self._ctx.key_bytes] = (encode_value(value), expires)
        self._touch(expires)

    def clear(self) -> None:
        table = self._table()
        if table and table.pop(self._ctx.key_bytes, None) is not None:
            self._touch(None)


class ListState(_Handle):
    """An ordered list per key; ``add`` appends."""

    def get(self) -> list[Any]:
        table = self._table()
        items = table.get(self._ctx.key_bytes, ()) if table else ()
        return [decode_value(v) for v, exp in items if self._alive(exp)]

    def add(self, value: Any) -> None:
        self.add_all([value])

    def add_all(self, values: Iterable[Any]) -> None:
        expires = self._expiry()
        items = self._table(create=True).setdefault(self._ctx.key_bytes, [])
        items.extend((encode_value(v), expires) for v in values)
        self._touch(expires)

    def update(self, values: Iterable[Any]) -> None:
        expires = self._expiry()
        encoded = [(encode_value(v), expires) for v in values]
        table = self._table(create=True)
        if encoded:
            table[self._ctx.key_bytes] = encoded
        else:
            table.pop(self._ctx.key_bytes, None)
        self._touch(expires)

    def clear(self) -> None:
        self.update([])


class MapState(_Handle):
    """A dict per key; map keys are any codec value, compared by their encoding."""

    def _entries(self) -> dict[bytes, tuple[bytes, int | None]]:
        table = self._table()
        return table.get(self._ctx.key_bytes, {}) if table else {}

    def get(self, field: Any, default: Any = None) -> Any:
        entry = self._entries().get(encode_canonical(field))
        if entry is None or not self._alive(entry[1]):
            return default
        return decode_value(entry[0])

    def __contains__(self, field: Any) -> bool:
        return self.get(field, _MISSING) is not _MISSING

    def put(self, field: Any, value: Any) -> None:
        expires = self._expiry()
        entries = self._table(create=True).setdefault(self._ctx.key_bytes, {})
        entries[encode_canonical(field)] = (encode_value(value), expires)
        self._touch(expires)

    def remove(self, field: Any) -> None:
        entries = self._entries()
        if entries.pop(encode_canonical(field), None) is not None:
            if not entries:
                self._table().pop(self._ctx.key_bytes, None)
            self._touch(None)

    def items(self) -> Iterator[tuple[Any, Any]]:
        for f, (v, exp) in list(self._entries().items()):
            if self._alive(exp):
                yield decode_value(f), decode_value(v)

    def keys(self) -> Iterator[Any]:
        return (k for k, _ in self.items())

    def values(self) -> Iterator[Any]:
        return (v for _, v in self.items())

    def to_dict(self) -> dict[Any, Any]:
        return dict(self.items())

    def clear(self) -> None:
        table = self._table()
        if table and table.pop(self._ctx.key_bytes, None) is not None:
            self._touch(None)


class _OfManyKeys:
    """One state of a batch's keys, ``k`` their place in it (key-group
    ``key_groups[k]``, bytes ``key_bytes[k]``)."""

    def __init__(
        self, backend: StateTables, spec: StateSpec, key_groups: Sequence[int],
        key_bytes: Sequence[bytes],
    ) -> None:  # fmt: skip
        self._backend, self._spec = backend, spec
        self._groups, self._bytes = key_groups, key_bytes


class KeyedValues(_OfManyKeys):
    """One value state of many keys at once — a batch's keys, ``k`` their place in it
    (key-group ``key_groups[k]``, bytes ``key_bytes[k]``): what a function's
    ``process_batch`` reads and writes instead of a :class:`ValueState` per key, with the
    same encoding, TTL and bookkeeping."""

    def get(self, k: int, default: Any = None) -> Any:
        return self._one(k).get(default)

    def get_many(self, keys: Sequence[int], default: Any = None) -> list[Any]:
        """``get`` of each of ``keys`` (one clock reading for the TTL of all)."""
        stored = self.get_many_encoded(keys)
        return [default if data is None else decode_value(data) for data in stored]

    def get_many_encoded(self, keys: Sequence[int]) -> list[bytes | None]:
        """Each of ``keys``' value as the codec's bytes (None: no value, or expired): for a
        function that reads values as columns (:func:`~.codec_rows.decode_rows`)."""
        backend, name, now = self._backend, self._spec.name, self._backend.now_ms()
        stored: list[bytes | None] = []
        for k in keys:
            table = backend.table(self._groups[k], name)
            entry = table.get(self._bytes[k]) if table else None
            alive = entry is not None and (entry[1] is None or entry[1] > now)
            stored.append(entry[0] if alive else None)  # type: ignore[index]  # alive: found
        return stored

    def set_many(self, keys: Sequence[int], values: Sequence[Any]) -> None:
        """``set`` of ``values[i]`` for key ``keys[i]``, encoded in one go."""
        self.set_many_encoded(keys, encode_values(values))

    def set_many_encoded(self, keys: Sequence[int], datas: Sequence[bytes]) -> None:
        """``set`` of the value whose codec bytes are ``datas[i]`` for key ``keys[i]``:
        a value already encoded (a record's payload) is stored as it is."""
        backend, name = self._backend, self._spec.name
        expires = backend.expiry_for(self._spec)
        written = [(self._groups[k], self._bytes[k]) for k in keys]
        tables: dict[int, dict[bytes, Any]] = {}
        for (kg, kb), data in zip(written, datas, strict=True):
            table = tables.get(kg)
            if table is None:
                table = tables[kg] = backend.table(kg, name, create=True)  # type: ignore[assignment]
            table[kb] = (data, expires)
        backend.touch_many(written, expires)

    def clear(self, k: int) -> None:
        self._one(k).clear()

    def _one(self, k: int) -> ValueState:
        """Key ``k``'s handle: reads and deletes go through :class:`ValueState` itself."""
        return ValueState(
            KeyContext(self._backend, None, self._bytes[k], self._groups[k]), self._spec
        )


class KeyedMaps(_OfManyKeys):
    """One map state of many keys at once, by their place ``k`` in a batch: what a
    function's ``process_batch`` reads and writes instead of a :class:`MapState` per
    key, with the same encoding, TTL and bookkeeping. Entries come and go as the codec's
    bytes, for a function that reads them as columns."""

    def entries_encoded(self, keys: Sequence[int]) -> list[list[tuple[bytes, bytes]]]:
        """Each of ``keys``' live entries as ``(field, value)`` codec bytes: the field in
        the canonical encoding (:func:`~.codec.decode_value` reads both), in no order."""
        backend, name, now = self._backend, self._spec.name, self._backend.now_ms()
        groups = [self._groups[k] for k in keys]
        tables = {kg: backend.table(kg, name) for kg in set(groups)}
        if not any(tables.values()):  # nothing held in any of their key-groups
            return [[] for _ in keys]
        out: list[list[tuple[bytes, bytes]]] = []
        for k, kg in zip(keys, groups, strict=True):
            table = tables[kg]
            entries = table.get(self._bytes[k]) if table else None
            out.append(
                [(f, v) for f, (v, exp) in entries.items() if exp is None or exp > now]
                if entries else []
            )  # fmt: skip
        return out

    def put_many_encoded(
        self, keys: Sequence[int], fields: Sequence[Any], datas: Sequence[bytes]
    ) -> None:
        """``put(fields[i], value)`` for key ``keys[i]``, the value already encoded as
        ``datas[i]`` (a record's payload is stored as it is); a later put of the same key
        and field wins, as in a loop of ``put``."""
        backend, name = self._backend, self._spec.name
        expires = backend.expiry_for(self._spec)
        written = [(self._groups[k], self._bytes[k]) for k in keys]
        tables: dict[int, dict[bytes, Any]] = {}
        for (kg, kb), field, data in zip(written, fields, datas, strict=True):
            table = tables.get(kg)
            if table is None:
                table = tables[kg] = backend.table(kg, name, create=True)  # type: ignore[assignment]
            table.setdefault(kb, {})[encode_canonical(field)] = (data, expires)
        backend.touch_many(written, expires)

    def remove_many(self, keys: Sequence[int], fields: Sequence[Any]) -> None:
        """``remove(fields[i])`` for key ``keys[i]``."""
        backend, name = self._backend, self._spec.name
        removed = []
        for k, field in zip(keys, fields, strict=True):
            kg, kb = self._groups[k], self._bytes[k]
            table = backend.table(kg, name)
            entries = table.get(kb) if table else None
            if entries is not None and entries.pop(encode_canonical(field), None) is not None:
                if not entries:
                    del table[kb]  # type: ignore[index]  # found in it
                removed.append((kg, kb))
        backend.touch_many(removed, None)


class BatchState:
    """State and timers of a batch's keys — key ``k`` in key-group ``key_groups[k]``,
    bytes ``key_bytes[k]`` — for a function's ``process_batch``: the same state its
    ``process`` calls see through a :class:`KeyContext` per key."""

    def __init__(
        self, backend: StateTables, key_groups: Sequence[int], key_bytes: Sequence[bytes]
    ) -> None:
        self._backend, self._groups, self._bytes = backend, key_groups, key_bytes

    def value(self, name: str, ttl: float | None = None) -> KeyedValues:
        spec = self._backend.declare(name, "value", ttl)
        return KeyedValues(self._backend, spec, self._groups, self._bytes)

    def map(self, name: str, ttl: float | None = None) -> KeyedMaps:
        spec = self._backend.declare(name, "map", ttl)
        return KeyedMaps(self._backend, spec, self._groups, self._bytes)

    def register_timers(self, keys: Sequence[int], timestamps: Sequence[int]) -> None:
        """``register_timer(timestamps[i])`` for key ``keys[i]``."""
        backend, groups, key_bytes = self._backend, self._groups, self._bytes
        for k, timestamp in zip(keys, timestamps, strict=True):
            backend.register_timer(groups[k], key_bytes[k], int(timestamp))

    def delete_timers(self, keys: Sequence[int], timestamps: Sequence[int]) -> None:
        """``delete_timer(timestamps[i])`` for key ``keys[i]`` (none there: nothing)."""
        backend, groups, key_bytes = self._backend, self._groups, self._bytes
        for k, timestamp in zip(keys, timestamps, strict=True):
            backend.delete_timer(groups[k], key_bytes[k], int(timestamp))


class KeyContext:
    """State and timers of one key inside one operator instance."""

    def __init__(self, backend: StateTables, key: Any, key_bytes: bytes, kg: int) -> None:
        self.backend = backend
        self.key = key
        self.key_bytes = key_bytes
        self.key_group = kg

    def value(self, name: str, ttl: float | None = None) -> ValueState:
        return ValueState(self, self.backend.declare(name, "value", ttl))

    def list(self, name: str, ttl: float | None = None) -> ListState:
        return ListState(self, self.backend.declare(name, "list", ttl))

    def map(self, name: str, ttl: float | None = None) -> MapState:
        return MapState(self, self.backend.declare(name, "map", ttl))

    def register_timer(self, timestamp: int) -> None:
        """Fire ``timestamp`` for this key once the watermark reaches it."""
        self.backend.register_timer(self.key_group, self.key_bytes, timestamp)

    def delete_timer(self, timestamp: int) -> None:
        self.backend.delete_timer(self.key_group, self.key_bytes, timestamp)

    def timers(self) -> list[int]:
        return self.backend.timers.of_key(self.key_group, self.key_bytes)

    def register_processing_timer(self, timestamp: int) -> None:
        """Fire ``timestamp`` for this key once a batch's processing time reaches it."""
        self.backend.register_processing_timer(self.key_group, self.key_bytes, timestamp)

    def delete_processing_timer(self, timestamp: int) -> None:
        self.backend.delete_processing_timer(self.key_group, self.key_bytes, timestamp)

    def processing_timers(self) -> list[int]:
        return self.backend.processing_timers.of_key(self.key_group, self.key_bytes)
