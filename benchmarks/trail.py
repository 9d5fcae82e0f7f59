"""The audit trail at scale: bytes per routine step, writer cost, audit speed, a 1,024-rank job.

Every trail here is written by the real ``EventLog`` (the trainer's writer), driven the way the
trainer drives it (the machine's recorders, step by step) with a simulated clock, so a week of
steps is written in seconds and step times are what a real job would see. Old form ("full": every
transition verbatim, as format 1 wrote it) and new ("compact") side by side.

1. Bytes per routine step on disk, plain and gzip-compressed (zstd beside it when ``zstandard`` is
   installed, as information), at several step rates. Target: <= 16 bytes compressed, amortized,
   at 10 steps/s (the issue's reference rate for a week-long run).
2. The writer's own cost per routine step (recorders only, the real clock), old vs new.
3. ``trainfsm audit`` seconds per million steps of one rank. Target: >= 1 M steps/s per core.
4. A simulated job of ``--ranks`` x ``--steps`` (default 1,024 x 100,000) at 10 steps/s, written
   by ``EventLog`` with its rotation into gzip segments, then audited with one process per core.
   Target: under 10 minutes on this machine.

    python benchmarks/trail.py                 # everything (the 1,024-rank job takes minutes)
    python benchmarks/trail.py --quick         # a smoke run: 8 ranks x 2,000 steps
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from trainfsm import machine as fsm
from trainfsm.tools.audit import audit
from trainfsm.trail.schema import FORMAT_VERSION
from trainfsm.trail.writer import EventLog

STEP_RATES = (1.0, 10.0, 100.0)  # steps per second
BYTES_TARGET = 16.0
AUDIT_TARGET = 1e6  # steps per second per core
JOB_TARGET = 600.0  # seconds
NO_ROTATION = 1 << 40  # one file, so its bytes are what the table shows


class Clock:
    """Simulated wall time: a step takes ``1 / rate`` seconds, +-20 % (a real job's spread)."""

    def __init__(self, rate: float, seed: int) -> None:
        self.now = 1.7e9
        self.mean = 1.0 / rate
        self.random = random.Random(seed)

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.mean * self.random.uniform(0.8, 1.2)


class RealClock:
    """The real clock, for measuring what the writer costs."""

    __call__ = staticmethod(time.time)

    def step(self) -> None:
        return None


class Owner:
    """What the writer reads from the trainer: its step (and, for events, its state)."""

    step = 0
    state = fsm.BUILD


def write_trail(
    logs: Path,
    rank: int,
    steps: int,
    *,
    form: str = "compact",
    rate: float = 10.0,
    micro: int = 1,
    checkpoint_every: int = 10_000,
    segment_bytes: int | None = None,
    clock: Any = None,
    killed: bool = False,
    world_size: int = 1,
) -> Path:
    """One rank's trail of ``steps`` steps, written by EventLog as the trainer writes it
    (``killed``: the process dies after its last step, leaving no exit event), of a job of
    ``world_size`` ranks (the audit names any rank of it whose trail it is not given)."""
    clock = clock if clock is not None else Clock(rate, seed=rank)
    owner = Owner()
    path = logs / f"events.rank{rank}.jsonl"
    log = EventLog(
        path=path,
        console=logging.getLogger("trainfsm.benchmark"),
        rank=rank,
        run_id="0123456789ab",
        attempt=0,
        progress=lambda: (owner.step, owner.state),
        owner=owner,
        form=form,
        segment_bytes=segment_bytes,
        clock=clock,
    )
    record = {(t, s, d): log.transition_recorder(t, s, d) for t, s, d in fsm.transition_rows()}
    start, nxt, end = record[fsm.ROUTINE_START], record[fsm.ROUTINE_NEXT], record[fsm.ROUTINE_END]
    save, resume, finish = (
        record[("save", fsm.ACCUMULATE, fsm.CHECKPOINT)],
        record[("resume", fsm.CHECKPOINT, fsm.STEP)],
        record[("finish", fsm.ACCUMULATE, fsm.EXIT)],
    )
    audit_log = log.log
    audit_log.info("run_start", format=FORMAT_VERSION, world_size=world_size, max_steps=steps, config={}, signals={})
    record[("built", fsm.BUILD, fsm.RESTORE)]()
    owner.state = fsm.RESTORE
    audit_log.info("restore", resumed=False, from_step=0)
    record[("restored", fsm.RESTORE, fsm.STEP)]()
    for step in range(1, steps + 1):
        owner.step = step
        start()
        for _ in range(micro - 1):
            nxt()
        clock.step()
        if step == steps and killed:
            end()
            log.write_out()  # what the page cache holds when the process is gone
            return path
        if step == steps:
            finish()
        elif step % checkpoint_every == 0:
            save()
            owner.state = fsm.CHECKPOINT
            audit_log.info("checkpoint_saved", path=f"checkpoints/{step}", saved_step=step, bytes=1 << 30)
            resume()
        else:
            end()
    owner.state = fsm.EXIT
    audit_log.info("exit", reason="completed", code=0)
    log.close()
    return path


def _size(logs: Path) -> int:
    return sum(p.stat().st_size for p in logs.iterdir())


def bytes_per_step(root: Path, steps: int) -> list[dict[str, Any]]:
    rows = []
    for rate in STEP_RATES:
        row: dict[str, Any] = {"rate": rate}
        for form in ("full", "compact"):
            logs = root / f"bytes-{form}-{rate}"
            logs.mkdir()
            path = write_trail(logs, 0, steps, form=form, rate=rate, segment_bytes=NO_ROTATION)
            raw = path.read_bytes()
            row[form] = len(raw) / steps
            row[f"{form}_gzip"] = len(gzip.compress(raw, compresslevel=6)) / steps
            try:
                import zstandard

                row[f"{form}_zstd"] = len(zstandard.ZstdCompressor(level=3).compress(raw)) / steps
            except ImportError:
                row[f"{form}_zstd"] = None
        rows.append(row)
    return rows


def writer_cost(steps: int, rounds: int) -> dict[str, float]:
    """Seconds per routine step spent in the recorders the machine calls (real clock, a real file),
    forms interleaved round by round; the median round of each."""
    times: dict[str, list[float]] = {"full": [], "compact": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for form in ("full", "compact") if i % 2 == 0 else ("compact", "full"):
                owner = Owner()
                log = EventLog(
                    path=Path(tmp) / f"{form}{i}" / "events.rank0.jsonl",
                    console=logging.getLogger("trainfsm.benchmark"),
                    rank=0,
                    run_id="0123456789ab",
                    attempt=0,
                    progress=lambda owner=owner: (owner.step, owner.state),
                    owner=owner,
                    form=form,
                )
                start, end = log.transition_recorder(*fsm.ROUTINE_START), log.transition_recorder(*fsm.ROUTINE_END)
                t0 = time.perf_counter()
                for step in range(1, steps + 1):
                    owner.step = step
                    start()
                    end()
                times[form].append((time.perf_counter() - t0) / steps)
                log.close()
    return {form: sorted(values)[len(values) // 2] for form, values in times.items()}


def audit_speed(root: Path, steps: int, rounds: int = 3) -> dict[str, float]:
    """Steps per second of whole ``audit`` runs of one rank (one process), forms interleaved round
    by round; the median round of each."""
    paths = {}
    for form in ("full", "compact"):
        logs = root / f"audit-{form}"
        logs.mkdir()
        write_trail(logs, 0, steps, form=form, rate=10.0, segment_bytes=NO_ROTATION)
        paths[form] = logs
    seconds: dict[str, list[float]] = {"full": [], "compact": []}
    for i in range(rounds):
        for form in ("full", "compact") if i % 2 == 0 else ("compact", "full"):
            t0 = time.perf_counter()
            report = audit([paths[form]], jobs=1)
            seconds[form].append(time.perf_counter() - t0)
            assert report.consistent and report.attempts[0].first.steps_done == steps, report.problems[:3]
    return {form: steps / sorted(values)[len(values) // 2] for form, values in seconds.items()}


def _write_rank(args: tuple[str, int, int, int, int]) -> int:
    logs, rank, steps, segment_bytes, ranks = args
    write_trail(Path(logs), rank, steps, rate=10.0, segment_bytes=segment_bytes, world_size=ranks)
    return rank


def job(root: Path, ranks: int, steps: int, segment_bytes: int) -> dict[str, Any]:
    logs = root / "job" / "logs"
    logs.mkdir(parents=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        work = [(str(logs), r, steps, segment_bytes, ranks) for r in range(ranks)]
        for _ in pool.map(_write_rank, work, chunksize=4):
            pass
    written = time.perf_counter() - t0
    files = list(logs.iterdir())
    t0 = time.perf_counter()
    report = audit([logs.parent])
    audited = time.perf_counter() - t0
    assert report.consistent, [p.message for p in report.problems[:3]]
    assert len(report.attempts[0].ranks) == ranks
    assert all(r.steps_done == steps for r in report.attempts[0].ranks)
    return {
        "ranks": ranks,
        "steps": steps,
        "files": len(files),
        "bytes": _size(logs),
        "write_seconds": written,
        "audit_seconds": audited,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100_000, help="steps per rank in the simulated job")
    parser.add_argument("--segment-mib", type=float, default=1.0, help="the job's segment size (rotation shown)")
    parser.add_argument("--quick", action="store_true", help="8 ranks x 2,000 steps, small samples: no verdict")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.steps = 8, 2000
    sample = 20_000 if args.quick else 200_000
    million = 100_000 if args.quick else 1_000_000
    root = Path(tempfile.mkdtemp(prefix="trail-bench-", dir=args.dir))
    verdicts = []
    try:
        print(f"## bytes per routine step ({sample:,} steps, 1 micro-batch, a checkpoint every 10,000)")
        print("| steps/s | full | full gzip | full zstd | compact | compact gzip | compact zstd |")
        print("|---|---|---|---|---|---|---|")
        for row in bytes_per_step(root, sample):
            cells = [
                f"{row[k]:.1f}" if row[k] is not None else "-"
                for k in ("full", "full_gzip", "full_zstd", "compact", "compact_gzip", "compact_zstd")
            ]
            print(f"| {row['rate']:g} | " + " | ".join(cells) + " |")
            if row["rate"] == 10.0:
                verdicts.append(("compressed bytes per step at 10 steps/s", row["compact_gzip"], BYTES_TARGET, "<="))
        cost = writer_cost(sample // 4, 5)
        print(
            f"\n## writer cost per routine step (median of 5 interleaved rounds): full "
            f"{cost['full'] * 1e6:.2f} us, compact {cost['compact'] * 1e6:.2f} us"
        )
        speed = audit_speed(root, million)
        print(
            f"\n## audit of one rank, {million:,} steps at 10 steps/s: full {speed['full'] / 1e6:.2f} M steps/s, "
            f"compact {speed['compact'] / 1e6:.2f} M steps/s (one core)"
        )
        verdicts.append(("audit M steps/s per core (compact)", speed["compact"] / 1e6, AUDIT_TARGET / 1e6, ">="))
        result = job(root, args.ranks, args.steps, int(args.segment_mib * (1 << 20)))
        print(
            f"\n## simulated job: {result['ranks']:,} ranks x {result['steps']:,} steps at 10 steps/s: "
            f"{result['files']:,} files, {result['bytes'] / (1 << 20):.1f} MiB on disk "
            f"({result['bytes'] / (result['ranks'] * result['steps']):.2f} bytes/step), written in "
            f"{result['write_seconds']:.1f} s, audited in {result['audit_seconds']:.1f} s on {os.cpu_count()} cores"
        )
        verdicts.append(("simulated job audit seconds", result["audit_seconds"], JOB_TARGET, "<="))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.quick:
        return 0
    print("\n## verdict")
    failed = 0
    for name, value, target, how in verdicts:
        ok = value <= target if how == "<=" else value >= target
        failed += not ok
        print(f"- {name}: {value:.2f} (target {how} {target:g}): {'met' if ok else 'MISSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
