"""Mapping between the engine's plain objects and the contract's protobuf messages."""

from __future__ import annotations

from dataclasses import asdict, fields

from ringserve.v1 import common_pb2, detokenizer_pb2, scheduler_pb2
from services.scheduler.engine.step_state import LoadStats
from services.scheduler.policy.grammar_backends import GrammarSpec
from services.scheduler.policy.output import StepOutput
from services.scheduler.policy.req import FinishReason, ReqInput, SamplingParams

# ResolvedSamplingParams fields copied as they are; the rest need a conversion.
_SCALAR_PARAMS = tuple(
    f.name for f in fields(SamplingParams) if f.name not in ("stop", "stop_token_ids", "seed", "logit_bias")
)


def grammar_from_proto(params: common_pb2.ResolvedSamplingParams) -> GrammarSpec | None:
    """The constraint of resolved parameters (json_schema, regex or ebnf), or None."""
    if not params.HasField("constraint"):
        return None
    c = params.constraint
    kind = c.WhichOneof("kind")
    if not kind:
        return None
    return GrammarSpec(kind, getattr(c, kind), c.param or "response_format", tuple(c.starts_after_ids),
                       tuple(c.opens_with_ids))


def req_input_from_proto(msg: scheduler_pb2.TokenizedGenerateReqInput, tokenizer_id: str) -> ReqInput:
    """TokenizedGenerateReqInput -> ReqInput; ``tokenizer_id`` (the stream's) fills an empty field."""
    p = msg.sampling_params
    sampling = SamplingParams(
        **{name: getattr(p, name) for name in _SCALAR_PARAMS},
        stop=tuple(p.stop),
        stop_token_ids=frozenset(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        logit_bias=tuple(sorted(p.logit_bias.items())),
    )
    return ReqInput(
        rid=msg.rid,
        input_ids=list(msg.input_ids),
        sampling=sampling,
        tokenizer_id=msg.tokenizer_id or tokenizer_id,
        return_logprob=msg.return_logprob,
        top_logprobs_num=msg.top_logprobs_num,
        stream=msg.stream,
        logprob_start_len=msg.logprob_start_len if msg.HasField("logprob_start_len") else None,
        prompt_top_logprobs_num=msg.prompt_top_logprobs_num,
        grammar=grammar_from_proto(p),
        priority=msg.priority,
        embed=msg.embed,
        embed_dimensions=msg.embed_dimensions,
        traceparent=msg.traceparent,
        lora_name=msg.lora_name,
        disagg_role=msg.disagg_role,
        disagg_bootstrap=msg.disagg_bootstrap,
    )


def _finish_to_proto(fr: FinishReason) -> common_pb2.FinishReason:
    msg = common_pb2.FinishReason(type=common_pb2.FinishReasonType.ValueType(fr.type), message=fr.message,
                                  status=fr.status)
    if fr.matched_str is not None:
        msg.matched_str = fr.matched_str
    elif fr.matched_token_id is not None:
        msg.matched_token_id = fr.matched_token_id
    return msg


# The StepOutput columns that map onto BatchTokenIDOutput fields of the same name as they are.
_COLUMNS = tuple(f.name for f in fields(StepOutput)
                 if f.name not in ("inits", "finish_reasons", "prompt_logprobs", "embeddings"))


def step_output_to_proto(out: StepOutput) -> detokenizer_pb2.BatchTokenIDOutput:
    """StepOutput -> BatchTokenIDOutput (same column names).

    Runs in the engine thread once per step, so it stays cheap at batch 1: the columns
    pass as lists, a running row's finish reason is an empty message (FINISH_NONE is 0),
    and optional parts are built only when present.
    """
    msg = detokenizer_pb2.BatchTokenIDOutput(**{name: getattr(out, name) for name in _COLUMNS})
    for i in out.inits:
        msg.inits.add(
            row=i.row, prompt_tail_ids=i.prompt_tail_ids, stop=i.stop, skip_special_tokens=i.skip_special_tokens,
            spaces_between_special_tokens=i.spaces_between_special_tokens, no_stop_trim=i.no_stop_trim,
            top_logprobs_num=i.top_logprobs_num, traceparent=i.traceparent,
        )
    fins = msg.finish_reasons
    for fr in out.finish_reasons:
        if fr is None:
            fins.add()
        else:
            fins.append(_finish_to_proto(fr))
    for p in out.prompt_logprobs:
        msg.prompt_logprobs.add(row=p.row, start=p.start, logprobs=p.logprobs, top_n=p.top_n,
                                top_ids=p.top_ids, top_vals=p.top_vals)
    for e in out.embeddings:
        msg.embeddings.add(row=e.row, values=e.values)
    return msg


def load_to_proto(stats: LoadStats, instance_id: str, tp_size: int = 1,
                  disaggregation_mode: str = "null") -> common_pb2.LoadReport:
    """LoadStats -> LoadReport (the field names are the same), with the replica's tensor-parallel size
    and its --disaggregation-mode."""
    return common_pb2.LoadReport(instance_id=instance_id, tp_size=tp_size, disaggregation_mode=disaggregation_mode,
                                 **asdict(stats))
