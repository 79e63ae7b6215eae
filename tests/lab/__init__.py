"""The multi-host lab (namespaces on this machine) and the tests that run on it (`make cluster-test`)."""
