"""The Ray Serve application: builder functions and the `baton serve` launcher."""
