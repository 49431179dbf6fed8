"""What the daemon remembers between runs: one SQLite file (stdlib sqlite3, WAL).

It holds the SSH ports handed out, the containers started and stopped, the calendar write-backs
done, an append-only event log, the outbox of notices (e-mail, webhook) waiting to be delivered
and, from the start/stop records, GPU-hours per user and booking. Each outcome of a pass is
recorded here once; the write-back, the notices and the status file read it from here.

It is a memory, not the truth: what runs is what the engine lists under gpubook's labels. So a
missing or corrupt database is set aside and recreated with a warning, and the apply stage adopts
running containers (`adopt_port`, `container_started`) from their labels. Every method commits
its own transaction; WAL with synchronous=NORMAL keeps every committed transaction through a
kill -9 of the daemon (a power cut may lose the last few, which the labels make up for).

The package: `store.py` (State, one transaction per method), `schema.py` (the migrations and how a
file is opened, checked and set aside), `records.py` (what State hands out), `usage.py` (accounting:
bookings seen, GPU samples, logins; mixed into State), `releases.py` (no-shows released, each
booking's GPU samples as the judge reads them; mixed in too), `slots.py` (the plan's priority: the
slot each occurrence asks for and when it was first accepted there; mixed in too), `notes.py` (the
per-booking notes the apply stage keeps: each kind's key and typed value, read all at once),
`errors.py`.
"""

from gpubook.scheduler.state.errors import StateError, StateUnavailable
from gpubook.scheduler.state.foreign import ForeignRow
from gpubook.scheduler.state.records import LEVELS, ContainerRecord, LogEntry, Notice, WriteBack
from gpubook.scheduler.state.releases import GpuSamples, ReleaseRow
from gpubook.scheduler.state.schema import MIGRATIONS
from gpubook.scheduler.state.store import State, port_is_free, port_range_problem
from gpubook.scheduler.state.usage import BookedRow, RejectedRow, Sample, SampleSum

__all__ = ["LEVELS", "MIGRATIONS", "BookedRow", "ContainerRecord", "ForeignRow", "GpuSamples", "LogEntry", "Notice",
           "RejectedRow", "ReleaseRow", "Sample", "SampleSum", "State", "StateError", "StateUnavailable", "WriteBack",
           "port_is_free", "port_range_problem"]
