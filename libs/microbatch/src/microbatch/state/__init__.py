"""Keyed state of one operator instance: value, list and map state, TTL and timers."""

from microbatch.state.backend import KeyedStateBackend
from microbatch.state.codec import CodecError, decode_value, encode_value
from microbatch.state.handles import KeyContext, ListState, MapState, ValueState
from microbatch.state.spec import StateSpec
from microbatch.state.timers import Timer

__all__ = [
    "CodecError",
    "KeyContext",
    "KeyedStateBackend",
    "ListState",
    "MapState",
    "StateSpec",
    "Timer",
    "ValueState",
    "decode_value",
    "encode_value",
]
