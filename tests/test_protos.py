"""The public gRPC API: checked-in stubs are current, messages round-trip, and the stubs
work over a real in-process gRPC server (a stand-in servicer; Baton's own is the router,
tested end to end in test_service.py) beside the standard health check and reflection."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from concurrent import futures
from importlib import metadata
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from serve_app.grpc.api import baton_pb2, baton_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
GRPC_API = ROOT / "serve_app" / "grpc" / "api"
SERVICE = "baton.v1.Baton"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_protos = _load_generator()


# -- (a) the checked-in stubs are what the generator makes now -------------------------


def test_checked_in_stubs_are_current(tmp_path: Path) -> None:
    written = gen_protos.generate(tmp_path)
    assert {p.name for p in written} == {"baton_pb2.py", "baton_pb2_grpc.py", "baton_pb2.pyi"}
    problems = gen_protos.stale_files(GRPC_API, tmp_path)
    if problems:
        # The most common innocent cause: a different grpcio-tools than the one that made them.
        made_with = re.search(
            r"grpcio-tools ([^)]+)\)", (GRPC_API / "baton_pb2.py").read_text(encoding="utf-8")
        )
        have = metadata.version("grpcio-tools")
        version_note = (
            f" (checked-in stubs were generated with grpcio-tools {made_with[1]}, "
            f"this environment has {have})"
            if made_with and made_with[1] != have
            else ""
        )
        details = "\n".join(f"- {name}: {why}" for name, why in sorted(problems.items()))
        pytest.fail(
            f"serve_app/grpc/api is stale{version_note}; run `python scripts/gen_protos.py` "
            f"and commit the result.\n{details}"
        )


def test_generated_modules_import_relatively() -> None:
    for name in ("baton_pb2.py", "baton_pb2_grpc.py"):
        text = (GRPC_API / name).read_text(encoding="utf-8")
        assert not re.search(r"^(from|import) baton\b", text, re.MULTILINE), name
    assert "from . import baton_pb2 as" in (GRPC_API / "baton_pb2_grpc.py").read_text()
    assert "baton" not in sys.modules  # nothing imported the absolute `baton.v1` path


def test_generator_rewrites_imports_between_protos(tmp_path: Path) -> None:
    # Two protos in one package, one importing the other plus a well-known type.
    protos = tmp_path / "protos" / "gentest" / "v1"
    protos.mkdir(parents=True)
    (protos / "gentest_common.proto").write_text(
        'syntax = "proto3";\npackage gentest.v1;\nmessage Thing { int32 n = 1; }\n'
    )
    (protos / "gentest_svc.proto").write_text(
        'syntax = "proto3";\npackage gentest.v1;\n'
        'import "gentest/v1/gentest_common.proto";\nimport "google/protobuf/empty.proto";\n'
        "service Things { rpc Get(google.protobuf.Empty) returns (Thing); }\n"
    )
    out = tmp_path / "pkg" / "gentest_api"
    out.mkdir(parents=True)
    (out / "__init__.py").write_text("")
    (out / "old_pb2.py").write_text("# from a .proto since deleted\n")
    written = gen_protos.generate(out, proto_root=tmp_path / "protos")
    names = sorted(p.name for p in written)
    assert names == sorted(
        f"gentest_{stem}{suffix}"
        for stem in ("common", "svc")
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
    )
    assert not (out / "old_pb2.py").exists()  # stale generated file removed
    assert (out / "__init__.py").exists()  # hand-written file kept
    svc = (out / "gentest_svc_pb2.py").read_text()
    assert "from . import gentest_common_pb2 as" in svc
    assert "from google.protobuf import empty_pb2 as" in svc  # well-known stays absolute

    sys.path.insert(0, str(out.parent))
    try:
        svc_pb2 = importlib.import_module("gentest_api.gentest_svc_pb2")
        importlib.import_module("gentest_api.gentest_svc_pb2_grpc")
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m.startswith("gentest_api")]:
            del sys.modules[name]
    assert svc_pb2.DESCRIPTOR.services_by_name["Things"].methods[0].output_type.name == "Thing"


# -- (b) messages ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("branch", "prompt"),
    [
        ("text", {"text": "Once upon a time"}),
        (
            "chat",
            {
                "chat": baton_pb2.ChatMessages(
                    messages=[
                        baton_pb2.ChatMessage(role="system", content="Be brief."),
                        baton_pb2.ChatMessage(role="user", content="Hi!"),
                    ]
                )
            },
        ),
        ("token_ids", {"token_ids": baton_pb2.TokenIds(ids=[1, 2, 49151])}),
    ],
)
def test_generate_request_round_trips(branch: str, prompt: dict) -> None:
    request = baton_pb2.GenerateRequest(
        request_id="r-1",
        max_tokens=32,
        temperature=0.0,
        top_p=0.9,
        top_k=40,
        seed=2**63 - 1,
        ignore_eos=True,
        stop_token_ids=[2, 7],
        stop=["\n\n", "END"],
        logprobs=0,
        skip_special_tokens=False,
        cache_salt="tenant-a",
        **prompt,
    )
    parsed = baton_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.WhichOneof("prompt") == branch
    # Explicit zeros / False survive: `optional` keeps presence.
    for field in ("temperature", "logprobs", "skip_special_tokens", "max_tokens", "seed"):
        assert parsed.HasField(field), field
    assert parsed.temperature == 0.0 and parsed.logprobs == 0
    assert parsed.skip_special_tokens is False
    assert parsed.seed == 2**63 - 1


def test_absent_optional_fields_mean_server_default() -> None:
    parsed = baton_pb2.GenerateRequest.FromString(
        baton_pb2.GenerateRequest(text="hi").SerializeToString()
    )
    for field in ("max_tokens", "temperature", "top_p", "seed", "logprobs", "skip_special_tokens"):
        assert not parsed.HasField(field), field
    assert parsed.request_id == "" and parsed.cache_salt == ""
    assert parsed.WhichOneof("prompt") == "text"
    assert baton_pb2.GenerateRequest().WhichOneof("prompt") is None


def test_generate_response_round_trips() -> None:
    response = baton_pb2.GenerateResponse(
        request_id="r-1",
        text=" world",
        token_ids=[1917],
        logprobs=[
            baton_pb2.TokenLogprob(
                token_id=1917,
                logprob=-0.25,
                top_logprobs=[baton_pb2.TopLogprob(token_id=1917, logprob=-0.25)],
            )
        ],
        finish_reason=baton_pb2.FINISH_REASON_LENGTH,
        usage=baton_pb2.Usage(prompt_tokens=5, completion_tokens=1, cached_prompt_tokens=0),
    )
    parsed = baton_pb2.GenerateResponse.FromString(response.SerializeToString())
    assert parsed == response
    assert parsed.HasField("usage")
    # A streamed delta: no finish reason, no usage.
    delta = baton_pb2.GenerateResponse.FromString(
        baton_pb2.GenerateResponse(request_id="r-1", text="a").SerializeToString()
    )
    assert delta.finish_reason == baton_pb2.FINISH_REASON_UNSPECIFIED == 0
    assert not delta.HasField("usage")


def test_finish_reasons_cover_the_engine() -> None:
    from workers.engine.sequence import FinishReason

    proto_names = set(baton_pb2.FinishReason.keys()) - {"FINISH_REASON_UNSPECIFIED"}
    assert proto_names == {f"FINISH_REASON_{r.name}" for r in FinishReason}


# -- (c) the service as Ray Serve's gRPC proxy sees it ---------------------------------


def test_service_descriptor() -> None:
    assert callable(baton_pb2_grpc.add_BatonServicer_to_server)
    service = baton_pb2.DESCRIPTOR.services_by_name["Baton"]
    assert service.full_name == SERVICE
    methods = {
        m.name: (m.client_streaming, m.server_streaming, m.input_type.name, m.output_type.name)
        for m in service.methods
    }
    assert methods == {
        "Generate": (False, True, "GenerateRequest", "GenerateResponse"),
        "GenerateUnary": (False, False, "GenerateRequest", "GenerateResponse"),
        "Tokenize": (False, False, "TokenizeRequest", "TokenizeResponse"),
        "GetModelInfo": (False, False, "ModelInfoRequest", "ModelInfo"),
    }


# -- (d) the stubs over a real gRPC server, with a stand-in servicer -------------------

_PIECES = ["Hello", ",", " world"]


class _EchoBaton(baton_pb2_grpc.BatonServicer):
    """Streams a fixed completion, one piece per message; just enough to exercise the wire
    (what the stubs carry, not what Baton answers)."""

    def Generate(self, request, context):
        request_id = request.request_id or "server-assigned"
        for i, piece in enumerate(_PIECES):
            last = i == len(_PIECES) - 1
            yield baton_pb2.GenerateResponse(
                request_id=request_id,
                text=piece,
                token_ids=[100 + i],
                finish_reason=baton_pb2.FINISH_REASON_STOP if last else None,
                usage=(
                    baton_pb2.Usage(
                        prompt_tokens=len(request.token_ids.ids),
                        completion_tokens=len(_PIECES),
                    )
                    if last
                    else None
                ),
            )

    def GenerateUnary(self, request, context):
        return baton_pb2.GenerateResponse(
            request_id=request.request_id,
            text="".join(_PIECES),
            token_ids=[100 + i for i in range(len(_PIECES))],
            finish_reason=baton_pb2.FINISH_REASON_LENGTH,
            usage=baton_pb2.Usage(prompt_tokens=1, completion_tokens=len(_PIECES)),
        )

    def Tokenize(self, request, context):
        ids = [ord(c) for c in request.text]
        return baton_pb2.TokenizeResponse(token_ids=ids, count=len(ids))

    def GetModelInfo(self, request, context):
        return baton_pb2.ModelInfo(model_id="echo", vocab_size=256, block_size=16)


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    baton_pb2_grpc.add_BatonServicer_to_server(_EchoBaton(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
            yield ch
    finally:
        server.stop(grace=None)
        health_servicer.enter_graceful_shutdown()


def test_the_stubs_stream_generate_over_the_wire(channel: grpc.Channel) -> None:
    stub = baton_pb2_grpc.BatonStub(channel)
    request = baton_pb2.GenerateRequest(request_id="s-1", token_ids=baton_pb2.TokenIds(ids=[1, 2]))
    responses = list(stub.Generate(request, timeout=5))
    assert [r.text for r in responses] == _PIECES
    assert all(r.request_id == "s-1" for r in responses)
    *deltas, final = responses
    assert all(r.finish_reason == baton_pb2.FINISH_REASON_UNSPECIFIED for r in deltas)
    assert not any(r.HasField("usage") for r in deltas)
    assert final.finish_reason == baton_pb2.FINISH_REASON_STOP
    assert final.usage == baton_pb2.Usage(prompt_tokens=2, completion_tokens=3)


def test_the_stubs_unary_methods_over_the_wire(channel: grpc.Channel) -> None:
    stub = baton_pb2_grpc.BatonStub(channel)
    whole = stub.GenerateUnary(baton_pb2.GenerateRequest(text="hi"), timeout=5)
    assert whole.text == "Hello, world" and whole.usage.completion_tokens == 3
    tokens = stub.Tokenize(baton_pb2.TokenizeRequest(text="ab"), timeout=5)
    assert list(tokens.token_ids) == [97, 98] and tokens.count == 2
    info = stub.GetModelInfo(baton_pb2.ModelInfoRequest(), timeout=5)
    assert info.model_id == "echo" and info.block_size == 16


def test_server_reflection_lists_baton(channel: grpc.Channel) -> None:
    database = ProtoReflectionDescriptorDatabase(channel)
    services = database.get_services()
    assert SERVICE in services and health.SERVICE_NAME in services
    # A client with no stubs can rebuild the API from the server alone.
    pool = descriptor_pool.DescriptorPool(database)
    methods = {m.name for m in pool.FindServiceByName(SERVICE).methods}
    assert methods == {"Generate", "GenerateUnary", "Tokenize", "GetModelInfo"}
    request = pool.FindMessageTypeByName("baton.v1.GenerateRequest")
    assert [f.name for f in request.oneofs_by_name["prompt"].fields] == [
        "text",
        "chat",
        "token_ids",
    ]
