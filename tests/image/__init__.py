"""make image-test: the cluster image built and used on this machine (see __main__.py)."""
