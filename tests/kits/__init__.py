"""Helpers the tests share: builders, servers, engines and clusters made for a test (no test lives here).

Imported one way only: `from tests.kits.daemon_kit import ...` (or `from tests.kits import daemon_kit`).
Fixtures are not defined here but in the pytest plugins of tests/plugins/, registered in tests/conftest.py.
"""
