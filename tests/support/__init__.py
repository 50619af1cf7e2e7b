"""Helpers shared by tests: fakes and fixtures that several test modules use."""
