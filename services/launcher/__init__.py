"""`baton serve` on one machine: `launcher.py` starts a local Ray cluster, a local Redis
(`local_redis.py`, unless the config names one) and the Serve application, and stops them."""
