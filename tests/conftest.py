"""One Hypothesis profile for every property test: no per-example deadline (a first example pays XLA's compile),
and no health-check failures for slow or large draws (op tests draw whole arrays)."""

from hypothesis import HealthCheck, settings

settings.register_profile("tunix-rt", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("tunix-rt")
