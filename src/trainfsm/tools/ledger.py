"""The data ledger: did the run, across all its attempts, train every batch exactly once?

Exact resume is tested on the project's own runs; this checks a user's run from its trail. Each
rank's replay (``trainfsm.tools.replay``) counts where its data stands: an attempt starts at (epoch
0, batch 0) or where ``data_resumed`` says; every entry into ACCUMULATE draws one batch; an
``epoch`` event starts the next epoch at its first batch; ``data_exhausted`` draws nothing. Each
save records the positions it saved (``checkpoint_saved.data``) and each resume the checkpoint it
came from (``checkpoint_loaded``: step and checksum). Per rank, across attempts:

- **saved as counted**: the position a save recorded is the one the trail counts at that step;
- **resumed as saved**: an attempt that resumed from a checkpoint restored exactly the position
  saved with it (the same checksum: the same save), so no batch is drawn twice or skipped;
- **the same batch next**: the first batch drawn after a resume is the batch the saving attempt drew
  after that save (``batch_fingerprint``), when both were drawn: a loader that resumed elsewhere
  while saying it did not shows here;
- **no silent restart**: an attempt that started from scratch while an earlier attempt had saved a
  complete checkpoint, without ``CheckpointingHook(load=None)``, trains those batches again.

A break is a run problem of kind ``ledger`` (``trainfsm audit`` exits 1). Attempts written before
the ledger (trail formats 1 and 2) or without a data position to restore (``data_resume="none"``,
a trainloop checkpoint) are named in a note, not checked. One line per rank (ranks alike together)
says what was drawn: from where to where, over which attempts and steps, each batch once or not.
"""

from __future__ import annotations

from typing import Any

from trainfsm.tools.replay import Problem, RankAttempt
from trainfsm.tools.report import AttemptReport, group_by, ranks_text
from trainfsm.trail.reader import Note

KIND = "ledger"


def saved_position(data: dict[str, Any] | None, rank: int) -> tuple[int, int] | None:
    """The position a save recorded for ``rank`` (``checkpoint_saved.data``); another world size
    resumes every rank from rank 0's."""
    if not data:
        return None
    if "ranks" in data:
        ranks = data["ranks"]
        entry = ranks[rank] if rank < len(ranks) else ranks[0]
        return int(entry[0]), int(entry[1])
    return int(data["epoch"]), int(data["batches"])


def where(position: tuple[int, int] | list[int]) -> str:
    return f"epoch {position[0]} batch {position[1]}"


def check(attempts: list[AttemptReport]) -> tuple[list[Problem], list[Note], list[str]]:
    """The ledger's run problems, notes, and one line per group of ranks."""
    problems: list[Problem] = []
    notes: list[Note] = []
    saves: dict[tuple[int, str | None], tuple[int, dict[str, Any]]] = {}  # (step, checksum) -> attempt, save
    after_save: dict[tuple[int, int, int], dict[str, Any]] = {}  # (rank, attempt, step) -> fingerprint
    segments: dict[int, list[dict[str, Any]]] = {}  # rank -> what each attempt drew
    handover: dict[tuple[int, int], tuple[int, tuple[int, int]]] = {}  # (rank, attempt) -> the save resumed from
    broken: set[int] = set()
    unchecked: list[int] = []

    def problem(r: RankAttempt, message: str, line: int | None = None) -> None:
        problems.append(Problem(KIND, message, r.file, line if line is not None else r.end_line, r.rank, r.attempt))
        broken.add(r.rank)

    for attempt in attempts:
        rank0 = next((r for r in attempt.ranks if r.rank == 0), None)
        own_saves = [s for s in (rank0.saved if rank0 is not None else []) if s.get("data") is not None]
        for r in attempt.ranks:
            start = r.ledger_start
            old = r.format is None or r.format < 3
            if start is None and not old:  # ended before RESTORE said where its data began: drew nothing
                segments.setdefault(r.rank, []).append({"attempt": attempt.attempt, "nothing": True})
                continue
            if old or start is None or start["how"] == "unchecked" or r.position is None:
                if attempt.attempt not in unchecked:
                    unchecked.append(attempt.attempt)
                    why = (
                        f"its trail (format {r.format or 'unknown'}) has no data ledger: written by an older trainfsm"
                        if old or start is None
                        else start["why"]
                    )
                    notes.append(Note(f"attempt {attempt.attempt}: the data ledger is not checked: {why}"))
                segments.setdefault(r.rank, []).append({"attempt": attempt.attempt, "unchecked": True})
                continue
            if start["how"] == "fresh":
                earlier = [(a, s) for (step, _), (a, s) in saves.items() if a < attempt.attempt]
                if earlier and not r.not_loaded:
                    a, newest = max(earlier, key=lambda item: item[1]["step"])
                    problem(
                        r,
                        f"rank {r.rank}, attempt {attempt.attempt} started from scratch (step 0, {where((0, 0))}) "
                        f"although attempt {a} saved checkpoint {newest['step']} completely ({newest['path']}): "
                        f"the batches up to {where(saved_position(newest['data'], r.rank) or (0, 0))} are trained "
                        f"again (pass CheckpointingHook(load=None) to start afresh on purpose)",
                    )
            else:
                resumed = _check_resume(r, attempt.attempt, start, saves, after_save, problem, notes)
                if resumed is not None:
                    handover[(r.rank, resumed[0])] = (int(start["from_step"]), resumed[1])
            for save in own_saves:  # saved as counted
                saved = saved_position(save["data"], r.rank)
                counted = r.positions.get(save["step"])
                if saved is not None and counted is not None and saved != counted:
                    problem(
                        r,
                        f"rank {r.rank}, attempt {attempt.attempt}: checkpoint {save['step']} saved {where(saved)}, "
                        f"but the trail counts {where(counted)} drawn by then: the loader's position and its draws "
                        f"disagree",
                    )
            for fingerprint in r.fingerprints:
                if fingerprint["after"] == "save":
                    after_save[(r.rank, attempt.attempt, int(fingerprint["from_step"]))] = fingerprint
            segments.setdefault(r.rank, []).append(
                {
                    "attempt": attempt.attempt,
                    "begin": (start["epoch"], start["batches"]),
                    "end": (r.position[0], r.position[1]),
                    "steps": f"steps {r.first_step}-{r.last_step}" if r.steps_done else "no steps",
                }
            )
        for save in own_saves:
            saves[(int(save["step"]), save.get("checksum"))] = (attempt.attempt, save)
    lines = []
    texts = {rank: _line(rank, chain, handover, rank in broken) for rank, chain in segments.items()}
    for text, ranks in group_by(sorted(texts), lambda rank: texts[rank]).items():
        lines.append(f"{ranks_text(ranks)}: {text}")
    return problems, notes, lines


def _line(
    rank: int, chain: list[dict[str, Any]], handover: dict[tuple[int, int], tuple[int, tuple[int, int]]], broken: bool
) -> str:
    """``attempt 0: epoch 0 batch 0 -> epoch 1 batch 2, saved at step 8 (drew on to epoch 1 batch 3:
    not kept); attempt 1: ...: each batch drawn once``."""
    parts = []
    for segment in chain:
        if segment.get("unchecked"):
            parts.append(f"attempt {segment['attempt']}: not checked")
            continue
        if segment.get("nothing"):
            parts.append(f"attempt {segment['attempt']}: ended before RESTORE, drew nothing")
            continue
        text = f"attempt {segment['attempt']}: {where(segment['begin'])} -> "
        passed = handover.get((rank, segment["attempt"]))
        if passed is not None:
            step, position = passed
            text += f"{where(position)}, saved at step {step}"
            if position != segment["end"]:
                text += f" (drew on to {where(segment['end'])}: not kept)"
        else:
            text += where(segment["end"])
        parts.append(f"{text} ({segment['steps']})")
    verdict = "NOT each batch once (see run problems)" if broken else "each batch drawn once"
    return f"{'; '.join(parts)}: {verdict}"


def _check_resume(
    r: RankAttempt,
    attempt: int,
    start: dict[str, Any],
    saves: dict[tuple[int, str | None], tuple[int, dict[str, Any]]],
    after_save: dict[tuple[int, int, int], dict[str, Any]],
    problem: Any,
    notes: list[Note],
) -> tuple[int, tuple[int, int]] | None:
    """A resumed attempt: the checkpoint it loaded, the position it restored, the batch it drew
    first. Returns the attempt that saved that checkpoint and the position it saved, if known."""
    step, checksum = start.get("from_step"), start.get("checksum")
    found = saves.get((int(step), checksum)) if step is not None else None
    if found is None:
        notes.append(
            Note(
                f"attempt {attempt}, rank {r.rank}: resumed from checkpoint {step} ({start.get('path')}), which no "
                f"earlier attempt in this trail saved (another run's, or a trail that begins later): its position "
                f"is taken as given"
            )
        )
        return None
    saved_by, save = found
    saved = saved_position(save["data"], r.rank)
    restored = (start["epoch"], start["batches"])
    if saved is None:
        return None
    if saved is not None and saved != restored:
        twice = restored < saved
        problem(
            r,
            f"rank {r.rank}, attempt {attempt} resumed from checkpoint {step} (saved by attempt {saved_by}) at "
            f"{where(restored)}, but that checkpoint saved {where(saved)} for it: the batches between are "
            f"{'drawn twice' if twice else 'never drawn'}",
        )
        return saved_by, saved
    first = next((f for f in r.fingerprints if f["after"] == "resume"), None)
    before = after_save.get((r.rank, saved_by, int(step))) if step is not None else None
    if first is not None and before is not None and first["fingerprint"] != before["fingerprint"]:
        problem(
            r,
            f"rank {r.rank}, attempt {attempt}: the first batch after resuming from checkpoint {step} is not the "
            f"batch attempt {saved_by} drew after saving it ({where((first['epoch'], first['batches']))}; "
            f"fingerprint {first['fingerprint']} != {before['fingerprint']}): the data loader did not resume where "
            f"it said it did",
            first["line"],
        )
    return saved_by, saved
