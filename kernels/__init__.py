"""Baton's kernels (import as `baton.kernels`): Triton kernels with torch references.

`baton.kernels.ops` is the one dispatch module the engine calls. Keep this file free of
imports and version attributes: transformers probes any importable `kernels` package.
"""
