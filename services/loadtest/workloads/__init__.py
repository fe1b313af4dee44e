"""What a benchmark sends: workloads produce sessions (conversations of one or more turns)."""
