"""Tools for testing and benchmarking ddp_ext, not for training:
`fake_hosts`, hosts made of network namespaces on one Linux machine (used by
the multi-host tests and by `python -m ddp_ext.bench scaleout`)."""
