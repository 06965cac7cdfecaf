"""Engines kept apart from pytest: engine worker processes (``workers``, ``engine_worker``)
and engine environments, other Pythons with other engine versions (``environments``)."""
