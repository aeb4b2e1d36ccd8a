"""The A/B harness: sizing, compute, latency, elastic and tier workloads
(``python -m vmcache.bench``)."""
