"""Shared test helpers (importable as ``helpers`` because pytest puts ``tests/`` on sys.path)."""
