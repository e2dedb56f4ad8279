"""The decision pipeline's filter stages (router.policy.pipeline), one file each.

A filter is a `pipeline.Filter` subclass with a `name`: every one defined in a module of this package runs in each
pipeline built afterwards, live and simulated, in (`order`, `name`) order. It returns the view with the replicas it
rules out for the request marked unhealthy (`late_binding.restrict`, `types.unhealthy`), or the same view. Filters
run before the health check, so one that rules out every replica answers the request as no healthy replica would.
"""
