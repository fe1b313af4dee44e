"""Autoscaling prefill and decode replicas on the signals that matter (queued prompt tokens,
measured prefill throughput, KV usage, TPOT): what each replica reports (signals.py) and the
Serve policies that read it (policy.py)."""
