"""The reliability tests start real servers (one per module) on the session's tiny checkpoint."""
from tests.server.conftest import http, tiny_checkpoint  # noqa: F401  (shared with tests/server)
