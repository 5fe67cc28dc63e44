"""The state engine: keyed state kept in immutable sorted runs on the object store.

One home for everything between a :class:`~microbatch.state.KeyedStateBackend` and the
bytes of its runs — what the runtime, restore, reshard, inspection and the checkpoint
writer call, and all they need to know:

- :class:`RunRef`: a run as a manifest names it (its data and index objects, the
  key-groups it serves); :func:`clip_runs` gives an instance its share of a manifest's;
- :class:`BlockCache`, :func:`state_cache`: the runs' blocks cached on local disk and in
  memory, one cache per process and checkpoint store;
- :func:`load_keys`, :func:`load_due_timers`, :class:`Loaded`: bring the keys a batch
  touches (and those with timers due) into the backend — nothing else is read;
  :func:`load_key_groups` loads every key of some key-groups (tools, reshard, restores);
- :func:`changed_entries`, :func:`mark_all_changed`, :func:`write_batch_run`,
  :class:`Written`: write what a batch changed as one run, merged with the newest runs
  when the size tiers say so; :func:`write_all_keys` writes a whole state as one run;
- :data:`TIMER`, :data:`PROCESSING_TIMER`: which timer index a due-timer load reads.

Inside, one job per module: :mod:`.runs` (the run format and its block index),
:mod:`.blockcache` (point reads and scans across runs), :mod:`.bundle` (a key's whole
state as one run entry, and the timer index), :mod:`.compaction` (the size tiers),
:mod:`.instance` (an instance's load and write of a batch's keys), :mod:`.process_cache`
(the per-process cache and its disk budget).

Import arrows point down: the engine imports the per-key state (backend, codec),
``keygroups``, ``storage``, ``settings`` and ``errors`` — never ``checkpoint`` or
``runtime``; ``checkpoint`` imports the engine. Where a run is stored is the caller's
(:class:`RunNames`, which :class:`~microbatch.checkpoint.Layout` satisfies).
"""

from microbatch.state.engine.blockcache import BlockCache, RunRef
from microbatch.state.engine.bundle import PROCESSING_TIMER, TIMER
from microbatch.state.engine.instance import (
    Loaded,
    RunNames,
    Written,
    changed_entries,
    clip_runs,
    load_due_timers,
    load_key_groups,
    load_keys,
    mark_all_changed,
    write_all_keys,
    write_batch_run,
)
from microbatch.state.engine.process_cache import state_cache

__all__ = [
    "PROCESSING_TIMER",
    "TIMER",
    "BlockCache",
    "Loaded",
    "RunNames",
    "RunRef",
    "Written",
    "changed_entries",
    "clip_runs",
    "load_due_timers",
    "load_key_groups",
    "load_keys",
    "mark_all_changed",
    "state_cache",
    "write_all_keys",
    "write_batch_run",
]
