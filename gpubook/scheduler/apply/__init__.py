"""Apply: one pass of the daemon, and one handler per action kind.

`passes.Pass.run` reads each host and State once (its notes too, typed: state/notes.py), plans,
keeps State in step (adopt, extend, remind: core/upkeep.py), decides (gpubook/scheduler/core),
hands each action to the handler for its kind (handlers.py, through hands.py; each booking's
actions in a lane of their own, lanes.py), folds each handler's recorded outcome into the pass's
view, then lets the outbox consumers (write-back, notices: delivery.py) read the recorded
outcomes. What the pass records besides its actions (accounting, priority, idle ports) is
accounting.py's `Bookkeeping`.
"""
