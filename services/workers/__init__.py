"""Engine deployments: one engine per Serve replica, in a colocated, prefill or decode role."""
