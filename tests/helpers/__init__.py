"""Helpers shared by test modules: rings, fakes, readers and payload builders.

Test modules import helpers from here, never from another test module.
"""
