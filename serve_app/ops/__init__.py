"""The operator's side, run in a short-lived driver: the `baton` command (cli.py, generate.py),
its gRPC client (client.py), deploy/scale/status/stop (service_ops.py), Serve's ports
(ports.py), `baton status`'s text (status_text.py) and node drains (node_drain.py). The
highest layer: it builds and deploys the application (app.py); nothing below imports it."""
