"""DDP and FSDP2 (`fully_shard`) of a model built from ncd modules (KATGroup, ChebyKANLayer, GatedKalmaNet and a
compiled attention spec's Module), on spawned gloo process groups of 2 ranks with the kernels in the interpreter:
two SGD steps on each rank's half of the batch give the parameters of single-process steps on the whole batch
(fp32, 1e-5 relative); the DDP model also trains through torch.compile (aot_eager: the custom ops trace)."""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

C, T, BATCH, HEADS = 8, 17, 4, 2


class Net(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        from ncd.kan import ChebyKANLayer, KATGroup
        from ncd.layers import GatedKalmaNet

        super().__init__()
        self.kat = KATGroup(4, "swish", "cpu")
        self.kan = ChebyKANLayer(C, C, 3)
        self.gka = GatedKalmaNet(hidden_size=C, num_heads=HEADS, num_iter=3, chunk_size=16)
        self.qkv = nn.Linear(C, 3 * C)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.kan(self.kat(x)).reshape(x.shape)  # ChebyKAN flattens the leading axes, as the official layer
        x = x + self.gka(x)
        q, k, v = (t.reshape(x.shape[0], T, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return x + self.attention(q, k, v).transpose(1, 2).reshape(x.shape)


def _model(cache: str) -> Net:
    import ncd
    from ncd.ops import shipped_spec

    torch.manual_seed(0)
    attention = ncd.load(shipped_spec("softmax_attention"), cache_dir=cache, sizes={"dim": C // HEADS}).Module()
    return Net(attention)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, T, C, generator=gen), torch.randn(BATCH, T, C, generator=gen)


def _worker(rank: int, world: int, modes: list, init: str, cache: str, errors: str, want: dict) -> None:
    try:
        os.environ["TRITON_INTERPRET"] = "1"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=180))
        for mode in modes:
            _compare(rank, world, mode, cache, want)
        dist.destroy_process_group()
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _reference(cache: str) -> dict:
    """The parameters after single-process steps on the whole batch; each module's moved (equality then means
    something)."""
    x, y = _data()
    reference = _model(cache)
    _train(reference, x, y)
    want = {n: p.detach() for n, p in reference.named_parameters()}
    initial = dict(_model(cache).named_parameters())
    for child in ("kat", "kan", "gka", "qkv"):
        assert sum(float((want[n] - initial[n]).norm()) for n in want if n.startswith(child + ".")) > 1e-4
    return want


def _compare(rank: int, world: int, mode: str, cache: str, want: dict) -> None:
    x, y = _data()
    model = _model(cache)
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for child in (model.kat, model.kan, model.gka, model.qkv):
            fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, x[part], y[part])
        got = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped: nn.Module = DistributedDataParallel(model)
        if mode == "ddp-compiled":
            wrapped = torch.compile(wrapped, backend="aot_eager")  # type: ignore[assignment]
        _train(wrapped, x[part], y[part])
        got = {n: p.detach() for n, p in model.named_parameters()}
    assert got.keys() == want.keys()
    errors = {n: float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-12)) for n in want}
    bad = {n: e for n, e in errors.items() if not e < 1e-5}
    assert not bad, f"{mode}, rank {rank}: parameters off single-process training: {bad}"


def test_data_parallel_training_equals_single_process_training(tmp_path):
    """DDP, FSDP2 and DDP under torch.compile, one after the other in the same two ranks (one spawn: CI time); the
    single-process reference trains once, here, and the ranks take its parameters."""
    errors = tmp_path / "errors"
    errors.mkdir()
    modes = ["ddp", "fsdp2", "ddp-compiled"]
    want = _reference(str(tmp_path / "cache"))
    try:
        mp.spawn(_worker, args=(2, modes, f"file://{tmp_path / 'pg'}", str(tmp_path / "cache"), str(errors), want),
                 nprocs=2)
    except Exception as e:
        reports = "\n".join(p.read_text() for p in sorted(errors.iterdir()))
        raise AssertionError(f"a rank failed:\n{reports}") from e
