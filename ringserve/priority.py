"""A request's scheduling priority: its bound, and the one scheduling policy that honours it.

``priority`` has vLLM's meaning: an integer, lower runs first, 0 by default. Only a scheduler
started with ``--schedule-policy priority`` orders its queue by it (``services.scheduler.
policy.waiting``); under any other policy a non-zero priority cannot be honoured, so every
entry point refuses it by name rather than ignore it (vLLM refuses it the same way):

- gateway: the pydantic field of chat, completions and ``/generate`` carries the bound (an
  int32, what the protos carry), refused with the table's message (``bound_message``);
- tokenizer: before dispatch, against the policy the chosen scheduler reports in its
  LoadReport (``schedule_policy``), with ``refusal``'s message;
- scheduler: the same check in its validation, for a request sent before its first
  LoadReport reached the tokenizer, or by a client of its own link.
"""

from __future__ import annotations

from ringserve.sampling_params import INT32_MAX, Param, violation

INT32_MIN = -(2**31)

# The --schedule-policy that orders requests by priority (one of ringserve.options.names.SCHEDULE_POLICIES).
PRIORITY_POLICY = "priority"

PRIORITY = Param("priority", int, 0, "Scheduling priority: lower runs first; honoured under --schedule-policy "
                 "priority, else only 0 is accepted.", lo=INT32_MIN, hi=INT32_MAX)


def refusal(value: int, policy: str) -> str | None:
    """Why a request of priority ``value`` cannot run on a scheduler with ``policy``, or None.

    A value outside the int32 range is refused with the table's bound message; a non-zero
    value under a policy other than ``PRIORITY_POLICY`` with a message that names the flag
    that honours it.
    """
    error = violation(PRIORITY, value)
    if error is not None:
        return error
    if value and policy != PRIORITY_POLICY:
        return (f"priority must be 0 under --schedule-policy {policy}: the scheduler orders requests by priority "
                f"only when started with --schedule-policy {PRIORITY_POLICY}")
    return None
