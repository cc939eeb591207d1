"""Kernels: how an op is computed on a device, with the Python that builds, loads or launches it.

- ``cpu/`` (C: ``common.h``, ``attention.c``, ``elementwise.c``, ``int8.c``) and
  ``cpu_kernels``, which compiles them into one library in the kernel cache and wraps its
  entry points (the ``cpu`` attention backend's kernels, the int8 linears' GEMMs).
- ``triton_attention``, ``triton_moe``, ``triton_batch_invariant``, ``triton_lora``: the
  Triton kernels of the CUDA path (paged attention, the fused-MoE grouped GEMM, the
  batch-invariant GEMM and RMSNorm, the segmented LoRA products).

What goes here: C and Triton kernels and their launch wrappers. What the model is made of
(modules with weights, and which kernel a module calls) is ``layers``; which attention kernel
a step runs is ``attention``. Kernels import no scheduler code except the layer a kernel
stands in for (``triton_batch_invariant.TritonRMSNorm`` is a ``layers.norm.RMSNorm``;
``triton_moe`` reads ``layers.moe``'s block layout). ``triton_aot`` compiles every
``@triton.jit`` kernel of this package ahead of time, so a new Triton kernel belongs here.
mini-sglang keeps its kernels apart the same way (``kernel/``).
"""
