"""The decode side's receive path on a (fake) CUDA KV pool: a streamed KV piece lands on the
device through the one host-to-device copy function, twice per piece (bytes, rows), with no
device-to-host read -- ``FakeTensorMode`` raises on any CPU/CUDA mix and on any host sync."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from ringserve.v1 import disagg_pb2
from services.scheduler.disagg.transfer import GrpcKvTransfer, KvLayout
from services.scheduler.policy.kv_pool import TokenToKVPool

CUDA = torch.device("cuda:0")


def test_a_kv_piece_lands_on_the_device_without_a_host_sync():
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    copies: list[tuple[torch.Size, torch.dtype]] = []

    def to_device(host: torch.Tensor) -> torch.Tensor:
        assert host.device.type == "cpu"
        copies.append((host.shape, host.dtype))
        with unset_fake_temporarily():  # the received bytes are a real host tensor (torch.frombuffer)
            meta = host.to("meta")
        return FakeTensor(mode, meta, CUDA)

    with mode:
        rows = torch.tensor([9, 4, 11], dtype=torch.int64)  # the reservation's rows, on the host
        pool = TokenToKVPool(16, num_layers=2, kv_heads=3, head_dim=4, dtype=torch.bfloat16, device=CUDA)
        layout = KvLayout.of(pool)
        assert layout == KvLayout(2, 3 * 4 * 2, "bfloat16")
        piece = disagg_pb2.KvChunk(rid="r", layer=1, start=1, k=bytes(2 * layout.row_bytes),
                                   v=bytes(2 * layout.row_bytes))
        moved = GrpcKvTransfer(to_device).receive(pool, rows, piece)
    assert moved == 4 * layout.row_bytes
    assert copies == [(torch.Size([4 * layout.row_bytes]), torch.uint8), (torch.Size([2]), torch.int64)]
    assert all(b.device == CUDA for b in pool.k_buffer + pool.v_buffer)
