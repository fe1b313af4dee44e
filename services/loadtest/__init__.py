"""`baton bench`: a client-side load-test harness for Baton (gRPC) and any OpenAI-compatible server.

    workloads/   what to send: random lengths, shared prefixes, multi-turn, a ShareGPT file
    arrivals.py  when to send it: Poisson, gamma (bursty), all at once (with a concurrency cap)
    backends/    how to send it: Baton gRPC streaming, OpenAI-compatible HTTP (SSE)
    runner.py    the open-loop dispatcher, bounded by request count and duration
    metrics.py   TTFT, TPOT, ITL, E2E, throughput, goodput (pure functions over request records)
    report.py    the JSON result file and the summary table; plots.py the PNGs
    compare.py   two or more result files side by side
    benchmark.py one benchmark end to end (checks first, then load); cli.py its command line

Nothing here is imported by the services; this package imports no Ray.
"""
