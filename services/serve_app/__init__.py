"""The Ray Serve application: `builder.py` binds the gateway and the engine deployments from a
`BatonConfig`; `serve_entry.py` is the import path Serve config files name (KubeRay's
serveConfigV2, `serve deploy`). Both run wherever a Ray cluster already exists."""
