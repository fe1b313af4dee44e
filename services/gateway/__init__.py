"""The ingress: gRPC `baton.v1.Inference` and the OpenAI-compatible HTTP API, both over one
generation service that tokenizes once, validates, places the request and streams."""
