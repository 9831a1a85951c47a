"""The performance benchmark (`make bench`): see bench.py."""
