"""Speculative decoding: propose draft tokens for a decoding request, verify them in one forward.

A decoding request's row in a step is normally one token (its newest). With drafts it is an
extend of ``1 + k`` tokens -- the newest token and ``k`` proposed ones -- over the same paged
KV cache, so one forward yields the logits after each of them (``speculator.Speculator``
plans it; ``executor.model_runner`` returns those logits after the batch's usual rows).
``verify`` then keeps the longest run of drafts the target model agrees with plus one token
of its own: greedy rows get exactly the tokens of non-speculative decoding; sampled rows go
through rejection sampling, which keeps the output distribution (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023). The KV rows
of rejected drafts go back to the pool in the same step.

Proposers (``proposer.Proposer``): ``ngram.NgramProposer``, prompt lookup over the request's
own prompt and output (Saxena 2023, "Prompt Lookup Decoding"; SGLang's and vLLM's ngram).
"""
