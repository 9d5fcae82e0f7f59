"""The store measures both ways of writing on the checkpoint's file system, uses the faster, re-checks
now and then, and records the choice and the rates in the trail; ``direct_io=True``/``False``
forces a way, and a file system that refuses ``O_DIRECT`` gets the page cache (issue 35)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer, read_events
from trainfsm import CheckpointingHook
from trainfsm.checkpoint import io, recycling, writemode
from trainfsm.checkpoint.store import CheckpointStore


@pytest.fixture(autouse=True)
def unmeasured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without the process's shared probe."""
    monkeypatch.setattr(writemode, "_probed", {})


NO_SAVES = {"page_cache": None, "o_direct": None}


def train(workspace: Path, steps: int = 4, **hook: Any) -> list[dict[str, Any]]:
    TinyTrainer(max_steps=steps, workspace=workspace, hooks=[CheckpointingHook(interval=2, **hook)]).train()
    return read_events(workspace)


def named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


def o_direct_works(directory: Path) -> bool:
    fd, direct = io.open_for_writing(directory / "probe", True)
    os.close(fd)
    (directory / "probe").unlink()
    return direct


def fake_rates(monkeypatch: pytest.MonkeyPatch, *rates: dict[str, float | None]) -> list[Path]:
    """``measure`` returns ``rates`` one after the other (the last one from then on); the roots it was asked about."""
    asked: list[Path] = []

    def measure(root: Path, *_: Any) -> dict[str, float | None]:
        asked.append(root)
        return rates[min(len(asked), len(rates)) - 1]

    monkeypatch.setattr(writemode, "measure", measure)
    return asked


def test_restore_measures_both_ways_and_the_trail_says_which_it_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ways: list[tuple[bool, int]] = []
    probe = writemode._probe

    def spy(
        path: Path, io_: Any, staging: Any, direct: bool, data: bytes, *times: int, over: bool = False
    ) -> tuple[float, bool]:
        ways.append((direct, len(data) * (times[0] if times else writemode.PROBE_BYTES // len(data)), over))
        return probe(path, io_, staging, direct, data, *times, over=over)

    monkeypatch.setattr(writemode, "_probe", spy)
    events = train(tmp_path)
    # Measured by the store's own writer: each way's file, then each way twice over its file (as
    # saves write over recycled files), alternating so that drift favours neither.
    size = writemode.PROBE_BYTES
    firsts = [(True, size, False), (False, size, False)]
    assert ways == [*firsts, (False, size, True), (True, size, True), (True, size, True), (False, size, True)]
    (ready,) = named(events, "checkpoint_store_ready")
    assert ready["state"] == "RESTORE" and ready["rates"]["saves"] == NO_SAVES
    rates = ready["rates"]["probe"]
    if o_direct_works(tmp_path):
        assert ready["chosen_by"] == "measurement" and rates["page_cache"] > 0 and rates["o_direct"] > 0
        assert ready["direct_io"] == (rates["o_direct"] > rates["page_cache"])
    else:
        assert ready["chosen_by"] == "O_DIRECT refused" and rates["o_direct"] is None and not ready["direct_io"]
    saved = named(events, "checkpoint_saved")
    # Saves of a few bytes say nothing of a way's rate (fixed costs): the probe's choice stands.
    assert [(e["direct_io"], e["chosen_by"], e["rates"]) for e in saved] == [
        (ready["direct_io"], ready["chosen_by"], ready["rates"])
    ] * 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "latest"]  # no probe file left


@pytest.mark.parametrize(
    ("rates", "direct"),
    [
        ({"page_cache": 1.0, "o_direct": 1.2}, True),
        ({"page_cache": 2.0, "o_direct": 1.2}, False),
    ],
    ids=["o-direct-faster", "page-cache-faster"],
)
def test_the_store_writes_the_way_measured_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rates: dict[str, float], direct: bool
) -> None:
    if not o_direct_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    asked = fake_rates(monkeypatch, rates)
    events = train(tmp_path)
    assert asked == [tmp_path / "checkpoints"]  # the checkpoint's own file system
    (ready,) = named(events, "checkpoint_store_ready")
    expected = (direct, "measurement", {"probe": rates, "saves": NO_SAVES})
    assert (ready["direct_io"], ready["chosen_by"], ready["rates"]) == expected
    assert [e["direct_io"] for e in named(events, "checkpoint_saved")] == [direct] * 2


def test_each_size_of_file_has_its_own_saves_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Back to back, the page cache took 200 MB files at the floor's pace and 1 GB ones with a long tail.
    mode = writemode.WriteMode("CheckpointStore", "auto")
    mode._probe = {"page_cache": 3.0, "o_direct": 1.5}
    mode.choice = writemode.Choice(False, "measurement")
    mb, gb = 200 << 20, 1 << 30
    assert (mode.for_file(mb).direct, mode.for_file(gb).direct) == (False, False)  # 3.0 against 1.5
    mode.after_write(False, mb, mb / 2.5e9)  # 2.5 GB/s through the page cache at 200 MB
    for _ in range(writemode.TRY_AFTER):  # 1.0 GB/s with O_DIRECT at 1 GB: below the page cache's probe
        mode.after_write(True, gb, gb / 1.0e9)
    at_200, at_1g = mode.for_file(mb), mode.for_file(gb)
    assert (at_200.direct, at_200.chosen_by) == (False, "saves")
    assert at_200.rates is not None and at_200.rates["saves"] == {"page_cache": 2.5, "o_direct": None}
    assert (at_1g.direct, at_1g.chosen_by) == (False, "trying the other way")
    assert at_1g.rates is not None and at_1g.rates["saves"] == {"page_cache": None, "o_direct": 1.0}
    mode.after_write(False, gb, gb / 0.5e9)  # the page cache's 1 GB file: 0.5 GB/s
    assert (mode.for_file(gb).direct, mode.for_file(gb).chosen_by) == (True, "saves")
    assert (mode.for_file(mb).direct, mode.for_file(mb).chosen_by) == (False, "saves")  # untouched at 200 MB


@pytest.mark.parametrize("forced", [True, False])
def test_a_forced_way_is_honoured_and_nothing_is_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forced: bool
) -> None:
    asked = fake_rates(monkeypatch, {"page_cache": 1.0, "o_direct": 1.0, "page_cache" if forced else "o_direct": 9.0})
    events = train(tmp_path, direct_io=forced)
    assert asked == []
    direct = forced and o_direct_works(tmp_path)
    chosen_by = f"direct_io={forced}" if direct == forced else "O_DIRECT refused"
    (ready,) = named(events, "checkpoint_store_ready")
    assert (ready["direct_io"], ready["chosen_by"], ready["rates"]) == (direct, chosen_by, None)
    assert [(e["direct_io"], e["chosen_by"]) for e in named(events, "checkpoint_saved")] == [(direct, chosen_by)] * 2


@pytest.fixture
def o_direct_refused(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A file system that refuses O_DIRECT at open(), as tmpfs does."""
    opener = os.open
    flag = getattr(os, "O_DIRECT", 0)

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flag and flags & flag:
            raise OSError(errno.EINVAL, "Invalid argument")
        return opener(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    yield


@pytest.mark.parametrize("setting", ["auto", True])
@pytest.mark.usefixtures("o_direct_refused")
def test_where_o_direct_is_refused_the_files_go_through_the_page_cache(tmp_path: Path, setting: Any) -> None:
    events = train(tmp_path, direct_io=setting)
    (ready,) = named(events, "checkpoint_store_ready")
    assert (ready["direct_io"], ready["chosen_by"]) == (False, "O_DIRECT refused")
    if setting == "auto":
        assert ready["rates"]["probe"]["o_direct"] is None and ready["rates"]["probe"]["page_cache"] > 0
    assert [e["direct_io"] for e in named(events, "checkpoint_saved")] == [False, False]
    resumed = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[CheckpointingHook(interval=2, direct_io=setting)])
    resumed.train()
    assert resumed.attempt == 1 and named(read_events(tmp_path), "checkpoint_loaded")[-1]["from_step"] == 4


def test_o_direct_refused_at_the_first_write_counts_as_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Some file systems take O_DIRECT at open() and refuse it at write() with EINVAL.
    import fcntl

    if not o_direct_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    pwrite = os.pwrite

    def picky(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", picky)
    store = CheckpointStore(tmp_path / "checkpoints")
    store.prepare()
    assert store.mode is not None and (store.mode.direct, store.mode.chosen_by) == (False, "O_DIRECT refused")
    assert store.mode.rates is not None and store.mode.rates["probe"]["o_direct"] is None
    store.close()


def test_the_probe_is_rechecked_after_a_save_once_it_is_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = {"page_cache": 1.0, "o_direct": 2.0}
    within_noise = {"page_cache": 2.1, "o_direct": 2.0}  # faster, but not by SWITCH_MARGIN: no switch
    turned = {"page_cache": 3.0, "o_direct": 1.0}
    asked = fake_rates(monkeypatch, first, within_noise, turned)
    store = CheckpointStore(tmp_path / "checkpoints", direct_io=False)
    store._mode = writemode.WriteMode("CheckpointStore", "auto")  # the default, with the rates above
    store.prepare()
    state = {"w": torch.zeros(3)}
    seen = []
    monkeypatch.setattr(writemode, "RECHECK_SECONDS", 0.0)
    for step in range(1, 5):
        store.save(step, {"model": state}, keep=False)
        seen.append((store.wrote_directly, store.written_with and store.written_with.rates["probe"]))
        store._mode.close()  # wait for the re-check the save started (in a run, the next save waits for it)
    store.close()
    assert len(asked) == 5  # RESTORE's probe, then one after each save
    assert seen == [(True, first), (True, within_noise), (False, turned), (False, turned)]


def test_without_a_recheck_due_a_save_measures_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_rates(monkeypatch, {"page_cache": 1.0, "o_direct": 2.0})
    store = CheckpointStore(tmp_path / "a")
    for step in range(3):
        store.save(step, {"model": {"w": torch.zeros(3)}}, keep=False)
    store.close()
    # A second store on the same file system uses the same fresh measurement.
    CheckpointStore(tmp_path / "b").prepare()
    assert asked == [tmp_path / "a"]


def test_a_rank_listing_while_rank_0_removes_its_measurement_root_finds_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 makes the checkpoint root to measure the disk in RESTORE and removes it again while it
    is empty; another rank lists it at the same time (restore's ``candidates()``, on every rank).
    Seen in a fresh four-rank launch: FileNotFoundError on rank 1, and the launch failed."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    listing = Path.iterdir

    def removed_meanwhile(self: Path) -> Iterator[Path]:
        if self == root:
            root.rmdir()  # rank 0's prepare(), between the listing rank's look and its listing
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", removed_meanwhile)
    assert CheckpointStore(root).checkpoints() == []


def test_measure_writes_through_the_stores_writer_and_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, direct_io=False)
    store.prepare()
    assert store._io is not None and store._staging is not None
    rates = writemode.measure(tmp_path, store._io, store._staging)
    store.close()
    assert rates["page_cache"] is not None and rates["page_cache"] > 0
    assert (rates["o_direct"] is not None) == o_direct_works(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_saves_decide_once_they_are_measured_and_the_other_way_is_tried_when_its_probe_is_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A probe's small files flattered the page cache (as a host's write cache may); the saves tell.
    fake_rates(monkeypatch, {"page_cache": 3.0, "o_direct": 1.5})
    mode = writemode.WriteMode("CheckpointStore", "auto")
    store = CheckpointStore(tmp_path, direct_io=False)
    store.prepare()
    assert store._io is not None and store._staging is not None
    choice = mode.choose(tmp_path, store._io, store._staging)
    store.close()
    seen = [(choice.direct, choice.chosen_by)]
    gb = 10**9
    for direct, seconds in [(False, 1.25), (False, 1.25), (True, 0.5), (True, 0.55), (True, 0.52)]:
        # 0.8, 0.8, 2.0, 1.8, 1.9 GB/s
        mode.after_write(direct, gb, seconds)
        choice = mode.for_file(gb)
        seen.append((choice.direct, choice.chosen_by))
    assert seen == [
        (False, "measurement"),  # the probe: page cache 3.0 GB/s, O_DIRECT 1.5
        (False, "saves"),  # one slow file (it may be the host's, once) tries nothing: TRY_AFTER
        (True, "trying the other way"),  # two saves through the page cache: 0.8 GB/s, O_DIRECT's probe 1.5 (TRY_MARGIN)
        (True, "saves"),  # O_DIRECT saved 2.0 GB/s: faster than the page cache's saves
        (True, "saves"),
        (True, "saves"),
    ]
    # A way's rate from its saves is their bytes over their seconds: 3 GB in 1.57 s.
    assert mode.for_file(gb).rates == {
        "probe": {"page_cache": 3.0, "o_direct": 1.5},
        "saves": {"page_cache": 0.8, "o_direct": 1.911},
    }
    mode.after_write(True, gb, 0.25)  # O_DIRECT: 4 GB in 1.82 s
    mode.after_write(False, gb, 0.5)  # the page cache: 3 GB in 3.0 s, not faster
    choice = mode.for_file(gb)
    assert (choice.direct, choice.chosen_by) == (True, "saves")
    # Files too small to say anything of a way's rate (fixed costs) change nothing.
    mode.after_write(False, writemode.RATED_BYTES - 1, 1.0)
    choice = mode.for_file(gb)
    assert choice.rates is not None and choice.rates["saves"] == {"page_cache": 1.0, "o_direct": 2.198}
    # Saves RECHECK_SECONDS old no longer count: the probe decides again (the way in use keeps its
    # place unless the other probed faster by SWITCH_MARGIN), and the saves after it tell again.
    monkeypatch.setattr(writemode, "RECHECK_SECONDS", 0.0)
    mode.after_write(True, gb, 0.25)
    choice = mode.for_file(gb)
    assert (choice.direct, choice.chosen_by, choice.rates["saves"]) == (False, "measurement", NO_SAVES)


def test_the_trail_shows_a_save_trying_the_other_way_and_the_saves_deciding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not o_direct_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    fake_rates(monkeypatch, {"page_cache": 20_000.0, "o_direct": 9_000.0})  # no real save is that fast
    monkeypatch.setattr(writemode, "RATED_BYTES", 1)  # the tiny trainer's saves count
    monkeypatch.setattr(recycling, "RECYCLED_BYTES", 1)  # and are written over kept files
    saved = named(train(tmp_path, steps=16), "checkpoint_saved")
    ways = [(e["direct_io"], e["chosen_by"]) for e in saved]
    tried = ways.index((True, "trying the other way"))
    # Through the page cache, as measured, until TRY_AFTER of its files counted (written over kept ones).
    assert ways[0] == (False, "measurement") and all(not direct for direct, _ in ways[:tried])
    assert tried >= writemode.TRY_AFTER
    # Once a file of each way was written over a kept one (a try into a new file does not count,
    # so the way is tried again), the saves decide.
    assert saved[-1]["chosen_by"] == "saves"
    assert all(rate is not None and rate > 0 for rate in saved[-1]["rates"]["saves"].values())


def test_only_files_written_over_a_kept_file_count_as_their_ways_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new file's blocks and fresh pages are found once (200 MB through the page cache after a
    # pause: 0.63 s into fresh pages, 0.08 s over kept ones); counting it would leave the way.
    fake_rates(monkeypatch, {"page_cache": 3.0, "o_direct": 1.5})
    store = CheckpointStore(tmp_path)
    big = {"model": {"w": torch.zeros(writemode.RATED_BYTES // 4 + 1024)}}
    rated = []  # whether each save was decided with a page cache save's rate
    for step in (1, 2, 3, 4):
        store.save(step, big, keep=False)
        store.prune(keep_previous=0)
        assert store.written_with is not None and store.written_with.rates is not None
        rated.append(store.written_with.rates["saves"]["page_cache"] is not None)
    store.close()
    # Saves 1 and 2 wrote new files (nothing pruned yet); save 3 wrote over the first one's.
    assert rated == [False, False, False, True]


def test_the_other_way_is_tried_only_when_its_probe_promises_try_margin_more() -> None:
    # A try is not free: an O_DIRECT write drops the file's cached pages, and the page cache's next
    # write over it takes fresh ones (1 GB here: 3.0 s against 0.3 s).
    gb = 10**9
    chosen = []
    for rate in (1.2, 0.9):  # through the page cache, GB/s: O_DIRECT probed 1.25x, 1.67x that
        mode = writemode.WriteMode("CheckpointStore", "auto")
        mode._probe = {"page_cache": 3.0, "o_direct": 1.5}
        mode.choice = writemode.Choice(False, "measurement")
        for _ in range(writemode.TRY_AFTER):
            mode.after_write(False, gb, 1 / rate)
        chosen.append((mode.for_file(gb).direct, mode.for_file(gb).chosen_by))
    assert chosen == [(False, "saves"), (True, "trying the other way")]


def test_one_slow_first_file_tries_nothing_and_a_second_slow_one_tries_the_other_way() -> None:
    # The benchmark's store: its first 200 MB save through the page cache took 0.2 s (1.06 GB/s)
    # where the others took 0.07 s. Tried on that one file, O_DIRECT (probed 1.66 GB/s) kept the
    # place at 0.117 s a save.
    gb = 10**9
    mode = writemode.WriteMode("CheckpointStore", "auto")
    mode._probe = {"page_cache": 2.55, "o_direct": 1.66}
    mode.choice = writemode.Choice(False, "measurement")
    mode.after_write(False, gb, 1 / 1.06)
    assert (mode.for_file(gb).direct, mode.for_file(gb).chosen_by) == (False, "saves")
    mode.after_write(False, gb, 1 / 1.06)
    assert (mode.for_file(gb).direct, mode.for_file(gb).chosen_by) == (True, "trying the other way")


def test_one_slow_save_among_fast_ones_tries_nothing() -> None:
    # A busy host makes one save slow now and then; a way that has become slow is slow in every file.
    mode = writemode.WriteMode("CheckpointStore", "auto")
    mode._probe = {"page_cache": 4.3, "o_direct": 3.4}
    mode.choice = writemode.Choice(False, "measurement")
    gb = 10**9
    chosen = []
    for rate in (3.3, 3.3, 1.5, 1.5):  # together 2.1 GB/s, O_DIRECT's probe 1.6x that
        mode.after_write(False, gb, 1 / rate)
        chosen.append(mode.for_file(gb).chosen_by)
    assert chosen == ["saves"] * 4
    assert mode.for_file(gb).rates["saves"]["page_cache"] == 2.062  # type: ignore[index]
    for _ in range(writemode.SAVES_KEPT - 2):  # the fast files leave the last SAVES_KEPT: every one is slow
        mode.after_write(False, gb, 1 / 1.5)
    assert (mode.for_file(gb).direct, mode.for_file(gb).chosen_by) == (True, "trying the other way")


def test_a_page_cache_write_over_a_file_o_direct_wrote_does_not_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # O_DIRECT drops a file's cached pages: the page cache's next write over that file takes fresh
    # ones (~2.6 s per GB here after a pause), a one-off that says nothing of its rate.
    if not o_direct_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    fake_rates(monkeypatch, {"page_cache": 3.0, "o_direct": 1.5})
    monkeypatch.setattr(writemode, "RATED_BYTES", 1)
    monkeypatch.setattr(recycling, "RECYCLED_BYTES", 1)
    store = CheckpointStore(tmp_path)
    store.prepare()
    ways = iter([True, True, False, False, False])
    monkeypatch.setattr(store._mode, "for_file", lambda nbytes: writemode.Choice(next(ways), "forced by the test"))
    counted: list[bool] = []
    after_write = store._mode.after_write
    monkeypatch.setattr(
        store._mode, "after_write", lambda *args, rated: (counted.append(rated), after_write(*args, rated=rated))
    )
    for step in (1, 2, 3, 4, 5):
        store.save(step, {"model": {"w": torch.zeros(1 << 18)}}, keep=False)
        store.prune(keep_previous=0)
    store.close()
    # 1, 2: O_DIRECT into new files; 3, 4: the page cache over 1's and 2's files (O_DIRECT wrote
    # them: no cached pages); 5: the page cache over 3's, whose pages it kept.
    assert counted == [False, False, False, False, True]


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o-direct"])
def test_a_save_takes_the_recycled_file_whose_pages_suit_its_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    # Through the page cache: the file whose pages are cached (no fresh pages to find). With
    # O_DIRECT: the other one, whose pages it does not drop. Both hold the file; the one that
    # suits is the larger, which the smallest-first rule alone would not take.
    monkeypatch.setattr(recycling, "RECYCLED_BYTES", 1)
    store = CheckpointStore(tmp_path)
    bin_ = tmp_path / recycling.RECYCLE
    bin_.mkdir(parents=True)
    cached, uncached = bin_ / "a.pt", bin_ / "b.pt"
    cached.write_bytes(bytes(4096 if direct else 8192))
    uncached.write_bytes(bytes(8192 if direct else 4096))
    store._recycler.cached.mark(cached, cached=True)
    store._recycler.cached.mark(uncached, cached=False)
    inodes = {cached.stat().st_ino: "cached", uncached.stat().st_ino: "uncached"}
    target = tmp_path / "model.pt"
    assert store._recycler.reuse(4096, target, direct) == (True, not direct)
    assert inodes[target.stat().st_ino] == ("uncached" if direct else "cached")


def test_a_file_changed_since_its_write_is_not_taken_for_cached(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = tmp_path / "model.pt"
    path.write_bytes(bytes(4096))
    store._recycler.cached.mark(path, cached=True)
    assert store._recycler.cached.holds(path.stat())
    path.write_bytes(bytes(8192))  # written by something else since: its pages are not ours to know
    assert not store._recycler.cached.holds(path.stat())


def test_the_store_forgets_the_cached_files_that_pruning_deletes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Recycled files add up to one checkpoint's size; a pruned checkpoint's files beyond that are
    # deleted, and an entry kept for one would outlive it (a slow leak over a long run). Here the
    # first checkpoint has two files and the later ones one: from the third save on, each pruned
    # checkpoint's file finds the recycled files full.
    monkeypatch.setattr(recycling, "RECYCLED_BYTES", 1)
    store = CheckpointStore(tmp_path, direct_io=False)
    for step in range(1, 7):
        names = ("model", "optimizer") if step == 1 else ("model",)
        store.save(step, {name: {"w": torch.zeros(4096)} for name in names}, keep=False)
        store.prune(keep_previous=0)
        existing = {path.stat().st_ino for path in tmp_path.rglob("*.pt")}
        assert set(store._recycler.cached._files) <= existing
    assert len(store._recycler.cached) == 2  # the newest checkpoint's file and the recycled one
    store.close()
    assert len(store._recycler.cached) == 0
