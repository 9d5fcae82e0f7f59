"""The data ledger's fingerprint check (``trainfsm.tools.ledger``): two fingerprints of one rank at
one (world size, per-rank batch, epoch, micro-batch), drawn by an attempt and by one resumed (directly or not) from
it, must be equal; the first difference of a rank is a problem that says what was trained twice or
skipped, and where the loader really resumed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainfsm.tools import ledger_words

if TYPE_CHECKING:
    from trainfsm.tools.ledger import Check, Key, Segment


def compare(check: Check) -> None:
    """Two fingerprints of one rank at one (world size, per-rank batch, epoch, micro-batch), drawn by an attempt
    and by one resumed (directly or not) from it, must be equal: both drew that micro-batch."""
    seen: dict[int, dict[Key, dict[str, Any]]] = {}
    # The micro-batch drawn after each save, by (rank, world size, checkpoint step): a resume's
    # first draw is compared with it even where the resumed loader's count moved elsewhere
    # (an epoch that ended early because the loader skipped its last micro-batch).
    after_save: dict[int, dict[tuple[int, int | None, int | None, int], dict[str, Any]]] = {}
    for attempt in check.attempts:
        a = attempt.attempt
        mine, saves = seen.setdefault(a, {}), after_save.setdefault(a, {})
        ancestors = check._ancestors(a)
        history = [seen[x] for x in ancestors if x in seen]
        saved_before = [after_save[x] for x in ancestors if x in after_save]
        for seg in check.segments[a].values():
            if not seg.checked:
                continue
            reported = False
            # A resume's first draw first: at an epoch's start it is also the epoch's fingerprint,
            # and the resume's says more (where the loader really resumed).
            for f in sorted(seg.r.data.fingerprints, key=lambda f: f["after"] != "resume"):
                entry = {**f, "attempt": a}
                step_key = (seg.r.rank, seg.world, seg.batch, int(f["from_step"] or 0))
                if f["fingerprint"] is None:  # an exit's draw abandoned after EXIT_DRAW_SECONDS
                    if f["after"] == "save":
                        saves.setdefault(step_key, entry)  # its resume: not compared, and said so
                    continue
                key = (seg.r.rank, seg.world, seg.batch, int(f["epoch"]), int(f["batches"]) - 1)
                mine.setdefault(key, entry)
                before = next((entries[key] for entries in history if key in entries), None)
                if f["after"] == "save":
                    saves.setdefault(step_key, entry)
                elif f["after"] == "resume" and not seg.misplaced:
                    before = next((s[step_key] for s in saved_before if step_key in s), before)
                if before is None or before["fingerprint"] is None:
                    same_size = seg.parent is not None and not check.relaid(seg.parent, seg)
                    if f["after"] == "resume" and same_size:
                        check.unpaired.append(f"rank {seg.r.rank}, attempt {a}, checkpoint {f['from_step']}")
                    continue
                check.pairs += 1
                if before["fingerprint"] != f["fingerprint"]:
                    check.differ += 1
                    if not reported:  # the first difference says it; the rest follow from it
                        reported = True
                        _differs(check, seg, entry, before, history)


def _differs(
    check: Check, seg: Segment, now: dict[str, Any], before: dict[str, Any], history: list[dict[Key, dict[str, Any]]]
) -> None:
    r = seg.r
    # A resume is judged at the position its checkpoint saved (where the saving run drew next):
    # the resumed loader's own count may have moved on (an epoch it ended early).
    where = before if now["after"] == "resume" else now
    epoch, index = int(where["epoch"]), int(where["batches"]) - 1
    digests = f"fingerprint {now['fingerprint']} != {before['fingerprint']}"
    if now["after"] != "resume":
        check.problem(
            r,
            f"rank {r.rank}, attempt {r.attempt}: epoch {epoch} micro-batch {index} is not the one attempt "
            f"{before['attempt']} drew there ({ledger_words.source(before)}; {digests}): the data loader's order "
            f"differs from the run it resumed",
            now["line"],
        )
        return
    if int(now["epoch"]) > epoch:  # the resumed loader had nothing left of the saved epoch
        check.problem(
            r,
            f"rank {r.rank}, attempt {r.attempt}: after resuming from checkpoint {now['from_step']} the data "
            f"loader ended epoch {epoch} at once, without drawing micro-batch {index}, which attempt "
            f"{before['attempt']} drew after saving it ({digests}): epoch {epoch} from micro-batch {index} on "
            f"skipped; the loader did not resume where it said it did",
            now["line"],
        )
        return
    same = [
        (key, entry)
        for entries in history
        for key, entry in entries.items()
        if key[:3] == (r.rank, seg.world, seg.batch) and entry["fingerprint"] == now["fingerprint"]
    ]
    if not same:
        check.problem(
            r,
            f"rank {r.rank}, attempt {r.attempt}: the first micro-batch after resuming from checkpoint "
            f"{now['from_step']} is not the one attempt {before['attempt']} drew after saving it (epoch {epoch} "
            f"micro-batch {index}; {digests}), nor any other micro-batch fingerprinted in this trail: the data "
            f"loader did not resume where it said it did",
            now["line"],
        )
        return
    # The match nearest the saved position (the same epoch first): a loader's epochs may repeat.
    key, match = min(same, key=lambda item: (item[0][3] != epoch, abs(item[0][4] - index), item[0][3:]))
    real = (key[3], key[4])
    if real < (epoch, index):
        what = f"{ledger_words.between(real, (epoch, index))} trained twice"
    else:
        what = f"{ledger_words.between((epoch, index), real)} skipped"
    check.problem(
        r,
        f"rank {r.rank}, attempt {r.attempt} resumed at epoch {real[0]} micro-batch {real[1]} (the micro-batch "
        f"it drew first is the one attempt {match['attempt']} drew {ledger_words.source(match)}), not at "
        f"micro-batch {index} of epoch {epoch} as checkpoint {now['from_step']} saved: {what}",
        now["line"],
    )
