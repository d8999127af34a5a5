"""Helpers the tests share: fakes at the HTTP boundary, stand-ins, factories and harnesses (no tests here)."""
