"""Disaggregated prefill and decode: see client.py for who owns each part of the handover."""
