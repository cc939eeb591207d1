"""ringserve's Triton kernels compiled ahead of time for real GPUs, on a machine without one.

Under ``TRITON_INTERPRET=1`` the kernels run as NumPy, which cannot see what a GPU compiler
refuses (unsupported ops and layouts, shared-memory overuse, register spills, dtype rules).
Here every specialization the CUDA code path launches is compiled by Triton's own pipeline
(TTIR, TTGIR, LLVM IR, PTX, then a cubin from the ``ptxas`` in the triton wheel) for each
``GPUTarget`` in ``compiler.TARGETS``, and its shared memory and registers are checked
against that GPU's limits:

- ``launches``: the models, built with dummy weights on fake CUDA tensors, run one step of
  each kind; every Triton launch is recorded, none runs.
- ``compiler``: the stand-in driver and JIT hook that record, and the compile of each
  distinct specialization with its resource use.

``bench/triton_aot.py`` prints the table; ``tests/scheduler/test_triton_aot.py`` runs it.
"""
