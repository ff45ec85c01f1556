"""Baton's serving side on Ray Serve. The application is `app.build_app(config)` with an
`config.AppConfig`; operators use the `baton` command (ops/cli.py). This file imports
nothing, so that the command starts without loading Serve or the engine."""
