"""Protobuf <-> engine translations and error -> status mapping of the gRPC surface."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from ray.exceptions import RayActorError, RayTaskError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RequestCancelledError,
)

from serve_app.errors import SubscriptionLost
from serve_app.grpc.api import baton_pb2 as pb
from serve_app.grpc.service import (
    DEFAULT_MAX_TOKENS,
    params_from_proto,
    prompt_from_proto,
    response_from_outputs,
    status_for,
)
from workers.engine import StructuredOutput
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import TokenLogprob
from workers.engine.sequence import FinishReason
from workers.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError


def test_unset_optional_fields_take_the_defaults_and_set_ones_are_kept():
    params = params_from_proto(pb.GenerateRequest(text="x"), room=1000)
    assert (params.max_tokens, params.temperature, params.top_p) == (DEFAULT_MAX_TOKENS, 1.0, 1.0)
    assert params.seed is None and params.logprobs is None and params.skip_special_tokens
    assert params.prompt_logprobs is None
    request = pb.GenerateRequest(
        text="x", max_tokens=7, temperature=0.0, seed=3, logprobs=2, stop=["\n"], top_k=5
    )
    params = params_from_proto(request, room=1000)
    assert (params.max_tokens, params.temperature, params.seed, params.logprobs) == (7, 0.0, 3, 2)
    assert (
        params_from_proto(pb.GenerateRequest(text="x", prompt_logprobs=0), 9).prompt_logprobs == 0
    )
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        params_from_proto(pb.GenerateRequest(text="x", prompt_logprobs=21), room=9)
    assert params.stop == ("\n",) and params.top_k == 5


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (
            pb.StructuredOutput(json_schema='{"type": "integer"}'),
            StructuredOutput("json", '{"type": "integer"}'),
        ),
        (pb.StructuredOutput(json_object=True), StructuredOutput("json_object")),
        (pb.StructuredOutput(regex="[a-z]+"), StructuredOutput("regex", "[a-z]+")),
        (
            pb.StructuredOutput(choice=pb.ChoiceList(choices=["y", "n"])),
            StructuredOutput.choice(["y", "n"]),
        ),
        (pb.StructuredOutput(grammar='start: "a"'), StructuredOutput("grammar", 'start: "a"')),
    ],
)
def test_a_structured_output_constraint_converts(constraint, expected):
    request = pb.GenerateRequest(text="x", structured_output=constraint)
    structured = params_from_proto(request, room=100).structured
    assert structured == expected
    assert structured.param.startswith("structured_output.")
    assert params_from_proto(pb.GenerateRequest(text="x"), room=100).structured is None


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        (pb.StructuredOutput(), "structured_output"),
        (pb.StructuredOutput(json_object=False), "structured_output.json_object"),
        (pb.StructuredOutput(json_schema="[oops"), "structured_output.json_schema"),
        (pb.StructuredOutput(choice=pb.ChoiceList()), "structured_output.choice"),
        (pb.StructuredOutput(regex=""), "structured_output.regex"),
    ],
)
def test_a_bad_structured_output_constraint_names_its_field(constraint, param):
    request = pb.GenerateRequest(text="x", structured_output=constraint)
    with pytest.raises(InvalidRequestError) as err:
        params_from_proto(request, room=100)
    assert err.value.param == param


def test_an_explicit_zero_is_not_mistaken_for_unset():
    with pytest.raises(ValueError, match="max_tokens"):
        params_from_proto(pb.GenerateRequest(text="x", max_tokens=0), room=1000)


def test_penalties_min_p_and_logit_bias_convert_and_default_to_off():
    off = params_from_proto(pb.GenerateRequest(text="x"), room=100)
    assert not off.adjusts_logits and off.min_p == 0.0 and off.repetition_penalty == 1.0
    request = pb.GenerateRequest(
        text="x",
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.25,
        min_p=0.125,
        logit_bias={7: 2.5, 3: -100.0},
        min_tokens=4,
    )
    params = params_from_proto(request, room=100)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert (params.repetition_penalty, params.min_p) == (1.25, 0.125)
    assert params.logit_bias == ((3, -100.0), (7, 2.5)) and params.min_tokens == 4
    with pytest.raises(InvalidRequestError, match=r"repetition_penalty must be in \[0.01, 10\]"):
        params_from_proto(pb.GenerateRequest(text="x", repetition_penalty=0.0), room=100)


def test_an_unset_max_tokens_fits_the_room_the_prompt_leaves():
    assert params_from_proto(pb.GenerateRequest(text="x"), room=40).max_tokens == 40
    # No room: the check against the model then blames the prompt (test_prompts.py).
    assert params_from_proto(pb.GenerateRequest(text="x"), room=0).max_tokens == 1
    # An unset max_tokens rises to min_tokens, as far as the room allows.
    long_min = pb.GenerateRequest(text="x", min_tokens=300)
    assert params_from_proto(long_min, room=400).max_tokens == 300
    with pytest.raises(InvalidRequestError, match=r"min_tokens \(300\) is more than the 40") as e:
        params_from_proto(long_min, room=40)
    assert (e.value.param, e.value.code) == ("min_tokens", "context_length_exceeded")
    # Sent, it is the client's: the engine's check then names the prompt and that budget.
    assert params_from_proto(pb.GenerateRequest(text="x", max_tokens=9), room=0).max_tokens == 9


def test_each_prompt_kind_converts_and_a_missing_prompt_is_refused():
    req = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    )
    assert prompt_from_proto(req).messages == (("user", "hi"),)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]))
    assert list(prompt_from_proto(req).token_ids) == [1, 2]
    with pytest.raises(ValueError, match="^prompt: set one of text, chat, token_ids$"):
        prompt_from_proto(pb.GenerateRequest())
    # Named after the request's own oneof.
    with pytest.raises(ValueError, match="^input: set one of text, chat"):
        prompt_from_proto(pb.TokenizeRequest())


def test_outputs_merge_into_one_response_with_usage_at_the_end():
    lp = TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.0)))
    outs = [
        RequestOutput("r", [5], "a", [lp]),
        RequestOutput(
            "r",
            [6],
            "b",
            [],
            True,
            FinishReason.LENGTH,
            num_prompt_tokens=3,
            num_output_tokens=2,
            num_cached_tokens=1,
        ),
    ]
    response = response_from_outputs("client-id", outs)
    assert (response.request_id, response.text, list(response.token_ids)) == (
        "client-id",
        "ab",
        [5, 6],
    )
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 2)
    assert response.usage.cached_prompt_tokens == 1
    assert [t.token_id for t in response.logprobs[0].top_logprobs] == [5, 6]
    assert not response_from_outputs("r", outs[:1]).HasField("usage")
    assert not response.prompt_logprobs  # not asked for
    asked = [replace(outs[0], prompt_logprobs=[TokenLogprob(9, -3.0, ((4, -0.1),), 7)]), outs[1]]
    (prompt_lp,) = response_from_outputs("r", asked).prompt_logprobs
    assert (prompt_lp.token_id, prompt_lp.logprob, prompt_lp.rank) == (9, -3.0, 7)
    assert [(t.token_id, t.logprob) for t in prompt_lp.top_logprobs] == [(4, pytest.approx(-0.1))]
    assert not response.logprobs[0].HasField("rank")  # a sampled token's: not computed


def _wrapped(exc: BaseException) -> RayTaskError:
    return RayTaskError("fn", "Traceback (most recent call last): ...", exc).as_instanceof_cause()


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidRequestError("top_p must be in (0, 1], got 5"), grpc.StatusCode.INVALID_ARGUMENT),
        # Only the client's error is INVALID_ARGUMENT: a ValueError from anywhere else is
        # the service's bug (say, a metric's inc(0)), not a bad request.
        (ValueError("value must be >0, got 0"), grpc.StatusCode.INTERNAL),
        (EngineOverloadedError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (EngineDeadError("dead"), grpc.StatusCode.UNAVAILABLE),
        # Serve's own refusals: a deployment's queue is full, or it has no replica.
        (
            BackPressureError(num_queued_requests=3, max_queued_requests=2),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            DeploymentUnavailableError(DeploymentID(name="DecodeServer", app_name="baton")),
            grpc.StatusCode.UNAVAILABLE,
        ),
        # The replica's process died mid-call.
        (RayActorError(), grpc.StatusCode.UNAVAILABLE),
        # The router lost its output subscription to the replica carrying the request.
        (SubscriptionLost("the subscription to replica r failed"), grpc.StatusCode.UNAVAILABLE),
        (asyncio.CancelledError(), grpc.StatusCode.CANCELLED),
        # Serve's cancel of a call whose parent request was cancelled.
        (RequestCancelledError("r1"), grpc.StatusCode.CANCELLED),
        (KeyError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_map_to_status_codes_without_tracebacks(exc, code):
    for raised in (exc, _wrapped(exc)):
        got, message = status_for(raised)
        assert got == code
        assert "Traceback" not in message and "\n" not in message
        if code is grpc.StatusCode.UNAVAILABLE:  # no actor, replica or node names
            assert message == "no healthy replica could serve the request; retry it"
    if isinstance(exc, InvalidRequestError):
        assert status_for(_wrapped(exc))[1] == str(exc)
