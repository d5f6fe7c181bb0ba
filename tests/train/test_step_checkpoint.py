"""Train steps of a module that checkpoints its attention block (``torch.utils.checkpoint``, both
``use_reentrant`` modes) equal PyTorch eager + torch.optim over several steps, float64, on cpu:1,
cpu:2 and a 2 x 2 dp x tp mesh with an uneven batch split.

The backward's recomputation runs the module again: it must read the step's parameters, not the
module's own (with ``functional_call`` around the forward only, every step after the first trained on stale weights).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

from spmd import Mesh
from spmd.train import SGD, make_train_step

E, S = 8, 5


class _Net(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.layer = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=True)
        self.q, self.kv = nn.Linear(E, E), nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def block(self, x, pad):
        x = self.layer(x, src_key_padding_mask=pad)
        q = self.q(x).unflatten(-1, (4, 2)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (2, 2, 2)).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
        return x + att.transpose(1, 2).flatten(-2)

    def forward(self, x, pad):
        return self.head(cp.checkpoint(self.block, x, pad, use_reentrant=self.use_reentrant)).squeeze(-1)


def _loss_fn(apply, batch):
    return ((apply(batch["x"], batch["pad"]) - batch["y"]) ** 2).mean()


def _batches(n, batch=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        pad = torch.rand(batch, S, generator=g) > 0.7
        pad[:, 0] = False
        out.append({"x": torch.randn(batch, S, E, generator=g, dtype=torch.float64), "pad": pad,
                    "y": torch.randn(batch, S, generator=g, dtype=torch.float64)})
    return out


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("mesh_shape", [{"dp": 1}, {"dp": 2}, {"dp": 2, "tp": 2}])
def test_checkpointed_block_trains_like_eager(use_reentrant, mesh_shape):
    torch.manual_seed(0)
    ref = _Net(use_reentrant).double()
    model = _Net(use_reentrant).double()
    model.load_state_dict(ref.state_dict())
    n = 1
    for size in mesh_shape.values():
        n *= size
    ts = make_train_step(model, Mesh.create(mesh_shape, devices=f"cpu:{n}"), None, _loss_fn, optimizer=SGD(lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k, batch in enumerate(_batches(3)):
        got = float(ts.step(batch)["loss"])
        opt.zero_grad()
        want = _loss_fn(ref, batch)
        want.backward()
        opt.step()
        assert abs(got - want.item()) <= 1e-6 * abs(want.item()), (k, got, want.item())
    sd = ts.state_dict()
    for name, want in ref.named_parameters():
        torch.testing.assert_close(sd[f"param.{name}"], want.detach(), rtol=1e-10, atol=1e-10, msg=name)
