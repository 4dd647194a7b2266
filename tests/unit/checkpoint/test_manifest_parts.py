"""The manifest in parts (``goat_dist/checkpoint/manifest.py``): a rank of a resume reads the top manifest and
the part listing its own files, so what it reads of the manifest does not grow with the world; each part is
checked (its sha256, its save) and named when wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from goat_dist.checkpoint import manifest as manifest_file
from goat_dist.checkpoint.digests import listing, read_checked, read_manifest, verify
from goat_dist.checkpoint.errors import CheckpointError
from goat_dist.checkpoint.manager import write_manifest

RUN_FILES = {
    "trainer_state.json": {"bytes": 300, "sha256": "1" * 64},
    "config.yaml": {"bytes": 2000, "sha256": "2" * 64},
    "universal/index.json": {"bytes": 140000, "sha256": "3" * 64},
}


def world_files(world: int) -> dict:
    """The digests a save of ``world`` ranks records: the run files and each rank's two files."""
    files = dict(RUN_FILES)
    for rank in range(world):
        files[f"universal/rank{rank:05d}.safetensors"] = {
            "bytes": 700_000_000 + rank,
            "sha256": f"{rank:064x}",
            "header_sha256": f"{rank + 1:064x}",
        }
        files[f"rng_rank{rank}.pt"] = {"bytes": 1500, "sha256": f"{rank + 2:064x}"}
    return files


def resume_lookups(step_dir: Path, rank: int) -> tuple[list[str], int]:
    """What a resuming rank does with the manifest: read it and look up its run and state files' digests.
    Returns (files opened, bytes read: ``share_reads.IoCount``)."""
    from workers.share_reads import IoCount

    with IoCount(step_dir) as io:
        manifest = read_manifest(step_dir)
        for name in ("trainer_state.json", "universal/index.json", f"rng_rank{rank}.pt"):
            assert manifest["files"][name]["bytes"] > 0
        own = manifest["files"][f"universal/rank{rank:05d}.safetensors"]
        assert own["sha256"] == f"{rank:064x}"
        assert manifest["files"].parts_read() == [manifest_file.part_name(rank // 8)]
    return io.opened, io.bytes


def test_a_rank_reads_the_manifest_of_its_own_files_whatever_the_world(tmp_path):
    """A fake world of 64 and of 512 ranks: each sampled rank opens manifest.json and the one part listing
    its 8 ranks' files, ~3.4 KB read in all at either size, where the single listing of every file that
    earlier releases wrote (and every rank read) is 23 KB at 64 and 185 KB at 512."""
    read: dict[int, list[int]] = {}
    whole: dict[int, int] = {}
    for world in (64, 512):
        step_dir = tmp_path / f"world{world}"
        step_dir.mkdir()
        files = world_files(world)
        write_manifest(step_dir, {"step": 7, "saved_at": 0.0}, files=files)
        whole[world] = len(json.dumps({"files": files, "step": 7, "saved_at": 0.0}, indent=1))
        read[world] = []
        for rank in (0, 9, world // 2 + 3, world - 1):
            opened, size = resume_lookups(step_dir, rank)
            part = manifest_file.part_name(rank // manifest_file.RANKS_PER_PART)
            assert opened == ["manifest.json", part], f"world {world} rank {rank}: {opened}"
            read[world].append(size)
        assert dict(read_manifest(step_dir)["files"]) == files  # nothing lost in the split
    print(f"manifest read per rank: world 64 {read[64]} B, world 512 {read[512]} B; one listing: {whole}")
    assert max(read[512]) <= max(read[64]) + 64  # a few digits longer: no growth with the world
    assert max(read[512]) < 5_000 and whole[512] > 40 * max(read[512])


def test_a_wrong_part_is_named_and_refused(tmp_path):
    """A corrupt part, a missing one and one left by another save are each a CheckpointError naming the
    part and the ranks it lists; the ranks of other parts read on; ``verify`` also finds two parts swapped
    (each intact)."""
    step_dir, other = tmp_path / "a", tmp_path / "b"
    for d in (step_dir, other):
        d.mkdir()
        write_manifest(d, {"step": 7}, files=world_files(32))
    part1 = step_dir / manifest_file.part_name(1)
    text = part1.read_text()
    part1.write_text(text.replace(f"{9:064x}", f"{99:064x}"))
    named = r"digests/ranks_000008\.json \(the digests of ranks 8-15's files\) does not match its sha256"
    with pytest.raises(CheckpointError, match=named):
        read_manifest(step_dir)["files"]["rng_rank9.pt"]
    assert read_manifest(step_dir)["files"]["rng_rank17.pt"]["bytes"] == 1500  # another part: unaffected
    part1.unlink()
    with pytest.raises(CheckpointError, match=r"step 7\): digests/ranks_000008\.json .* is missing"):
        read_manifest(step_dir)["files"]["universal/rank00008.safetensors"]
    shutil.copy(other / manifest_file.part_name(1), part1)  # the same listing, from another save
    with pytest.raises(CheckpointError, match=r"ranks_000008\.json .* belongs to another save"):
        read_manifest(step_dir)["files"]["rng_rank8.pt"]
    shutil.copy(step_dir / manifest_file.part_name(2), part1)  # intact, of this save, in the wrong place
    with pytest.raises(CheckpointError, match=r"digests/ parts are not the ones its manifest\.json records"):
        read_manifest(step_dir)["files"].check_parts()


def test_verify_reads_every_part_and_an_earlier_manifest_is_read_as_it_is(tmp_path):
    """``verify`` checks every file of every part (a corrupt rank file is named); ``listing`` leaves the
    parts out, as it leaves the manifest; a manifest of an earlier release (every file in ``files``) reads
    the same."""
    for rank in range(10):
        (tmp_path / f"rng_rank{rank}.pt").write_bytes(bytes([rank]) * (100 + rank))
    (tmp_path / "trainer_state.json").write_text('{"step": 7}')
    write_manifest(tmp_path, {"step": 7})
    assert sorted(p.name for p in (tmp_path / "digests").iterdir()) == [
        "ranks_000000.json",
        "ranks_000008.json",
    ]
    assert sorted(listing(tmp_path)) == sorted(
        [f"rng_rank{r}.pt" for r in range(10)] + ["trainer_state.json"]
    )
    assert len(verify(tmp_path)["files"]) == 11
    (tmp_path / "rng_rank9.pt").write_bytes(bytes([1]) * 109)
    with pytest.raises(CheckpointError, match=r"rng_rank9\.pt"):
        verify(tmp_path)
    with pytest.raises(CheckpointError, match=r"rng_rank9\.pt does not match its sha256"):
        read_checked(tmp_path, "rng_rank9.pt", read_manifest(tmp_path))
    files = dict(read_manifest(tmp_path)["files"])
    shutil.rmtree(tmp_path / "digests")
    (tmp_path / "manifest.json").write_text(json.dumps({"files": files, "step": 7}))
    earlier = read_manifest(tmp_path)
    assert dict(earlier["files"]) == files and earlier["step"] == 7
    assert read_checked(tmp_path, "rng_rank3.pt", earlier) == bytes([3]) * 103
    with pytest.raises(CheckpointError, match=r"rng_rank10\.pt is not in its manifest\.json"):
        read_checked(tmp_path, "rng_rank10.pt", earlier)


def test_agreeing_at_resume_gathers_nothing_from_the_world_unless_a_rank_failed(tmp_path, monkeypatch):
    """A resume's checks that every rank read the same manifest and found no problem are two small
    all-reduces on a fake rank 3 of 512 (1 and 2 elements), no gather of the world's messages; a problem
    on some rank gathers them, and every rank raises the lowest failing rank's message; a rank that read
    another manifest.json (its fingerprint differs) stops every rank, naming the shared file system."""
    from goat_dist import collectives
    from goat_dist.checkpoint import digests, manager

    (tmp_path / "trainer_state.json").write_text('{"step": 7}')
    files = {**world_files(16), "trainer_state.json": digests.digest(tmp_path / "trainer_state.json")}
    write_manifest(tmp_path, {"step": 7}, files=files)
    another = {"world": 512}  # not the saved layout: no RNG file is read
    calls: list[tuple[str, int]] = []
    failing: list[str] = []

    elsewhere: list[int] = []  # another rank's manifest fingerprint, when it read another file

    def all_reduce(tensor, op="sum", group=None):
        calls.append(("all_reduce", tensor.numel()))
        if tensor.numel() == 1 and failing:
            tensor.fill_(1)
        if tensor.numel() == 2 and elsewhere:  # max(h) and max(-h) over this rank and the other
            tensor[0], tensor[1] = max(int(tensor[0]), elsewhere[0]), max(int(tensor[1]), -elsewhere[0])
        return tensor

    def all_gather_object(obj, group=None):
        calls.append(("all_gather_object", 512))
        return ["", "", *failing, *[""] * (509 - len(failing)), obj]

    monkeypatch.setattr(digests, "_world", lambda: (3, 512))
    monkeypatch.setattr(collectives, "all_reduce", all_reduce)
    monkeypatch.setattr(collectives, "all_gather_object", all_gather_object)
    monkeypatch.setattr(manager.universal, "require_state", lambda *a, **k: None)
    manifest, state, _ = manager.read_run_files(tmp_path, 3, layout=another)
    assert state == {"step": 7} and manifest["step"] == 7
    assert calls == [("all_reduce", 1), ("all_reduce", 2)]  # no rank receives the world's messages
    calls.clear()
    failing.append("checkpoint x: rng_rank2.pt is missing")
    with pytest.raises(CheckpointError, match=r"rng_rank2\.pt is missing \(found on rank 2\)"):
        manager.read_run_files(tmp_path, 3, layout=another)
    assert calls == [("all_reduce", 1), ("all_gather_object", 512)]
    failing.clear()
    elsewhere.append(int(read_manifest(tmp_path).fingerprint[:15], 16) + 1)
    with pytest.raises(CheckpointError, match=r"the ranks read different manifest\.json files"):
        manager.read_run_files(tmp_path, 3, layout=another)
