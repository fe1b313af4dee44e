"""Helpers shared by Baton's tests (importable because pytest puts tests/ on sys.path)."""
