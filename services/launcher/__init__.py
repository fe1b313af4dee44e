"""`baton serve` on one machine (`serve_command.py`): `launcher.py` starts a local Ray cluster, a local Redis
(`local_redis.py`, unless the config names one; supervised: restarted if it dies) and the Serve application, and stops them
(`stop_signals.py`, `serve_shutdown.py`); `ports.py` checks the ports first, and
`console_logging.py` keeps the console to Baton's lines and the level asked for."""
