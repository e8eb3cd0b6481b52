"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.load_profile("ci")
