"""Is one source tree's trainer slower than another's? Whole runs, the trees interleaved.

For a change that must not cost speed (a restructuring), the question is not the overhead over a
hand-written loop (``overhead.py``) but old tree against new tree, with the noise of this shared
machine hitting both alike. One process cannot import two ``trainfsm`` packages, so each tree runs
in child processes (``PYTHONPATH=<tree>/src``), alternating A B B A A B ...; each child runs
``overhead.py``'s loops (the hand-written one, trainfsm as most users run it, and the quick start's
hooks) for ``--rounds`` interleaved rounds of ``--steps`` steps and reports each loop's total wall
time. The verdict is each tree's total for a trainfsm loop over the same child's hand-written total
(which cancels the machine's drift between children), summed over that tree's children: the new
tree's over the old tree's. The trees' own ``benchmarks/`` are not used: both run this checkout's
``overhead.py`` against their own package.

    python benchmarks/trees.py OLD_TREE NEW_TREE            # e.g. a `git worktree` of main, and .
    python benchmarks/trees.py OLD NEW --children 8 --steps 1000 --rounds 6
    python benchmarks/trees.py OLD NEW --quick              # a smoke run: no verdict
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOOPS = ("hand-written", "trainfsm", "quick start")


def child(steps: int, rounds: int) -> None:
    """Run the loops in this process (its trainfsm is whatever PYTHONPATH gives) and print totals."""
    import torch

    sys.path.insert(0, str(HERE))
    import overhead  # this checkout's benchmark, run against the child's package

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(32, 784, generator=generator), torch.randint(0, 10, (32,), generator=generator)) for _ in range(16)
    ]
    kinds = {key: run for key, run in overhead.loops(128, features=False).items() if key in LOOPS}
    for run in kinds.values():  # untimed warm-up
        with tempfile.TemporaryDirectory() as workspace:
            run(data, 50, [], workspace)
    totals = dict.fromkeys(kinds, 0.0)
    names = list(kinds)
    for index in range(rounds):
        for key in names[index % len(names) :] + names[: index % len(names)]:
            with tempfile.TemporaryDirectory() as workspace:
                start = time.perf_counter()
                kinds[key](data, steps, [], workspace)
                totals[key] += time.perf_counter() - start
    import trainfsm

    print(json.dumps({"totals": totals, "package": trainfsm.__file__}))


def spawn(tree: Path, steps: int, rounds: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    command = [sys.executable, __file__, "--child", "--steps", str(steps), "--rounds", str(rounds)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if not report["package"].startswith(str(tree / "src")):
        raise SystemExit(
            f"the child imported {report['package']}, not {tree / 'src'}: is trainfsm installed non-editable?"
        )
    return report["totals"]  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, nargs="?", help="the tree to compare against (a checkout's root)")
    parser.add_argument("new", type=Path, nargs="?", help="the tree under test")
    parser.add_argument("--children", type=int, default=8, help="child processes per tree (default 8)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 children each, few steps, no verdict")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.rounds)
        return
    if args.old is None or args.new is None:
        parser.error("give two trees: OLD NEW")
    children, steps, rounds = (2, 50, 1) if args.quick else (args.children, args.steps, args.rounds)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    sums = {tree: dict.fromkeys(LOOPS, 0.0) for tree in trees}
    ratios: dict[str, dict[str, list[float]]] = {tree: {loop: [] for loop in LOOPS[1:]} for tree in trees}
    order = [("old", "new"), ("new", "old")]
    for index in range(children):
        for tree in order[index % 2]:
            totals = spawn(trees[tree], steps, rounds)
            for loop in LOOPS:
                sums[tree][loop] += totals[loop]
            for loop in LOOPS[1:]:
                ratios[tree][loop].append(totals[loop] / totals["hand-written"])
    print(f"{children} children per tree, alternating; each {rounds} rounds x {steps} steps of each loop")
    print("| loop | old: total / hand-written | new: same | new over old (verdict) | per child: old | new |")
    print("|---|---|---|---|---|---|")
    for loop in LOOPS[1:]:
        old = sums["old"][loop] / sums["old"]["hand-written"]
        new = sums["new"][loop] / sums["new"]["hand-written"]
        spread = {tree: f"{min(ratios[tree][loop]):.3f}-{max(ratios[tree][loop]):.3f}" for tree in trees}
        print(f"| {loop} | {old:.4f} | {new:.4f} | {new / old:.4f} | {spread['old']} | {spread['new']} |")
    if args.quick:
        print("quick smoke run: too few steps for a verdict")


if __name__ == "__main__":
    main()
