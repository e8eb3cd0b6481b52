"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.load_profile("ci")


def pytest_configure(config):
    """Keep the on-disk graph cache of the tests away from the user's cache."""
    import os
    import tempfile

    os.environ.setdefault("PARAPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="paraplan-test-cache-"))
