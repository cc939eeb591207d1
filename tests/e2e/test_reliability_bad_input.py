"""Bad input straight to each gRPC service (hypothesis-generated).

Each service refuses what it cannot serve with INVALID_ARGUMENT and a message, changes no
state for it, and keeps serving: after every run a normal request through the ring still
gets the right answer and every service is back to baseline.

- tokenizer ``Generate``: ids outside the vocabulary, empty input, huge n or max tokens,
  NaN/inf floats; ``Abort`` of unknown rids answers found=false.
- every field of every tokenizer RPC, from the proto descriptors (``bad_values``): one bad
  value at a time (300 KiB strings, JSON text 10,000 deep, extreme numbers, NaN, unknown
  enum values, 10,000-long lists) in an otherwise valid request ends with a status the
  client caused (never UNKNOWN, INTERNAL, UNAVAILABLE or a hang), nothing stays held and
  no service logs a traceback; the JSON-in-JSON fields over the limits name the field.
- scheduler ``Connect`` (acting as a tokenizer, reading its rows back through a
  detokenizer subscription): the same bad values past the tokenizer's checks each come back
  as one FINISH_ABORT row with status INVALID_ARGUMENT; unknown rid aborts are no-ops.
- detokenizer ``Stream`` (acting as a scheduler): malformed columnar batches are refused.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import uuid

import grpc
import pytest
from google.protobuf import message_factory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve import sampling_params
from ringserve.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.helpers.bad_values import STRINGS, no_errors_logged, proto_fields, proto_values, set_proto
from tests.helpers.ringstack import still_serves

VOCAB = 49152  # SmolLM2
CONTEXT = 8192
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))

bad_id = st.integers(-(2**31), -1) | st.integers(VOCAB, 2**31 - 1)
bad_float = st.sampled_from([math.nan, math.inf, -math.inf])
FLOAT_PARAMS = tuple(p.name for p in sampling_params.TABLE if p.type is float)


# --- tokenizer -----------------------------------------------------------------------------


@st.composite
def bad_generate(draw) -> tokenizer_pb2.GenerateReqInput:
    req = tokenizer_pb2.GenerateReqInput(rid=f"fuzz-{uuid.uuid4().hex}")
    kind = draw(st.sampled_from(["ids", "empty", "n", "max_tokens", "float", "logit_bias", "stop_token"]))
    if kind == "ids":
        ids = draw(st.lists(st.integers(0, VOCAB - 1), max_size=5)) + [draw(bad_id)]
        req.input_ids.ids.extend(draw(st.permutations(ids)))
        return req
    if kind == "empty":
        which = draw(st.sampled_from(["none", "text", "ids"]))
        if which == "text":
            req.text = ""
        elif which == "ids":
            req.input_ids.SetInParent()
        return req
    req.text = draw(st.text(min_size=1, max_size=20).filter(str.strip))
    sp = req.sampling_params
    if kind == "n":
        sp.n = draw(st.integers(129, 2**31 - 1) | st.integers(-(2**31), 0))
    elif kind == "max_tokens":
        sp.max_new_tokens = draw(st.integers(CONTEXT, 2**31 - 1) | st.integers(-(2**31), 0))
    elif kind == "float":
        setattr(sp, draw(st.sampled_from(FLOAT_PARAMS)), draw(bad_float))
    elif kind == "logit_bias":
        sp.logit_bias[draw(bad_id)] = 1.0
    else:
        sp.stop_token_ids.append(draw(bad_id))
    return req


@FUZZ
@given(req=bad_generate())
def test_tokenizer_refuses_bad_generate(stack, req):
    with grpc.insecure_channel(stack.tokenizer) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        try:
            outs = list(stub.Generate(req, timeout=30))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
            assert exc.details()
        else:
            raise AssertionError(f"accepted {req}: {outs}")
    assert stack.tokenizer_load().req_states == 0


@FUZZ
@given(rid=st.text(max_size=40))
def test_tokenizer_abort_of_unknown_rid(stack, rid):
    with grpc.insecure_channel(stack.tokenizer) as ch:
        resp = tokenizer_pb2_grpc.TokenizerStub(ch).Abort(tokenizer_pb2.AbortRequest(rid=f"unknown-{rid}"), timeout=10)
    assert not resp.found


def test_tokenizer_still_serves(stack):
    still_serves(stack)


# --- every field of the tokenizer's API, from its descriptors --------------------------------

TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"]
USER = tokenizer_pb2.ChatMessage(role="user", content="hi")
# Statuses a client's bad request may end with on this ring (no queue limits, 64 MiB messages);
# any other is the server failing (RESOURCE_EXHAUSTED here was trailers too big to read).
CLIENT_STATUSES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                   grpc.StatusCode.NOT_FOUND}


def base_request(method, steps):
    """A valid request of ``method``, its input oneof on the branch the field path enters."""
    msg = message_factory.GetMessageClass(method.input_type)()
    first = steps[0].name if steps else ""
    if method.name in ("Generate", "Tokenize"):
        if first == "chat":
            msg.chat.messages.append(USER)
        elif first == "input_ids":
            msg.input_ids.ids.extend([504, 3575])
        else:
            msg.text = "hi"
    if method.name == "Generate":
        msg.rid = f"fields-{uuid.uuid4().hex}"
        msg.sampling_params.max_new_tokens = 1
    elif method.name in ("Detokenize", "TokenPieces"):
        msg.ids.append(504)
    return msg


# SubscribeKvEvents is a subscription that does not end by design (its bad input:
# tests/e2e/test_kv_events_ring.py).
GRPC_FIELDS = [(m, steps) for m in TOKENIZER.methods if not m.client_streaming and m.name != "SubscribeKvEvents"
               for steps in proto_fields(m.input_type)]


def call_bad(stack, method, steps, msg) -> grpc.StatusCode:
    where = f"{method.name} {'.'.join(f.name for f in steps)}"
    with grpc.insecure_channel(stack.tokenizer, options=[("grpc.max_send_message_length", -1)]) as ch:
        rpc = getattr(tokenizer_pb2_grpc.TokenizerStub(ch), method.name)
        try:
            result = rpc(msg, timeout=30, metadata=stack.grpc_metadata)  # a hang fails here (DEADLINE_EXCEEDED)
            if method.server_streaming:
                list(result)
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_STATUSES, (where, exc.code(), exc.details())
            assert exc.details(), (where, exc.code())
            return exc.code()
    return grpc.StatusCode.OK


def test_every_string_field_survives_deep_json_text(stack):
    """JSON text 600 objects deep in every string field of every tokenizer RPC."""
    strings = [(m, steps) for m, steps in GRPC_FIELDS if steps[-1].type == steps[-1].TYPE_STRING]
    assert len(strings) >= 30
    with no_errors_logged(stack):
        for method, steps in strings:
            msg = set_proto(base_request(method, steps), steps, "deep object text", many=False)
            call_bad(stack, method, steps, msg)
        stack.wait_idle()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(GRPC_FIELDS), data=st.data())
def test_every_field_survives_bad_values(stack, field, data):
    method, steps = field
    value = data.draw(proto_values(steps[-1]), label="value")
    many = steps[-1].is_repeated and data.draw(st.booleans(), label="many")
    with no_errors_logged(stack):
        call_bad(stack, method, steps, set_proto(base_request(method, steps), steps, value, many))
        stack.wait_idle()


DEEP_OBJECTS = json.dumps({"x": json.loads(STRINGS["deep object text"])})
DEEP = "nests deeper than 32 levels of objects and arrays, the limit for JSON inside a request"


@pytest.mark.parametrize("request_,param,message", [
    (tokenizer_pb2.GenerateReqInput(chat=tokenizer_pb2.ChatInput(messages=[USER],
                                                                 chat_template_kwargs_json=DEEP_OBJECTS)),
     "chat_template_kwargs", f"chat_template_kwargs: {DEEP}"),
    (tokenizer_pb2.GenerateReqInput(chat=tokenizer_pb2.ChatInput(messages=[USER], tools_json=f"[{DEEP_OBJECTS}]")),
     "tools", f"tools: {DEEP}"),
    (tokenizer_pb2.GenerateReqInput(text="hi", sampling_params=common_pb2.SamplingParams(
        constraint=common_pb2.Constraint(json_schema=STRINGS["deep JSON text"], param="response_format"))),
     "response_format", f"response_format: {DEEP}"),
], ids=["chat_template_kwargs", "tools", "constraint"])
def test_deep_json_in_the_grpc_api_is_invalid_argument_naming_the_field(stack, request_, param, message):
    """Depth 600 objects and 10,000 arrays: INVALID_ARGUMENT with the field, not UNKNOWN with a traceback."""
    with no_errors_logged(stack), grpc.insecure_channel(stack.tokenizer) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(tokenizer_pb2_grpc.TokenizerStub(ch).Generate(request_, timeout=30))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert dict(info.value.trailing_metadata()) == {"code": "invalid_value", "param": param}
    assert stack.tokenizer_load().req_states == 0


# --- scheduler -----------------------------------------------------------------------------


def resolved(**overrides) -> common_pb2.ResolvedSamplingParams:
    p = common_pb2.ResolvedSamplingParams(**{**sampling_params.resolved_defaults(), "temperature": 0.0,
                                             "max_new_tokens": 4})
    for name, value in overrides.items():
        setattr(p, name, value)
    return p


@st.composite
def bad_tokenized(draw) -> scheduler_pb2.TokenizedGenerateReqInput:
    kind = draw(st.sampled_from(["ids", "empty", "max_tokens", "float", "top_k", "logit_bias"]))
    ids = [504, 3575, 282]
    params = resolved()
    if kind == "ids":
        ids = ids + [draw(bad_id)]
    elif kind == "empty":
        ids = []
    elif kind == "max_tokens":
        params.max_new_tokens = draw(st.integers(CONTEXT, 2**31 - 1) | st.integers(-(2**31), 0))
    elif kind == "float":
        setattr(params, draw(st.sampled_from(FLOAT_PARAMS)), draw(bad_float))
    elif kind == "top_k":
        params.top_k = draw(st.integers(-(2**31), -2) | st.just(0))
    else:
        params.logit_bias[draw(bad_id)] = 1.0
    return scheduler_pb2.TokenizedGenerateReqInput(rid=f"fuzz-{uuid.uuid4().hex}", input_ids=ids,
                                                   sampling_params=params)


class FakeTokenizer:
    """A Connect stream to the scheduler plus a Subscribe stream to the detokenizer, under
    one made-up tokenizer id, so the rows the scheduler produces can be read back."""

    def __init__(self, stack):
        self.id = f"fuzz-tok-{uuid.uuid4().hex}"
        self._sched_ch = grpc.insecure_channel(stack.scheduler)
        self._detok_ch = grpc.insecure_channel(stack.detokenizer)
        self.rows: queue.Queue[tuple[str, common_pb2.FinishReason, int]] = queue.Queue()
        self._sub = detokenizer_pb2_grpc.DetokenizerStub(self._detok_ch).Subscribe(
            detokenizer_pb2.SubscribeRequest(tokenizer_id=self.id), metadata=stack.internal_metadata)
        self._sub.initial_metadata()  # registered
        threading.Thread(target=self._read, daemon=True).start()
        self._out: queue.Queue[scheduler_pb2.SchedulerInput | None] = queue.Queue()
        hello = scheduler_pb2.AbortReq(rid="", tokenizer_id=self.id)
        self._out.put(scheduler_pb2.SchedulerInput(abort=hello))
        self._connect = scheduler_pb2_grpc.SchedulerStub(self._sched_ch).Connect(iter(self._out.get, None),
                                                                                  metadata=stack.internal_metadata)
        next(self._connect)  # the first LoadReport: the stream is open

    def _read(self) -> None:
        try:
            for batch in self._sub:
                for i, rid in enumerate(batch.rids):
                    self.rows.put((rid, batch.finish_reasons[i], batch.completion_tokens[i]))
        except grpc.RpcError:
            pass

    def send(self, msg: scheduler_pb2.SchedulerInput) -> None:
        self._out.put(msg)

    def final_row(self, rid: str, timeout_s: float = 10) -> tuple[common_pb2.FinishReason, int]:
        while True:
            got, finish, completion = self.rows.get(timeout=timeout_s)
            if got == rid and finish.type != common_pb2.FINISH_NONE:
                return finish, completion

    def close(self) -> None:
        self._out.put(None)
        self._connect.cancel()
        self._sub.cancel()
        self._sched_ch.close()
        self._detok_ch.close()


def test_scheduler_refuses_bad_requests_and_keeps_serving(stack):
    fake = FakeTokenizer(stack)
    try:

        @FUZZ
        @given(req=bad_tokenized(), unknown=st.text(max_size=20))
        def one(req, unknown):
            fake.send(scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(rid=f"unknown-{unknown}")))
            fake.send(scheduler_pb2.SchedulerInput(req=req))
            finish, completion = fake.final_row(req.rid)
            assert finish.type == common_pb2.FINISH_ABORT and finish.status == "INVALID_ARGUMENT", finish
            assert finish.message and completion == 0

        one()
        good = scheduler_pb2.TokenizedGenerateReqInput(rid=f"good-{uuid.uuid4().hex}", input_ids=[504, 3575, 282],
                                                       sampling_params=resolved())
        fake.send(scheduler_pb2.SchedulerInput(req=good))
        finish, completion = fake.final_row(good.rid)
        assert finish.type == common_pb2.FINISH_LENGTH and completion == 4
    finally:
        fake.close()
    still_serves(stack)


def test_scheduler_refuses_a_stream_without_hello(stack):
    with grpc.insecure_channel(stack.scheduler) as ch:
        req = scheduler_pb2.TokenizedGenerateReqInput(rid="x", input_ids=[1], sampling_params=resolved())
        call = scheduler_pb2_grpc.SchedulerStub(ch).Connect(iter([scheduler_pb2.SchedulerInput(req=req)]),
                                                            metadata=stack.internal_metadata)
        try:
            list(call)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "hello" in exc.details()
        else:
            raise AssertionError("a Connect stream without a hello was accepted")


# --- detokenizer ---------------------------------------------------------------------------


@st.composite
def malformed_batch(draw) -> detokenizer_pb2.BatchTokenIDOutput:
    n = draw(st.integers(1, 50))
    rids = [f"fuzz-{uuid.uuid4().hex}" for _ in range(n)]
    counts = [1] * n
    ids = [draw(st.integers(0, VOCAB - 1)) for _ in range(n)]
    b = detokenizer_pb2.BatchTokenIDOutput(rids=rids, tokenizer_ids=["fuzz"] * n)
    kind = draw(st.sampled_from(["counts", "ids", "column", "init_row"]))
    if kind == "counts":
        counts[draw(st.integers(0, n - 1))] += draw(st.integers(1, 5) | st.integers(-5, -1))
    elif kind == "ids":
        ids[draw(st.integers(0, n - 1))] = draw(bad_id)
    elif kind == "column":
        b.completion_tokens.extend([1] * (n + draw(st.integers(1, 3))))
    else:
        b.inits.append(detokenizer_pb2.RowInit(row=draw(st.integers(n, 2**31 - 1) | st.integers(-(2**31), -1))))
    b.new_token_counts.extend(counts)
    b.output_ids.extend(ids)
    return b


@FUZZ
@given(batch=malformed_batch())
def test_detokenizer_refuses_malformed_batches(stack, batch):
    with grpc.insecure_channel(stack.detokenizer) as ch:
        try:
            list(detokenizer_pb2_grpc.DetokenizerStub(ch).Stream(iter([batch]), timeout=10,
                                                                 metadata=stack.internal_metadata))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
            assert "malformed" in exc.details()
        else:
            raise AssertionError("a malformed batch was accepted")
    assert stack.detokenizer_load().decode_states == 0


def test_detokenizer_still_serves(stack):
    still_serves(stack)


@pytest.mark.parametrize("param", ["\x00\uffff\U0001f600", "p" * 300 * 1024])
def test_a_clients_constraint_param_comes_back_as_safe_metadata(stack, param):
    """``Constraint.param`` is echoed in the trailers: not ASCII made it INTERNAL "Invalid
    metadata" (and a traceback), 300 KiB RESOURCE_EXHAUSTED "Stream removed"."""
    req = tokenizer_pb2.GenerateReqInput(text="hi", sampling_params=common_pb2.SamplingParams(
        max_new_tokens=1, constraint=common_pb2.Constraint(param=param)))
    with no_errors_logged(stack), grpc.insecure_channel(stack.tokenizer) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(tokenizer_pb2_grpc.TokenizerStub(ch).Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "the constraint names no kind (json_schema, json_object, regex, ebnf or choice)"
    escaped = param.encode("ascii", "backslashreplace").decode().replace("\x00", "\\x00")
    assert dict(info.value.trailing_metadata())["param"] == escaped[:128]
