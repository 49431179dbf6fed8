"""The pure core: the booking convention and recurrence, the plan, the decision.

No I/O here: import-linter keeps engines, sockets, SQLite and HTTP out (see .importlinter).
"""
