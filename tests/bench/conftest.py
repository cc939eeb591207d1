"""The e2e ``stack`` fixture (one ringserve launch per session), shared with the bench tests."""

from tests.e2e.conftest import stack  # noqa: F401
