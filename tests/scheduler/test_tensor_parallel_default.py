"""Models and expert blocks built without a tensor-parallel group each get a group of their own.

``TensorParallel`` is mutable (deterministic inference sets ``fixed_order`` on the group every
layer of a model holds), so a default shared by every call would carry one model's setting
into the next model the process builds.
"""

from __future__ import annotations

import torch

from services.scheduler.layers.moe import Experts
from services.scheduler.models import build_model
from tests.helpers.tiny_models import TINY

LLAMA = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama")


def test_models_built_without_a_group_do_not_share_one():
    first, second = build_model(LLAMA, torch.float32), build_model(LLAMA, torch.float32)
    first.tp.fixed_order = True
    assert (first.tp.size, second.tp.size, second.tp.fixed_order) == (1, 1, False)


def test_expert_blocks_built_without_a_group_do_not_share_one():
    first, second = Experts(4, 64, 32), Experts(4, 64, 32)
    first.tp.fixed_order = True
    assert (first.tp.size, second.tp.size, second.tp.fixed_order) == (1, 1, False)
