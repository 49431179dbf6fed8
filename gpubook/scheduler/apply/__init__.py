"""Apply: one pass of the daemon, and one handler per action kind.

`passes.Pass.run` reads each host and State once, plans, decides (gpubook/scheduler/core), hands each
action to the handler for its kind (handlers.py; each booking's actions in a lane of their own,
lanes.py), folds each handler's recorded outcome into the pass's view, then lets the outbox
consumers (write-back, notices) read the recorded outcomes.
"""
