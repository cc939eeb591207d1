"""The blocks the models are made of: linears (packed, tensor-parallel, int8, batch-invariant),
norms, rotary embeddings, activations and MoE experts.

What goes here: ``torch.nn`` modules and the functions that build, shard or convert them.
A block that runs a kernel of its own calls it from ``kernels``; attention is ``attention``.
"""
