"""Validated OpenAI / native requests -> ``GenerateReqInput`` protos.

Only the fields a client gave are set on ``SamplingParams`` (proto3 ``optional``), so the
tokenizer's defaults apply to the rest; the table of ``ringserve.sampling_params`` says which
fields there are and checks each value with the message the tokenizer would give.
Cross-field checks that need no model knowledge (min_tokens <= max_tokens, the
continue_final_message rules, content part types) raise a 400 here, before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringserve import limits, tracing
from ringserve import sampling_params as table
from ringserve.v1 import common_pb2, tokenizer_pb2

from . import request_context
from .constraints import forced_tool_constraint, forced_tools, native_constraint, request_constraint
from .errors import invalid
from .protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    NativeSamplingParams,
    SamplingFields,
    Tool,
)

# Prompts in one completions batch: each is its own Generate call, and the gateway's memory
# for a batch grows with it (a 16 MiB body holds millions of one-character prompts).
MAX_BATCH_PROMPTS = 2048

def new_rid(req: SamplingFields | GenerateRequest) -> str:
    """The request's rid: its ``X-Request-Id``, else the body's (``rid`` or vLLM's ``request_id``),
    else the fresh id its response carries (``request_context.adopt``, which also puts the
    request's GenAI attributes on its span).

    Raises:
        GatewayError(400): ``X-Request-Id`` and the body's rid differ.
    """
    return request_context.adopt(req.rid or getattr(req, "request_id", None), lambda: _span_attributes(req))


def _span_attributes(req: SamplingFields | GenerateRequest) -> dict:
    """The OpenTelemetry GenAI request attributes of ``req`` (those it gives)."""
    sampling = req.sampling_params if isinstance(req, GenerateRequest) else req
    attrs = {
        tracing.GEN_AI_OPERATION: "chat" if isinstance(req, ChatCompletionRequest) else "text_completion",
        tracing.GEN_AI_REQUEST_MODEL: getattr(req, "model", None),
        tracing.GEN_AI_REQUEST_MAX_TOKENS: getattr(req, "max_completion_tokens", None)
        or getattr(sampling, "max_tokens", None) or getattr(sampling, "max_new_tokens", None),
        tracing.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
    }
    return {k: v for k, v in attrs.items() if v is not None}


def _table_params(req: object, out: common_pb2.SamplingParams, http_names: bool, prefix: str = "") -> None:
    """Copy every table parameter the client gave onto ``out`` (OpenAI names or the proto's).

    The pydantic fields checked the bounds (``protocol.bounded``) but the lower one of a
    parameter with an ``off`` value, checked here with the tokenizer's message (top_k: "-1
    (disabled) or at least 1").

    Raises:
        GatewayError(400): the table's message naming ``prefix + name``.
    """
    for p in table.TABLE:
        name = p.http_name if http_names else p.name
        value = getattr(req, name)
        if value is not None:
            error = table.violation(p, value, prefix + name) if p.off is not None else None
            if error is not None:
                raise invalid(error, prefix.rstrip(".") or name)  # the top-level field, as pydantic's errors
            setattr(out, p.name, value)


def _logit_bias(bias: dict[str, float] | None, out: common_pb2.SamplingParams) -> None:
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token_id < 2**31:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        error = table.violation(table.LOGIT_BIAS, value, f"logit_bias[{token_id}]")
        if error is not None:
            raise invalid(error, "logit_bias")
        out.logit_bias[token_id] = value


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if any(s == "" for s in stops):
        raise invalid("stop strings must not be empty", "stop")
    return stops


def sampling_params(req: SamplingFields) -> common_pb2.SamplingParams:
    """SamplingParams from an OpenAI chat or completions request.

    Raises:
        GatewayError(400): min_tokens > max_tokens, bad logit_bias, empty stop string,
            stream_options without stream.
    """
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise invalid(f"min_tokens ({req.min_tokens}) must not exceed {param} ({max_tokens})", "min_tokens")
    out = common_pb2.SamplingParams(stop=_stops(req.stop), stop_token_ids=req.stop_token_ids or ())
    _table_params(req, out, http_names=True)
    if max_tokens is not None:
        out.max_new_tokens = max_tokens
    if req.no_stop_trim is not None or req.include_stop_str_in_output is not None:
        out.no_stop_trim = bool(req.no_stop_trim or req.include_stop_str_in_output)
    _logit_bias(req.logit_bias, out)
    constraint = request_constraint(req)
    if constraint is not None:
        out.constraint.CopyFrom(constraint)
    return out


def native_sampling_params(params: NativeSamplingParams) -> common_pb2.SamplingParams:
    """SamplingParams from ``/generate``'s sampling_params (field names are the proto's)."""
    if (
        params.min_new_tokens is not None
        and params.max_new_tokens is not None
        and params.min_new_tokens > params.max_new_tokens
    ):
        raise invalid(
            f"min_new_tokens ({params.min_new_tokens}) must not exceed max_new_tokens ({params.max_new_tokens})",
            "sampling_params.min_new_tokens",
        )
    out = common_pb2.SamplingParams(stop=_stops(params.stop), stop_token_ids=params.stop_token_ids or ())
    _table_params(params, out, http_names=False, prefix="sampling_params.")
    _logit_bias(params.logit_bias, out)
    return out


def message_text(msg: ChatMessage, index: int) -> tuple[str | None, list[str]]:
    """(content, the texts of its content parts) of one message; only text parts are accepted.

    Parts are passed on as parts; the tokenizer joins them (its documented rule), so a
    single text part renders exactly like the same string.
    """
    if isinstance(msg.content, str) or msg.content is None:
        if msg.content is None and msg.role not in ("assistant",):
            raise invalid(f"messages[{index}].content is required for role '{msg.role}'", "messages")
        return msg.content, []
    parts = []
    for j, part in enumerate(msg.content):
        where = f"messages[{index}].content[{j}]"
        if part.type != "text":
            raise invalid(
                f"{where}: content part type '{part.type}' is not supported; this model accepts only 'text' parts",
                "messages",
                "unsupported_content_type",
            )
        if part.text is None:
            raise invalid(f"{where}: a text part needs 'text'", "messages")
        if part.model_extra:
            fields = ", ".join(part.model_extra)
            raise invalid(f"{where}: unrecognized fields {fields}", "messages", "unknown_parameter")
        parts.append(part.text)
    return None, parts


def chat_messages(messages: Sequence[ChatMessage], out: tokenizer_pb2.ChatInput) -> None:
    """Add ``messages`` to ``out.messages``, built in place: copying a proto message holding a
    15 MB string takes ~80 ms of the event loop, assigning the string ~2 ms.

    Raises:
        GatewayError(400): a tool message without tool_call_id, a content problem
            (``message_text``).
        LimitExceeded: a tool call's arguments over the limits of ``ringserve.limits``.
    """
    for i, msg in enumerate(messages):
        content, parts = message_text(msg, i)
        if msg.role == "tool" and not msg.tool_call_id:
            raise invalid(f"messages[{i}]: a tool message needs tool_call_id", "messages")
        for j, call in enumerate(msg.tool_calls or ()):
            limits.check_json_text(call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments",
                                   "messages")
        pb = out.messages.add(role=msg.role, name=msg.name or "", tool_call_id=msg.tool_call_id or "")
        for text in parts:
            pb.content_parts.add(type="text", text=text)
        for c in msg.tool_calls or ():
            pb.tool_calls.add(id=c.id, type=c.type, function_name=c.function.name,
                              function_arguments=c.function.arguments)
        if content is not None:
            pb.content = content
        if msg.reasoning_content is not None:
            pb.reasoning_content = msg.reasoning_content


def chat_input(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool | None,
    continue_final_message: bool,
    chat_template_kwargs: dict | None,
    tools: Sequence[Tool] | None,
    out: tokenizer_pb2.ChatInput,
) -> None:
    """Fill ``out`` (in place, see ``chat_messages``) with the template flags checked (C10).

    Raises:
        GatewayError(400): add_generation_prompt and continue_final_message both true, or
            continue_final_message with a last message that is not the assistant's.
        LimitExceeded: tools, chat_template_kwargs or a call's arguments over the limits
            of ``ringserve.limits``.
    """
    if not messages:
        raise invalid("messages must not be empty", "messages")
    if continue_final_message:
        if add_generation_prompt:
            raise invalid(
                "add_generation_prompt and continue_final_message cannot both be true", "continue_final_message"
            )
        if messages[-1].role != "assistant":
            raise invalid(
                "continue_final_message needs the last message to be the assistant's", "continue_final_message"
            )
        add_generation_prompt = False
    chat_messages(messages, out)
    out.continue_final_message = continue_final_message
    out.tools_json = limits.dump_json([t.model_dump(exclude_none=True) for t in tools], "tools") if tools else ""
    out.chat_template_kwargs_json = (limits.dump_json(chat_template_kwargs, "chat_template_kwargs")
                                     if chat_template_kwargs else "")
    if add_generation_prompt is not None:
        out.add_generation_prompt = add_generation_prompt


def chat_request(req: ChatCompletionRequest, rid: str) -> tokenizer_pb2.GenerateReqInput:
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    # tool_choice "none" means the model must not see the tools (as vLLM and OpenAI do).
    tools = None if req.tool_choice == "none" else req.tools
    forced = forced_tools(req)
    pb = tokenizer_pb2.GenerateReqInput(
        rid=rid, stream=req.stream, return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
        priority=req.priority,
    )
    chat_input(
        req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs, tools, pb.chat
    )
    params = sampling_params(req)
    if forced is not None:
        params.constraint.CopyFrom(forced_tool_constraint(req, forced))
    pb.sampling_params.CopyFrom(params)
    if req.prompt_logprobs is not None:
        if req.stream:
            raise invalid("prompt_logprobs is not available with stream (as in vLLM)", "prompt_logprobs")
        pb.logprob_start_len = 0
        pb.prompt_top_logprobs_num = req.prompt_logprobs
    return pb


def prompt_top_logprobs(req: CompletionRequest) -> int | None:
    """Top logprobs per prompt token a completions request needs (None: no prompt logprobs):
    ``echo`` with ``logprobs`` (OpenAI), vLLM's ``prompt_logprobs``, and ``max_tokens: 0``
    (scoring) each ask for the prompt's logprobs.

    Raises:
        GatewayError(400): max_tokens 0 without echo or prompt_logprobs (nothing to return).
    """
    if req.prompt_logprobs is not None and req.stream:
        raise invalid("prompt_logprobs is not available with stream (as in vLLM)", "prompt_logprobs")
    if req.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
        raise invalid("max_tokens 0 is only allowed with echo or prompt_logprobs (score the prompt)", "max_tokens")
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    if wanted:
        return max(wanted)
    return 0 if req.max_tokens == 0 else None


def completion_prompts(prompt: str | list[int] | list[list[int]] | list[str]) -> list[str | list[int]]:
    """The prompts of a completions request: one string, one id list, or a batch of either.

    Raises:
        GatewayError(400): an empty prompt or id list, or a batch of more than
            MAX_BATCH_PROMPTS prompts (checked before any request is built for it).
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise invalid(f"prompt: a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}; "
                      "split it into several requests", "prompt")
    prompts: list[str | list[int]] = list(prompt)
    if any(isinstance(p, list) and not p for p in prompts):
        raise invalid("prompt token lists must not be empty", "prompt")
    return prompts


def completion_requests(req: CompletionRequest, rid: str) -> list[tokenizer_pb2.GenerateReqInput]:
    """One GenerateReqInput per prompt; a batch gets rids ``<rid>-<i>``."""
    params = sampling_params(req)
    prompt_top = prompt_top_logprobs(req)
    prompts = completion_prompts(req.prompt)
    out = []
    for i, prompt in enumerate(prompts):
        pb = tokenizer_pb2.GenerateReqInput(
            rid=rid if len(prompts) == 1 else f"{rid}-{i}",
            sampling_params=params,
            stream=req.stream,
            return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0,
            priority=req.priority,
        )
        if prompt_top is not None:
            pb.logprob_start_len = 0
            pb.prompt_top_logprobs_num = prompt_top
        if isinstance(prompt, str):
            pb.text = prompt
        else:
            pb.input_ids.ids.extend(prompt)
        out.append(pb)
    return out


def native_request(req: GenerateRequest, rid: str) -> tokenizer_pb2.GenerateReqInput:
    if (req.text is None) == (req.input_ids is None):
        raise invalid("give exactly one of text and input_ids", "text")
    params = native_sampling_params(req.sampling_params)
    constraint = native_constraint(req)
    if constraint is not None:
        params.constraint.CopyFrom(constraint)
    pb = tokenizer_pb2.GenerateReqInput(
        rid=rid,
        sampling_params=params,
        stream=req.stream,
        return_logprob=req.return_logprob,
        top_logprobs_num=req.top_logprobs_num,
        priority=req.priority,
    )
    if req.return_logprob and req.logprob_start_len >= 0:
        pb.logprob_start_len = req.logprob_start_len
        pb.prompt_top_logprobs_num = req.top_logprobs_num
    if req.text is not None:
        pb.text = req.text
    else:
        pb.input_ids.ids.extend(req.input_ids or ())
    return pb
