"""pytest plugins: the fixtures the test modules share, and the fast lane. Registered once, in
tests/conftest.py (`pytest_plugins`); a test module asks for a fixture by name and imports nothing
from here. Builders and servers the fixtures use live in tests/kits.
"""
