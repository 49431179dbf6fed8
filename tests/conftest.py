"""The tests' pytest plugins, registered once: fixtures by name in every test module, and the fast lane.

Test modules import builders and servers from tests/kits (`from tests.kits.daemon_kit import ...`),
never from another test module nor from tests/plugins (tests/test_layout.py checks it).
"""

pytest_plugins = [
    "tests.plugins.calendars",
    "tests.plugins.engines",
    "tests.plugins.daemons",
    "tests.plugins.slurm",
    "tests.plugins.lanes",
    "tests.plugins.notify",
    "tests.plugins.probes",
    "tests.plugins.pause",
    "tests.plugins.lane_health",
    "tests.plugins.module_queue",
]
