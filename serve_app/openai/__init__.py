"""The OpenAI-compatible HTTP surface: a body read within its bounds (body.py), parsed into
engine requests (requests.py, refusing what the engine cannot honour: unsupported.py), and
engine outputs turned into completion objects and SSE chunks (responses.py)."""
