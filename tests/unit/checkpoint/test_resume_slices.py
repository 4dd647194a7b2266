"""Universal state, read and written where DeepSpeed keeps it, one rank's slices at a time.

* ``slices.UniversalReader`` against an independent reference: the whole tensor merged from the saved TP
  slices, re-split for the new TP size (``universal.merge`` / ``universal.split``), then cut to the
  requested flat range, for TP 1/2/4 -> 1/2/4, split dims 0 and 1, strides 1 and 2.
* Every precision x ZeRO stage (one process): train, save the universal state, load it into a fresh
  engine built from another seed; the fp32 masters and both Adam moments read back equal, bit for bit,
  the moments are not zero, and the next two steps' losses equal the original engine's.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from goat_dist.checkpoint import universal
from goat_dist.checkpoint.errors import CheckpointError
from goat_dist.checkpoint.slices import UniversalReader, tensor_key
from goat_dist.engine.masters import KEYS

SPLITS = [
    ("dim0", [12, 6], {"tp_split": True, "dim": 0, "stride": 1}),
    ("dim1", [6, 8], {"tp_split": True, "dim": 1, "stride": 1}),
    ("dim0-stride2", [16, 3], {"tp_split": True, "dim": 0, "stride": 2}),
    ("dim1-stride2", [5, 16], {"tp_split": True, "dim": 1, "stride": 2}),
    ("bias", [8], {"tp_split": True, "dim": 0, "stride": 1}),
    ("replicated", [7, 3], {"tp_split": False, "dim": 0, "stride": 1}),
    ("scalar", [], {"tp_split": False, "dim": 0, "stride": 1}),
]


def write_universal(
    step_dir, full: dict[str, torch.Tensor], metas: dict, saved_tp: int, fmt: int = 1, dp: int = 3
) -> None:
    """Format 1: one file per TP rank, whole local tensors. Format 2: ``dp`` files per TP rank, each holding
    an uneven flat range of every local tensor (as ZeRO partitions cut them: inside rows, some empty)."""
    udir = step_dir / "universal"
    udir.mkdir(parents=True)
    if fmt == 2:
        files, pieces = [], {name: [] for name in full}
        for r in range(saved_tp):
            for d in range(dp):
                tensors = {}
                for name, t in full.items():
                    local = universal.split(t, metas[name], saved_tp, r).reshape(-1)
                    n = local.numel()
                    cuts = [0, n // 5, n // 5, n]  # the second range is empty: no piece for it
                    lo, hi = cuts[d], cuts[d + 1]
                    if hi > lo:
                        for key in ("", "exp_avg"):
                            value = local if not key else local * 10
                            tensors[tensor_key(name, key)] = value[lo:hi].contiguous()
                        pieces[name].append([r, lo, hi - lo, len(files)])
                save_file(tensors, str(udir / f"rank{len(files):05d}.safetensors"))
                files.append(f"rank{len(files):05d}.safetensors")
        params = {
            name: {**metas[name], "shape": list(universal.split(t, metas[name], saved_tp, 0).shape)}
            for name, t in full.items()
        }
        meta = {"format": 2, "tp": saved_tp, "step": 1, "params": params, "files": files, "pieces": pieces}
        (udir / "meta.json").write_text(json.dumps(meta))
        return
    for r in range(saved_tp):
        tensors = {}
        for name, t in full.items():
            for key in ("", "exp_avg"):
                value = t if not key else t * 10
                tensors[tensor_key(name, key)] = universal.split(value, metas[name], saved_tp, r).contiguous()
        save_file(tensors, str(udir / f"tp{r:02d}.safetensors"))
    (udir / "meta.json").write_text(json.dumps({"tp": saved_tp, "step": 1, "params": metas}))


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("saved_tp", [1, 2, 4])
@pytest.mark.parametrize("new_tp", [1, 2, 4])
def test_reader_slices_equal_merge_then_split(saved_tp, new_tp, fmt, tmp_path):
    g = torch.Generator().manual_seed(saved_tp * 10 + new_tp)
    full = {name: torch.randn(shape, generator=g) for name, shape, _ in SPLITS}
    metas = {name: meta for name, _, meta in SPLITS}
    write_universal(tmp_path, full, metas, saved_tp, fmt)
    for rank in range(new_tp):
        reader = UniversalReader(tmp_path, new_tp, rank)
        for name, t in full.items():
            for key in ("", "exp_avg"):
                value = t if not key else t * 10
                expected = universal.split(value, metas[name], new_tp, rank)
                assert reader.read_local(name, key).shape == expected.shape, name
                assert torch.equal(reader.read_local(name, key), expected), (name, key, rank)
                flat = expected.reshape(-1)
                n = flat.numel()
                for start, numel in ((0, n), (1, n - 2), (n // 3, n // 3 + 1), (n - 1, 1), (n // 2, 0)):
                    got = reader.read_flat(name, key, start, max(0, min(numel, n - start)))
                    assert torch.equal(got, flat[start : start + max(0, min(numel, n - start))]), (
                        f"{name}/{key} rank {rank}: [{start}, +{numel})"
                    )


def test_reader_names_a_gap_in_the_pieces(tmp_path):
    full = {"w": torch.randn(6, 4)}
    write_universal(tmp_path, full, {"w": SPLITS[1][2]}, 1, fmt=2)
    meta = json.loads((tmp_path / "universal" / "meta.json").read_text())
    meta["pieces"]["w"] = meta["pieces"]["w"][1:]  # the first range is listed nowhere
    (tmp_path / "universal" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"lacks elements \[0, 4\) of w on saved TP rank 0"):
        UniversalReader(tmp_path, 1, 0).read_flat("w", "", 0, 24)


def test_reader_names_a_missing_parameter(tmp_path):
    write_universal(tmp_path, {"w": torch.ones(2, 2)}, {"w": SPLITS[0][2]}, 1)
    with pytest.raises(CheckpointError, match="no parameter other"):
        UniversalReader(tmp_path, 1, 0).split_of("other")


def _cfg(precision: str, stage: int, position: str):
    from harness.multiproc import one_layer_config

    return one_layer_config(
        f"model.position={position}", f"train.precision={precision}", f"parallel.zero_stage={stage}"
    )


def _build(cfg, seed: int):
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize

    torch.manual_seed(seed)
    model = GPT(cfg.model)
    return model, parallelize(model, cfg, grad_accum=1)


def _step(engine, precision: str) -> float:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (2, 33), generator=g)
    positions = torch.arange(32).expand(2, -1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = engine(tokens[:, :-1], positions, tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    return float(loss)


def as_format_1(step_dir) -> None:
    """Rewrite a (one-process) format-2 universal state as the previous release wrote it: one file per TP
    rank with whole TP-local tensors, and a meta.json without format, pieces or counters."""
    full, meta = universal.read_full(step_dir, KEYS)
    udir = step_dir / "universal"
    for path in [*udir.glob("rank*.safetensors"), udir / "index.json"]:  # format 1 had no index
        path.unlink()
    tensors = {
        tensor_key(name, key): v.contiguous() for name, states in full.items() for key, v in states.items()
    }
    save_file(tensors, str(udir / "tp00.safetensors"))
    splits = {name: {k: m[k] for k in ("tp_split", "dim", "stride")} for name, m in meta["params"].items()}
    (udir / "meta.json").write_text(json.dumps({"tp": 1, "step": meta["step"], "params": splits}))


LAYOUTS = [(p, z, f) for p in ("fp32", "bf16") for z in range(4) for f in (2, 1)]


@pytest.mark.parametrize(
    "precision,stage,fmt", LAYOUTS, ids=[f"{p}-zero{z}-format{f}" for p, z, f in LAYOUTS]
)
def test_universal_round_trip_every_precision_and_stage(precision, stage, fmt, world1, tmp_path):
    """Save, load into a fresh engine of another seed: every fp32 master and moment equal, and the next
    steps' losses too (format 2, and format 1 as the previous release wrote it). Adam's and the LR
    schedule's step come from the checkpoint, not from the trainer's step (a dropped non-finite step
    moves only the latter): loading "step 5" of a state that took 3 optimizer steps continues at 3."""
    from goat_dist.engine.masters import layout_of

    cfg = _cfg(precision, stage, "goat")
    model, engine = _build(cfg, seed=0)
    for _ in range(3):
        _step(engine, precision)
    universal.save(engine, model, tmp_path, step=5 if fmt == 2 else 3)
    if fmt == 1:
        as_format_1(tmp_path)
    fresh_model, fresh = _build(cfg, seed=7)
    universal.load(fresh, fresh_model, tmp_path, step=5 if fmt == 2 else 3)
    steps = {float(torch.as_tensor(s["step"])) for s in layout_of(fresh).base.state.values()}
    assert steps == {3.0} and fresh.scheduler.last_epoch == engine.scheduler.last_epoch == 3

    saved, loaded = layout_of(engine), layout_of(fresh)
    saved.prepare()
    loaded.prepare()
    nonzero = fp32_only = 0
    for (name, p), (_, q) in zip(model.named_parameters(), fresh_model.named_parameters()):
        a, b = saved.full(p), loaded.full(q)
        for key in a:
            assert torch.equal(a[key].float(), b[key].float()), f"{name} {key or 'value'}"
        nonzero += int(a["exp_avg_sq"].abs().sum() > 0)
        fp32_only += int(not torch.equal(a[""], a[""].bfloat16().float()))
    assert nonzero == len(list(model.parameters())), "Adam's second moments were not saved"
    # the saved values are fp32 masters: most are not representable in bf16 (a bf16 weight always is)
    assert fp32_only >= len(list(model.parameters())) // 2
    assert [_step(engine, precision) for _ in range(2)] == [_step(fresh, precision) for _ in range(2)]
