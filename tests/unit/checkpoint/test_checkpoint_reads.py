"""Reading a universal state by its share: block checksums, the compact index, one open per file.

* ``tensor_file``: ranges of a checksummed file read back exactly; a flipped byte, a truncated file or a
  rewritten header is a CheckpointError naming the file; a file without checksums (an earlier release's)
  is checked whole against the manifest when opened.
* ``index.index_record``: ZeRO-3's pieces become one ``even`` rule per parameter, the replicated
  layouts' one ``share`` rule, ZeRO-1/2's one ``flat`` rule, irregular ones a list; ``index.agree``
  finds the same rules with all-reduces, no list gathered, and no ``meta.json`` (every piece
  listed, O(parameters x ranks)) is written; the reader finds every element through the index, for
  TP 1/2/4 -> 1/2/4 and any range.
* A corrupt file stops only the ranks that read it, and is named; a rank reading other files does not
  open it. A format-2 checkpoint of the previous release is read through meta.json, each file it opens
  checked whole against the manifest.
* ``ckpt export`` streams: every state file opened once, the merged tensors written one at a time.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from goat_dist.checkpoint import tensor_file, universal
from goat_dist.checkpoint.digests import digest, listing, read_manifest
from goat_dist.checkpoint.errors import CheckpointError
from goat_dist.checkpoint.manager import write_manifest
from goat_dist.checkpoint.slices import UniversalReader
from goat_dist.checkpoint.tensor_file import TensorFile
from goat_dist.engine.masters import KEYS

SPLITS = {
    "w0": ([24, 6], {"tp_split": True, "dim": 0, "stride": 1}),
    "w1": ([6, 16], {"tp_split": True, "dim": 1, "stride": 1}),
    "fc1": ([32, 3], {"tp_split": True, "dim": 0, "stride": 2}),
    "norm": ([8], {"tp_split": False, "dim": 0, "stride": 1}),
    "big": ([4096, 3], {"tp_split": True, "dim": 0, "stride": 1}),  # several checksum blocks per piece
}


def full_value(name: str, key: str) -> torch.Tensor:
    """A whole (TP=1) tensor whose every element is distinct and recomputable."""
    shape = SPLITS[name][0]
    base = list(SPLITS).index(name) * 1000 + KEYS.index(key) * 100
    return (torch.arange(math.prod(shape), dtype=torch.float64) * 1e-3 + base).float().reshape(shape)


def local_value(name: str, key: str, tp: int, rank: int) -> torch.Tensor:
    shape, meta = SPLITS[name]
    return universal.split(full_value(name, key), meta, tp, rank).contiguous()


def even(numel: int, count: int, i: int) -> tuple[int, int]:
    size = -(-numel // count)
    lo = min(numel, i * size)
    return lo, min(numel, lo + size) - lo


def ragged(numel: int, count: int, i: int) -> tuple[int, int]:
    """Uneven cuts inside rows, replica 1 empty (as ZeRO-1/2 flat groups cut parameters)."""
    fifth = numel // 5
    cuts = [0, fifth, fifth] + [fifth + (numel - fifth) * j // (count - 1) for j in range(2, count)] + [numel]
    return cuts[i], cuts[i + 1] - cuts[i]


def flat_group(sizes: dict[str, int], count: int, i: int) -> dict[str, tuple[int, int]]:
    """{name: (start, numel)} of replica ``i``'s partition of one ZeRO-1/2 flat group: the parameters of
    ``sizes`` flattened in order and cut into ``count`` equal partitions (the last short)."""
    part = -(-sum(sizes.values()) // count)
    out, offset = {}, 0
    for name, n in sizes.items():
        a, z = max(offset, i * part), min(offset + n, (i + 1) * part)
        out[name] = (a - offset, max(z - a, 0))
        offset += n
    return out


def write_checkpoint(step_dir, tp: int, dp: int, cut=even, step: int = 3) -> dict:
    """The universal state of a TP x DP world written by the real writer (each rank its pieces, rank 0 the
    index), with a manifest holding each file's digests as the save records them."""
    udir = step_dir / "universal"
    udir.mkdir(parents=True)
    params = {
        name: {**meta, "shape": list(local_value(name, "", tp, 0).shape)}
        for name, (_, meta) in SPLITS.items()
    }
    gathered, known = [], {}
    for rank in range(tp * dp):
        t, i = rank % tp, rank // tp
        pieces = []
        sizes = {name: math.prod(params[name]["shape"]) for name in SPLITS}
        for name in SPLITS:
            n = sizes[name]
            start, numel = flat_group(sizes, dp, i)[name] if cut is flat_group else cut(n, dp, i)
            if numel > 0:
                dest = {k: local_value(name, k, tp, t).reshape(-1)[start : start + numel] for k in KEYS}
                pieces.append((name, start, numel, dest))
        path = udir / universal.file_name(rank)
        known[f"universal/{path.name}"] = universal.write_share(path, pieces, rank, step)
        gathered.append({"file": path.name, "tp": t, "replica": i, "pieces": [p[:3] for p in pieces]})
    universal.write_index(udir, params, gathered, tp, {"step": step, "adam_step": step})
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": step}))
    files = {name: digest(step_dir / name) for name in listing(step_dir)}
    write_manifest(step_dir, {"step": step}, files={**files, **known})
    return read_manifest(step_dir)


# ---- tensor_file ---------------------------------------------------------------------------------------
def test_checksummed_ranges_read_back_and_damage_is_named(tmp_path):
    values = {"a": torch.randn(5000), "b": torch.randn(7, 3), "c": torch.randn(0)}
    entries = [tensor_file.Entry(k, torch.float32, list(v.shape), lambda v=v: v) for k, v in values.items()]
    path = tmp_path / "f.safetensors"
    written = tensor_file.write(path, entries, {"x": "1"}, checksums=True)
    from safetensors.torch import load_file

    assert torch.equal(load_file(path)["a"], values["a"])  # still a safetensors file
    with TensorFile(path, expect=written) as f:
        assert f.checksums == (tensor_file.BLOCK_MIN, tensor_file.BLOCKS_MAX)
        for lo, hi in ((0, 5000), (1, 2), (1023, 1025), (4999, 5000), (3000, 3000)):
            assert torch.equal(f.read("a", lo, hi), values["a"][lo:hi])
        assert torch.equal(f.read_whole("b"), values["b"]) and f.read("c").numel() == 0
        with pytest.raises(CheckpointError, match=r"f.safetensors has no elements \[4, 30\) of 'b'"):
            f.read("b", 4, 30)
    data = bytearray(path.read_bytes())
    head = 8 + int.from_bytes(data[:8], "little")
    data[head + 4 * 2500] ^= 1  # an element of a's block 2500 // block
    path.write_bytes(bytes(data))
    block = tensor_file.block_size(5000)
    with TensorFile(path, "universal/f.safetensors", "checkpoint X (step 3): ", written) as f:
        intact = 2500 // block * block
        assert torch.equal(f.read("a", 0, intact), values["a"][:intact])  # the intact blocks still read
        with pytest.raises(CheckpointError, match=rf"checkpoint X \(step 3\): universal/f.safetensors does "
                           rf"not match its checksums: block {2500 // block} of 'a'"):  # fmt: skip
            f.read("a", 2499, 2501)
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match=r"f.safetensors has \d+ bytes, expected \d+ \(truncated\?\)"):
        TensorFile(path, expect=written)
    with pytest.raises(CheckpointError, match=r"f.safetensors is shorter than its header says.*truncated"):
        TensorFile(path)  # without a manifest: the header's offsets no longer fit the file
    rewritten = tensor_file.header(entries[:1], {"y": "2"})
    path.write_bytes(rewritten + bytes(4 * 5000))
    with pytest.raises(CheckpointError, match="does not match its sha256 .its header"):
        TensorFile(path, expect={"header_sha256": written["header_sha256"]})
    with pytest.raises(CheckpointError, match=r"nowhere.safetensors is missing"):
        TensorFile(tmp_path / "nowhere.safetensors")


def test_a_file_without_checksums_is_checked_whole_when_opened(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "tp00.safetensors"
    save_file({"w": torch.arange(10.0)}, str(path))
    record = digest(path)
    with TensorFile(path, expect=record) as f:
        assert f.checksums is None and torch.equal(f.read("w", 2, 5), torch.arange(2.0, 5.0))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tp00.safetensors does not match its sha256"):
        TensorFile(path, expect=record)


# ---- the index -----------------------------------------------------------------------------------------
def test_the_index_is_a_rule_per_parameter_where_one_fits(tmp_path):
    write_checkpoint(tmp_path / "zero3", tp=2, dp=8)
    index = json.loads((tmp_path / "zero3" / "universal" / "index.json").read_text())
    assert index["replicas"] == 8 and index["grid"] == {"tp_inner": True} and "files" not in index
    with UniversalReader(tmp_path / "zero3", 2, 1) as reader:  # the rules: rank 7 is t1, i3; its file
        assert reader.grid[1][3] == 7 and reader.paths[7] == "universal/rank00007.safetensors"
    assert all(isinstance(rule, dict) and "even" in rule for rule in index["pieces"].values())
    assert sorted(p.name for p in (tmp_path / "zero3" / "universal").glob("*.json")) == ["index.json"]
    write_checkpoint(tmp_path / "share", tp=1, dp=3, cut=lambda n, c, i: universal._share(0, n, i, c))
    index = json.loads((tmp_path / "share" / "universal" / "index.json").read_text())
    assert index["pieces"]["norm"] == {"share": 3}  # 8 elements: 2, 3, 3 (the others split evenly too)
    assert all(isinstance(rule, dict) for rule in index["pieces"].values())
    write_checkpoint(tmp_path / "ragged", tp=1, dp=4, cut=ragged)
    index = json.loads((tmp_path / "ragged" / "universal" / "index.json").read_text())
    assert all(isinstance(rule, list) for rule in index["pieces"].values())
    write_checkpoint(tmp_path / "flat", tp=2, dp=5, cut=flat_group)  # ZeRO-1/2: a run of replicas each
    index = json.loads((tmp_path / "flat" / "universal" / "index.json").read_text())
    assert all(isinstance(rule, dict) for rule in index["pieces"].values())  # none listed: O(parameters)
    assert index["pieces"]["big"] == {"flat": [0, 1088, 1264]}  # replica 0 holds 1,088 of it, 1-4 1,264


def _pieces_of(tp: int, dp: int, cut) -> tuple[dict, list[list[tuple[str, int, int]]]]:
    """The parameters' meta at TP=``tp`` and every rank's (name, start, numel), as ``write_checkpoint``
    cuts them (rank ``i * tp + t``)."""
    params = {
        name: {**meta, "shape": list(local_value(name, "", tp, 0).shape)}
        for name, (_, meta) in SPLITS.items()
    }
    sizes = {name: math.prod(params[name]["shape"]) for name in SPLITS}
    held = []
    for rank in range(tp * dp):
        i = rank // tp
        cuts = flat_group(sizes, dp, i) if cut is flat_group else {n: cut(sizes[n], dp, i) for n in SPLITS}
        held.append([(n, s, c) for n, (s, c) in cuts.items() if c > 0])
    return params, held


def _agree_in_threads(params: dict, held: list, tp: int, misplaced: int | None = None) -> list:
    """Every rank's ``index.agree``, the ranks played as threads, the all-reduces done among them."""
    from goat_dist.checkpoint import index

    world, slots, out = len(held), [None] * len(held), [None] * len(held)
    barrier = threading.Barrier(world)

    def rank_body(rank: int) -> None:
        def reduce(tensor, op):
            slots[rank] = tensor.clone()
            barrier.wait()
            stacked = torch.stack(slots)
            done = stacked.max(0).values if op == "max" else stacked.min(0).values
            barrier.wait()
            tensor.copy_(done)

        out[rank] = index.agree(params, held[rank], rank // tp, world // tp, rank != misplaced, reduce)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize(
    "tp,dp,cut",
    [(2, 5, even), (1, 4, even), (2, 3, flat_group), (1, 7, flat_group), (2, 3, "share"), (1, 4, ragged)],
    ids=["zero3-tp2", "zero3", "zero1-tp2", "zero1", "replicated", "ragged"],
)
def test_the_ranks_agree_on_the_rules_without_gathering_their_pieces(tp, dp, cut):
    """``index.agree`` (a save's three all-reduces, ranks played as threads) gives every rank the rules
    rank 0 would fit from every rank's gathered list, so the index written is the same, byte for byte;
    where some parameter has no rule (ragged cuts) or a rank is not where ``tp_inner`` puts it, every rank
    gets None and the save gathers the lists."""
    from goat_dist.checkpoint import index

    cut = (lambda n, c, i: universal._share(0, n, i, c)) if cut == "share" else cut
    params, held = _pieces_of(tp, dp, cut)
    gathered = [{"file": universal.file_name(r), "tp": r % tp, "replica": r // tp, "pieces": p}
                for r, p in enumerate(held)]  # fmt: skip
    fitted = index.index_record(params, gathered, tp, {"step": 3})
    agreed = _agree_in_threads(params, held, tp)
    assert all(a == agreed[0] for a in agreed)  # the same on every rank
    if cut is ragged:
        assert agreed[0] is None and all(isinstance(rule, list) for rule in fitted["pieces"].values())
    else:
        assert agreed[0] is not None
        record = index.rules_record(params, agreed[0], tp, dp, {"step": 3})
        assert json.dumps(record, sort_keys=True) == json.dumps(fitted, sort_keys=True)
        assert _agree_in_threads(params, held, tp, misplaced=tp * dp - 1) == [None] * (tp * dp)


@pytest.mark.parametrize("cut", [even, ragged, flat_group], ids=["zero3", "ragged", "zero1"])
@pytest.mark.parametrize("saved_tp", [1, 2, 4])
@pytest.mark.parametrize("new_tp", [1, 2, 4])
def test_the_index_finds_every_range_on_any_layout(saved_tp, new_tp, cut, tmp_path):
    manifest = write_checkpoint(tmp_path, saved_tp, dp=3, cut=cut)
    for rank in range(new_tp):
        with UniversalReader(tmp_path, new_tp, rank, manifest) as reader:
            assert reader.index_name == "universal/index.json"
            for name in SPLITS:
                for key in KEYS:
                    flat = local_value(name, key, new_tp, rank).reshape(-1)
                    n = flat.numel()
                    assert torch.equal(reader.read_local(name, key).reshape(-1), flat), (name, key)
                    for start, numel in ((1, n - 2), (n // 3, n // 3 + 1), (n - 1, 1)):
                        got = reader.read_flat(name, key, start, numel)
                        assert torch.equal(got, flat[start : start + numel]), (name, key, start)
            opened = sorted(reader._files)
        assert len(opened) == len(set(opened))


def test_a_corrupt_file_stops_only_its_readers_and_is_named(tmp_path):
    manifest = write_checkpoint(tmp_path, tp=1, dp=4)
    path = tmp_path / "universal" / "rank00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-4 * 50] ^= 0xFF  # inside rank 2's last tensor (before the checksum table)
    path.write_bytes(bytes(data))
    with UniversalReader(tmp_path, 1, 0, manifest) as reader:
        n = math.prod(SPLITS["big"][0])
        size = -(-n // 4)
        assert torch.equal(reader.read_flat("big", "", 0, size), full_value("big", "").reshape(-1)[:size])
        assert "universal/rank00002.safetensors" not in reader._files
        with pytest.raises(CheckpointError, match=r"\(step 3\): universal/rank00002.safetensors does not "
                           r"match its checksums"):  # fmt: skip
            reader.read_local("big", "exp_avg_sq")
    path.unlink()
    with UniversalReader(tmp_path, 1, 0, manifest) as reader:
        with pytest.raises(CheckpointError, match=r"universal/rank00002.safetensors is missing"):
            reader.read_local("norm")


def test_a_format_2_index_listing_files_grid_and_pieces_reads_the_same(tmp_path):
    """The index of the release before (format 2: file names, grid and ZeRO-1/2's pieces listed, each
    piece as ``[TP rank, start, numel, file]``) reads every range as format 3's rules do: the ``flat``
    rule expanded (``index.flat_spans``) is exactly the pieces the ranks wrote."""
    from goat_dist.checkpoint.index import flat_spans

    manifest = write_checkpoint(tmp_path, tp=2, dp=5, cut=flat_group)
    path = tmp_path / "universal" / "index.json"
    index = json.loads(path.read_text())
    assert index["format"] == 3 and any("flat" in rule for rule in index["pieces"].values())
    tp, replicas = index["tp"], index["replicas"]
    index["files"] = [universal.file_name(r) for r in range(index.pop("world"))]
    index["grid"] = [[i * tp + t for i in range(replicas)] for t in range(tp)]
    for name, rule in index["pieces"].items():
        if "flat" in rule:
            n = math.prod(index["params"][name]["shape"])
            spans = flat_spans(rule["flat"], n).items()
            index["pieces"][name] = [[t, a, k, i * tp + t] for t in range(tp) for i, (a, k) in spans if k]
    index["format"] = 2
    path.write_text(json.dumps(index))
    write_manifest(
        tmp_path, {"step": 3}, files={**dict(manifest["files"]), "universal/index.json": digest(path)}
    )
    for new_tp in (1, 2):
        for rank in range(new_tp):
            with UniversalReader(tmp_path, new_tp, rank, read_manifest(tmp_path)) as reader:
                assert reader.format == 2 and isinstance(reader.grid, list)
                for name in SPLITS:
                    for key in KEYS:
                        flat = local_value(name, key, new_tp, rank).reshape(-1)
                        assert torch.equal(reader.read_local(name, key).reshape(-1), flat), (name, key)
                        n = flat.numel()
                        got = reader.read_flat(name, key, n // 3, n // 3 + 1)
                        assert torch.equal(got, flat[n // 3 : 2 * (n // 3) + 1]), (name, key)


def test_an_earlier_format_2_checkpoint_is_read_through_meta_json_and_checked_whole(tmp_path):
    """A format-2 checkpoint of the previous release (meta.json only, no block checksums, no header digests
    in its manifest) reads the same elements; each file a rank opens is checked whole against the
    manifest's sha256, once, and a corrupt one is named only by the ranks that open it."""
    from safetensors.torch import save_file

    udir = tmp_path / "universal"
    udir.mkdir()
    files, pieces = [], {name: [] for name in SPLITS}
    for i in range(2):
        tensors = {}
        for name in SPLITS:
            n = math.prod(SPLITS[name][0])
            start, numel = even(n, 2, i)
            for key in KEYS:
                tensors[f"{name}::{key}" if key else name] = full_value(name, key).reshape(-1)[
                    start : start + numel
                ]
            pieces[name].append([0, start, numel, i])
        files.append(f"rank{i:05d}.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(udir / files[-1]))
    params = {name: {**meta, "shape": shape} for name, (shape, meta) in SPLITS.items()}
    meta = {"format": 2, "tp": 1, "step": 3, "params": params, "files": files, "pieces": pieces}
    (udir / "meta.json").write_text(json.dumps(meta))
    write_manifest(tmp_path, {"step": 3})
    manifest = read_manifest(tmp_path)
    assert "header_sha256" not in manifest["files"]["universal/rank00000.safetensors"]
    with UniversalReader(tmp_path, 1, 0, manifest) as reader:
        assert reader.index_name == "universal/meta.json"
        for name in SPLITS:
            assert torch.equal(reader.read_local(name, "exp_avg"), full_value(name, "exp_avg"))
    data = bytearray((udir / files[1]).read_bytes())
    data[-1] ^= 1
    (udir / files[1]).write_bytes(bytes(data))
    with UniversalReader(tmp_path, 1, 0, manifest) as reader:
        first = even(math.prod(SPLITS["big"][0]), 2, 0)[1]
        assert torch.equal(reader.read_flat("big", "", 0, first), full_value("big", "").reshape(-1)[:first])
        with pytest.raises(CheckpointError, match=r"\(step 3\): universal/rank00001.safetensors does not "
                           r"match its sha256"):  # fmt: skip
            reader.read_flat("big", "", first, 1)


def test_export_streams_each_file_opened_once(tmp_path):
    """``ckpt export`` of a TP=2 x DP=3 state: every tensor merged whole, every state file opened once
    (all its tensors read through the one handle) and nothing else of the state read but the index."""
    from safetensors.torch import load_file
    from workers.share_reads import IoCount

    from goat_dist.checkpoint.export import export

    step_dir = tmp_path / "step_00000003"
    manifest = write_checkpoint(step_dir, tp=2, dp=3)
    (step_dir / "config.yaml").write_text("model: {}\n")
    write_manifest(
        step_dir, {"step": 3}, files={**manifest["files"], "config.yaml": digest(step_dir / "config.yaml")}
    )
    with IoCount(step_dir) as io:
        out = export(step_dir, tmp_path / "out")
    state = sorted(p for p in io.opened if p.startswith("universal/"))
    assert state == ["universal/index.json"] + [f"universal/rank{r:05d}.safetensors" for r in range(6)], state
    checkpoint_files = {name for name in io.stats if (step_dir / name).is_file()}  # not the paths it tried
    assert checkpoint_files <= set(io.opened), io.stats
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == set(SPLITS) and all(torch.equal(exported[n], full_value(n, "")) for n in SPLITS)
