"""Send SIGTERM, SIGUSR1 or SIGINT to a real training process at random moments, then resume.

Each trial runs the deterministic script of ``kill_resume.py`` (its CheckpointingHook exits on
these three signals), signals it ``--signals`` times at moments drawn uniformly over the whole
life of ``train()``: from the first line of its trail (``run_start``) to the end, so BUILD (which
holds the signals until the hook's policy is known), RESTORE, steps, CHECKPOINT and EXIT all get
their share; every other signal is drawn over what is left of the training only (from the
trail's ``restore`` event on), so that a BUILD slowed by a loaded machine does not take them all. It restarts the script
after each exit and lets the last run finish. A trial passes when every signalled run ended as the rule says:

- signalled during training: exit ``128 + signal`` with a checkpoint at the agreed step;
- signalled in BUILD or RESTORE: ``preempt`` to EXIT, exit ``128 + signal``, nothing saved;
- signalled once training was complete (EXIT, or after ``train()``): exit 0 (the signal is
  recorded), or killed by it once ``train()`` returned and handed the handlers back;
- SIGINT before the hook's policy exists: Python's own KeyboardInterrupt, as without trainfsm
  (the process ends with SIGINT; its trail says ``interrupted``, code 130, as a shell would);

and the final parameters are bitwise equal to an uninterrupted run's. ``trainfsm audit`` must time
every preemption (signal to step finished, ranks agreed, checkpoint durable, exit; under SLURM also
the margin before the job's end): each trial's line ends with those figures.

    python tests/faults/signal_resume.py --trials 200 --signal-names TERM

prints one line per trial and ends with "N passed, N failed"; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.kill_resume import STEPS, Reference, _count, _events, _last_step, _launch, repeat
from tests.helpers import ledger_problem

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def trial(
    directory: Path, ref: Reference, signals: int, rng: random.Random, slow: float, names: tuple[signal.Signals, ...]
) -> tuple[bool, str, int]:
    import torch

    workspace, out = directory / "workspace", directory / "final.pt"
    sent = 0
    where: list[str] = []
    while True:
        attempt, restores = _count(workspace, "run_start"), _count(workspace, "restore")
        process = _launch(workspace, out, slow)
        sig = None
        if sent < signals:
            _wait_for_event(process, workspace, "run_start", attempt)
            left = 1.0 - _last_step(workspace) / STEPS
            if sent % 2:
                # Every other signal at a moment of what is left of the training, drawn once the
                # trail says ``restore`` (the hooks' RESTORE work is done): under load BUILD can
                # outlast the reference's whole run, and then no signal drawn from run_start would
                # land in training (CI saw 24 of 24 land in BUILD).
                _wait_for_event(process, workspace, "restore", restores)
                time.sleep(rng.uniform(0.0, left * ref.training))
            else:
                time.sleep(rng.uniform(0.0, ref.startup + left * ref.training))
            if process.poll() is None:
                sig = rng.choice(names)
                process.send_signal(sig)
        _, err = process.communicate(timeout=120)
        if sig is None:
            if process.returncode != 0:
                return False, f"run exited {process.returncode}: {err.decode()[-2000:]}", sent
            break
        sent += 1
        mine = [e for e in _events(workspace) if e["attempt"] == attempt]
        verdict, place = _judge(mine, sig, process.returncode)
        if verdict:
            return False, f"{sig.name} ({place}): {verdict}: {err.decode()[-1500:]}", sent
        where.append(place)
        if place == "after training" and process.returncode == 0 and out.exists():
            break
    ledger = ledger_problem(workspace)
    if ledger:
        return False, ledger, sent
    missing, timings = preemption_timings(workspace)
    if missing:
        return False, missing, sent
    final = torch.load(out)
    if not all(torch.equal(a, b) for a, b in zip(final, ref.parameters, strict=True)):
        return False, "final parameters differ from the uninterrupted run", sent
    return True, f"{sent} signals: {', '.join(where)}; preemptions: {'; '.join(timings) or 'none'}", sent


def _wait_for_event(process: Any, workspace: Path, event: str, seen: int) -> None:
    """Until the trail has more than ``seen`` ``event`` records, or the process ended."""
    while process.poll() is None and _count(workspace, event) == seen:
        time.sleep(0.005)


def preemption_timings(workspace: Path) -> tuple[str, list[str]]:
    """("" or what is missing, a short text per preemption) from ``trainfsm audit``'s timing of each
    preempted attempt: a preemption during training has a durable checkpoint and an exit, one in
    BUILD or RESTORE an exit; the margin before the job's end where SLURM gave one."""
    from trainfsm.tools import audit

    texts = []
    for attempt in audit.audit([workspace]).attempts:
        if (attempt.first.exit or {}).get("reason") != "preempted":
            continue
        timing = attempt.as_dict()["preemption"]
        if timing is None or timing["exit"] is None:
            return f"attempt {attempt.attempt} was preempted, but the audit did not time it: {timing}", texts
        if timing["agreed_step"] is not None and timing["durable"] is None:
            return f"attempt {attempt.attempt}: no durable checkpoint in the audit's timing: {timing}", texts
        text = f"{timing['signal']} at step {timing['at_step']}:"
        if timing["durable"] is not None:
            text += f" durable +{timing['durable']:.2f} s,"
        text += f" exit +{timing['exit']:.2f} s"
        if timing["margin"] is not None:
            text += f", margin {timing['margin']:.1f} s"
        texts.append(text)
    return "", texts


def _judge(mine: list[dict[str, Any]], sig: signal.Signals, code: int) -> tuple[str, str]:
    """(what went wrong or "", where the signal landed) for one signalled attempt's trail."""
    exits = [e for e in mine if e["event"] == "exit"]
    if not exits:
        return "the trail has no exit event", "unknown"
    exit_event = exits[0]
    agreed = [e for e in mine if e["event"] == "signal_agreed"]
    saved = [e["saved_step"] for e in mine if e["event"] == "checkpoint_saved"]
    preempt = [e for e in mine if e["event"] == "transition" and e["trigger"] == "preempt"]
    if agreed:
        if code != 128 + sig:
            return f"exit {code}, expected {128 + sig}", "training"
        if not saved or saved[-1] != agreed[0]["agreed_step"]:
            return f"agreed at step {agreed[0]['agreed_step']}, last save at {saved[-1:]}", "training"
        return "", "training"
    if preempt:
        place = preempt[0]["source"]
        if code != 128 + sig or (exit_event["reason"], exit_event["code"]) != ("preempted", 128 + sig):
            return f"exit {code} ({exit_event['reason']}), expected {128 + sig} (preempted)", place
        if saved:
            return f"saved {saved} before any step", place
        if not any(e["event"] == "signal_received" and e["signal"] == sig.name for e in mine):
            return "no signal_received event", place
        return "", place
    if exit_event["reason"] == "completed":
        # Training was done: the signal came in EXIT (recorded, exit 0) or after train() returned.
        return ("" if code in (0, -sig) else f"exit {code} after a completed run"), "after training"
    interrupted = [e for e in mine if e["event"] == "exception" and e["type"] == "KeyboardInterrupt"]
    if sig == signal.SIGINT and interrupted and interrupted[0]["state"] == "BUILD":
        # Python ends itself with SIGINT (-2 here, 130 in a shell): the trail says so.
        if code != -signal.SIGINT or (exit_event["reason"], exit_event["code"]) != ("interrupted", 128 + sig):
            return f"exit {code}, trail {exit_event['reason']} {exit_event['code']} after KeyboardInterrupt", "BUILD"
        return "", "BUILD (Ctrl-C)"
    return f"exit {code}, trail ends {exit_event['reason']} without agreement or preempt", "unknown"


def run_trials(
    trials: int,
    signals: int,
    seed: int,
    slow: float,
    verbose: bool = True,
    names: tuple[signal.Signals, ...] = SIGNALS,
    at_least: int = 0,
    most: int = 0,
) -> tuple[int, int, int]:
    """(passed, failed, signals sent) over ``trials`` trials, each signal drawn from ``names``; more
    trials (up to ``most`` in all) while fewer than ``at_least`` signals were sent."""
    return repeat(partial(trial, names=names), trials, signals, seed, slow, verbose, at_least, most)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--signals", type=int, default=2, help="signals per trial before it may finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.03, help="seconds added to each checkpoint file's write")
    parser.add_argument("--signal-names", default="TERM,USR1,INT", help="the signals to draw from, e.g. TERM")
    args = parser.parse_args()
    names = tuple(signal.Signals[f"SIG{name}"] for name in args.signal_names.split(","))
    passed, failed, sent = run_trials(args.trials, args.signals, args.seed, args.slow, names=names)
    print(f"{sent} signals sent")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
