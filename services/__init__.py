"""Baton's services: the engine, models, router, KV handover and Ray Serve deployments."""
