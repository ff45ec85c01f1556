"""Baton's public gRPC API: Python modules generated from `protos/baton/v1/baton.proto`.

    from serve_app.grpc.api import baton_pb2, baton_pb2_grpc

- `baton_pb2`: the messages (GenerateRequest, GenerateResponse, ...) and the
  FinishReason enum; `baton_pb2.pyi` types them.
- `baton_pb2_grpc`: `BatonStub` (client), `BatonServicer` (server base class) and
  `add_BatonServicer_to_server`, the function Ray Serve's gRPC proxy is given as
  `serve_app.grpc.api.baton_pb2_grpc.add_BatonServicer_to_server`.

Those files are generated: edit the .proto and run `python scripts/gen_protos.py`
(tests/test_protos.py fails while they are stale). This file is the only hand-written
one here and re-exports nothing, so importing the package stays free of protobuf.
"""
